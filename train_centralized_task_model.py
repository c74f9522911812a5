"""Step 2: train one centralized model for a task; its penultimate layer later defines the task's embedding."""

from steps import train_centralized
from utils.cli import leave_launched_process, run_main

if __name__ == "__main__":
    run_main(train_centralized.main)
    leave_launched_process()  # a rank of `accelerate launch` skips the finalization where gloo's threads aborted it
