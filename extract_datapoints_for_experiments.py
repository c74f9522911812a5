"""Step 1: choose the samples of an experiment, label their scene class and split them."""

from steps import select_scenes
from utils.cli import run_main

if __name__ == "__main__":
    run_main(select_scenes.main)
