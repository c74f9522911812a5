"""The federated part of TaskHet (DESIGN.md §4).

``algorithms/`` holds one small file per algorithm (both halves), ``local_train``
the one local training loop, ``aggregation`` the pure server arithmetic,
``sampling`` seeded client sampling, ``client_store`` per-client state, and
``engine_sequential`` the single-process engine that drives them.
"""
