"""Step 3p: group every manifest sample by the mean of its target (quantile bins), for the positive control.

Inputs: manifest.csv (step 1), the data root and a dense task. Outputs in --out: groups.csv (sample_id, cluster:
make_client_assignments.py --groups groups.csv draws the property-based partition), property.csv, metrics.csv,
property_bins.png, config.json, run.log.
"""

from steps import target_groups
from utils.cli import run_main

if __name__ == "__main__":
    run_main(target_groups.main)
