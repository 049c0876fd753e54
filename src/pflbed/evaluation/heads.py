"""Many personal heads on one shared body, evaluated as one batched operation.

FedPer, FedRep, FedRoD and every linear probe give each client its own head on a body all clients share. At
10,000 clients, evaluating them one by one costs a parameter load and a tiny forward per client and split — most
of a round (docs/guide/speed.md). Here the heads of a group of clients are stacked and run together with
`torch.func.vmap` over `functional_call`: one call per chunk of clients instead of two per client.

Only the parameters that differ between the predictors (by tensor identity: a state a client trained) are
stacked; parameters every predictor shares (the server's global head of FedRoD, heads of clients never sampled)
are loaded into the model once. A predictor class that overrides `classify` is run its own way, one by one.
Batched and one-by-one results are equal up to float rounding of the batched matrix products.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.utils.rnn import pad_sequence

from pflbed.algorithms.base import Predictor
from pflbed.algorithms.training import load_params

CHUNK_ELEMENTS = 1 << 23  # stacked parameters + features per chunk of clients (32 MiB of float32)


class _Classify(nn.Module):
    """A module whose forward is `model.classify`, so `functional_call` can swap the head's parameters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.m.classify(z)


def batchable(preds: list[Predictor]) -> bool:
    """Plain predictors on one model object: their heads differ only by parameters."""
    first = preds[0]
    return all(type(p).classify is Predictor.classify and p.model is first.model for p in preds)


def varying_keys(preds: list[Predictor]) -> list[str]:
    """Parameter keys whose tensor is not the same object in every predictor (what must be stacked)."""
    first = preds[0].params
    return [k for k, v in first.items() if any(p.params.get(k) is not v for p in preds[1:])]


def classify_all(preds: list[Predictor], zs: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Logits of `preds[i]` on features `zs[i]` for every i (features may be one shared tensor object).

    One `classify` per predictor when the group cannot be batched or has a single member; else one vmapped call
    per chunk of clients, with per-client features padded to the chunk's longest (rows past a client's own are
    discarded).
    """
    out: list[torch.Tensor] = []
    for part in _logits(preds, zs, batch_size):
        out += part if isinstance(part, list) else [part.logits[r, :n] for r, n in enumerate(part.rows)]
    return out


def predict_all(preds: list[Predictor], zs: list[torch.Tensor], batch_size: int) -> torch.Tensor:
    """Predicted labels of `preds[i]` on `zs[i]` for every i, concatenated in order: `classify_all`'s logits,
    argmax taken per chunk of clients on the padded block (one call, not one slice and argmax per client: those
    were most of an evaluation at 10,000 clients)."""
    out: list[torch.Tensor] = []
    for part in _logits(preds, zs, batch_size):
        if isinstance(part, list):
            out += [torch.cat(part[i : i + 1024]).argmax(1) for i in range(0, len(part), 1024)]
            continue
        labels = part.logits.argmax(-1)  # (clients, padded rows)
        rows = torch.tensor(part.rows, device=labels.device)
        out.append(labels[torch.arange(labels.shape[1], device=labels.device) < rows[:, None]])  # row-major: in order
    device = zs[0].device if zs else None
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=device)


class _Padded(NamedTuple):
    """Logits of a chunk of clients, (clients, padded rows, classes); client r's own rows are the first rows[r]."""

    logits: torch.Tensor
    rows: list[int]


def _logits(preds: list[Predictor], zs: list[torch.Tensor], batch_size: int) -> Iterator[list[torch.Tensor] | _Padded]:
    """The logits of `classify_all`, a chunk at a time: a list per predictor, or one padded block per chunk."""
    if len(preds) <= 1 or not batchable(preds):  # (no predictor: no logits)
        yield [p.classify(z, batch_size) for p, z in zip(preds, zs, strict=True)]
        return
    keys = varying_keys(preds)
    model = preds[0].model
    load_params(model, preds[0].params)  # the shared parameters; varying ones are swapped in per client
    model.eval()
    if not keys:  # every head the same: one classify over the distinct feature sets together
        distinct = list({id(z): z for z in zs}.values())
        start, first_row = 0, {}
        for z in distinct:
            first_row[id(z)], start = start, start + len(z)
        logits = preds[0].classify(torch.cat(distinct), batch_size)
        yield [logits[first_row[id(z)] : first_row[id(z)] + len(z)] for z in zs]
        return
    head = _Classify(model)
    per_client = sum(preds[0].params[k].numel() for k in keys)
    width = math.prod(zs[0].shape[1:])  # elements per feature row
    rows = [z.shape[0] for z in zs]
    shared = all(z is zs[0] for z in zs)  # one evaluation set for all (domain / global protocols)
    i = 0
    while i < len(preds):  # chunks of clients whose stacked parameters and padded features fit the budget
        j, longest = i + 1, rows[i]
        while j < len(preds) and (j + 1 - i) * (per_client + max(longest, rows[j]) * width) <= CHUNK_ELEMENTS:
            longest = max(longest, rows[j])
            j += 1
        yield _Padded(_chunk(head, keys, preds[i:j], zs[i:j], shared), rows[i:j])
        i = j


def _chunk(
    head: _Classify, keys: list[str], preds: list[Predictor], zs: list[torch.Tensor], shared: bool
) -> torch.Tensor:
    stacked = {f"m.{k}": torch.stack([p.params[k] for p in preds]) for k in keys}
    call = lambda params, z: functional_call(head, params, (z,))  # noqa: E731
    with torch.no_grad():
        if shared:
            return vmap(call, in_dims=(0, None))(stacked, zs[0])
        return vmap(call)(stacked, pad_sequence(zs, batch_first=True))  # padding rows are classified, then dropped
