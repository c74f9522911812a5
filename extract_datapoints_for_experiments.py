"""Step 1: choose the samples of an experiment, label them and split them (--family picks the data family)."""

from steps import select
from utils.cli import run_main

if __name__ == "__main__":
    run_main(select.main)
