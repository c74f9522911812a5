"""Per-client state (SCAFFOLD's c_i, FedRep's heads) in memory or spilled to disk.

One explicit, serialisable store (STYLE.md §8): the engine reads a client's state
before it trains and writes it back after. States are kept on the CPU; once the
in-memory total would pass ``max_memory_bytes``, further states go to one file
per client under ``spill_dir``. ``snapshot``/``restore`` move the whole store in
and out of a checkpoint, wherever each state lives. A spilled state leaves out its copy of a
frozen pretrained encoder (a personal model's, e.g. Ditto's v_i), as checkpoints do
(``models.frozen_encoder``); reading it puts the copy back.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from torch import Tensor

from models.frozen_encoder import FrozenEncoder, load_full_checkpoint, strip_frozen_encoder
from utils.run_dir import atomic_torch_save

State = dict[str, Tensor]
STATE = "state"  # a spilled file's entry: {"state": the client's state, and the frozen encoder's record if any}


class ClientStore:
    """Client id -> state dict; memory first, disk above a size.

    Args:
        spill_dir: folder for spilled states (created on first use; emptied by ``restore``).
        max_memory_bytes: largest total size of states kept in memory (``None``: no limit).
        frozen: the run's frozen pretrained encoder, left out of spilled files (None: files hold whole states).
    """

    def __init__(self, spill_dir: Path | None = None, max_memory_bytes: int | None = None,
                 frozen: FrozenEncoder | None = None) -> None:
        if max_memory_bytes is not None and spill_dir is None:
            raise ValueError("a memory limit needs a spill_dir")
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        self.max_memory_bytes = max_memory_bytes
        self.frozen = frozen
        self._memory: dict[str, State] = {}
        self._spilled: set[str] = set()
        self._memory_bytes = 0

    @property
    def memory_bytes(self) -> int:
        """Bytes of state currently held in memory."""
        return self._memory_bytes

    def get(self, client_id: object) -> State | None:
        """The client's state, or None if it has none yet."""
        key = str(client_id)
        if key in self._memory:
            return self._memory[key]
        if key in self._spilled:
            return load_full_checkpoint(self._path(key), "spilled client state", keys=(STATE,), known=self.frozen)[STATE]
        return None

    def put(self, client_id: object, state: State) -> None:
        """Store (a CPU copy of) the client's state, replacing any previous one."""
        key = str(client_id)
        self._discard(key)
        state = {name: value.detach().to("cpu", copy=True) for name, value in state.items()}
        size = sum(value.numel() * value.element_size() for value in state.values())
        if self.max_memory_bytes is None or self._memory_bytes + size <= self.max_memory_bytes:
            self._memory[key] = state
            self._memory_bytes += size
        else:
            # a full disk is an error naming the file, not a torch traceback
            atomic_torch_save(strip_frozen_encoder({STATE: state}, self.frozen), self._path(key))
            self._spilled.add(key)

    def snapshot(self) -> dict[str, State]:
        """Every client's state (spilled ones loaded), for a checkpoint."""
        return {key: self.get(key) for key in sorted([*self._memory, *self._spilled])}

    @property
    def count(self) -> int:
        """The clients whose state holds something (FedAvg's clients keep an empty one)."""
        return sum(1 for state in self._memory.values() if state) + len(self._spilled)  # an empty state never spills

    def drop_spilled(self) -> None:
        """Delete the spill folder's files (a finished run that keeps no client state); the in-memory ones stay."""
        if self.spill_dir is not None and self.spill_dir.exists():
            shutil.rmtree(self.spill_dir)
        self._spilled.clear()

    def restore(self, snapshot: dict[str, State]) -> None:
        """Replace the whole store by a snapshot (spilled files of the old contents are removed)."""
        self._memory.clear()
        self._spilled.clear()
        self._memory_bytes = 0
        if self.spill_dir is not None and self.spill_dir.exists():
            shutil.rmtree(self.spill_dir)
        for key, state in snapshot.items():
            self.put(key, state)

    def _discard(self, key: str) -> None:
        if key in self._memory:
            self._memory_bytes -= sum(value.numel() * value.element_size() for value in self._memory.pop(key).values())
        elif key in self._spilled:
            self._spilled.discard(key)
            self._path(key).unlink()

    def _path(self, key: str) -> Path:
        return self.spill_dir / f"client_{key}.pt"
