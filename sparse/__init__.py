"""Sparse fine-tuning and task arithmetic in FL (TaLoS, Iurada et al., ICLR 2025; issue 15).

Generic over any ``nn.Module``: a masked SGD-with-momentum (:mod:`sparse.optim`),
Fisher sensitivity scores (:mod:`sparse.fisher`), mask rules (:mod:`sparse.rules`) and
their multi-round calibration (:mod:`sparse.calibration`), the closed-form classifier
head (:mod:`sparse.head`), per-entry aggregation of sparse uploads
(:mod:`sparse.aggregation`) and task arithmetic with interference diagnostics
(:mod:`sparse.merge`). The federated algorithm is ``network/algorithms/sparse_finetune.py``.
"""
