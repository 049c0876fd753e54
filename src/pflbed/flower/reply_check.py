"""What the server of a site-local deployment (`sites.local`) accepts as a site's reply to a round's work.

A site runs its own node: its replies are whatever it chooses to send. The server's rules read each reply as the
algorithm's `client_update` would have made it, so a reply of another shape, dtype or key set would crash the
server rule or enter the server state, and one of a huge but finite size would set the averaged model to the
site's choice. Each reply is therefore checked against what the server sent (`ReplyCheck.round`), before the
server rule sees any of it; a site with one wrong reply is left out of the round, as a site whose reply was lost
(`Replies.failed`), with one line naming it (`refuse`).

What is expected of a reply:
- an algorithm that checks its own replies (`reply_fits(payload, reply)`: None, or why not) decides alone;
- an algorithm whose replies are the clients' new values of payload entries (`Algorithm.dp_refused` None, the
  declaration client-level DP relies on): every key a key of the payload, of its shape and dtype, and the same key
  set for every reply to payloads of one structure. That set is fixed the first time such payloads get replies,
  by the sites that sent them (the set most sites send; on a tie, the payload's own set if it is one of them,
  else the one of the most clients, then of the lowest site) — what an algorithm declaring `reply_fits` does not
  need to trust;
- every algorithm: the change of the entries sent (the reply's entries of the payload's key and shape) at most
  `sites.max_update` × max(1, ‖payload‖) in norm, the norms over those entries in float64. Honest runs stay near
  or below 1 (an update, or an algorithm replying a difference, is at most of the model's own size).
Non-finite replies are left to the divergence guard (`engine.guard`), which stops the run as for any diverged
client.

What a reply carries besides its tensors is held to an allow-list as well (`clear_fault`): the few fields a site
sends, each within its rule, and flags (a client's first non-finite entry) only for the clients the site trained
that round. A flag stops the run, so one naming another site's client would blame that site; a figure the server
reads as a number would crash it were it text. JSON a site sends is read with `site_json`, which bounds its nesting.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Collection, Mapping

import torch

from pflbed.algorithms.base import Algorithm, Tensors

Structure = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def structure(tensors: Tensors) -> Structure:
    """Keys, shapes and dtypes, in key order."""
    return tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(tensors.items()))


MAX_NAME = 200  # the longest entry name a site's flag may carry (it is printed in the line that stops the run)


def shown(name: object, limit: int = 60) -> str:
    """A name a site chose, as a line may show it: quoted, escaped, cut at `limit` characters (a key of newlines
    would otherwise write lines of the site's own into the server's output)."""
    text = str(name)
    return repr(text if len(text) <= limit else text[:limit] + "…")


def site_json(text: str, depth: int) -> object:
    """The JSON text a site sent, parsed: ValueError if it is not JSON, or nests containers deeper than `depth` (the
    figures a site sends nest at most 3 deep). Any deeper is refused whole: nesting deep enough to exhaust Python's
    recursion, in the parser or in a later `repr`, would crash the server with a `RecursionError`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"it nests deeper than {depth}") from None
    level = [value]  # the values inside 0, 1, … containers
    for _ in range(depth):
        level = [v for x in level if isinstance(x, dict | list) for v in (x.values() if isinstance(x, dict) else x)]
    if not any(isinstance(x, dict | list) for x in level):
        return value
    raise ValueError(f"it nests deeper than {depth}")


def seconds(value: object) -> bool:
    """A duration a site reports: a finite, non-negative number (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def clear_fault(record: Mapping[str, object], fields: Mapping[str, Callable[[object], bool]],
                flags: Collection[str], cids: Collection[int]) -> str | None:  # fmt: skip
    """Why the clear part of a site's reply (`record`) is refused; None if it is not. It holds every one of
    `fields`, each passing its rule, and nothing else but flags `<flag>/<cid>` for `cids` (the clients the site
    trained this round), each naming an entry: a printable string of 1 to `MAX_NAME` characters."""
    allowed = {f"{flag}/{cid}" for flag in flags for cid in cids}
    for key in sorted(record):
        value = record[key]
        if key in fields and not fields[key](value):
            return f"its {shown(key)} is {shown(value)}"
        if key in allowed and not (isinstance(value, str) and 0 < len(value) <= MAX_NAME and value.isprintable()):
            return f"its {shown(key)} names no entry: {shown(value)}"
        if key not in fields and key not in allowed:
            return f"it sends {shown(key)}, which is not a figure of its own clients"
    missing = sorted(set(fields) - set(record))
    return f"its {shown(missing[0])} is missing" if missing else None


def refuse(line: str) -> None:
    """One line on the run's error stream: the run goes on without what was refused."""
    print(f"pflbed: refused: {line}", file=sys.stderr, flush=True)


def _shape(v: torch.Tensor) -> list[int]:
    return list(v.shape)


def entry_fault(payload: Tensors, reply: Tensors) -> str | None:
    """Why a reply is not the new values of payload entries (a key not sent, another shape or dtype); None if it
    is."""
    for k in sorted(reply):
        v = reply[k]
        if k not in payload:
            return f"has key {shown(k)}, which the server did not send"
        if tuple(v.shape) != tuple(payload[k].shape):
            return f"has '{k}' of shape {_shape(v)}, the server sent {_shape(payload[k])}"
        if v.dtype != payload[k].dtype:
            return f"has '{k}' of dtype {v.dtype}, the server sent {payload[k].dtype}"
    return None


def update_ratio(payload: Tensors, reply: Tensors) -> float:
    """‖reply − payload‖ ÷ max(1, ‖payload‖) over the reply's entries of a payload key and shape (float64)."""
    change = size = 0.0
    for k, v in reply.items():
        p = payload.get(k)
        if p is None or tuple(p.shape) != tuple(v.shape) or not v.numel():
            continue
        p64 = p.detach().to("cpu", torch.float64)
        change += float(((v.detach().to("cpu", torch.float64) - p64) ** 2).sum())
        size += float((p64**2).sum())
    return math.sqrt(change) / max(1.0, math.sqrt(size))


class ReplyCheck:
    """The run's checks of replies (`round`), and the reply key sets it has fixed so far."""

    def __init__(self, algo: Algorithm, max_update: float) -> None:
        self.algo, self.max_update = algo, max_update
        own = getattr(type(algo), "reply_fits", None)  # an algorithm's own check, not a default all share
        shared = own is not None and own is getattr(Algorithm, "reply_fits", None)
        self.fits: Callable[[Tensors, Tensors], str | None] | None = None if own is None or shared else \
            algo.reply_fits  # type: ignore[attr-defined]  # fmt: skip
        self.declared = type(algo).dp_refused is None and self.fits is None
        self.keys: dict[Structure, frozenset[str]] = {}  # payload structure → the key set of its replies

    def fault(self, payload: Tensors, reply: Tensors) -> str | None:
        """Why one reply is refused, whatever the others are; None if it is not."""
        why = self.fits(payload, reply) if self.fits is not None else None
        if why is None and self.declared:
            why = entry_fault(payload, reply)
        if why is None:
            ratio = update_ratio(payload, reply)
            if ratio > self.max_update:  # a NaN ratio (a non-finite reply) is the divergence guard's
                why = f"changes the model by {ratio:.3g} × max(1, its norm): over sites.max_update={self.max_update:g}"
        return why

    def round(self, payloads: dict[int, Tensors], replies: dict[int, Tensors], site_of: Callable[[int], int]
              ) -> dict[int, str]:  # fmt: skip
        """The sites refused this round, each with why (its first wrong client's reply)."""
        refused: dict[int, str] = {}
        for cid in sorted(replies):
            why = self.fault(payloads[cid], replies[cid])
            if why is not None and site_of(cid) not in refused:
                refused[site_of(cid)] = f"client {cid}'s reply {why}"
        if not self.declared:
            return refused
        ok = [c for c in sorted(replies) if site_of(c) not in refused]
        votes: dict[Structure, dict[frozenset[str], list[int]]] = {}
        for cid in ok:
            votes.setdefault(structure(payloads[cid]), {}).setdefault(frozenset(replies[cid]), []).append(cid)
        for sig, by_keys in votes.items():
            if sig not in self.keys:
                self.keys[sig] = self.elect(sig, by_keys, site_of)
        for cid in ok:
            want, got = self.keys[structure(payloads[cid])], frozenset(replies[cid])
            if got != want and site_of(cid) not in refused:
                missing, extra = sorted(want - got), sorted(got - want)
                refused[site_of(cid)] = (f"client {cid}'s reply lacks keys {missing[:3]}" if missing else
                                         f"client {cid}'s reply has keys {extra[:3]} no other reply has")  # fmt: skip
        return refused

    @staticmethod
    def elect(sig: Structure, by_keys: dict[frozenset[str], list[int]], site_of: Callable[[int], int]
               ) -> frozenset[str]:  # fmt: skip
        """The key set of the replies to payloads of structure `sig`: the one most sites send; on a tie the
        payload's own, if tied, else the one of the most clients, then of the lowest site."""
        sent = frozenset(k for k, _, _ in sig)

        def rank(keys: frozenset[str]) -> tuple[int, bool, int, int]:
            cids = by_keys[keys]
            return (len({site_of(c) for c in cids}), keys == sent, len(cids), -min(site_of(c) for c in cids))

        return max(by_keys, key=rank)
