"""Step 3c: the heterogeneity meter (G² and B²) of one partition at a trained model.

``python measure_heterogeneity.py --help`` lists the flags; the work is done by ``steps/meter.py``.
"""

from steps.meter import main
from utils.cli import run_main

if __name__ == "__main__":
    run_main(main)
