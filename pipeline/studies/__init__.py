"""Study kinds: one registered unit per kind of experiment file (its keys, validation, runner and report).

Each kind module registers itself in :data:`pipeline.studies.registry.STUDIES` when imported; this package
imports them all explicitly (torchvision's rule), so a new kind is one module plus one line here.

* ``main_job`` (a file without ``study:``): label- vs embedding-based partitions, the paper's question.
* ``mechanism`` (in ``main_job/``): the main job once per knob level, each knob moved alone (when the penalty appears).
* ``fedavg_sharding``, ``sparse_finetuning``, ``fed_lt``, ``heterogeneity_toolbox``: grid studies
  (pipeline/studies/grid/: the shared grid keys, validation and runner).
"""

from pipeline.studies import fed_lt, fedavg_sharding, heterogeneity_toolbox, main_job, sparse_finetuning  # noqa: F401
from pipeline.studies.registry import MAIN_JOB, STUDIES, StudyKind


def get_study(name: str) -> StudyKind:
    """The registered study kind ``name`` (a ``TaskHetError`` listing the kinds otherwise)."""
    return STUDIES.get(name)


def list_studies() -> list[str]:
    """The names of every registered study kind, sorted."""
    return STUDIES.names()


__all__ = ["MAIN_JOB", "StudyKind", "get_study", "list_studies"]
