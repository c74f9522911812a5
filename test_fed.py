"""Step 4: federated training of a task model over the clients of an assignment file.

``python test_fed.py --help`` lists the run's flags; ``--list_methods`` every algorithm and
its settings; ``--method X --help`` the run's flags plus X's settings. The work is done by
``steps/federated.py`` (parsing) and ``network/run.py`` (setup and engines).
"""

from __future__ import annotations

from steps.federated import main
from utils.cli import run_main

__all__ = ["main"]

if __name__ == "__main__":
    run_main(main)
