"""Step 2: train one centralized model for a task; its penultimate layer later defines the task's embedding."""

from steps import train_centralized
from utils.cli import run_main

if __name__ == "__main__":
    run_main(train_centralized.main)
