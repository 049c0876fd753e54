"""A site's side of secure aggregation (`sites.secagg`; the protocol and the server's side: `flower.secagg`).

Distributed noise (`privacy.noise: distributed`): with client-level DP, each site adds its share of the Gaussian
noise to its update before SecAgg+ masks it, so the server unmasks a sum that is already noised — neither the
server nor any site ever sees a noise-free sum (with central noise the server adds z_t after unmasking, and must be
trusted to). The release must carry noise of variance at least σ²C² per entry (what the accountant counts) whatever
subset of sites survives the round, and SecAgg+ completes only when at least t sites survive (its reconstruction
threshold): each site adds N(0, σ²C²/t), so t or more surviving shares sum to at least σ²C². With all S sites
present the noise has S/t times the accounted variance (2 for an even S ≥ 4): the price of not trusting the server.
The share is drawn from the operating system's random source: a seeded share would be known to whoever knows the
config. A site's update is then v_s = (Σ_{c∈s} Δ̃_c + z_s) / (qN), with weight 1 for every site (the server
multiplies the unmasked mean by the number of sites that survived, and gets the release's increment).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from pflbed.algorithms.base import Algorithm, Tensors
from pflbed.config import Config
from pflbed.flower.sites import SiteError

SHARED = "shared"  # the round's payload, the same for every client, sent to every site
NONFINITE_REPLY = "nonfinite-reply"  # a site's clear flag for a client whose reply diverged (its first bad key)
CLIP_RANGE = 8.0  # Flower's default: each entry of a site's (weighted) update clipped to ±8 before quantization
TARGET_RANGE, MOD_RANGE = 2**22, 2**32  # Flower's defaults: 2²² quantization levels, sums modulo 2³²
# SecAgg+ as `flower.secagg` runs it: every site holds a share of every other's secrets (all S of them), and half
# of them are needed to unmask
NUM_SHARES, RECONSTRUCTION = 1.0, 0.5


def reconstruction_threshold(sites: int) -> int:
    """t: the fewest of `sites` sites whose updates SecAgg+ can unmask — Flower's rule for a fractional threshold
    over S shares, max(round(0.5·S), 2) (Python's round: 5 sites give 2, 6 give 3)."""
    return max(round(RECONSTRUCTION * sites), 2)


@dataclass(frozen=True)
class NoiseShare:
    """A site's part of distributed noise: N(0, std²) per entry, and the release's denominator qN."""

    std: float
    expected_clients: float

    @staticmethod
    def of(sigma: float, clip: float, sites: int, expected_clients: float) -> NoiseShare:
        """σC/√t for a deployment of `sites` sites (module docstring)."""
        return NoiseShare(sigma * clip / math.sqrt(reconstruction_threshold(sites)), expected_clients)


def asked(msg: Message) -> bool:
    """Whether a TRAIN message is a step of the SecAgg+ protocol."""
    return RECORD_KEY_CONFIGS in msg.content.config_records


def secagg_if_asked(msg: Message, context: Context, call_next) -> Message:
    """The node's mod: SecAgg+'s where the server runs the protocol (its parameters checked first,
    `check_setup`); ordinary training passes through."""
    if not asked(msg):
        return call_next(msg, context)
    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    if configs.get(Key.STAGE) == Stage.SETUP:
        check_setup(configs)
    return secaggplus_mod(msg, context, call_next)


def check_setup(configs: ConfigRecord) -> None:
    """What a site takes of the protocol's parameters, which the server sets in SecAgg+'s setup stage: the values
    pflbed's server uses (`flower.secagg`) for the number of sites it names, and no other. Every site holds a share
    of every other's secrets, and a threshold below `reconstruction_threshold` would let a server that tells the
    sites different stories about who dropped out gather both secrets of one site — its update in clear; the
    clipping and quantization ranges are those the site's beyond-range count assumes. The number of sites itself
    cannot be checked here (a server that invents sites is the threat model's Sybil case)."""
    n = configs.get(Key.SAMPLE_NUMBER)
    if type(n) is not int or n < 2:
        raise SiteError(f"SecAgg+ setup: {n!r} sites; this site takes part only with at least two")
    want = {Key.SHARE_NUMBER: n, Key.CLIPPING_RANGE: CLIP_RANGE, Key.TARGET_RANGE: TARGET_RANGE,
            Key.MOD_RANGE: MOD_RANGE}  # fmt: skip
    for key, value in want.items():
        if configs.get(key) != value:
            raise SiteError(f"SecAgg+ setup: {key}={configs.get(key)!r} for {n} sites; this site takes only {value!r}")
    t = configs.get(Key.THRESHOLD)
    if type(t) is not int or not reconstruction_threshold(n) <= t <= n:
        raise SiteError(f"SecAgg+ setup: {Key.THRESHOLD}={t!r} for {n} sites; this site takes "
                        f"{reconstruction_threshold(n)} to {n}")  # fmt: skip


def client_weight(algo: Algorithm, n_train: int) -> int:
    """A client's weight in the secure mean: its training samples, or 1 under `privacy` (uniform weights)."""
    return 1 if algo.ctx.cfg.privacy.enabled else n_train


def noise_share(cfg: Config, sites: int) -> NoiseShare | None:
    """This site's share of the noise in a deployment of `sites` sites (None: the noise is central, or there is no
    DP): σ from the run's config (given, or derived from its target ε), over N = federation.clients."""
    if not cfg.privacy.enabled or cfg.privacy.noise != "distributed":
        return None
    from pflbed.privacy import mechanism

    mech = mechanism(cfg, cfg.federation.clients)
    assert mech is not None
    return NoiseShare.of(mech.sigma, mech.clip, sites, mech.expected_clients)


def site_update(payload: Tensors, replies: list[tuple[Tensors, int]], flags: dict,
                noise: NoiseShare | None = None) -> FitRes:  # fmt: skip
    """The node's masked-vector reply, as a FitRes (`secaggplus_mod` quantizes and masks its parameters): per
    payload entry Σ_c w_c (reply_c − payload) / Σ_c w_c over `replies` (reply, weight) — zero where no reply updates
    the entry, or the site has no client this round — with the total weight as its `num_examples`. Every site sends
    the same shapes (the protocol sums them); the names of the entries the replies update go in clear (`keys`).
    With `noise` (distributed DP): (Σ_c (reply_c − payload) + z_s) / qN per float entry, weight 1, whether or not
    the site has a client this round (its share must be in the sum: the module's docstring)."""
    total = sum(w for _, w in replies)
    updated = set(replies[0][0]) if replies else set()
    shares = _os_noise(payload, noise.std) if noise is not None else {}
    arrays, big = [], 0
    for k in sorted(payload):
        if noise is not None:
            change = torch.zeros(payload[k].shape, dtype=torch.float64)
            for r, _ in replies if k in updated else []:
                change += r[k].double() - payload[k].double()
            mean = (change + shares[k]) / noise.expected_clients if k in shares else change
        elif total and k in updated:
            mean = sum((r[k].double() - payload[k].double()) * w for r, w in replies) / total
        else:
            mean = torch.zeros(payload[k].shape, dtype=torch.float64)
        big += int((mean.abs() > CLIP_RANGE).sum())
        arrays.append(mean.cpu().numpy())
    metrics = {"keys": json.dumps(sorted(updated)), "beyond_range": big, **flags}
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1 if noise is not None else total, metrics)


def _os_noise(payload: Tensors, std: float) -> Tensors:
    """The site's share z_s over the payload's float entries, float64, from the operating system's random source."""
    from pflbed.privacy import os_noise

    floats = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in payload.items() if v.is_floating_point()}
    return os_noise(floats, std)
