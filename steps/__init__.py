"""One library module per numbered step: its ``build_parser()`` and ``main(argv)``.

render (step 0, synthetic data), select_scenes (step 1), train_centralized (step 2),
embed (step 3) and assign (step 3b). The top-level scripts are thin command lines over
these modules, and pipeline.runner calls them directly, so library code never imports a
script. Step 4 (test_fed.py) is still a script; it moves here with the run config (issue 11).
Modules are imported by name, not here.
"""
