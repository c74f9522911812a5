"""The quadratic explainer: why heterogeneity biases FedAvg (η²E²G²), with closed forms on four quadratic clients.

``python explain_heterogeneity.py --help`` lists the flags; the work is done by ``steps/explain.py``.
"""

from steps.explain import main
from utils.cli import run_main

if __name__ == "__main__":
    run_main(main)
