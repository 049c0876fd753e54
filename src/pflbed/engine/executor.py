"""Executors decide *where* `client_update` runs; the round loop is the same for all of them.

`LoopExecutor` runs clients one after another in this process, reusing one model object per architecture, and
keeps the client states. Its strict mode round-trips everything through bytes (see `wire`).
"""

from __future__ import annotations

import torch

from pflbed.algorithms.base import Algorithm, ClientContext, Tensors
from pflbed.engine import rng, wire
from pflbed.engine.guard import check_client


class LoopExecutor:
    def __init__(self, algo: Algorithm, strict: bool = False) -> None:
        self.algo, self.strict = algo, strict
        self.states: dict[int, Tensors] = {}

    def state(self, cid: int) -> Tensors:
        """A client's state, created by `init_client` the first time it is needed."""
        if cid not in self.states:
            s = self.algo.init_client(cid)
            self.states[cid] = wire.roundtrip(s) if self.strict else s
        return self.states[cid]

    def run(self, rnd: int, payloads: dict[int, Tensors]) -> dict[int, Tensors]:
        ctx = self.algo.ctx
        replies: dict[int, Tensors] = {}
        for cid in sorted(payloads):
            payload, state = payloads[cid], self.state(cid)
            if self.strict:
                payload = wire.roundtrip(payload)
            seed = rng.derive_seed(ctx.seed, rng.CLIENT, rnd, cid)
            torch.manual_seed(seed)  # for any randomness an algorithm draws from torch's global RNG
            cctx = ClientContext(rnd, cid, torch.Generator().manual_seed(seed))
            reply, new_state = self.algo.client_update(payload, state, ctx.client_data(cid), cctx)
            if self.strict:
                reply, new_state = wire.roundtrip(reply), wire.roundtrip(new_state)
            check_client(rnd, cid, reply, new_state)
            replies[cid] = reply
            self.states[cid] = new_state
        return replies
