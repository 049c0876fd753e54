"""The client executor (engine/executor.py): each client's update seeded from (seed, round, client) alone, what
strict mode copies, and the guard on every reply. Where clients run is compared end to end in the executors'
parity tests (procs, Flower, batched clients); these pin the rules every executor shares."""

import pytest
import torch

from pflbed import rng
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import LoopExecutor, client_generator, update_client
from pflbed.errors import DivergedError

from ..tiny import TINY


def _algo():
    return prepare(validate_config({**TINY, "algorithm": {"name": "fedavg"}}))


def test_a_clients_update_draws_from_its_own_seed_of_seed_round_and_client(monkeypatch):
    """Rule (`update_client`): torch's global RNG and the client's generator are seeded from (seed, round, client id)
    — nothing else — so that an update is the same wherever and whenever it runs; the update is told its round and
    client."""
    algo = _algo()
    seen = {}
    real = algo.client_update

    def client_update(payload, state, data, cctx):
        seen[cctx.rnd, cctx.cid] = torch.randn(3), torch.randn(3, generator=cctx.generator)
        return real(payload, state, data, cctx)

    monkeypatch.setattr(algo, "client_update", client_update)
    server = algo.init_server()
    a, b = algo.ctx.federation.participated[:2]
    for rnd, cid in ((1, a), (1, b), (2, a)):
        update_client(algo, rnd, cid, algo.configure(rnd, server, [cid])[cid], algo.init_client(cid))
        seed = rng.derive_seed(algo.ctx.seed, rng.CLIENT, rnd, cid)
        rng.seed_global(seed, algo.ctx.device)
        assert torch.equal(seen[rnd, cid][0], torch.randn(3))
        assert torch.equal(seen[rnd, cid][1], torch.randn(3, generator=torch.Generator().manual_seed(seed)))
        assert torch.equal(seen[rnd, cid][1], torch.randn(3, generator=client_generator(algo.ctx.seed, rnd, cid)))
    draws = [g for g, _ in seen.values()]
    assert all(not torch.equal(x, y) for i, x in enumerate(draws) for y in draws[i + 1 :])  # each its own stream


def test_strict_mode_hands_a_client_copies_through_bytes_and_the_default_the_tensors_themselves():
    """`executor.strict`: what a client receives went through bytes, so an algorithm that keeps a reference to the
    server's tensors (or changes them in place) fails as it would across machines; by default the loop passes the
    tensors themselves (no copy per client)."""
    algo = _algo()
    payload = algo.init_server()
    loose = LoopExecutor(algo).prepare(payload)
    assert all(loose[k] is payload[k] for k in payload)
    strict = LoopExecutor(algo, strict=True).prepare(payload)
    assert strict.keys() == payload.keys()
    for k in payload:
        assert torch.equal(strict[k], payload[k]) and strict[k].data_ptr() != payload[k].data_ptr(), k


def test_a_reply_with_non_finite_values_stops_the_round_naming_the_client():
    """Every reply passes the guard where the executor keeps it: the round, the client and the tensor are named."""
    algo = _algo()
    server = algo.init_server()
    a, b = algo.ctx.federation.participated[:2]
    real = algo.client_update

    def client_update(payload, state, data, cctx):
        reply, new_state = real(payload, state, data, cctx)
        if cctx.cid == b:
            reply = {**reply, "blocks.classifier.bias": torch.full_like(reply["blocks.classifier.bias"], float("nan"))}
        return reply, new_state

    algo.client_update = client_update
    ex = LoopExecutor(algo)
    with pytest.raises(DivergedError) as caught:
        ex.run(3, algo.configure(3, server, [a, b]))
    assert caught.value.round == 3
    assert caught.value.where == f"client {b}'s reply has non-finite values in 'blocks.classifier.bias'"
