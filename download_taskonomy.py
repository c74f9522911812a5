"""Step 0 (real data): download Taskonomy in the omnidata layout, non-interactively (``make download``).

``python download_taskonomy.py --help`` lists the flags; the work is done by ``steps/download.py``.
"""

from steps.download import main
from utils.cli import run_main

if __name__ == "__main__":
    run_main(main)
