"""The structure an honest reply has: keys, shapes and dtypes, for algorithms that check their own replies.

A site-local deployment's server reads a site's replies as its clients' `client_update` would have made them
(`pflbed.flower.reply_check`). An algorithm whose replies are not plain new values of payload entries declares
`reply_fits(payload, reply)` and builds, from the payload and what the server knows, the structure an honest
client replies; `misfit` then says why a reply is not of it. A reply of another structure could crash the
server rule or enter the server state unnoticed (a `[2, 10]` tensor broadcast into a `[10]` bias, a float64
tensor promoting a float32 state).

Only functions live here: `pflbed.algorithms` imports every module of the package to register algorithms.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from pflbed.algorithms.common import Tensors

Spec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one reply entry
UNSENT = "this algorithm's server does not send"  # `misfit`'s `unknown` for a payload or a server view


def spec(t: torch.Tensor) -> Spec:
    """The shape and dtype of `t`."""
    return tuple(t.shape), t.dtype


def specs(tensors: Tensors, keys: Iterable[str] | None = None) -> dict[str, Spec]:
    """The shape and dtype of each of `keys` (all by default) in `tensors`."""
    return {k: spec(tensors[k]) for k in (tensors if keys is None else keys)}


def misfit(reply: Tensors, expected: Mapping[str, Spec], unknown: str = "this algorithm's clients do not reply"
           ) -> str | None:  # fmt: skip
    """Why `reply` (or a payload) does not have exactly the keys of `expected`, each of its shape and dtype; None
    if it does.

    One line, to follow "client <cid>'s reply" (or "payload"): the first extra key (`unknown` says who never sends
    it), else the first missing one, else the first entry (in key order) of another shape or dtype."""
    extra = sorted(set(reply) - set(expected))
    if extra:
        return f"has key '{extra[0]}', which {unknown}"
    missing = sorted(set(expected) - set(reply))
    if missing:
        return f"lacks '{missing[0]}'"
    for k in sorted(expected):
        shape, dtype = expected[k]
        v = reply[k]
        if tuple(v.shape) != tuple(shape):
            return f"has '{k}' of shape {list(v.shape)}, expected {list(shape)}"
        if v.dtype != dtype:
            return f"has '{k}' of dtype {v.dtype}, expected {dtype}"
    return None


def whole(tensors: Tensors, expected: Mapping[str, Spec], groups: Iterable[Mapping[str, Spec]]) -> dict[str, Spec]:
    """`expected` and each of `groups` that `tensors` holds any key of: the structure of a state whose groups of
    entries (a client's stored model, a warm start's bases) are held whole or not at all, for `misfit`."""
    out = dict(expected)
    for group in groups:
        if not group.keys().isdisjoint(tensors):
            out.update(group)
    return out
