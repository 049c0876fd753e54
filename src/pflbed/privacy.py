"""Client-level differential privacy (`privacy`): DP-FedAvg's mechanism over what an algorithm shares.

McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent Language Models", ICLR 2018
(DP-FedAvg, Algorithm 1 with the fixed-denominator estimator): in round t each client k of the round's sample P_t
sends its update of the shared parameters Δ_k = w_k − w_t clipped to L2 norm C,

    Δ̃_k = Δ_k · min(1, C / ‖Δ_k‖),

and the server releases w_{t+1} = w_t + (Σ_{k∈P_t} Δ̃_k + z_t) / (qN),   z_t ~ N(0, σ²C² I),

q the sampling rate (`federation.sample_fraction`), N the participated clients, qN the expected number of clients
per round. Clients are drawn by Poisson sampling (each independently with probability q), which the accountant
assumes: the release is the sampled Gaussian mechanism with sensitivity C under adding or removing one client's
data, composed over the rounds and accounted by one of Opacus's accountants (`privacy.accountant`): RDP (Mironov,
Talwar & Zhang 2019; the default) or PRV (Gopi, Lee & Wutschitz, NeurIPS 2021; tighter).

What is shared: an algorithm declares (`Algorithm.dp_refused` is None) that each reply entry is the client's new
value of the payload entry of the same name (a payload may hold more, e.g. FedBABU's fixed head), and that its
server reads the replies only through their mean. Then personal entries (heads, masks, coefficients) never leave
the client and need no protection; the shared ones are clipped together, as one vector, on the client
(`clip_reply`, in every executor and on a Flower node), and the server (`Mechanism.replies`, in the round driver)
adds the noise once per round. The algorithm's own server rule (a weighted mean, pFedMe's mixing, …) then runs on
replies whose uniform mean is exactly the release above: post-processing, so it costs no privacy. Weights are
uniform under DP (a client's size would scale its influence past C).

Where the randomness comes from (`privacy.randomness`): the noise and the round's sample are drawn either from the
run's seed (`seeded`: reproducible, for research) or from the operating system's random source (`os`: for a
deployment). The seed is in the config, which every Flower site receives: from it, anyone can recompute a seeded
z_t and subtract it from the release, leaving the round's sum of clipped updates in clear, and tell in advance who
will be sampled, which voids the accountant's amplification by sampling. A Flower run therefore draws from the OS
unless its config names `seeded`.

How much noise the model can take (`Mechanism.noise_to_signal`): over T rounds the noise adds up to a norm of
σC√(Td)/(qN) on the d noised entries, while the clients' clipped updates move them by at most C per round, T·C in
all; σ√d/(qN√T) ≥ 1 means the noise outweighs even that best case, and a run is warned at its first release (on
stderr) and, if it diverges, told that the noise is the likely cause.

Releases are counted in a durable ledger (`Ledger`, `privacy_ledger.jsonl` in the run directory), written before a
round's release can leave the server. A resumed run replays the rounds after its last checkpoint: under `os` each
replay is a fresh draw, a second release of that round that ε counts; under `seeded` a replay draws the same z_t
again (by design: a resumed research run ends as an uninterrupted one), which releases nothing new only because the
replay is the same computation — a deployment, whose replay may have other repliers, must not use `seeded`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pflbed import rng
from pflbed.errors import DivergedError

if TYPE_CHECKING:
    from pflbed.config import Config

Tensors = dict[str, torch.Tensor]
LEDGER = "privacy_ledger.jsonl"  # in the run directory: one line per released round (`Ledger`)
NOISE_SWAMPS = 1.0  # `Mechanism.noise_to_signal` from which the noise outweighs the clients' best case
SWAMPED = ("the noise outweighs the most the clients' clipped updates can move the model, whatever the learning "
           "rate: DP-FedAvg needs many clients per round (federation.clients × federation.sample_fraction), or a "
           "larger ε")  # fmt: skip


def update_norm(payload: Tensors, reply: Tensors) -> float:
    """‖reply − payload‖₂ over every entry of `reply`, as one vector (float64 accumulation)."""
    sq = sum(float(torch.sum((reply[k].double() - payload[k].double()) ** 2)) for k in sorted(reply))
    return math.sqrt(sq)


def clip_reply(payload: Tensors, reply: Tensors, clip: float) -> Tensors:
    """The reply with its update clipped to norm `clip`: payload + Δ·min(1, C/‖Δ‖). A reply within the norm is
    returned as it is (not rebuilt from payload + Δ, whose rounding would change it)."""
    wrong = [f"{k} ({'not in the payload' if k not in payload else str(reply[k].dtype).removeprefix('torch.')})"
             for k in reply if k not in payload or not reply[k].is_floating_point()]  # fmt: skip
    if wrong:
        raise ValueError(f"privacy: reply entries {', '.join(wrong)} are not float updates of payload entries; an "
                         "algorithm with such replies must not declare DP support (dp_refused)")  # fmt: skip
    norm = update_norm(payload, reply)
    if norm <= clip:
        return reply
    scale = clip / norm
    return {k: payload[k] + (reply[k] - payload[k]) * scale for k in reply}


def noise(seed: int, rnd: int, like: Tensors, std: float) -> Tensors:
    """z_t: N(0, std²) per entry of `like`'s tensors, drawn on the CPU from the (seed, round) stream in key order —
    the same numbers on any executor, device or resume (`privacy.randomness: seeded`)."""
    g = rng.generator(seed, rng.PRIVACY, rnd)
    cpu = {k: torch.randn(like[k].shape, generator=g, dtype=torch.float32, device="cpu") * std for k in sorted(like)}
    return {k: z.to(like[k].device, like[k].dtype) for k, z in cpu.items()}


def os_noise(like: Tensors, std: float) -> Tensors:
    """z_t: N(0, std²) per entry of `like`'s tensors from the operating system's random source
    (`privacy.randomness: os`): unknown to anyone who knows the config, and never the same twice.

    Box–Muller over `rng.os_uniform`'s float64 uniforms, both outputs of each pair used (cos and sin parts are
    independent normals), in float64 on the entry's device (on the CPU: 1.5 s for ResNet-18's 11 M entries on 2
    cores, against 0.4 s for `noise`), rounded to the entry's dtype at the end."""
    out = {}
    for k in sorted(like):
        n, dev = like[k].numel(), like[k].device
        if dev.type not in ("cpu", "cuda"):  # float64 where it exists
            dev = torch.device("cpu")
        half = (n + 1) // 2
        u = torch.from_numpy(rng.os_uniform(2 * half)).to(dev)
        radius = torch.sqrt(-2.0 * torch.log1p(-u[:half]))  # 1 − u ∈ (0, 1]: finite
        angle = (2.0 * math.pi) * u[half:]
        z = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n] * std
        out[k] = z.reshape(like[k].shape).to(like[k].device, like[k].dtype)
    return out


@dataclass(frozen=True)
class Mechanism:
    """A run's DP-FedAvg parameters: clip C, noise multiplier σ, sampling rate q, participated clients N; where its
    randomness comes from (`seeded` or `os`) and which accountant counts it (`rdp` or `prv`)."""

    clip: float
    sigma: float
    rate: float
    clients: int
    delta: float
    randomness: str = "seeded"
    accountant: str = "rdp"
    noise: str = "central"  # or "distributed": the sites add it, inside SecAgg+ (`flower.secagg_node`)
    rounds: int = 1  # T, the run's rounds: what the noise of `noise_to_signal` averages over
    _released: list[int] = field(default_factory=list, init=False, compare=False, repr=False)  # rounds it released

    @property
    def expected_clients(self) -> float:
        """qN, the fixed denominator."""
        return self.rate * self.clients

    @property
    def entropy(self) -> bool:
        """Whether the noise and the sample come from the OS (`sample_clients(entropy=…)`)."""
        return self.randomness == "os"

    def noise_to_signal(self, entries: int) -> float:
        """σ√d / (qN√T) for d = `entries` noised entries: a lower bound on how far the noise moves the model over
        the run's T rounds, relative to how far the clients' clipped updates can.

        Why this figure: the release moves the shared entries by (Σ_t Σ_k Δ̃_k + Σ_t z_t)/qN over the T rounds. The
        clients' part has norm at most T·C (qN updates of norm ≤ C per round on average, over qN), reached only if
        every update is at the clip and all point the same way in every round. The noise's part Σ_t z_t/qN has
        norm σC√(Td)/qN (T independent draws of N(0, σ²C² I_d)). Per entry it reads the same: each round's noise
        std σC/qN against C/√d, the per-entry size of an update at the clip, the T rounds averaging the noise
        down by √T. At 1 or more (`NOISE_SWAMPS`) the noise outweighs the clients' best case, whatever the
        learning rate: the model is mostly noise, and its training often diverges. C cancels out: the clip sets
        the size of both. Under distributed noise the sites' shares hold at least σ²C² (`flower.secagg_node`):
        the figure is then a lower bound too."""
        if self.expected_clients <= 0:
            return math.inf
        return self.sigma * math.sqrt(entries) / (self.expected_clients * math.sqrt(max(self.rounds, 1)))

    def describe_noise(self, entries: int) -> str:
        """The noise in numbers: its std per entry and round on the model, what gives it, and `noise_to_signal`."""
        return (f"privacy noise of std {self.sigma * self.clip / self.expected_clients:.3g} per entry and round "
                f"with qN = {self.expected_clients:g} clients per round (σC/qN: σ = {self.sigma:.4g}, C = "
                f"{self.clip:g}), noise-to-signal σ√d/(qN√T) = {self.noise_to_signal(entries):.3g} (d = {entries:,} "
                f"shared entries, T = {self.rounds} rounds)")  # fmt: skip

    def noise_warning(self, entries: int) -> str | None:
        """What to tell a run whose noise swamps the clients' updates (`noise_to_signal` ≥ `NOISE_SWAMPS`); None if
        it does not."""
        if self.noise_to_signal(entries) < NOISE_SWAMPS:
            return None
        return f"pflbed: warning: {self.describe_noise(entries)} ≥ {NOISE_SWAMPS:g}: {SWAMPED}"

    def draw(self, seed: int, rnd: int, like: Tensors) -> Tensors:
        """Round `rnd`'s z_t over `like`'s entries, from the configured source (`noise` or `os_noise`)."""
        std = self.sigma * self.clip
        return os_noise(like, std) if self.entropy else noise(seed, rnd, like, std)

    def replies(self, seed: int, rnd: int, payload: Tensors, replies: Iterator[tuple[int, Tensors]], count: int
                ) -> Iterator[tuple[int, Tensors]]:  # fmt: skip
        """The round's clipped replies, turned into ones whose uniform mean is the release:
        r'_k = w + (m/qN)·Δ̃_k + z/qN for the m = `count` replies (Σ_k r'_k / m = w + (Σ Δ̃_k + z)/qN). `payload` is
        the shared entries' w, the same for every client (checked by the caller's algorithm declaration). With no
        reply in the round, one pseudo-reply w + z/qN under client -1: the release is noise alone, never w bare
        (that would tell whether anyone was sampled). With distributed noise each reply already holds the sites'
        shares (`flower.secagg`: r_k = w + (Σ Δ̃ + Σ_s z_s)/m, so r'_k = w + (Σ Δ̃ + Σ_s z_s)/qN is the
        release): the server adds none, except in a round with no reply, where no site was asked and it draws z.

        The first release of this mechanism prints `noise_warning` to stderr (as `flower.reply_check` prints its
        refusals; Opacus's import reformats the root logger) where the noise swamps the updates: in the loop
        executor, before any client of the round trains (`replies` is consumed lazily), on Flower once the round's
        replies are in. A client that diverges meanwhile (a `DivergedError` from `replies`) is reported with
        `describe_noise`: under DP the noise is a suspect before the learning rate."""
        entries = sum(v.numel() for v in payload.values())
        if not self._released:
            warning = self.noise_warning(entries)
            if warning:
                print(warning, file=sys.stderr, flush=True)
        self._released.append(rnd)
        m_bar = self.expected_clients
        z = self.draw(seed, rnd, payload) if self.noise == "central" else None
        scale = count / m_bar
        seen = False
        try:
            for cid, reply in replies:
                seen = True
                if z is None:
                    yield cid, {k: payload[k] + (reply[k] - payload[k]) * scale for k in reply}
                else:
                    yield cid, {k: payload[k] + (reply[k] - payload[k]) * scale + z[k] / m_bar for k in reply}
        except DivergedError as e:  # swamped: the noise, not the learning rate, is the cause to name
            swamped = self.noise_to_signal(entries) >= NOISE_SWAMPS
            raise DivergedError(e.round, f"{e.where}, after {self.describe_noise(entries)}",
                                hint=SWAMPED if swamped else e.hint) from None
        if not seen:
            z = z if z is not None else self.draw(seed, rnd, payload)  # distributed: no site was asked
            yield -1, {k: payload[k] + z[k] / m_bar for k in payload}

    def epsilon(self, draws: int) -> float:
        """ε at δ after `draws` noise draws released (one sampled-Gaussian step each: the rounds, and under `os`
        every replay of a round as well), by the configured Opacus accountant."""
        if draws == 0:
            return 0.0
        if self.sigma == 0:
            return math.inf
        return _epsilon(self.sigma, self.rate, draws, self.delta, self.accountant)

    def record(self, rounds: int, since: int, draws: dict[int, int] | None = None) -> dict[str, Any]:
        """What `metrics.jsonl` says of the guarantee after `rounds` rounds, with ε after each round since round
        `since` (the previous evaluation) under `epsilon_by_round`; `summary.json` keeps the rest. `draws`: the
        noise draws released by the end of each round (`Ledger.draws`; default: one per round, no replay)."""
        counted = {r: (draws or {}).get(r, r) for r in range(since + 1, rounds + 1)}
        # ε = ∞ (no noise) is written null: JSON has no infinity
        by_round = {str(r): e if math.isfinite(e := self.epsilon(n)) else None for r, n in counted.items()}
        return {"epsilon": by_round[str(rounds)], "delta": self.delta, "noise_multiplier": self.sigma,
                "clip": self.clip, "sampling_rate": self.rate, "expected_clients": self.expected_clients,
                "rounds": rounds, "noise_draws": counted[rounds], "accountant": self.accountant,
                "randomness": self.randomness, "noise": self.noise, "sampling": "poisson",
                "epsilon_by_round": by_round}  # fmt: skip


class Ledger:
    """The releases of a run's rounds, one JSON line each in `path` (`privacy_ledger.jsonl`; None: in memory), so
    that ε counts every noise draw that ever left the server — across a crash and a resume too.

    Why a ledger: a resumed run replays the rounds after its last checkpoint, and those rounds' releases may already
    have left (the next round's payloads, an evaluation on the sites). Under `os` randomness the replay draws fresh
    noise, so the round is released twice, and each release costs privacy; `release` writes and fsyncs its line
    before the driver hands the new server state to anyone, so no release escapes the count. Under `seeded`
    randomness a replay draws the round's noise again: the ledger still lists the replay, but the draw is counted
    once (the replay of a deterministic run is the same release). A line torn by a crash counts as a release.
    """

    def __init__(self, path: Path | None, randomness: str, fresh: bool = True) -> None:
        self.path, self.randomness = path, randomness
        self.entries: list[tuple[int | None, str]] = []  # (round, randomness) per release; round None: torn line
        self.torn = False  # the file ends inside a line: the next one starts on a line of its own
        if path is None:
            return
        if fresh:  # a new run: an earlier run's releases in this directory are that run's
            path.unlink(missing_ok=True)
        elif path.exists():
            text = path.read_text()
            self.entries = [_entry(line) for line in text.splitlines() if line.strip()]
            self.torn = bool(text) and not text.endswith("\n")

    def release(self, rnd: int) -> int:
        """Count round `rnd`'s release (durably, when the ledger has a file); the noise draws counted so far."""
        entry = {"round": rnd, "release": len(self.entries) + 1, "randomness": self.randomness,
                 "replay": any(r == rnd for r, _ in self.entries)}  # fmt: skip
        if self.path is not None:
            created = not self.path.exists()
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(("\n" if self.torn else "") + json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
            if created:  # the new file's directory entry, durable too
                fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        self.entries.append((rnd, self.randomness))
        self.torn = False
        return self.draws

    @property
    def releases(self) -> int:
        """Rounds released, replays included."""
        return len(self.entries)

    @property
    def draws(self) -> int:
        """Distinct noise draws released: every `os` release, and each round's seeded draw once."""
        seeded = {r for r, how in self.entries if how == "seeded" and r is not None}
        return sum(1 for r, how in self.entries if how != "seeded" or r is None) + len(seeded)

    def draws_by_round(self) -> dict[int, int]:
        """Round → the draws counted at its latest release: what a resumed run's ε after a round it does not
        replay (the checkpoint's, those before it) is."""
        out: dict[int, int] = {}
        fresh, seeded = 0, set()
        for r, how in self.entries:  # as `draws`, entry by entry
            if how == "seeded" and r is not None:
                seeded.add(r)
            else:
                fresh += 1
            if r is not None:
                out[r] = fresh + len(seeded)
        return out


def _entry(line: str) -> tuple[int | None, str]:
    """A ledger line's (round, randomness); a line that does not parse (torn by a crash) counts as an `os` release
    of an unknown round: counted, never merged with another."""
    try:
        e = json.loads(line)
        return int(e["round"]), str(e["randomness"])
    except (ValueError, KeyError, TypeError):
        return None, "os"


@functools.lru_cache(maxsize=4096)
def _epsilon(sigma: float, rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """ε of `steps` sampled-Gaussian steps by Opacus's `accountant`. PRV returns ∞ where its discretization does not
    reach (σ ≲ 0.1 at q = 0.1, after a minute): RDP's bound, valid as well, is given there."""
    from opacus.accountants import PRVAccountant, RDPAccountant  # late: the privacy extra, a slow import

    with warnings.catch_warnings():  # "optimal order is the largest alpha": ε is then an upper bound, still valid
        warnings.simplefilter("ignore", UserWarning)
        if accountant == "prv":
            prv = PRVAccountant()
            prv.history = [(sigma, rate, steps)]
            eps = float(prv.get_epsilon(delta=delta))
            if math.isfinite(eps):
                return eps
        rdp = RDPAccountant()
        rdp.history = [(sigma, rate, steps)]
        return float(rdp.get_epsilon(delta=delta))


SIGMA_MAX = 1000.0  # noise beyond this drowns any update: a target that needs more is refused


@functools.lru_cache(maxsize=64)
def noise_multiplier(target_epsilon: float, delta: float, rate: float, rounds: int, accountant: str = "rdp") -> float:
    """The σ that reaches `target_epsilon` at `delta` after `rounds` rounds at sampling rate `rate`, by Opacus's
    binary search with `accountant`: the ε reached is at most the target and within 0.005 of it (an absolute
    tolerance, in ε). ValueError if σ = `SIGMA_MAX` does not reach it. Replays of a resumed `os` run are releases
    beyond `rounds`: their ε then ends above the target (the record says how many draws it counts)."""
    floor = _epsilon(SIGMA_MAX, rate, rounds, delta, accountant)
    if floor > target_epsilon:
        raise ValueError(f"{target_epsilon:g} is out of reach: even σ = {SIGMA_MAX:g} gives ε = {floor:.3g} at "
                         f"δ = {delta:g} after {rounds} rounds at sampling rate {rate:g}")  # fmt: skip
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():  # as in `_epsilon`
        warnings.simplefilter("ignore", UserWarning)
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=rate,
                                          steps=rounds, accountant=accountant, epsilon_tolerance=0.005))  # fmt: skip


def mechanism(cfg: Config, participated: int) -> Mechanism | None:
    """The run's mechanism (None without `privacy.clip`); σ derived from `privacy.target_epsilon` where asked."""
    p = cfg.privacy
    if p.clip is None:
        return None
    rate = cfg.federation.sample_fraction
    sigma = p.noise_multiplier
    if sigma is None:
        sigma = noise_multiplier(p.target_epsilon, p.delta, rate, cfg.train.rounds, p.accountant)
    return Mechanism(p.clip, sigma, rate, participated, p.delta, cfg.privacy_randomness(), p.accountant, p.noise,
                     cfg.train.rounds)  # fmt: skip
