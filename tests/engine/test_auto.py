"""`executor.name: auto`: the rule of `engine.auto` and what `make_executor` builds from it."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pflbed.config import validate_config
from pflbed.engine import auto
from pflbed.engine.auto import PROCS_MIN_MACS, choose_executor, forward_macs, training_macs
from pflbed.engine.batched import BatchedExecutor
from pflbed.engine.build import make_executor, prepare
from pflbed.engine.executor import LoopExecutor
from pflbed.engine.procs import ProcsExecutor
from pflbed.engine.threads import LARGE_MODEL_PARAMS

from ..tiny import TINY


def test_forward_macs_count_linear_and_convolution_layers():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 1, 3, padding=1), nn.Flatten(), nn.Linear(5 * 5, 7)
    )  # the second convolution has one output channel
    convs = 3 * 3 * 3 * 4 * 5 * 5 + 4 * 3 * 3 * 1 * 5 * 5  # (in × kernel) per output element × outputs, summed
    assert forward_macs(model, (3, 5, 5), torch.device("cpu")) == convs + 25 * 7
    grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)  # in_channels / groups per output
    assert forward_macs(grouped, (4, 5, 5), torch.device("cpu")) == 2 * 9 * 4 * 25


def test_training_macs_are_three_forwards_of_every_sample_the_rounds_train():
    algo = prepare(validate_config({**TINY, "train": {**TINY["train"], "rounds": 3, "local_epochs": 2}}))
    ctx, fed = algo.ctx, algo.ctx.federation
    samples = sum(fed.num_train(c) for c in fed.participated) * ctx.cfg.federation.sample_fraction
    fwd = forward_macs(ctx.model, ctx.source.input_shape, ctx.device)
    assert training_macs(ctx) == pytest.approx(3 * fwd * samples * 2 * 3)
    assert auto.clients_per_round(ctx) == len(fed.participated) * 0.5  # TINY samples half of them


def _ctx(macs: float, clients: float = 10, params: int = 1000, device: str = "cpu"):
    model = nn.Linear(params, 1, bias=False)
    return SimpleNamespace(device=torch.device(device), model=model, macs=macs, clients=clients)


@pytest.fixture
def rule(monkeypatch):
    """The rule on a 2-core machine, with the work and clients per round given by the fake context."""
    monkeypatch.setattr(auto.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(auto, "training_macs", lambda ctx: ctx.macs)
    monkeypatch.setattr(auto, "clients_per_round", lambda ctx: ctx.clients)
    return lambda ctx, **ex: choose_executor(validate_config({"executor": ex}).executor, ctx)


def test_procs_from_the_threshold_on_a_multicore_cpu_loop_below(rule):
    assert rule(_ctx(PROCS_MIN_MACS)) == "procs"
    assert rule(_ctx(PROCS_MIN_MACS * 0.99)) == "loop"


def test_loop_on_a_gpu_one_core_one_client_per_round_or_a_model_using_every_core(rule, monkeypatch):
    assert rule(_ctx(1e15, device="meta")) == "loop"  # any accelerator: batched clients in the loop
    assert rule(_ctx(1e15, clients=1.5)) == "loop"
    assert rule(_ctx(1e15, clients=2)) == "procs"  # two clients a round already keep two workers busy
    assert rule(_ctx(1e15, params=LARGE_MODEL_PARAMS)) == "loop"  # its steps take all cores by default
    assert rule(_ctx(1e15, params=LARGE_MODEL_PARAMS), threads=1) == "procs"
    monkeypatch.setattr(auto.os, "cpu_count", lambda: 1)
    assert rule(_ctx(1e15)) == "loop"
    monkeypatch.setattr(auto.os, "cpu_count", lambda: None)  # unknown: as if one core
    assert rule(_ctx(1e15)) == "loop"


def test_a_named_executor_is_kept(rule):
    assert rule(_ctx(0), name="procs") == "procs"
    assert rule(_ctx(1e15), name="loop") == "loop"


def test_make_executor_builds_the_choice_and_batch_clients_means_the_loop(monkeypatch, pool):
    algo = prepare(validate_config(TINY))
    monkeypatch.setattr("pflbed.engine.build.choose_executor", lambda ex, ctx: "procs")
    assert isinstance(make_executor(algo, pool)[0], ProcsExecutor)
    batched = prepare(validate_config({**TINY, "executor": {"batch_clients": True}}))
    assert isinstance(make_executor(batched, pool)[0], BatchedExecutor)
    assert validate_config({}).executor.name == "auto"


def test_make_executor_passes_strict_and_sizes_its_own_pool_from_the_config(monkeypatch):
    """The loop stays unbatched on a CPU unless asked; `strict` reaches every executor; a pool the caller gives
    is not the run's to close; a pool of its own has `executor.workers` workers (default: every core, 1 where the
    count is unknown) of `executor.threads` threads (default 1). Recorded, not started."""
    from pflbed.engine import build

    started = []
    monkeypatch.setattr(build, "WorkerPool", lambda workers, threads: started.append((workers, threads)) or "own")
    monkeypatch.setattr(build, "ProcsExecutor", lambda algo, pool, strict: ("procs", pool, strict))
    for strict in (True, False):
        algo = prepare(validate_config({**TINY, "executor": {"name": "loop", "strict": strict}}))
        executor, own = make_executor(algo)
        assert type(executor) is LoopExecutor and executor.strict is strict and own is None
        procs = prepare(validate_config({**TINY, "executor": {"name": "procs", "strict": strict}}))
        assert make_executor(procs, "given") == (("procs", "given", strict), None) and not started
    algo = prepare(validate_config({**TINY, "executor": {"name": "loop", "batch_clients": True, "strict": True}}))
    assert type(make_executor(algo)[0]) is BatchedExecutor and make_executor(algo)[0].strict
    for cores, executor, want in [(4, {}, (4, 1)), (4, {"workers": 3, "threads": 2}, (3, 2)), (None, {}, (1, 1))]:
        procs = prepare(validate_config({**TINY, "executor": {"name": "procs", **executor}}))
        monkeypatch.setattr(build.os, "cpu_count", lambda cores=cores: cores)
        assert make_executor(procs) == (("procs", "own", False), "own") and started.pop() == want
