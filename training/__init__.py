"""Step 2's centralized training: the training loop written once (loop: a loader, one batch, one
evaluation; fit: the epochs with checkpoints) and the per-task metrics it accumulates (metrics).

The loop is also what step 3 (its loader) and step 4 (its evaluation) reuse. Modules are
imported by name, not here.
"""
