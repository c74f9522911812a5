"""Render the embedded synthetic Taskonomy-format dataset (input of step 1)."""

from steps import render
from utils.cli import run_main

if __name__ == "__main__":
    run_main(render.main)
