"""The experiment layer of run_pipeline.py: experiment files (experiment), skip-if-done stage
folders (stages), the runner that calls steps 0-4 for every combination (runner) and the gap
report (report).

Modules are imported by name, not here: partitioning.assignments needs only stages' file hash,
and run_pipeline.py validates an experiment file before the runner's heavy imports.
"""
