"""Step 3b: assign the manifest's train samples to federated clients.

Inputs: manifest.csv (step 1) and the groups to skew: a manifest column
(``scene_class``: label-based) or a clusters.csv (step 3: embedding-based).
Outputs in --out: assignments.csv (sample_id, client_id, group, subset) with its
assignments.json sidecar, client_stats.csv, client_group_heatmap.png,
unused_samples.csv, metrics.csv, config.json, run.log.
"""

from steps import assign
from utils.cli import run_main

if __name__ == "__main__":
    run_main(assign.main)
