"""Checkpoints without the frozen encoder: the encoder named by its weights' source and hash, rebuilt when read.

With ``--freeze_encoder`` over pretrained weights the encoder never changes, yet every checkpoint held a
copy of it (EfficientNet-Lite0: 12 MB in each best.pt, last.pt and checkpoint.pt). A writer now passes
its checkpoint through :func:`strip_frozen_encoder`: every tensor, at any depth of the checkpoint's dicts
(a model's state, the server's models, a client's state), whose name ends in an encoder entry
(``encoder.<key>``, after nothing, a ``.`` or a ``/``) and whose dtype, shape and values equal that entry
of the encoder as loaded is left out, and the checkpoint gains one entry::

    "frozen_encoder": {"name": <encoder>, "weights": <source name or path>, "sha256": <hex>,
                       "omitted": [{"path": [<key>, ...], "keys": [<name>, ...], "positions": [<int>, ...]}, ...]}

``path`` leads from the checkpoint to a dict that lost tensors, ``keys`` are their names and ``positions``
their places in that dict's order. A tensor that training did change stays in the file, so nothing the
run holds is lost. ``sha256`` is :func:`utils.hashing.tensors_sha256` of the encoder's state dict as its
source gave it, computed once when the model is built (:class:`FrozenEncoder`, kept on the model).

A reader (:func:`load_full_checkpoint`, :func:`restore_frozen_encoder`) rebuilds the encoder from
``name`` and ``weights`` with the code that built it (``models.encoders.build_encoder``), or takes the
running model's own when it has one, compares the hashes, refuses a mismatch with one line naming the
file, both hashes and the source, and puts every tensor back in its place: the reader gets exactly the
dicts the writer had, so a resumed run stays bit-identical. A checkpoint without the entry (one whose
encoder trains, or one written before this format) is read as it is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from models.encoders import build_encoder
from models.weights import FROZEN_ENCODER
from utils.errors import TaskHetError
from utils.hashing import tensors_sha256
from utils.run_dir import atomic_torch_save, load_checkpoint

ENCODER_PREFIX = "encoder."
# An encoder entry inside a longer name: FedEM's "components.0.encoder.x", sparse_ft's "base/encoder.x".
_ENCODER_ENTRY = re.compile(r"(?:^|[./])(encoder\..+)$")


class FrozenEncoder:
    """A frozen pretrained encoder: its registry name, weights source, SHA-256 and its tensors as loaded.

    Read-only once made: a deep copy of a model (FedEM's components) shares it.

    Args:
        name: the encoder's registry name (``models.encoders.ENCODERS``).
        weights: what ``build_encoder(name, weights)`` rebuilds it from: a named source or a file path.
        state: the encoder's state dict as loaded (its own keys, without ``encoder.``).
    """

    def __init__(self, name: str, weights: str, state: Mapping[str, Tensor]) -> None:
        self.name, self.weights = name, str(weights)
        self.tensors = {ENCODER_PREFIX + key: value.detach().to("cpu", copy=True) for key, value in state.items()}
        self.sha256 = tensors_sha256(state)

    @classmethod
    def rebuild(cls, name: str, weights: str) -> "FrozenEncoder":
        """The encoder ``name`` built from ``weights`` by the code that built it for training."""
        with torch.random.fork_rng(devices=[]):  # a reader must not move the global RNG (a resumed run's draws)
            encoder = build_encoder(name, weights)
        return cls(name, weights, encoder.state_dict())

    def record(self) -> dict[str, str]:
        """What names it in a checkpoint: ``{"name", "weights", "sha256"}``."""
        return {"name": self.name, "weights": self.weights, "sha256": self.sha256}

    def entry(self, key: str) -> str | None:
        """The encoder entry (``encoder.<key>``) that the checkpoint entry ``key`` would copy, or None."""
        match = _ENCODER_ENTRY.search(key)
        return match.group(1) if match and match.group(1) in self.tensors else None

    def reference(self, key: str) -> Tensor | None:
        """The encoder's tensor that the checkpoint entry ``key`` would copy, or None."""
        entry = self.entry(key)
        return None if entry is None else self.tensors[entry]

    def holds(self, key: str, value: Any) -> bool:
        """Whether ``value`` at ``key`` is this encoder's own tensor, unchanged (dtype, shape and every value)."""
        reference = self.reference(key)
        return (reference is not None and torch.is_tensor(value) and value.dtype == reference.dtype
                and value.shape == reference.shape and torch.equal(value.detach().to("cpu"), reference))

    def __deepcopy__(self, memo: dict) -> "FrozenEncoder":
        return self


def frozen_encoder_of(model: nn.Module) -> FrozenEncoder | None:
    """The frozen encoder of ``model`` or of a model inside it (a worker model that wraps the task model), or None."""
    for module in model.modules():
        frozen = getattr(module, FROZEN_ENCODER, None)
        if isinstance(frozen, FrozenEncoder):
            return frozen
    return None


# ----- writing -----
def strip_frozen_encoder(checkpoint: dict[str, Any], frozen: FrozenEncoder | None) -> dict[str, Any]:
    """``checkpoint`` without the tensors equal to ``frozen``'s, plus the ``frozen_encoder`` entry (module docstring).

    The given dicts are not changed (the ones that lose tensors are copied). Without ``frozen``, or when nothing
    equals it, the checkpoint is returned as it is: the full format.
    """
    if frozen is None:
        return checkpoint
    omitted: list[dict[str, Any]] = []
    stripped = _strip(checkpoint, [], frozen, omitted)
    if not omitted:
        return checkpoint
    return {**stripped, FROZEN_ENCODER: {**frozen.record(), "omitted": omitted}}


def _strip(node: Any, path: list, frozen: FrozenEncoder, omitted: list[dict[str, Any]]) -> Any:
    if not isinstance(node, dict):
        return node
    kept, keys, positions = {}, [], []
    for position, (key, value) in enumerate(node.items()):
        if isinstance(key, str) and frozen.holds(key, value):
            keys.append(key)
            positions.append(position)
        else:
            kept[key] = _strip(value, [*path, key], frozen, omitted)
    if keys:
        omitted.append({"path": path, "keys": keys, "positions": positions})
    return kept


# ----- reading -----
def load_full_checkpoint(path: Path, what: str = "checkpoint", keys: tuple[str, ...] = (), finished: bool = False,
                         known: FrozenEncoder | None = None) -> Any:
    """:func:`utils.run_dir.load_checkpoint`, then :func:`restore_frozen_encoder`: the checkpoint as it was written."""
    checkpoint = load_checkpoint(path, what, keys, finished)
    restore_frozen_encoder(checkpoint, path, what, known)
    return checkpoint


def restore_frozen_encoder(checkpoint: Any, path: Path, what: str,
                           known: FrozenEncoder | None = None) -> FrozenEncoder | None:
    """Put a frozen encoder's tensors back into a loaded checkpoint (in place); returns the encoder, or None.

    Args:
        checkpoint: what ``load_checkpoint`` returned; without a ``frozen_encoder`` entry it is left alone.
        path, what: the file and what it is, for messages.
        known: the running model's frozen encoder (a resume): used instead of a rebuild, and it must be the
            checkpoint's.

    Raises:
        TaskHetError: one line naming the file when the encoder cannot be rebuilt, when its hash differs from the
            recorded one, or when the entry does not describe the checkpoint.
    """
    if not isinstance(checkpoint, dict) or FROZEN_ENCODER not in checkpoint:
        return None
    record = checkpoint.pop(FROZEN_ENCODER)
    _check_record(record, path, what)
    frozen = _reference(record, path, what, known)
    copies: dict[str, Tensor] = {}  # one copy of each tensor, shared by every place that held it (as torch.load shares)
    for entry in record["omitted"]:
        _fill(checkpoint, entry, frozen, copies, path, what)
    return frozen


def _check_record(record: Any, path: Path, what: str) -> None:
    fields_ok = isinstance(record, dict) and all(isinstance(record.get(field), str) for field in ("name", "weights", "sha256"))
    entries_ok = fields_ok and isinstance(record.get("omitted"), list) and all(
        isinstance(entry, dict) and isinstance(entry.get("path"), list) and isinstance(entry.get("keys"), list)
        and isinstance(entry.get("positions"), list) and len(entry["keys"]) == len(entry["positions"])
        for entry in record["omitted"])
    if not entries_ok:
        raise TaskHetError(f"{what} {path}: its {FROZEN_ENCODER!r} entry is not the record this code writes "
                           "(name, weights, sha256, omitted)")


def _reference(record: dict[str, Any], path: Path, what: str, known: FrozenEncoder | None) -> FrozenEncoder:
    """The encoder whose tensors fill the checkpoint: ``known``, or a rebuild from the recorded source; hash checked."""
    name, weights, expected = record["name"], record["weights"], record["sha256"]
    described = f"frozen encoder {name} --weights {weights} (SHA-256 {expected[:16]}…)"
    if known is not None:
        frozen, source = known, f"this run's encoder {known.name} --weights {known.weights}"
    else:
        try:
            frozen = FrozenEncoder.rebuild(name, weights)
        except TaskHetError as error:
            raise TaskHetError(f"{what} {path} leaves out its {described}, which cannot be rebuilt: {error}") from None
        source = f"--weights {weights} now"
    if frozen.name != name or frozen.sha256 != expected:
        raise TaskHetError(f"{what} {path} was written with the {described}, but {source} gives encoder {frozen.name} "
                           f"with SHA-256 {frozen.sha256[:16]}…: put back the weights it was trained with, or rerun "
                           "the step that wrote it")
    return frozen


def _fill(checkpoint: dict[str, Any], entry: dict[str, Any], frozen: FrozenEncoder, copies: dict[str, Tensor],
          path: Path, what: str) -> None:
    """Put one dict's left-out tensors back at their positions (``copies``: the reader's copy of each, by name)."""
    parent, node = None, checkpoint
    for step in entry["path"]:
        if not isinstance(node, dict) or step not in node:
            raise TaskHetError(f"{what} {path}: its {FROZEN_ENCODER!r} entry names {entry['path']}, which it does not hold")
        parent, node = node, node[step]
    size = len(node) + len(entry["keys"]) if isinstance(node, dict) else -1
    if sorted(entry["positions"]) != sorted(set(entry["positions"])) or not all(
            isinstance(position, int) and 0 <= position < size for position in entry["positions"]):
        raise TaskHetError(f"{what} {path}: its {FROZEN_ENCODER!r} entry places tensors outside {entry['path']}")
    missing = [key for key in entry["keys"] if frozen.reference(key) is None]
    if missing:
        raise TaskHetError(f"{what} {path}: encoder {frozen.name} has no entry for {missing[0]} "
                           f"({len(missing)} left-out tensors unknown to it)")
    at = dict(zip(entry["positions"], entry["keys"]))
    kept = iter(node.items())
    restored = {}
    for position in range(size):
        if position in at:
            entry_name = frozen.entry(at[position])
            if entry_name not in copies:
                copies[entry_name] = frozen.tensors[entry_name].clone()
            restored[at[position]] = copies[entry_name]
        else:
            key, value = next(kept)
            restored[key] = value
    if parent is None:
        checkpoint.clear()
        checkpoint.update(restored)
    else:
        parent[entry["path"][-1]] = restored


# ----- step 2's checkpoint for a run that fine-tunes its encoder -----
def write_unfrozen_copy(checkpoint: Path, out: Path) -> None:
    """Write a step-2 ``best.pt`` whole (its frozen encoder put back) with ``freeze_encoder`` off in its model config.

    The copy is a full checkpoint: the runs that start from it train the encoder, so no source can stand in
    for it. Written atomically and from content only (the runs' stage keys hash the file).
    """
    loaded = load_full_checkpoint(checkpoint, "step-2 best.pt", keys=("model", "model_config"), finished=True)
    atomic_torch_save({"model": loaded["model"], "model_config": {**loaded["model_config"], "freeze_encoder": False}}, out)
