"""The skew record in assignments.json: step 3b draws and records every client's parameters; step 4 reads
the record back as a user file (a user may edit it), validates it and assembles each client's
:class:`~partitioning.skew_transforms.ClientSkew`. The kinds of skew are the registry of
``partitioning/skews.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from partitioning.skew_transforms import ClientSkew
from partitioning.skews import (CONCEPT, FEATURE, SKEWS_KEY, BatchKeys, SkewContext, flag_context, get_skew, json_object,
                                list_skews)
from utils.errors import TaskHetError
from utils.seeding import derive_seed

# A client id key of the record: ASCII digits, a few of them (ids are below partitioning.assignments.MAX_CLIENTS).
CLIENT_KEY = re.compile(r"[0-9]{1,9}", re.ASCII)


# ----- step 3b: draw and record -----
def draw_skews(settings: dict[str, dict], context: SkewContext, seed: int) -> dict[str, dict]:
    """The sidecar record of the skews in ``settings`` (name -> that skew's flag settings), drawn per client.

    Returns:
        ``{name: {"settings": checked settings, "clients": {"<id>": params}}}`` (JSON-ready; empty without skews).
    """
    record = {}
    for name, given in settings.items():
        skew = get_skew(name)
        checked = skew.check_settings(given, context)
        drawn = skew.draw(checked, context, derive_seed(seed, "skews"))
        record[name] = {"settings": checked, "clients": {str(client): params for client, params in sorted(drawn.items())}}
    return record


def check_skew_settings(settings: dict[str, dict], n_clients: int) -> None:
    """The checks of :func:`draw_skews` that need no data (step 3b's flags alone): each skew's settings against
    :func:`partitioning.skews.flag_context` (σ, transform names and limits, class pairs below
    :data:`partitioning.skews.MAX_CLASSES`, a task with a target variant, the concept fraction). The family's own
    classes and tasks are checked by :func:`draw_skews` once the manifest is read."""
    context = flag_context(n_clients)
    for name, given in settings.items():
        get_skew(name).check_settings(given, context)


def skew_columns(record: dict[str, dict], n_clients: int) -> dict[str, list]:
    """client_stats.csv's columns for ``record``: each skew's per-client columns, clients 0..n_clients-1."""
    columns: dict[str, list] = {}
    for name in sorted(record, key=lambda n: get_skew(n).order):
        skew, clients = get_skew(name), record[name]["clients"]
        for client in range(n_clients):
            for column, value in skew.columns(clients.get(str(client))).items():
                columns.setdefault(column, []).append(value)
    return columns


def skew_summary(record: dict[str, dict], client: int) -> str:
    """A short label of what client ``client`` sees (the heatmap's row labels): "" when unaffected."""
    parts = []
    for name in sorted(record, key=lambda n: get_skew(n).order):
        params = record[name]["clients"].get(str(client))
        if not params:
            continue
        if name == "feature_noise" and params["sigma"] > 0:
            parts.append(f"σ={params['sigma']:.2g}")
        elif name == "feature_shift":
            parts.append("shift " + " ".join(f"{key[:3]}={value:.2g}" for key, value in params.items()))
        elif name == "label_swap":
            parts.append("swap " + ",".join(f"{a}↔{b}" for a, b in params["pairs"]))
        elif name == "target_variant":
            parts.append(f"targets={params['variant']}")
    return "; ".join(parts)


# ----- step 4: read back, validate, apply -----
def read_skews(sidecar: Path, meta: dict, context: SkewContext) -> dict[str, dict[int, dict]]:
    """The recorded skews of an assignments.json, validated: name -> client id -> params.

    The file is parsed again with duplicate keys refused (``json`` keeps the last silently), so a
    hand-edited record with a client or key twice is named rather than half-applied.

    Raises:
        TaskHetError: one line naming the file and the key (``skews.label_swap.clients.3.pairs``).
    """
    if SKEWS_KEY not in meta:
        return {}
    json.loads(Path(sidecar).read_text(), object_pairs_hook=lambda pairs: _no_duplicates(pairs, sidecar))
    record = meta[SKEWS_KEY]
    if not isinstance(record, dict):
        raise TaskHetError(f"{sidecar}: {SKEWS_KEY} must be a JSON object of skews, got {record!r}")
    skews: dict[str, dict[int, dict]] = {}
    for name, entry in record.items():
        where = f"{sidecar}: {SKEWS_KEY}.{name}"
        if name not in list_skews():
            raise TaskHetError(f"{where}: unknown skew {name!r}; known skews: {', '.join(list_skews())}")
        entry = json_object(entry, where, ("clients", "settings"))
        clients = entry["clients"]
        if not isinstance(clients, dict):
            raise TaskHetError(f"{where}.clients must map client ids to parameters, got {clients!r}")
        skews[name] = {}
        for key, params in clients.items():
            client = _client_id(key, context.n_clients, f"{where}.clients.{key}")
            if client in skews[name]:
                raise TaskHetError(f"{where}.clients: client {client} appears twice ({key!r})")
            skews[name][client] = get_skew(name).check_client(params, context, f"{where}.clients.{key}")
    return skews


def _no_duplicates(pairs: list[tuple[str, Any]], source: Path) -> dict:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise TaskHetError(f"{source}: key {repeated[0]!r} appears twice in one JSON object")
    return dict(pairs)


def _client_id(key: str, n_clients: int, where: str) -> int:
    """A record's client key as its id: ASCII digits (not '²' or '٣', which str.isdigit() takes) in 0..n_clients-1."""
    if not CLIENT_KEY.fullmatch(key) or not 0 <= int(key) < n_clients:
        raise TaskHetError(f"{where}: {key!r} is not a client id in 0..{n_clients - 1}")
    return int(key)


def client_skews(skews: dict[str, dict[int, dict]], keys: BatchKeys) -> dict[int, ClientSkew]:
    """Client id -> its :class:`ClientSkew`, for every client some recorded skew changes (others are left out)."""
    steps: dict[int, dict[str, list]] = {}
    extras: dict[int, dict] = {}
    for name in sorted(skews, key=lambda n: get_skew(n).order):
        skew = get_skew(name)
        for client, params in skews[name].items():
            step = skew.transform(params, keys)
            if step is None:
                continue
            steps.setdefault(client, {FEATURE: [], CONCEPT: []})[skew.kind].append(step)
            if name == "label_swap":
                extras.setdefault(client, {})["pairs"] = tuple(tuple(pair) for pair in params["pairs"])
            if name == "target_variant":
                extras.setdefault(client, {})["variant"] = params["variant"]
    return {client: ClientSkew(tuple(kinds[FEATURE]), tuple(kinds[CONCEPT]), keys.input_key, **extras.get(client, {}))
            for client, kinds in sorted(steps.items())}
