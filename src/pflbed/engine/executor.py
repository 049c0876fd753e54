"""Executors decide *where* `client_update` runs; the round loop is the same for all of them.

`LoopExecutor` runs clients one after another in this process, reusing one model object per architecture, and
keeps the client states; `procs.ProcsExecutor` runs them in worker processes and keeps the states the same way.
Strict mode round-trips everything through bytes (see `wire`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pflbed import privacy, rng
from pflbed.algorithms.base import Algorithm, ClientContext, Tensors
from pflbed.engine import wire
from pflbed.engine.guard import check_client
from pflbed.evaluation.evaluate import Forward


def client_generator(seed: int, rnd: int, cid: int) -> torch.Generator:
    """Client `cid`'s generator in round `rnd`: seeded from (seed, round, client id) alone, on the CPU (the same
    draws on any device). Torch's global RNG is seeded from the same number (`update_client`)."""
    return torch.Generator(device="cpu").manual_seed(rng.derive_seed(seed, rng.CLIENT, rnd, cid))


def precision(algo: Algorithm) -> contextlib.AbstractContextManager:
    """`executor.precision`: bf16 runs training under `torch.autocast` (matrix products and convolutions in
    bfloat16; parameters, their updates and everything exchanged stay float32); fp32: nothing.

    Where: around every client update (wherever it runs), batched clients, and the final fine-tuning and
    new-client stages (their training and their scoring). Not around the server's rules or the rounds'
    evaluation: a weighted mean or a coefficient product computed as a matrix product would be rounded to
    bfloat16's 8 bits every round, and the rounds' figures are scored in float32."""
    ctx = algo.ctx
    return torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.cfg.executor.precision == "bf16")


def seeded(algo: Algorithm, rnd: int, cid: int) -> ClientContext:
    """Client `cid`'s context in round `rnd`, torch's global RNG seeded for it (its dropout draws from there): what
    its update draws from, seeded from (seed, round, client id) alone."""
    ctx = algo.ctx
    generator = client_generator(ctx.seed, rnd, cid)
    rng.seed_global(generator.initial_seed(), ctx.device)  # the same number, hashed once (≈ 10 µs a hash: a
    # millisecond of a batched round's plans at 100 clients, host time a GPU waits through)
    return ClientContext(rnd, cid, generator)


def update_client(algo: Algorithm, rnd: int, cid: int, payload: Tensors, state: Tensors) -> tuple[Tensors, Tensors]:
    """One client's update, seeded from (seed, round, client id) alone — the same wherever and whenever it runs.
    With `privacy.clip`, the reply leaves it clipped (`private`): on the client, so that with a Flower deployment
    no unclipped update ever reaches the server."""
    ctx = algo.ctx
    cctx = seeded(algo, rnd, cid)
    with precision(algo):
        reply, new_state = algo.client_update(payload, state, ctx.client_data(cid), cctx)
    return private(algo, payload, reply), new_state


def private(algo: Algorithm, payload: Tensors, reply: Tensors) -> Tensors:
    """The reply as it may leave the client: its update of the shared model clipped to `privacy.clip` (DP-FedAvg,
    `pflbed.privacy`); unchanged without privacy."""
    clip = algo.ctx.cfg.privacy.clip
    return reply if clip is None else privacy.clip_reply(payload, reply, clip)


class LoopExecutor:
    forward: Forward | None = None  # evaluation forwards run in this process

    def __init__(self, algo: Algorithm, strict: bool = False) -> None:
        self.algo, self.strict = algo, strict
        self.states: dict[int, Tensors] = {}

    def state(self, cid: int) -> Tensors:
        """A client's state, created by `init_client` the first time it is needed."""
        if cid not in self.states:
            self.states[cid] = self.prepare(self.algo.init_client(cid))
        return self.states[cid]

    def prepare(self, tensors: Tensors) -> Tensors:
        """What a client receives: in strict mode a copy that went through bytes (back on the run's device)."""
        return wire.roundtrip(tensors, self.algo.ctx.device) if self.strict else tensors

    def keep(self, rnd: int, cid: int, reply: Tensors, new_state: Tensors, screened: bool = False) -> Tensors:
        """Check a client's (reply, new state), keep the state, return the reply. `screened`: found finite already,
        with others' (`guard.screen_finite`), or to be checked with them before the round ends
        (`guard.check_clients_later`); going through bytes in strict mode changes no value."""
        reply, new_state = self.prepare(reply), self.prepare(new_state)
        if not screened:
            check_client(rnd, cid, reply, new_state)
        self.states[cid] = new_state
        return reply

    def stream(self, rnd: int, payloads: dict[int, Tensors]) -> Iterator[tuple[int, Tensors]]:
        """The round's (client, reply) pairs in client order, each one as soon as it is ready: the server folds a
        reply in and drops it before the next one is trained (`Algorithm.aggregator`), so a round need not hold all
        its replies at once. A client's own state is the only one its update reads, so keeping it at once is safe."""
        for cid in sorted(payloads):
            yield cid, self.keep(rnd, cid, *update_client(self.algo, rnd, cid, self.prepare(payloads[cid]),
                                                           self.state(cid)))  # fmt: skip

    def run(self, rnd: int, payloads: dict[int, Tensors]) -> dict[int, Tensors]:
        """All of the round's replies, by client."""
        return dict(self.stream(rnd, payloads))

    def close(self) -> None:
        """Nothing to release in-process."""
