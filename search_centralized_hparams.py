"""Search the centralized baseline's learning rate x weight decay x scheduler on the validation split (step 2 per config)."""

from steps import search_centralized
from utils.cli import run_main

if __name__ == "__main__":
    run_main(search_centralized.main)
