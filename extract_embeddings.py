"""Step 3: embed every manifest sample with a step-2 model and cluster the embeddings.

Inputs: a step-2 checkpoint (best.pt), manifest.csv (step 1) and the data root.
Outputs in --out: embeddings.npy (float32, rows in manifest order) with
sample_ids.csv, clusters.csv (sample_id, cluster), centers.npy, agreement.json
(NMI/ARI of clusters vs scene labels), cluster_diagnostics.json, scatter and
contingency plots, metrics.csv, config.json, run.log. The clusters are the
embedding-based groups of step 3b (make_client_assignments.py --groups clusters.csv).
A best.pt of epoch 0 (the untrained model) is refused unless --allow_untrained asks for it.
"""

from steps import embed
from utils.cli import run_main

if __name__ == "__main__":
    run_main(embed.main)
