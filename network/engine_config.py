"""The round loop's settings, shared by the sequential engine and the Flower engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from network.diagnostics import check_diagnostics_options
from network.local_work import check_not_lockstep
from network.privacy import PrivacySettings
from utils.errors import TaskHetError


@dataclass(frozen=True)
class EngineConfig:
    """Round-loop settings (identical for every algorithm).

    Attributes:
        out_dir: the run folder.
        n_rounds: rounds to train (round 0 is the initial model, evaluated only).
        lr_schedule: local learning rate as a function of the round (see network.lr_schedule.make_lr_schedule).
        seed: root seed of sampling and of every client's training.
        local_steps / local_epochs: the local budget (exactly one is set).
        client_fraction: share of clients per round.
        eval_every: evaluate every this many rounds (and round 0 and the last round).
        checkpoint_every: write ``checkpoint.pt`` every this many rounds (and round 0 and the last round); a killed
            run resumes from the last one and redoes the rounds after it, bit for bit. A checkpoint holds the whole
            model, a frozen encoder included, so writing one every round is a tenth of a cheap run's time.
        checkpoint_minutes: write ``checkpoint.pt`` whenever this many minutes have passed since the last one (and at
            round 0 and the last round) instead of every ``checkpoint_every`` rounds: a budget of time lost to a kill,
            whatever a round costs (None: by rounds).
        keep_client_state: keep the clients' states (SCAFFOLD's c_i, personal models) in the final checkpoint and
            their spill folder; False drops them when the run ends (their evaluation is done; a finished SCAFFOLD
            run of paper.yaml's ResNet50 and 25 clients keeps ~2.5 GB otherwise), and a later resume that would
            train more rounds is refused.
        momentum / weight_decay: local SGD settings.
        resume: continue from ``out_dir/checkpoint.pt`` if present (else start over).
        max_state_memory_bytes: client state kept in memory before spilling to disk (None: no limit).
        progress: show a tqdm bar over rounds.
        signature: the caller's description of the run (its arguments); resuming a
            checkpoint written with another signature is refused.
        finetune_steps: evaluate every client's model also after this many local steps (0: off).
        diagnostics: record client drift, update norms and the update-cosine matrix every round, and G², B² and
            every client's ‖∇F_k‖² at the global model every ``diagnostics_every`` rounds (network.diagnostics).
        diagnostics_every: the gradient diagnostics' period in rounds (round 0 included).
        diagnostics_max_samples: each client's gradient over at most this many of its train rows, a fixed seeded
            sample (None: all of them).
        tensorboard: also write metrics.csv's rows as TensorBoard scalars under ``out_dir/tensorboard``.
        round_lines: print one console line per evaluated round (with the ETA); False keeps them in run.log only and prints one
            summary line at the end (what a pipeline of hundreds of runs wants).
        vectorize_chunk: 0 trains the sampled clients one after another; C > 0 trains them in
            lock-step, C at a time (``--vectorize_clients``, network/vectorized.py).
        privacy: client-level DP (network/privacy.py) with its noise multiplier resolved; None: no DP.
        client_steps: each client's own local steps per round (unequal local work, network/local_work.py); None:
            every client takes ``local_steps``.
        plots: draw the run's pictures (``curves.png`` at the end; with diagnostics, ``diagnostics.png`` and the
            cosine heatmaps). Step 4 always draws them; a caller that reads none (a benchmark, a test of the
            numbers) may skip them: ``curves.png`` alone is about half of a tiny run's time.
    """

    out_dir: Path
    n_rounds: int
    lr_schedule: Callable[[int], float]
    seed: int = 0
    local_steps: int | None = None
    local_epochs: int | None = None
    client_fraction: float = 1.0
    eval_every: int = 1
    checkpoint_every: int = 1
    checkpoint_minutes: float | None = None
    keep_client_state: bool = True
    momentum: float = 0.0
    weight_decay: float = 0.0
    resume: bool = True
    max_state_memory_bytes: int | None = None
    progress: bool = True
    signature: dict[str, str] | None = None
    finetune_steps: int = 0
    diagnostics: bool = False
    diagnostics_every: int = 1
    diagnostics_max_samples: int | None = None
    tensorboard: bool = False
    round_lines: bool = True
    vectorize_chunk: int = 0
    plots: bool = True
    client_steps: Mapping[str, int] | None = None
    privacy: PrivacySettings | None = None

    def __post_init__(self) -> None:
        check_diagnostics_options(self.diagnostics_every, self.diagnostics_max_samples)
        if self.checkpoint_minutes is not None and (self.checkpoint_every != 1 or not self.checkpoint_minutes > 0):
            raise TaskHetError(f"--checkpoint_minutes must be > 0 and replaces --checkpoint_every (pass one), got "
                               f"{self.checkpoint_minutes} minutes and every {self.checkpoint_every} rounds")
        check_not_lockstep(self.client_steps is not None, bool(self.vectorize_chunk))

    def local_steps_of(self, client_id: str) -> int | None:
        """Client ``client_id``'s local steps per round (None: the budget is ``local_epochs``)."""
        if self.client_steps is None or self.local_steps is None:
            return self.local_steps
        return int(self.client_steps.get(str(client_id), self.local_steps))
