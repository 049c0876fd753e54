"""Streaming aggregation: the server folds each reply in as it comes, so a round never holds all its replies.

At 10,000 FedPer clients with the McMahan CNN, 100 replies of 1.7M parameters were 660 MB of a 1.5 GB peak.
"""

import weakref

import pytest
import torch

from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.training import WeightedMean, weighted_mean
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import LoopExecutor
from pflbed.engine.procs import ProcsExecutor
from pflbed.federation import sample_clients
from pflbed.results.experiment import run

from ..tiny import TINY

EXECUTORS = {
    "loop": {"threads": 1, "batch_clients": False},
    "batched": {"threads": 1, "batch_clients": True},
    "procs": {"name": "procs", "workers": 2, "threads": 1},
}


def _cfg(executor, rounds=1, fraction=0.5):
    return validate_config({**TINY, "train": {**TINY["train"], "rounds": rounds}, "algorithm": {"name": "fedavg"},
                            "federation": {**TINY["federation"], "sample_fraction": fraction},
                            "model": {"name": "mlp"}, "executor": executor})  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_every_executor_hands_replies_on_one_at_a_time(name, pool, monkeypatch):
    """When the server folds in a reply, no earlier reply of the round is alive any more (weak references to them
    are dead): an executor that trains the whole round before handing anything on is red here."""
    seen: list[weakref.ref] = []
    alive_at_add: list[int] = []

    class Watching(WeightedMean):
        def add(self, cid, reply):  # tensors are freed by reference counting: no garbage collection needed
            alive_at_add.append(sum(r() is not None for r in seen))
            seen.append(weakref.ref(next(iter(reply.values()))))
            super().add(cid, reply)

    monkeypatch.setattr(FedAvg, "aggregator", lambda self, rnd, server, weights: Watching(weights))
    run(_cfg(EXECUTORS[name], fraction=1.0), write=False, progress=False, pool=pool if name == "procs" else None)
    assert len(alive_at_add) == 6  # one round of all 6 clients
    assert alive_at_add == [0] * len(alive_at_add)


def test_streamed_server_equals_the_server_rule_over_all_replies():
    """The loop's server after a round is `aggregate` over the round's collected replies, bit for bit (the fold
    adds clients in client order, as the collected rule does)."""
    torch.set_num_threads(1)
    cfg = _cfg({"threads": 1}, rounds=1)
    streamed = run(cfg, write=False, progress=False).server
    algo = prepare(cfg)
    fed, server = algo.ctx.federation, algo.init_server()
    cids = sample_clients(cfg.seed, 1, fed.participated, cfg.federation.sample_fraction)
    replies = LoopExecutor(algo).run(1, algo.configure(1, server, cids))
    collected = algo.aggregate(1, server, replies, {c: fed.num_train(c) for c in cids})
    assert streamed.keys() == collected.keys()
    assert all(torch.equal(streamed[k], collected[k]) for k in streamed)


def test_weighted_mean_carries_base_and_refuses_nothing():
    """`base` tensors pass through unchanged (FedBABU's frozen head), averaged keys override them; an empty key set
    still gives the base; no reply at all is an error rather than an all-zero model."""
    replies = {1: {"a": torch.tensor([2.0]), "h": torch.tensor([5.0])}, 4: {"a": torch.tensor([8.0])}}
    base = {"h": torch.tensor([-1.0]), "a": torch.tensor([100.0])}
    agg = WeightedMean({1: 1.0, 4: 3.0}, keys=["a"], base=base)
    for c, r in replies.items():
        agg.add(c, r)
    out = agg.result()
    assert torch.equal(out["h"], base["h"]) and torch.allclose(out["a"], torch.tensor([6.5]))
    assert weighted_mean(replies, {1: 1.0, 4: 3.0}, keys=[]) == {}
    with pytest.raises(ValueError, match="no replies"):
        WeightedMean({1: 1.0}).result()


def test_a_round_stopped_early_leaves_a_reused_pool_clean(pool):
    """A round whose stream is abandoned after its first reply (a diverged client stops the run there) drains the
    workers' other results: the next run on the same pool still equals the loop. Round 7's leftovers differ from
    round 1's results, so a pool that kept them hands the next run wrong replies (red without the drain)."""
    torch.set_num_threads(1)
    cfg = _cfg({"name": "procs", "workers": 2, "threads": 1}, rounds=1)
    algo = prepare(cfg)
    cids = algo.ctx.federation.participated[:6]
    stream = ProcsExecutor(algo, pool).stream(7, algo.configure(7, algo.init_server(), cids))
    next(stream)
    stream.close()
    procs = run(cfg, write=False, progress=False, pool=pool)
    loop = run(_cfg({"threads": 1}, rounds=1), write=False, progress=False)
    assert all(torch.equal(procs.server[k], loop.server[k]) for k in loop.server)
