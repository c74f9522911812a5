"""The kinds of client partition the experiments compare, by name.

A partition skews clients over class labels (``label_based``: the data family's label
column) or over a task's embedding clusters (``embedding_based``); the main job compares the two. A third,
``property_based``, skews them over quantile bins of a property of each sample's target (partitioning/property_bins.py):
the positive control, a heterogeneity the task's loss must feel. The original code called label-based partitions
``class_based``; that name is still accepted on input and replaced by
:func:`canonical_grouping` as soon as it is read, so no file, folder or report says it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

LABEL_BASED = "label_based"
EMBEDDING_BASED = "embedding_based"
GROUPINGS = (LABEL_BASED, EMBEDDING_BASED)
# The positive control's grouping: quantile bins of the mean target (an experiment may add it to GROUPINGS).
PROPERTY_BASED = "property_based"
ALL_GROUPINGS = (*GROUPINGS, PROPERTY_BASED)
# The reference partition of an experiment (partition.iid_reference): clients drawn uniformly at random.
IID_REFERENCE = "iid"
# Old names -> current names; read-only so no caller can change what every caller sees.
ALIASES = MappingProxyType({"class_based": LABEL_BASED})


def canonical_grouping(name: Any) -> Any:
    """The current name of a grouping: an alias is replaced, anything else returned unchanged.

    Args:
        name: a grouping name as given by a user (command line or experiment file). Values
            that are not strings pass through, so the caller's validation names them.

    Returns:
        ``label_based`` for ``class_based``; otherwise ``name`` itself.
    """
    return ALIASES.get(name, name) if isinstance(name, str) else name
