"""Client-level differential privacy: DP-FedAvg's clipping and Gaussian noise, adaptive clipping, and its accountant.

The mechanism (McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018), for every
algorithm whose uploads allow it (``Algorithm.dp_groups``):

* **Client** (``network.client.train_client``, both engines): the upload groups the algorithm names are clipped
  *together* to an L2 norm C: each floating entry is multiplied by min(1, C/‖Δ‖), ‖Δ‖ over every entry of every
  named group (SCAFFOLD's Δy_i and Δc_i are one vector). Integer entries (BatchNorm's step counter) are counts the
  server sets, not data, and pass unchanged. Nothing unclipped leaves the client. With adaptive clipping the client
  also uploads the bit b_i = 1[‖Δ‖ ≤ C] (group ``dp``).
* **Server** (:class:`ServerPrivacy`, called by the engine's round): one Gaussian draw per round,
  N(0, (z_Δ·C)²) per coordinate, is added to the *sum* of the clipped uploads; the algorithm's uniform mean then
  divides by the round's m sampled clients: (Σ_i clip(Δ_i) + noise)/m, DP-FedAvg's fixed denominator (the
  engine samples a fixed number m of the N clients each round). The noise comes from
  ``torch_generator(seed, "dp_noise", round)`` on the CPU, in sorted group and entry order, so both engines, any
  device and a resumed run draw the same numbers.
* **Adaptive clipping** (Andrew et al., "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021):
  after each round C ← C·exp(−η_C·(b̄ − γ)), b̄ = (Σ_i b_i + N(0, σ_b²))/m the noisy share of unclipped uploads,
  γ the target quantile (``--dp_adaptive_quantile``), η_C = ``--dp_clip_lr``, σ_b = ``--dp_count_noise``
  (default m/20, the paper's). The bits are privatised too, so the update's noise multiplier is raised to
  z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) and the pair (noisy sum, noisy count) is as private as one Gaussian mechanism of
  multiplier z (their Theorem 1).

**The accountant** is dp-accounting's RDP accountant (Google's ``dp_accounting``, the library behind TensorFlow
Privacy and pfl-research's RDP accountant), not a hand-written formula. It assumes what the engine does: each round
samples m of the N clients uniformly *without replacement* (``SampledWithoutReplacementDpEvent``), which makes
the neighbouring relation *replace one client* (N is public). Replacing one client moves the sum of clipped
updates by up to 2C, so the Gaussian's multiplier as the accountant defines it (std ÷ L2 sensitivity) is z/2:
ε is about twice what a Poisson-sampled add-or-remove analysis at the same z would print (PLD accounting is not
offered: dp-accounting's PLD accountant has no sampling-without-replacement event). Poisson sampling is not
offered either: the engine's fixed m keeps a DP run with z = 0 and C = ∞ bit for bit the ordinary run with
``--weighting uniform``.

What it protects, and what it does not (a trusted server that sees single clipped updates; no secure aggregation;
no sample-level guarantee inside a client): docs/explain/client-dp.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import torch
from torch import Tensor

from network.sampling import clients_per_round
from utils.errors import TaskHetError
from utils.seeding import torch_generator

if TYPE_CHECKING:  # the algorithms' module imports nothing of this one; the run config imports this one early
    from network.algorithms.base import Upload

Weights = dict[str, Tensor]
Bundle = dict[str, Weights]

DP_GROUP = "dp"  # broadcast: {"clip": C}; upload (adaptive clipping only): {"unclipped": b_i}
CLIP_KEY, ADAPTIVE_KEY, UNCLIPPED_KEY = "clip", "adaptive", "unclipped"
PRIVACY_SPLIT, SERVER_CLIENT = "privacy", "server"  # metrics.csv: one row per round and figure
EPSILON, CLIP_METRIC, NOISE_STD, UNCLIPPED_SHARE = "dp_epsilon", "dp_clip", "dp_noise_std", "dp_unclipped_share"
MAX_CLIP = 1e6  # a larger C on a model's update is no clipping at all; say --dp_clip inf (z = 0 only)
MAX_NOISE_MULTIPLIER = 1e4  # noise 10,000 times the update drowns any model
MAX_EPSILON = 1e4
DEFAULT_CLIP_LR = 0.2  # Andrew et al.'s η_C
COUNT_NOISE_SHARE = 1 / 20  # σ_b = m/20, Andrew et al.'s recommendation


@dataclass(frozen=True)
class PrivacySettings:
    """Client-level DP settings (``--dp_*``); None on the run config: no DP.

    Attributes:
        clip: the clipping norm C (the initial C with adaptive clipping); ``math.inf``: no clipping (z = 0 only).
        noise_multiplier: z, the update noise's std over C (before the adaptive correction); None: calibrated to
            ``target_epsilon`` over the run's rounds.
        target_epsilon: the ε the run may spend at ``delta``; None: no budget (ε is reported only).
        delta: δ of every reported ε.
        adaptive_quantile: γ of adaptive clipping; None: C stays fixed.
        clip_lr: η_C of adaptive clipping.
        count_noise: σ_b of the privatised unclipped count; None: m/20.
    """

    clip: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    adaptive_quantile: float | None = None
    clip_lr: float = DEFAULT_CLIP_LR
    count_noise: float | None = None

    def __post_init__(self) -> None:
        check_settings(self)


def check_settings(settings: PrivacySettings) -> None:
    """One line per bad value, naming its flag (NaN, ±∞ and huge values included)."""
    clip = settings.clip
    if not (clip == math.inf or (math.isfinite(clip) and 0 < clip <= MAX_CLIP)):
        raise TaskHetError(f"--dp_clip must be in (0, {MAX_CLIP:g}] or inf (no clipping), got {clip!r}")
    _check_range(settings.noise_multiplier, "--dp_noise_multiplier", 0.0, MAX_NOISE_MULTIPLIER, low_open=False)
    _check_range(settings.target_epsilon, "--dp_target_epsilon", 0.0, MAX_EPSILON, low_open=True)
    if not (math.isfinite(settings.delta) and 0 < settings.delta < 1):
        raise TaskHetError(f"--dp_delta must be in (0, 1), got {settings.delta!r}")
    _check_range(settings.adaptive_quantile, "--dp_adaptive_quantile", 0.0, 1.0, low_open=False)
    _check_range(settings.clip_lr, "--dp_clip_lr", 0.0, 10.0, low_open=True)
    _check_range(settings.count_noise, "--dp_count_noise", 0.0, 1e6, low_open=True)
    if settings.noise_multiplier is None and settings.target_epsilon is None:
        raise TaskHetError("--dp_clip: pass --dp_noise_multiplier Z (0: clipping only, ε = ∞) or "
                           "--dp_target_epsilon E (Z is then calibrated to the run's rounds)")
    if clip == math.inf and (settings.noise_multiplier != 0 or settings.adaptive_quantile is not None):
        raise TaskHetError("--dp_clip inf (no clipping) leaves the noise z·C infinite: it needs "
                           "--dp_noise_multiplier 0 and no --dp_adaptive_quantile")


def _check_range(value: float | None, flag: str, low: float, high: float, low_open: bool) -> None:
    if value is None:
        return
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and value <= high):
        raise TaskHetError(f"{flag} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")


def delta_warning(delta: float, num_clients: int) -> str | None:
    """A warning when δ ≥ 1/N: a mechanism publishing one whole client's data outright would meet such a δ."""
    if delta >= 1 / num_clients:
        return (f"--dp_delta {delta:g} is at least 1/N = 1/{num_clients}: a δ that large allows releasing one "
                f"client's update in the clear; use δ well below 1/N (e.g. {0.1 / num_clients:.2g})")
    return None


def check_dp_algorithm(algorithm: Any, settings: Any) -> None:
    """Client-level DP's conditions on an algorithm (its class or object) and its settings, one line each: it names
    the upload groups DP clips (``dp_groups``), and it weighs every client alike."""
    if not algorithm.dp_groups:
        raise TaskHetError(f"--dp_clip: client-level DP is not offered for {algorithm.name}: {algorithm.dp_refusal}")
    weighting = getattr(settings, "weighting", None)
    if weighting != "uniform":
        raise TaskHetError(f"--dp_clip: client-level DP weighs every client alike (pass --weighting uniform): a weight "
                           f"n_i would scale a clipped update past C; {algorithm.name} has --weighting {weighting}")


# ----- the client's half -----

def floating_entries(upload: Bundle, groups: tuple[str, ...]) -> list[Tensor]:
    """The floating entries of the named groups, in sorted group and entry order (what clipping and noise touch)."""
    return [upload[group][key] for group in sorted(groups) for key in sorted(upload[group])
            if upload[group][key].is_floating_point()]


def upload_norm(upload: Bundle, groups: tuple[str, ...]) -> float:
    """‖Δ‖₂ over every floating entry of the named groups together, summed in float64."""
    squares = [value.detach().double().pow(2).sum() for value in floating_entries(upload, groups)]
    return math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0


def clip_upload(upload: Bundle, groups: tuple[str, ...], clip: float, adaptive: bool) -> Bundle:
    """The upload with its named groups scaled by min(1, C/‖Δ‖) (unchanged, the same tensors, when ‖Δ‖ ≤ C); with
    adaptive clipping, plus the group ``dp`` holding b = 1[‖Δ‖ ≤ C]."""
    norm = upload_norm(upload, groups)
    clipped = dict(upload)
    if norm > clip:
        factor = clip / norm
        for group in groups:
            clipped[group] = {key: value * factor if value.is_floating_point() else value
                              for key, value in upload[group].items()}
    if adaptive:
        clipped[DP_GROUP] = {UNCLIPPED_KEY: torch.tensor(float(norm <= clip))}
    return clipped


# ----- the server's half -----

def update_noise_multiplier(noise_multiplier: float, count_noise: float | None) -> float:
    """z_Δ: the update noise's std over C. With the unclipped count privatised by σ_b, (z⁻² − (2σ_b)⁻²)^(−1/2), so
    the pair's privacy is one Gaussian of multiplier z (Andrew et al., Theorem 1); else z itself."""
    if count_noise is None or noise_multiplier == 0:
        return noise_multiplier
    return (noise_multiplier ** -2 - (2 * count_noise) ** -2) ** -0.5


def count_noise_for(settings: PrivacySettings, per_round: int) -> float | None:
    """σ_b of the privatised unclipped count (None without adaptive clipping; 0 without noise)."""
    if settings.adaptive_quantile is None:
        return None
    if settings.noise_multiplier == 0:
        return 0.0
    return settings.count_noise if settings.count_noise is not None else COUNT_NOISE_SHARE * per_round


def gaussian_like(tensors: list[Tensor], std: float, generator: torch.Generator) -> list[Tensor]:
    """N(0, std²) draws of each tensor's shape: standard normals from ``generator`` on the CPU in float32 (the same
    numbers on any engine and device), scaled by ``std`` in float64, then cast to the tensor's dtype and device."""
    return [(torch.randn(value.shape, generator=generator, dtype=torch.float32).double() * std).to(value.dtype)
            .to(value.device) for value in tensors]


def add_noise_to_sum(first: Bundle, groups: tuple[str, ...], noise: list[Tensor]) -> Bundle:
    """The round's first upload with the server's noise added to its named groups.

    The algorithm's uniform mean is (Σ_i Δ_i)/m; adding the noise to one term of that sum makes it
    (Σ_i Δ_i + noise)/m, DP-FedAvg's noisy sum over the fixed denominator, with one draw per round at the server.
    """
    noisy = {group: dict(first[group]) for group in groups}
    keys = [(group, key) for group in sorted(groups) for key in sorted(first[group])
            if first[group][key].is_floating_point()]
    for (group, key), draw in zip(keys, noise, strict=True):
        noisy[group][key] = first[group][key] + draw
    return {**first, **noisy}


@dataclass
class ServerPrivacy:
    """The server's side of client-level DP over one run: the current C, the accountant, and each round's noise.

    ``state()`` goes into every checkpoint and ``load_state`` restores it, so a resumed run continues C's path and
    ε's count exactly.

    Args:
        settings: the ``--dp_*`` settings.
        groups: the upload groups the algorithm privatises (``Algorithm.dp_groups``).
        num_clients: N; per_round: m, the clients sampled each round.
        seed: the run's root seed (the noise's stream).
        noise_multiplier: z, the settings' or the one calibrated to their target ε.
    """

    settings: PrivacySettings
    groups: tuple[str, ...]
    num_clients: int
    per_round: int
    seed: int
    noise_multiplier: float
    clip: float = field(init=False)
    rounds: int = field(init=False, default=0)  # rounds whose noisy sums were released

    def __post_init__(self) -> None:
        self.clip = self.settings.clip
        self.count_noise = count_noise_for(self.settings, self.per_round)
        if self.count_noise and 2 * self.count_noise <= self.noise_multiplier:
            raise TaskHetError(f"--dp_adaptive_quantile: the count noise σ_b = {self.count_noise:g} must exceed z/2 = "
                               f"{self.noise_multiplier / 2:g} (z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) is undefined otherwise); "
                               "raise --dp_count_noise or lower --dp_noise_multiplier")
        self.update_multiplier = update_noise_multiplier(self.noise_multiplier, self.count_noise)
        self.accountant = Accountant(self.num_clients, self.per_round, self.noise_multiplier, self.settings.delta)

    @property
    def adaptive(self) -> bool:
        return self.settings.adaptive_quantile is not None

    @property
    def noise_std(self) -> float:
        """The std of the update noise added to the sum: z_Δ·C (0 when z = 0)."""
        return self.update_multiplier * self.clip if self.update_multiplier else 0.0

    def broadcast(self) -> Weights:
        """What every sampled client receives besides its model: the round's C, and whether to send its bit."""
        message = {CLIP_KEY: torch.tensor(self.clip, dtype=torch.float64)}
        return {**message, ADAPTIVE_KEY: torch.tensor(1.0)} if self.adaptive else message

    def start_round(self, round_index: int) -> "PrivateRound":
        return PrivateRound(self, torch_generator(self.seed, "dp_noise", round_index))

    def state(self) -> dict[str, float]:
        return {"clip": self.clip, "rounds": self.rounds}

    def load_state(self, state: Mapping[str, float]) -> None:
        self.clip, self.rounds = float(state["clip"]), int(state["rounds"])


def server_privacy(settings: PrivacySettings | None, algorithm: Any, num_clients: int, client_fraction: float,
                   seed: int) -> ServerPrivacy | None:
    """The server's client-level DP over a run of ``algorithm`` (None without DP). The run config checks the
    algorithm first; an engine built directly (a test, a benchmark) is checked here too."""
    if settings is None:
        return None
    check_dp_algorithm(algorithm, algorithm.settings)
    return ServerPrivacy(settings, algorithm.dp_groups, num_clients, clients_per_round(num_clients, client_fraction),
                         seed, settings.noise_multiplier or 0.0)


@dataclass
class PrivateRound:
    """One round at the server: its uploads pass through :meth:`uploads`, then :meth:`finish` moves C and counts ε."""

    privacy: ServerPrivacy
    generator: torch.Generator  # the update noise first, then the count noise
    bits: float = 0.0
    received: int = 0

    def uploads(self, uploads: Iterable[Upload]) -> Iterator[Upload]:
        """``uploads`` with the round's noise added to the first one's groups (one draw per round, at the server) and
        the ``dp`` group taken off each, its bit counted."""
        privacy = self.privacy
        for upload in uploads:
            tensors = dict(upload.tensors)
            bit = tensors.pop(DP_GROUP, None)
            if privacy.adaptive:
                self.bits += float(bit[UNCLIPPED_KEY]) if bit is not None else 0.0
            if self.received == 0 and privacy.noise_std > 0:
                noise = gaussian_like(floating_entries(tensors, privacy.groups), privacy.noise_std, self.generator)
                tensors = add_noise_to_sum(tensors, privacy.groups, noise)
            self.received += 1
            yield dataclasses.replace(upload, tensors=tensors)

    def finish(self) -> list[tuple[str, float]]:
        """Move C (adaptive clipping), count the round, and return its figures for metrics.csv (C and the noise std
        this round used, the noisy unclipped share, ε after it)."""
        privacy = self.privacy
        figures = [(CLIP_METRIC, privacy.clip), (NOISE_STD, privacy.noise_std)]
        if privacy.adaptive and self.received:
            noise = float(torch.randn((), generator=self.generator, dtype=torch.float64)) * (privacy.count_noise or 0.0)
            share = (self.bits + noise) / self.received
            figures.append((UNCLIPPED_SHARE, share))
            privacy.clip *= math.exp(-privacy.settings.clip_lr * (share - privacy.settings.adaptive_quantile))
        privacy.rounds += 1
        figures.append((EPSILON, privacy.accountant.epsilon(privacy.rounds)))
        return figures


# ----- the accountant -----

@dataclass(frozen=True)
class Accountant:
    """ε after R rounds of m-of-N sampling without replacement and a Gaussian of multiplier z, by dp-accounting's
    RDP accountant under the replace-one relation (sensitivity 2C: the accountant's multiplier is z/2)."""

    num_clients: int
    per_round: int
    noise_multiplier: float
    delta: float

    def event(self, rounds: int, noise_multiplier: float | None = None) -> Any:
        import dp_accounting

        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        one_round = dp_accounting.SampledWithoutReplacementDpEvent(
            source_dataset_size=self.num_clients, sample_size=self.per_round,
            event=dp_accounting.GaussianDpEvent(z / 2))
        return dp_accounting.SelfComposedDpEvent(one_round, rounds)

    def epsilon(self, rounds: int, noise_multiplier: float | None = None) -> float:
        """ε at δ after ``rounds`` rounds (∞ for z = 0; 0 for no rounds)."""
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if rounds == 0:
            return 0.0
        if z == 0:
            return math.inf
        accountant = fresh_accountant()
        accountant.compose(self.event(rounds, z))
        return float(accountant.get_epsilon(self.delta))

    def rounds_within(self, target_epsilon: float, most: int) -> int:
        """The most rounds, up to ``most``, whose ε stays ≤ ``target_epsilon`` (ε grows with the rounds)."""
        low, high = 0, most
        while low < high:
            middle = (low + high + 1) // 2
            if self.epsilon(middle) <= target_epsilon:
                low = middle
            else:
                high = middle - 1
        return low

    def calibrate(self, target_epsilon: float, rounds: int) -> float:
        """The smallest z (to 1e-6) whose ε after ``rounds`` rounds is ≤ ``target_epsilon``, by dp-accounting's own
        calibration (Brent's method on the accountant)."""
        from dp_accounting import mechanism_calibration

        z = float(mechanism_calibration.calibrate_dp_mechanism(
            fresh_accountant, lambda value: self.event(rounds, value), target_epsilon, self.delta,
            mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-6))
        while self.epsilon(rounds, z) > target_epsilon:  # the search's tolerance may land on the wrong side
            z += 1e-6
        return z


def fresh_accountant() -> Any:
    """dp-accounting's RDP accountant under the replace-one relation (sampling without replacement needs it)."""
    from dp_accounting import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    return RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)  # the library's own RDP orders


def resolve_budget(settings: PrivacySettings, num_clients: int, per_round: int, n_rounds: int
                   ) -> tuple[PrivacySettings, int, list[tuple[int, str]]]:
    """The settings with z set, the rounds the run may train, and the lines to log (logging level, text).

    Without ``noise_multiplier``, z is calibrated so that ``n_rounds`` rounds spend ``target_epsilon``. With both, the
    run stops before the first round whose ε would exceed the target; a budget the first round already exceeds is
    refused.
    """
    warning = delta_warning(settings.delta, num_clients)
    notes = [] if warning is None else [(logging.WARNING, warning)]
    accountant = Accountant(num_clients, per_round, settings.noise_multiplier or 0.0, settings.delta)
    if settings.noise_multiplier is None:
        z = accountant.calibrate(settings.target_epsilon, n_rounds)
        notes.append((logging.INFO, f"--dp_target_epsilon {settings.target_epsilon:g}: noise multiplier z = {z:.6g} calibrated so that "
                     f"{n_rounds} rounds of {per_round} of {num_clients} clients spend ε = "
                     f"{accountant.epsilon(n_rounds, z):.6g} at δ = {settings.delta:g}"))
        return dataclasses.replace(settings, noise_multiplier=z), n_rounds, notes
    if settings.target_epsilon is None:
        return settings, n_rounds, notes
    rounds = accountant.rounds_within(settings.target_epsilon, n_rounds)
    if rounds == 0:
        raise TaskHetError(f"--dp_target_epsilon {settings.target_epsilon:g}: one round already spends ε = "
                           f"{accountant.epsilon(1):.4g} at δ = {settings.delta:g}; raise --dp_noise_multiplier or the "
                           "target")
    if rounds < n_rounds:
        notes.append((logging.INFO, f"--dp_target_epsilon {settings.target_epsilon:g}: round {rounds + 1} would spend ε = "
                     f"{accountant.epsilon(rounds + 1):.4g} at δ = {settings.delta:g}, so the run stops after round "
                     f"{rounds} of --n_rounds {n_rounds}"))
    return settings, rounds, notes
