"""A site's side of secure aggregation (`sites.secagg`; the protocol and the server's side: `flower.secagg`)."""

from __future__ import annotations

import json

import torch
from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from pflbed.algorithms.base import Algorithm, Tensors

SHARED = "shared"  # the round's payload, the same for every client, sent to every site
CLIP_RANGE = 8.0  # Flower's default: each entry of a site's (weighted) update clipped to ±8 before quantization


def asked(msg: Message) -> bool:
    """Whether a TRAIN message is a step of the SecAgg+ protocol."""
    return RECORD_KEY_CONFIGS in msg.content.config_records


def secagg_if_asked(msg: Message, context: Context, call_next) -> Message:
    """The node's mod: SecAgg+'s where the server runs the protocol; ordinary training passes through."""
    return secaggplus_mod(msg, context, call_next) if asked(msg) else call_next(msg, context)


def client_weight(algo: Algorithm, n_train: int) -> int:
    """A client's weight in the secure mean: its training samples, or 1 under `privacy` (uniform weights)."""
    return 1 if algo.ctx.cfg.privacy.enabled else n_train


def site_update(payload: Tensors, replies: list[tuple[Tensors, int]], flags: dict) -> FitRes:
    """The node's masked-vector reply, as a FitRes (`secaggplus_mod` quantizes and masks its parameters): per
    payload entry Σ_c w_c (reply_c − payload) / Σ_c w_c over `replies` (reply, weight) — zero where no reply updates
    the entry, or the site has no client this round — with the total weight as its `num_examples`. Every site sends
    the same shapes (the protocol sums them); the names of the entries the replies update go in clear (`keys`)."""
    total = sum(w for _, w in replies)
    arrays, big = [], 0
    for k in sorted(payload):
        if total and k in replies[0][0]:
            mean = sum((r[k].double() - payload[k].double()) * w for r, w in replies) / total
        else:
            mean = torch.zeros(payload[k].shape, dtype=torch.float64)
        big += int((mean.abs() > CLIP_RANGE).sum())
        arrays.append(mean.cpu().numpy())
    keys = sorted(replies[0][0]) if replies else []
    metrics = {"keys": json.dumps(keys), "beyond_range": big, **flags}
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), total, metrics)
