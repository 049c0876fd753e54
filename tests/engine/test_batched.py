"""Batched clients (engine/batched.py) give the loop's results up to float rounding, for every algorithm.

Tolerance: after one step the batched and the one-by-one parameters differ by float32 rounding (≤ 1e-7); the
tests below allow 1e-5 after two rounds or several phases of the tiny configs, far below what any planted wrong rule
(loss weights, momentum, weight decay, a missing phase, a stopped client still updated) moves them.
"""

import pytest
import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.algorithms.local_sgd import run_plan
from pflbed.config import validate_config
from pflbed.engine import batched
from pflbed.engine.batched import BatchedExecutor, batchable_model, train_together
from pflbed.engine.executor import LoopExecutor, client_generator
from pflbed.engine.loop import prepare
from pflbed.errors import ConfigError
from pflbed.models import build_model
from pflbed.runs import run

from ..tiny import TINY

TOL = 1e-5
FED = {**TINY["federation"], "public": 64, "sample_fraction": 1.0}
LIGHT = {"architectures": ["lenet5", "mlp"], "server_steps": 3}


def _cfg(name, batch_clients, rounds=2, **train):
    options = {k: v for k, v in LIGHT.items() if k in ALGORITHMS[name].Config.model_fields}
    return validate_config({**TINY, "federation": FED, "train": {**TINY["train"], "rounds": rounds, **train},
                            "algorithm": {"name": name, **options},
                            "executor": {"threads": 1, "batch_clients": batch_clients}})  # fmt: skip


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max([(a[k].double() - b[k].double()).abs().max().item() for k in a] or [0.0])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_batched_equals_loop_within_tolerance(name, monkeypatch):
    """Plain-SGD algorithms (an `sgd_plan`) are trained together and land within TOL of the loop's parameters and
    client states; every other algorithm runs client by client in the batched executor, bit-identical. Two rounds
    with momentum and weight decay (one round for the others: their rounds are the loop's code); vmapped
    convolutions: `test_train_together_is_each_clients_own_sgd`."""
    torch.set_num_threads(1)
    calls = []
    monkeypatch.setattr(batched, "train_together", lambda *a: calls.append(len(a[1])) or train_together(*a))
    train = {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.01}
    planned = ALGORITHMS[name].sgd_plan is not ALGORITHMS["fedmd"].sgd_plan
    loop = run(_cfg(name, False, 2 if planned else 1, **train), write=False, progress=False)
    both = run(_cfg(name, True, 2 if planned else 1, **train), write=False, progress=False)
    assert isinstance(both.executor, BatchedExecutor)
    if planned:
        assert calls and all(n > 1 for n in calls)  # the batched path ran, on several clients at a time
        assert _max_diff(loop.server, both.server) <= TOL
        assert loop.executor.states.keys() == both.executor.states.keys()
        assert all(_max_diff(loop.executor.states[c], both.executor.states[c]) <= TOL for c in loop.executor.states)
        assert both.summary["final"]["pfl_acc"] == pytest.approx(loop.summary["final"]["pfl_acc"], abs=0.05)
    else:
        assert not calls
        assert {k: v for k, v in both.summary.items() if k not in ("timing", "provenance")} == {
            k: v for k, v in loop.summary.items() if k not in ("timing", "provenance")
        }
        assert all(torch.equal(loop.server[k], both.server[k]) for k in loop.server)


def test_the_algorithms_with_a_plan_are_the_plain_sgd_ones():
    planned = {n for n, cls in ALGORITHMS.items() if cls.sgd_plan is not ALGORITHMS["fedmd"].sgd_plan}
    # kNN-Per trains exactly as FedAvg does (its personalization happens at inference)
    assert planned == {"fedavg", "fedper", "fedrep", "lg_fedavg", "fedbabu", "knnper"}


@pytest.mark.parametrize("model", ["lenet5", "mlp"])
def test_train_together_is_each_clients_own_sgd(model):
    """Rule (batched.py:_phase = local_sgd.run_plan): two phases (FedPer's head-only epoch, then every block),
    momentum restarted per phase, weight decay, a batch size that leaves a smaller last batch, clients of unequal
    sizes (the smaller stops early and must then stay put): each client's result equals its own `run_plan`."""
    torch.set_num_threads(1)
    cfg = validate_config({"dataset": {"name": "digits"}, "model": {"name": model},
                           "federation": {"clients": 6, "partition": "dirichlet", "alpha": 0.3},
                           "train": {"batch_size": 8, "lr": 0.02, "momentum": 0.5, "weight_decay": 0.05,
                                     "local_epochs": 2},
                           "algorithm": {"name": "fedper", "head_finetune_epochs": 1}})  # fmt: skip
    algo = prepare(cfg)
    ctx, server = algo.ctx, algo.init_server()
    cids = sorted(ctx.federation.participated)[:3]
    sizes = [ctx.client_data(c).num_train for c in cids]
    assert len(set(sizes)) == 3 and all(n % 8 for n in sizes)  # unequal, each with a partial last batch
    plans = [algo.sgd_plan(server, algo.init_client(c), ctx.client_data(c)) for c in cids]
    together = train_together(ctx.model, plans, [ctx.client_data(c) for c in cids], cfg.train,
                              [client_generator(cfg.seed, 1, c) for c in cids])  # fmt: skip
    for c, plan, got in zip(cids, plans, together, strict=True):
        reply, state = run_plan(ctx.model, plan, ctx.client_data(c), cfg.train, client_generator(cfg.seed, 1, c))
        assert _max_diff({**reply, **state}, got) <= TOL
        assert _max_diff(got, plan.start) > 100 * TOL  # it trained


def test_models_with_batchnorm_or_dropout_are_not_batched():
    assert batchable_model(build_model("mlp", (1, 8, 8), 10))
    assert batchable_model(build_model("cnn", (1, 8, 8), 10))
    assert not batchable_model(build_model("cnn_bn", (1, 8, 8), 10))  # running statistics
    assert not batchable_model(build_model("alexnet_small", (1, 8, 8), 10))  # dropout


def test_batch_clients_is_on_by_default_only_on_a_gpu_and_only_in_the_loop():
    algo = prepare(validate_config({**TINY, "algorithm": {"name": "fedavg"}}))
    from pflbed.engine.loop import make_executor

    ex, _ = make_executor(algo)
    assert type(ex) is LoopExecutor  # CPU: off unless asked for
    with pytest.raises(ConfigError, match="executor: batch_clients applies to executor.name=loop"):
        validate_config({"executor": {"name": "procs", "batch_clients": True}})
