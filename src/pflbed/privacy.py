"""Client-level differential privacy (`privacy`): DP-FedAvg's mechanism over what an algorithm shares.

McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent Language Models", ICLR 2018
(DP-FedAvg, Algorithm 1 with the fixed-denominator estimator): in round t each client k of the round's sample P_t
sends its update of the shared parameters Δ_k = w_k − w_t clipped to L2 norm C,

    Δ̃_k = Δ_k · min(1, C / ‖Δ_k‖),

and the server releases w_{t+1} = w_t + (Σ_{k∈P_t} Δ̃_k + z_t) / (qN),   z_t ~ N(0, σ²C² I),

q the sampling rate (`federation.sample_fraction`), N the participated clients, qN the expected number of clients
per round. Clients are drawn by Poisson sampling (each independently with probability q), which the accountant
assumes: the release is the sampled Gaussian mechanism with sensitivity C under adding or removing one client's
data, composed over the rounds and accounted by Opacus's RDP accountant (Mironov, Talwar & Zhang 2019). Opacus's
PRV accountant, tighter, is not offered: at small σ it ran out of memory or did not return within minutes.

What is shared: an algorithm declares (`Algorithm.dp_refused` is None) that each reply entry is the client's new
value of the payload entry of the same name (a payload may hold more, e.g. FedBABU's fixed head), and that its
server reads the replies only through their mean. Then personal entries (heads, masks, coefficients) never leave
the client and need no protection; the shared ones are clipped together, as one vector, on the client
(`clip_reply`, in every executor and on a Flower node), and the server (`Mechanism.replies`, in the round driver)
adds the noise once per round, from the (seed, round) stream. The algorithm's own server rule (a weighted mean,
pFedMe's mixing, …) then runs on replies whose uniform mean is exactly the release above: post-processing, so it
costs no privacy. Weights are uniform under DP (a client's size would scale its influence past C).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pflbed import rng

if TYPE_CHECKING:
    from pflbed.config import Config

Tensors = dict[str, torch.Tensor]


def update_norm(payload: Tensors, reply: Tensors) -> float:
    """‖reply − payload‖₂ over every entry of `reply`, as one vector (float64 accumulation)."""
    sq = sum(float(torch.sum((reply[k].double() - payload[k].double()) ** 2)) for k in sorted(reply))
    return math.sqrt(sq)


def clip_reply(payload: Tensors, reply: Tensors, clip: float) -> Tensors:
    """The reply with its update clipped to norm `clip`: payload + Δ·min(1, C/‖Δ‖). A reply within the norm is
    returned as it is (not rebuilt from payload + Δ, whose rounding would change it)."""
    wrong = [k for k in reply if k not in payload or not reply[k].is_floating_point()]
    if wrong:
        raise ValueError(f"privacy: reply entries {wrong} are not float updates of payload entries; an algorithm "
                         "with such replies must not declare DP support (dp_refused)")  # fmt: skip
    norm = update_norm(payload, reply)
    if norm <= clip:
        return reply
    scale = clip / norm
    return {k: payload[k] + (reply[k] - payload[k]) * scale for k in reply}


def noise(seed: int, rnd: int, like: Tensors, std: float) -> Tensors:
    """z_t: N(0, std²) per entry of `like`'s tensors, drawn on the CPU from the (seed, round) stream in key order —
    the same numbers on any executor, device or resume."""
    g = rng.generator(seed, rng.PRIVACY, rnd)
    cpu = {k: torch.randn(like[k].shape, generator=g, dtype=torch.float32, device="cpu") * std for k in sorted(like)}
    return {k: z.to(like[k].device, like[k].dtype) for k, z in cpu.items()}


@dataclass(frozen=True)
class Mechanism:
    """A run's DP-FedAvg parameters: clip C, noise multiplier σ, sampling rate q, participated clients N."""

    clip: float
    sigma: float
    rate: float
    clients: int
    delta: float

    @property
    def expected_clients(self) -> float:
        """qN, the fixed denominator."""
        return self.rate * self.clients

    def replies(self, seed: int, rnd: int, payload: Tensors, replies: Iterator[tuple[int, Tensors]], count: int
                ) -> Iterator[tuple[int, Tensors]]:  # fmt: skip
        """The round's clipped replies, turned into ones whose uniform mean is the release:
        r'_k = w + (m/qN)·Δ̃_k + z/qN for the m = `count` replies (Σ_k r'_k / m = w + (Σ Δ̃_k + z)/qN). `payload` is
        the shared entries' w, the same for every client (checked by the caller's algorithm declaration). With no
        reply in the round, one pseudo-reply w + z/qN under client -1: the release is noise alone, never w bare
        (that would tell whether anyone was sampled)."""
        m_bar = self.expected_clients
        z = noise(seed, rnd, payload, self.sigma * self.clip)
        scale = count / m_bar
        seen = False
        for cid, reply in replies:
            seen = True
            yield cid, {k: payload[k] + (reply[k] - payload[k]) * scale + z[k] / m_bar for k in reply}
        if not seen:
            yield -1, {k: payload[k] + z[k] / m_bar for k in payload}

    def epsilon(self, rounds: int) -> float:
        """ε at δ after `rounds` rounds (one sampled-Gaussian step each), by the configured Opacus accountant."""
        if rounds == 0:
            return 0.0
        if self.sigma == 0:
            return math.inf
        return _epsilon(self.sigma, self.rate, rounds, self.delta)

    def record(self, rounds: int, since: int) -> dict[str, Any]:
        """What `metrics.jsonl` says of the guarantee after `rounds` rounds, with ε after each round since round
        `since` (the previous evaluation) under `epsilon_by_round`; `summary.json` keeps the rest."""
        # ε = ∞ (no noise) is written null: JSON has no infinity
        by_round = {str(r): e if math.isfinite(e := self.epsilon(r)) else None for r in range(since + 1, rounds + 1)}
        return {"epsilon": by_round[str(rounds)], "delta": self.delta, "noise_multiplier": self.sigma,
                "clip": self.clip, "sampling_rate": self.rate, "expected_clients": self.expected_clients,
                "rounds": rounds, "accountant": "rdp", "sampling": "poisson", "epsilon_by_round": by_round}  # fmt: skip


def _epsilon(sigma: float, rate: float, rounds: int, delta: float) -> float:
    from opacus.accountants import RDPAccountant  # late: the privacy extra, a slow import

    accountant = RDPAccountant()
    accountant.history = [(sigma, rate, rounds)]
    with warnings.catch_warnings():  # "optimal order is the largest alpha": ε is then an upper bound, still valid
        warnings.simplefilter("ignore", UserWarning)
        return float(accountant.get_epsilon(delta=delta))


SIGMA_MAX = 1000.0  # noise beyond this drowns any update: a target that needs more is refused


@functools.lru_cache(maxsize=64)
def noise_multiplier(target_epsilon: float, delta: float, rate: float, rounds: int) -> float:
    """The σ that reaches `target_epsilon` at `delta` after `rounds` rounds at sampling rate `rate` (Opacus's
    search, to within 0.5 % of ε; the ε reached is at most the target). ValueError if σ = `SIGMA_MAX` does not."""
    floor = _epsilon(SIGMA_MAX, rate, rounds, delta)
    if floor > target_epsilon:
        raise ValueError(f"{target_epsilon:g} is out of reach: even σ = {SIGMA_MAX:g} gives ε = {floor:.3g} at "
                         f"δ = {delta:g} after {rounds} rounds at sampling rate {rate:g}")  # fmt: skip
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():  # as in `_epsilon`
        warnings.simplefilter("ignore", UserWarning)
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=rate,
                                          steps=rounds, accountant="rdp", epsilon_tolerance=0.005))  # fmt: skip


def mechanism(cfg: Config, participated: int) -> Mechanism | None:
    """The run's mechanism (None without `privacy.clip`); σ derived from `privacy.target_epsilon` where asked."""
    p = cfg.privacy
    if p.clip is None:
        return None
    rate = cfg.federation.sample_fraction
    sigma = p.noise_multiplier
    if sigma is None:
        sigma = noise_multiplier(p.target_epsilon, p.delta, rate, cfg.train.rounds)
    return Mechanism(p.clip, sigma, rate, participated, p.delta)
