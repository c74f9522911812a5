"""Task arithmetic over fine-tuned checkpoints (TaLoS, issue 15): merged model and interference diagnostics.

``python merge_task_vectors.py --help`` lists the flags; the work is done by ``steps/merge.py``.
"""

from steps.merge import main
from utils.cli import run_main

if __name__ == "__main__":
    run_main(main)
