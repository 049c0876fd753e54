"""Batched clients (engine/batched.py) give the loop's results up to float rounding, for every algorithm.

Tolerance. Each algorithm's batched step (its plan trained together with other clients') is compared with the same
plan run alone in float64 (`_in_float64`), within TOL64 = 1e-10 (seen: ≤ 1e-13). In float32 the two differ by
rounding (≤ 1e-7 a step), which these tiny runs amplify at the kinks of ReLU and max-pooling, and by how much
depends on the CPU's kernels: on one CPU FedRoD's and FedSelect's lenet5_bn results stayed within 1e-5, on another
(AVX2) they moved by 3e-5 and 0.057. float64's rounding does not reach the kinks, so the test holds on any CPU and
is tighter. The executor end to end (`run`, float32 as users run it) is compared within TOL = 1e-5 after two rounds
(seen: ≤ 5e-7). Both are far below what any planted wrong rule (loss weights, momentum, weight decay, a missing
phase, a stopped client still updated) moves them.
"""

import collections
import contextlib
import copy
import gc
import weakref
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pflbed import compute, rng
from pflbed.algorithms import ALGORITHMS
from pflbed.algorithms.base import Algorithm, ClientContext
from pflbed.algorithms.ktpfl import KTpFL
from pflbed.algorithms.local_sgd import (
    LocalSGDPlan,
    Phase,
    RegularizedObjective,
    model_forward,
    run_plan,
    weighted_mean,
)
from pflbed.algorithms.masks import pack_bits
from pflbed.algorithms.pfedme import MoreauStep
from pflbed.config import validate_config
from pflbed.data.augment import Augment
from pflbed.engine import batched, conv_weight_grad
from pflbed.engine.batched import BatchedExecutor, batchable_model, train_together
from pflbed.engine.build import prepare
from pflbed.engine.executor import LoopExecutor, client_generator, update_client
from pflbed.engine.per_client_layers import PerClientLayers
from pflbed.errors import ConfigError, DivergedError
from pflbed.models import build_model
from pflbed.models.zoo import ReproducibleDropout
from pflbed.results.experiment import run

from ..tiny import ALEXNET_TINY, DATA, TINY

pytestmark = pytest.mark.usefixtures("alexnet_tiny")

TOL = 1e-5
TOL64 = 1e-10
TOL_DEEP = 1e-6  # `test_mobilenets_depthwise_separable_blocks_together_are_each_clients_own_sgd`
FED = {**TINY["federation"], "public": 64, "sample_fraction": 1.0}
# FedDF's server distillation (server code, the same in both executors) is left out: its Adam steps turn a rounding
# difference of a near-zero gradient into one of up to 2·server_lr a step (1e-5 after three steps here).
LIGHT = {"architectures": ["lenet5", "mlp"], "server_steps": 0}


def _cfg(name, batch_clients, rounds=2, **train):
    """A tiny run of `name` (heterogeneous: half the clients the run's model, batched; half another, one by one)."""
    options = {k: v for k, v in LIGHT.items() if k in ALGORITHMS[name].Config.model_fields}
    return validate_config({**TINY, "dataset": DATA, "federation": FED,
                            "train": {**TINY["train"], "rounds": rounds, **train},
                            "algorithm": {"name": name, **options},
                            "executor": {"threads": 1, "batch_clients": batch_clients}})  # fmt: skip


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max([(a[k].double() - b[k].double()).abs().max().item() for k in a] or [0.0])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_batched_equals_loop_within_tolerance(name, together):
    """Plain-SGD algorithms (an `sgd_plan`) are trained together and land within TOL of the loop's parameters and
    client states; every other algorithm runs client by client in the batched executor, bit-identical. Two rounds
    with momentum and weight decay (one round for the others: their rounds are the loop's code); vmapped
    convolutions: `test_train_together_is_each_clients_own_sgd`."""
    torch.set_num_threads(1)
    train = {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.01}
    planned = ALGORITHMS[name].loop_only is None
    loop = run(_cfg(name, False, 2 if planned else 1, **train), write=False, progress=False)
    both = run(_cfg(name, True, 2 if planned else 1, **train), write=False, progress=False)
    assert isinstance(both.executor, BatchedExecutor)
    if planned:
        assert together and all(n > 1 for n in together)  # the batched path ran, on several clients at a time
        assert _max_diff(loop.server, both.server) <= TOL
        assert loop.executor.states.keys() == both.executor.states.keys()
        assert all(_max_diff(loop.executor.states[c], both.executor.states[c]) <= TOL for c in loop.executor.states)
        assert both.summary["final"]["pfl_acc"] == pytest.approx(loop.summary["final"]["pfl_acc"], abs=0.05)
    else:
        assert not together
        assert {k: v for k, v in both.summary.items() if k not in ("timing", "provenance")} == {
            k: v for k, v in loop.summary.items() if k not in ("timing", "provenance")
        }
        assert all(torch.equal(loop.server[k], both.server[k]) for k in loop.server)


@pytest.mark.parametrize("name, models", [("fedavg", 1), ("ktpfl", 2)])
def test_a_round_asks_whether_each_model_is_batchable_once_not_once_per_client(monkeypatch, tmp_path, name, models):
    """Whether a model can be batched (a walk over its modules) is asked once a round for each of the round's
    models, not for each client: with 100 clients it was 11 ms of every round's host time before its first step."""
    from pflbed.engine import batched
    from pflbed.results.experiment import run

    asked, real = [], batched.batchable_model

    def counted(model):
        asked.append(id(model))
        return real(model)

    monkeypatch.setattr(batched, "batchable_model", counted)
    run(_cfg(name, True), tmp_path / "r")
    assert len(asked) == 2 * models and len(set(asked)) == models  # 2 rounds, every client in each


def _assert_batched_equals_loop(cfg, together):
    """`cfg(batch_clients)` run both ways: the round's clients trained together, the server and every client's
    state within TOL of the loop's, and the run trained."""
    loop = run(cfg(False), write=False, progress=False)
    both = run(cfg(True), write=False, progress=False)
    assert together and all(n > 1 for n in together)
    assert _max_diff(loop.server, both.server) <= TOL
    assert all(_max_diff(loop.executor.states[c], both.executor.states[c]) <= TOL for c in loop.executor.states)
    assert _max_diff(loop.server, loop.executor.algo.init_server()) > 100 * TOL  # it trained


@pytest.mark.parametrize("model", ["lenet5_bn", ALEXNET_TINY])
@pytest.mark.parametrize("name", ["fedavg", "fedper"])
def test_a_batchnorm_or_dropout_model_is_batched_and_equals_the_loop(name, model, together):
    """The executor end to end on the models the batched path used to leave to the loop: the round's clients
    trained together, the server and every client's state (BatchNorm statistics included) within TOL. One round,
    lr 0.05: these tiny runs have kinks where float rounding decides (lenet5_bn at lr 0.1: one client's gradient
    at two inputs 1.2e-7 apart differs by 0.066, the same function on both; at lr 0.05 a 1e-7 change of a
    round-2 start moved the loop's own update by 0.065), where no rounding tolerance can hold; every round's
    update is the same rule from its start (`test_train_together_is_each_clients_own_sgd`)."""
    torch.set_num_threads(1)

    def cfg(batch_clients):
        c = _cfg(name, batch_clients, 1, lr=0.05, momentum=0.5, weight_decay=0.01)
        return validate_config({**c.model_dump(), "model": {"name": model}})

    _assert_batched_equals_loop(cfg, together)


def test_a_finish_that_draws_dropout_masks_draws_on_from_where_the_clients_training_left_them(together):
    """SCAFFOLD's option I takes c_i⁺ = ∇f_i(x) in its plan's `finish`, a pass over the client's data in training
    mode: on a dropout model its masks come from torch's global RNG, where the loop's update left it after the
    client's steps. Batched, each client's `finish` draws on from where its own dropout stream's training left it:
    the server and the control variates within TOL of the loop's. Red with `finish` run from wherever the global
    RNG stands (0.0034 off on the tiny AlexNet)."""
    torch.set_num_threads(1)

    def cfg(batch_clients):
        c = _cfg("scaffold", batch_clients, 1, lr=0.05)
        return validate_config({**c.model_dump(), "model": {"name": ALEXNET_TINY},
                                "algorithm": {"name": "scaffold", "option": "I"}})  # fmt: skip

    _assert_batched_equals_loop(cfg, together)


def test_a_plan_that_draws_first_is_trained_on_from_where_it_left_the_clients_streams(together):
    """FedALA's plan learns its weights before it trains: it draws its sample and batches from the client's
    generator and its dropout masks from torch's global RNG, and the batched training goes on from both where the
    plan left them, as the loop's does. AlexNet with ALA on its three top blocks (both dropout layers), half the
    clients a round, three rounds (ALA runs from the second): the server and every state within TOL."""
    torch.set_num_threads(1)

    def cfg(batch_clients):
        c = _cfg("fedala", batch_clients, 3, lr=0.05, momentum=0.5).model_dump()
        c["federation"]["sample_fraction"] = 0.5
        return validate_config({**c, "model": {"name": ALEXNET_TINY},
                                "algorithm": {"name": "fedala", "layers": 3, "rand_percent": 50}})  # fmt: skip

    loop = run(cfg(False), write=False, progress=False)
    both = run(cfg(True), write=False, progress=False)
    assert len(together) == 3 and all(n > 1 for n in together)
    assert any(k.startswith("ala/") for s in both.executor.states.values() for k in s)  # the weights were learned
    assert _max_diff(loop.server, both.server) <= TOL
    assert all(_max_diff(loop.executor.states[c], both.executor.states[c]) <= TOL for c in loop.executor.states)


def test_a_plans_finish_draws_on_from_where_training_left_the_clients_generator(together):
    """FedSelect's random GradSelect draws the entries it makes personal from the client's generator after the
    client trained: batched, the generator stands where the batched training left it, as in the loop — the same
    masks, bit for bit (a packed mask differing anywhere differs by ≥ 1), and the run within TOL."""
    torch.set_num_threads(1)

    def cfg(batch_clients):
        c = _cfg("fedselect", batch_clients, 3, lr=0.05, momentum=0.5).model_dump()
        return validate_config({**c, "algorithm": {"name": "fedselect", "selection": "random", "update_every": 1}})

    loop = run(cfg(False), write=False, progress=False)
    both = run(cfg(True), write=False, progress=False)
    assert together and all(n > 1 for n in together)
    masks = [k for s in loop.executor.states.values() for k in s if k.startswith("mask/")]
    assert masks  # the selection ran
    assert all(torch.equal(loop.executor.states[c][k], both.executor.states[c][k])
               for c in loop.executor.states for k in loop.executor.states[c] if k.startswith("mask/"))  # fmt: skip
    assert _max_diff(loop.server, both.server) <= TOL
    assert all(_max_diff(loop.executor.states[c], both.executor.states[c]) <= TOL for c in loop.executor.states)


def test_where_the_global_rng_stands_is_taken_and_put_back_without_drawing():
    """`rng.global_now` draws what torch's global RNG draws next and leaves it as it was; `rng.set_global` puts it
    where a generator stands; `rng.copy` draws what its original will, apart from it."""
    cpu = torch.device("cpu")
    with rng.fork(cpu):
        torch.manual_seed(11)
        torch.rand(5)
        now = rng.global_now(cpu)
        ahead = torch.rand(7)
        assert torch.equal(torch.rand(7, generator=now), ahead)
        twin = rng.copy(now)
        assert torch.equal(torch.rand(3, generator=twin), torch.rand(3, generator=now))
        rng.set_global(twin, cpu)
        assert torch.equal(torch.rand(4), torch.rand(4, generator=now))


def _gpu_fitting(most, calls, held=None):
    """`train_together` on a GPU whose memory holds at most `most` clients at a time; `calls`: each call's size.
    One that does not fit runs out part way, its clients' streams drawn from (the retry must start them afresh),
    holding a tensor as a computation would (a weak reference to it in `held`)."""

    def train(*a):
        calls.append(len(a[1]))
        if len(a[1]) > most:
            for g in [*a[4], *(a[5] or [])]:
                torch.rand(1, generator=g)
            activations = [torch.zeros(len(a[1]))]
            activations.append(activations)  # in a reference cycle, as a computation's tensors may be
            if held is not None:
                held.append(weakref.ref(activations[0]))
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return train_together(*a)

    return train


def test_a_round_too_big_for_the_gpu_is_trained_in_halves_and_the_size_kept(monkeypatch):
    """A round whose clients do not fit in the GPU's memory together is retried at once with half as many at a
    time (again, until they fit: one client at a time, if need be), and that size is kept for the rounds after; the
    results are the all-at-once ones within TOL (each client's own generators). The device's cache is emptied
    once the failed try's tensors are gone (not while its traceback holds them), so the retry allocates afresh. A
    client that does not fit alone, and any out-of-memory error under `executor.batch_max_clients` (which sets the
    size outright), is the user's to see."""
    torch.set_num_threads(1)
    train = {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.01}

    def cfg(rounds):  # a dropout model: each client's dropout stream restarted too
        return validate_config({**_cfg("fedper", True, rounds, **train).model_dump(),
                                "model": {"name": ALEXNET_TINY}})  # fmt: skip

    whole = run(cfg(2), write=False, progress=False)
    held, emptied = [], []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append([r() is None for r in held]))
    n = len(whole.executor.states)
    halving = [n]
    while halving[-1] > 1:
        halving.append((halving[-1] + 1) // 2)
    assert n > 4 and halving[-3:] == [3, 2, 1]
    for most in (2, 1):
        calls, emptied[:] = [], []
        monkeypatch.setattr(batched, "train_together", _gpu_fitting(most, calls, held))
        gc.disable()  # a cycle freed by the executor, not by a collection that happens to run
        try:
            halves = run(cfg(2), write=False, progress=False)
        finally:
            gc.enable()
        first_fit = halving.index(most)
        assert calls[: first_fit + 1] == halving[: first_fit + 1]  # tried whole, then halved until it fitted
        assert emptied == [[True] * k for k in range(len(held) - first_fit + 1, len(held) + 1)]  # each try's gone
        assert all(k <= most for k in calls[first_fit:]) and halves.executor.most == most  # kept for round 2
        assert sum(calls[first_fit:]) == 2 * n  # every client trained once per round
        assert _max_diff(whole.server, halves.server) <= TOL
        assert all(_max_diff(whole.executor.states[c], halves.executor.states[c]) <= TOL
                   for c in whole.executor.states)  # fmt: skip

    calls = []
    monkeypatch.setattr(batched, "train_together", _gpu_fitting(0, calls))
    with pytest.raises(torch.OutOfMemoryError):
        run(cfg(1), write=False, progress=False)
    assert calls == halving  # down to one client, which does not fit either

    calls.clear()
    monkeypatch.setattr(batched, "train_together", _gpu_fitting(2, calls))
    capped = validate_config({**_cfg("fedper", True, 1, **train).model_dump(), "executor": {
        "threads": 1, "batch_clients": True, "batch_max_clients": 3}})  # fmt: skip
    with pytest.raises(torch.OutOfMemoryError):
        run(capped, write=False, progress=False)
    assert calls == [3]


def test_a_round_that_fits_only_by_flushing_the_allocators_cache_keeps_its_results_and_the_next_take_half(
    monkeypatch,
):
    """A batched computation during which the GPU's allocator had to flush its cache to allocate (`cache_flushes`
    rises) stands — its results kept, not computed again — and the computations after it take half as many
    clients, again after each that flushes; the results are the all-at-once ones within TOL. Under
    `executor.batch_max_clients` the size is the user's and stays."""
    torch.set_num_threads(1)
    train = {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.01}
    flushes = [0]

    def flushing(most, calls):  # a GPU that holds more than `most` clients only by flushing its cache
        def train_(*a):
            calls.append(len(a[1]))
            flushes[0] += len(a[1]) > most
            return train_together(*a)

        return train_

    monkeypatch.setattr(batched, "cache_flushes", lambda device: flushes[0])
    whole = run(_cfg("fedper", True, 3, **train), write=False, progress=False)
    n = len(whole.executor.states)
    assert n > 4
    calls = []
    monkeypatch.setattr(batched, "train_together", flushing(n // 2, calls))
    halved = run(_cfg("fedper", True, 3, **train), write=False, progress=False)
    half = (n + 1) // 2
    assert calls == [n, half, n - half, half, n - half]  # round 1 once, whole; rounds 2 and 3 in halves
    assert halved.executor.most == half
    assert _max_diff(whole.server, halved.server) <= TOL
    assert all(_max_diff(whole.executor.states[c], halved.executor.states[c]) <= TOL
               for c in whole.executor.states)  # fmt: skip

    calls.clear()
    monkeypatch.setattr(batched, "train_together", flushing(1, calls))
    run(_cfg("fedper", True, 2, **train), write=False, progress=False)
    expected, most = [n], half  # round 1 whole; round 2 halved again after each computation that flushed
    while sum(expected) < 2 * n:
        expected.append(min(most, 2 * n - sum(expected)))
        most = (most + 1) // 2 if expected[-1] > 1 else most
    assert calls == expected and expected[1:4] == [half, (half + 1) // 2, 1]

    calls.clear()
    capped = validate_config({**_cfg("fedper", True, 2, **train).model_dump(), "executor": {
        "threads": 1, "batch_clients": True, "batch_max_clients": n - 1}})  # fmt: skip
    run(capped, write=False, progress=False)
    assert calls == [n - 1, 1, n - 1, 1]


def test_cache_flushes_are_the_allocators_retries_on_a_gpu_and_none_elsewhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": 7, "num_ooms": 1})
    assert batched.cache_flushes(torch.device("cuda", 0)) == 7
    assert batched.cache_flushes(torch.device("cpu")) == 0
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {})  # no allocation yet: no counters
    assert batched.cache_flushes(torch.device("cuda", 0)) == 0


def test_two_clients_are_trained_together_a_lone_one_alone_and_the_replies_are_the_batched_updates(
    monkeypatch, together
):
    """A round's clients of one plan are trained together from two on; a lone client's plan runs as the loop runs
    it (`run_plan`: a vmapped step of one client is the loop's work at a higher cost), bit for bit the loop's. A
    client trained together is not trained again client by client: its reply is `train_together`'s (the two agree
    within TOL, so only the calls tell). The executor keeps the run's `executor.strict`."""
    torch.set_num_threads(1)
    alone = []
    monkeypatch.setattr(batched, "run_plan", lambda *a: alone.append(a[2].cid) or run_plan(*a))

    def cfg(sampled, batch_clients):
        return validate_config({**TINY, "dataset": DATA, "algorithm": {"name": "fedavg"},
                                "model": {"name": ALEXNET_TINY},  # dropout: the global RNG seeded alone too
                                "federation": {**TINY["federation"], "sample_fraction": sampled / 6},
                                "train": {**TINY["train"], "rounds": 2},
                                "executor": {"threads": 1, "batch_clients": batch_clients,
                                             "strict": True}})  # fmt: skip

    for sampled, want, trained_alone in [(2, [2, 2], 0), (1, [], 2)]:
        together.clear()
        alone.clear()
        r = run(cfg(sampled, True), write=False, progress=False)
        assert isinstance(r.executor, BatchedExecutor) and r.executor.strict
        assert together == want and len(alone) == trained_alone
    loop = run(cfg(1, False), write=False, progress=False)
    assert all(torch.equal(loop.server[k], r.server[k]) for k in loop.server)


def test_every_algorithm_is_batched_or_says_why_not():
    """An algorithm declares its update as a plan (`sgd_plan`, or `round_plan` for one that depends on the round)
    or the reason it cannot (`loop_only`, listed in the docs), never both, never neither."""
    for name, cls in ALGORITHMS.items():
        planned = cls.sgd_plan is not Algorithm.sgd_plan or cls.round_plan is not Algorithm.round_plan
        assert planned == (cls.loop_only is None), name
        assert cls.loop_only is None or len(cls.loop_only.split()) >= 8, name


def _plans(model, batch_size=8, algorithm=None, state=None, clients=6, augment=(), dataset=None, **train):
    """Three clients of unequal sizes (digits, Dir 0.3, of `clients`; `augment`: its augmentation; `dataset`: another
    dataset section), FedPer's two phases (or `algorithm`'s plan, from each client's `state(algo, cid)` where given),
    momentum and weight decay; the payloads of one round's `configure` (a tensor it sends every client shared by
    their plans: `batched._one_or_stacked`)."""
    algorithm = algorithm or {"name": "fedper", "head_finetune_epochs": 1}
    dataset = dataset or {"name": "digits"}
    cfg = validate_config({"dataset": {**dataset, "augment": list(augment)}, "model": {"name": model},
                           "federation": {"clients": clients, "partition": "dirichlet", "alpha": 0.3},
                           "train": {"batch_size": batch_size, "lr": 0.02, "momentum": 0.5, "weight_decay": 0.05,
                                     "local_epochs": 2, **train},
                           "algorithm": algorithm})  # fmt: skip
    algo = prepare(cfg)
    ctx, server = algo.ctx, algo.init_server()
    cids = sorted(ctx.federation.participated)[:3]
    states = {c: state(algo, c) if state else algo.init_client(c) for c in cids}
    payloads = algo.configure(1, server, cids)  # as a round sends them: what they share, one object for all
    plans = [algo.round_plan(payloads[c], states[c], ctx.client_data(c),
                             ClientContext(1, c, client_generator(cfg.seed, 1, c))) for c in cids]  # fmt: skip
    return cfg, ctx, cids, plans


@contextlib.contextmanager
def _in_float64(ctx, plans):
    """The model (the plans' own architecture, else the run's), the training pool and the plans' tensors in
    float64 — samples of a phase's own too, still one object for every plan — and torch's default dtype with them
    (the batched step's batch weights); why: the module's docstring."""
    done = {}  # a tensor the plans share stays one object, shared

    def f64(tensors):
        return {k: done.setdefault(id(v), v.double()) if v.is_floating_point() else v for k, v in tensors.items()}

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        pool = ctx.source.train.x.double()  # (one tensor: batched clients index one shared pool)
        model = copy.deepcopy(ctx.model if plans[0].model is None else plans[0].model).double()
        own = {id(ph.data): replace(ph.data, x=pool) for p in plans for ph in p.phases if ph.data is not None}
        yield (model, lambda c: replace(ctx.client_data(c), x=pool),
               [replace(p, start=f64(p.start), consts=f64(p.consts),
                        phases=tuple(replace(ph, data=own.get(id(ph.data))) for ph in p.phases)) for p in plans])
    finally:
        torch.set_default_dtype(default)


def _each_own(cfg, ctx, cids, plans, rnd=1, float64=True, autotune=False):
    """Batched, then each client alone (`run_plan`, torch's global RNG seeded as `update_client` seeds it), in
    float64 (`_in_float64`; else in the run's own dtype), as round `rnd`'s updates; `autotune`: train_together's."""
    noise = [rng.global_stream(rng.derive_seed(cfg.seed, rng.CLIENT, rnd, c), ctx.device) for c in cids]
    as_run = (ctx.model if plans[0].model is None else plans[0].model, ctx.client_data, plans)
    with _in_float64(ctx, plans) if float64 else contextlib.nullcontext(as_run) as (model, data, plans):
        together = train_together(model, plans, [data(c) for c in cids], cfg.train,
                                  [client_generator(cfg.seed, rnd, c) for c in cids], noise,
                                  autotune=autotune)  # fmt: skip
        alone = []
        for c, plan in zip(cids, plans, strict=True):
            rng.seed_global(rng.derive_seed(cfg.seed, rng.CLIENT, rnd, c), ctx.device)
            reply, state = run_plan(model, plan, data(c), cfg.train, client_generator(cfg.seed, rnd, c))
            alone.append({**reply, **state})
    return together, alone


def _assert_each_own(cfg, ctx, cids, plans):
    """Batched == each client alone (`_each_own`) within TOL64, and every client trained away from its start."""
    together, alone = _each_own(cfg, ctx, cids, plans)
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64
        assert _max_diff(got, plan.start) > 100 * TOL


@pytest.mark.parametrize("model", ["lenet5", "mlp", "lenet5_bn", ALEXNET_TINY])
def test_train_together_is_each_clients_own_sgd(model):
    """Rule (batched.py:_phase = local_sgd.run_plan): two phases (FedPer's head-only epoch, then every block),
    momentum restarted per phase, weight decay, a batch size that leaves a smaller last batch, clients of unequal
    sizes (the smaller stops early and must then stay put): each client's result equals its own `run_plan`. With
    BatchNorm (lenet5_bn) its running statistics too — moved by every forward, frozen blocks' included, from the
    real rows of a padded batch only — and with dropout (AlexNet) the masks its own stream draws, which
    it must be given. One client alone too."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans(model)
    sizes = [ctx.client_data(c).num_train for c in cids]
    assert len(set(sizes)) == 3 and all(n % 8 for n in sizes)  # unequal, each with a partial last batch
    together, alone = _each_own(cfg, ctx, cids, plans)
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64
        assert _max_diff(got, plan.start) > 100 * TOL  # it trained
        for k in (k for k in got if k.endswith("num_batches_tracked")):
            assert torch.equal(got[k], want[k]) and got[k] > plan.start[k], k
    (one,), (own,) = _each_own(cfg, ctx, cids[-1:], plans[-1:])  # alone: a GPU's last resort when out of memory
    assert _max_diff(own, one) <= TOL64
    if model == ALEXNET_TINY:
        data = [ctx.client_data(c) for c in cids]
        with pytest.raises(ValueError, match=r"^a model with dropout needs each client's dropout stream \(`noise`\)$"):
            train_together(ctx.model, plans, data, cfg.train, [client_generator(cfg.seed, 1, c) for c in cids])


def test_mobilenets_depthwise_separable_blocks_together_are_each_clients_own_sgd():
    """FedPer's MobileNet-v1 (depthwise 3×3 convs, one group per channel, vmapped; thirteen BatchNorm pairs; the
    global pool inside the last block), as `test_train_together_is_each_clients_own_sgd`, on 32-px images.

    Tolerance: TOL_DEEP = 1e-6, not TOL64. This deep BatchNorm net amplifies rounding: moving each client's start by
    one part in 10¹⁵ moves its own client-by-client result by up to 4e-9 here (on 8-px digits, whose last blocks
    see 1×1 maps normalized over a few values, by 0.7 — no tolerance can hold there, hence 32 px); batched and
    alone differ by 1.3e-8. A wrong rule moves it by orders of magnitude more (weight decay left out: 0.52)."""
    torch.set_num_threads(1)
    synthetic = {"name": "synthetic", "synthetic": {"shape": [3, 32, 32], "n_train": 300, "n_test": 50}}
    cfg, ctx, cids, plans = _plans("mobilenet_v1", dataset=synthetic, local_epochs=1)
    together, alone = _each_own(cfg, ctx, cids, plans)
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff(want, got) <= TOL_DEEP
        assert _max_diff({k: v for k, v in got.items() if v.is_floating_point()},
                         {k: v for k, v in plan.start.items() if v.is_floating_point()}) > 1000 * TOL_DEEP  # fmt: skip


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn"])
@pytest.mark.parametrize(("name", "personal"), [("fedrod", "personal."), ("fedrod_hyper", "hyper.")])
def test_fedrods_plan_together_is_each_clients_own_update(name, personal, model):
    """FedRoD's plan (Eq. 8 + Eq. 9 on one batch, its objective, `fedrod.DecoupledObjective`): the body and
    generic head at train.lr on the balanced-softmax loss of each client's own class counts, the personal head
    at personal_lr (≠ train.lr here) on the P-loss — or, for the hyper variant, the hypernetwork ν generating it
    from each client's own class prior at hyper_lr; trained together, each client lands where its own update
    does — the reply, the personal head (ν), BatchNorm statistics."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans(model, algorithm={"name": name, "personal_lr": 0.2, "gamma": 0.7})
    assert len({tuple(p.consts["counts"].tolist()) for p in plans}) == 3  # each client its own class counts
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    together, alone = _each_own(cfg, ctx, cids, plans)
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert got.keys() == want.keys() and any(k.startswith(personal) for k in got)
        assert _max_diff(want, got) <= TOL64
        assert _max_diff({k: got[k] for k in plan.start}, plan.start) > 100 * TOL  # it trained


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn"])
def test_a_proximal_plan_together_is_each_clients_own_update_with_its_own_anchor(model):
    """FedProx's and FedAMP's objective (`local_sgd.RegularizedObjective`): CE + μ/2·‖w − a‖², the anchor a each
    client's own (here three different ones, as FedAMP's u_i are), the proximal term once per client and step
    however many samples its batch has; μ = 0.5 so that the term moves the result."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans(model, algorithm={"name": "fedprox", "mu": 0.5})
    algo = ALGORITHMS["fedprox"]
    g = torch.Generator().manual_seed(0)
    anchored = []
    for p in plans:  # a different anchor per client, away from the start
        anchor = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in p.consts.items()}
        anchored.append(type(p)(p.start, p.phases, p.finish, p.objective, anchor))
    assert algo.sgd_plan is not Algorithm.sgd_plan
    _assert_each_own(cfg, ctx, cids, anchored)


def _previous_model(algo, cid):
    """A MOON client state: a previous model of its own, away from the global one (running variances kept
    positive)."""
    g = torch.Generator().manual_seed(cid)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() and "running_var" not in k
            else v.clone() for k, v in algo.init_server().items()}  # fmt: skip


@pytest.mark.parametrize("model", ["lenet5_bn", ALEXNET_TINY])
def test_moons_frozen_models_run_in_eval_mode_together_as_alone(model):
    """MOON's objective (`moon.ContrastiveObjective`) runs the global and the previous model in eval mode inside the
    step: there BatchNorm normalizes with the frozen model's own running statistics and moves none, and dropout
    draws no mask. Batched, each client's result (its running statistics included) equals its own `run_plan`; with
    the per-client layers' forwards blind to the mode, they were normalized by the batch and moved the client's
    statistics three times a step (BatchNorm: off by 168), or asked for masks never drawn (dropout: an error)."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans(model, algorithm={"name": "moon", "mu": 1.0}, state=_previous_model)
    assert all(any(k.startswith("previous/") for k in p.consts) for p in plans)  # ℓ_con is in the loss
    _assert_each_own(cfg, ctx, cids, plans)


def _random_masks(algo, cid):
    """A FedSelect client state whose next training has personal entries in every eligible tensor, a different
    random third of them per client (and one tensor wholly personal for client 1)."""
    g = torch.Generator().manual_seed(cid)
    masks = {k: torch.rand(algo.shapes[k], generator=g) < 0.3 for k in algo.eligible}
    if cid % 2:
        masks[algo.eligible[-1]][:] = True
    return {f"mask/{k}": pack_bits(m) for k, m in masks.items()}


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn", ALEXNET_TINY])
def test_fedselects_masked_passes_together_are_each_clients_own(model):
    """FedSelect's LocalAlt plan (Alg. 2): per epoch a pass on each client's personal entries, then one on its
    global entries, the masks each client's own (random here), each side one optimizer kept across the round's
    passes (momentum 0.5, weight decay). Batched == each client's own `run_plan` — with BatchNorm statistics and
    dropout masks."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans(model, algorithm={"name": "fedselect", "eligible": "all"}, state=_random_masks)
    assert [ph.optimizer for ph in plans[0].phases] == ["personal", "global"] * 2  # the optimizers kept across epochs
    assert len({tuple(p.consts[next(iter(p.consts))].reshape(-1).tolist()) for p in plans}) == 3
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]  # the trained tensors themselves
    together, alone = _each_own(cfg, ctx, cids, plans)
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64
        assert _max_diff(got, plan.start) > 100 * TOL  # it trained
    assert any(v.all() for k, v in plans[1].consts.items() if k.startswith("own/"))  # a wholly personal tensor


def _moved_personal_model(algo, cid):
    """A Ditto client's v_k: the initial model moved by a different random step per client (BatchNorm statistics
    included), so that v_k, w^t and the anchor all differ."""
    g = torch.Generator().manual_seed(cid)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in algo.ctx.initial_params.items()}  # fmt: skip


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn", ALEXNET_TINY])
def test_dittos_two_models_together_are_each_clients_own(model):
    """Ditto's plan (Algorithm 1): FedAvg's epochs on w from w^t, then the personal epochs on the second model
    v_k (`Phase.model`) on F_k(v_k) + λ/2·‖v_k − w^t‖², at its own lr: batched == each client's own `run_plan`,
    for the reply w and for v_k — its BatchNorm statistics moved by the personal forwards only, its dropout masks
    drawn after the global phase's. Personal lr 0.01: at 0.05 lenet5_bn's personal model is where these tiny runs
    have kinks (there a 1e-7 change of v_k's start moves the loop's own result by 0.62)."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans(model, algorithm={"name": "ditto", "lam": 0.5, "personal_lr": 0.01},
                                   state=_moved_personal_model)
    assert [ph.model for ph in plans[0].phases] == ["", "personal."]
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]  # w and v_k side by side
    together, alone = _each_own(cfg, ctx, cids, plans)
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64
        for part in (lambda k: not k.startswith("personal."), lambda k: k.startswith("personal.")):  # both trained
            assert _max_diff({k: got[k] for k in got if part(k)}, {k: plan.start[k] for k in got if part(k)}) > 1e-3


def test_a_second_models_phase_while_the_first_model_is_still_shared_is_each_clients_own():
    """Ditto's two phases the other way round: the personal model's phase (`Phase.model`) runs while w, which the
    round sent every client, is still one shared tensor per key (`_one_or_stacked`). The personal phase sees its
    own model only, under the model's names; were the shared w handed to it too, its keys would stand in for
    the personal model's: batched == each client's own `run_plan`."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans("mlp", algorithm={"name": "ditto", "lam": 0.5, "personal_lr": 0.01},
                                   state=_moved_personal_model)
    plans = [replace(p, phases=p.phases[::-1], finish=lambda t: (t, {})) for p in plans]
    assert [ph.model for ph in plans[0].phases] == ["personal.", ""]
    assert all(p.start[k] is plans[0].start[k] for p in plans for k in p.start if not k.startswith("personal."))
    together, alone = _each_own(cfg, ctx, cids, plans)
    for got, want in zip(together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn"])
def test_a_phase_of_k_steps_together_is_each_clients_own(model):
    """pFedHN's plan (`Phase.steps`): K = 9 steps, across an epoch boundary for the smaller clients (a new
    shuffle drawn there) and within the first epoch for the larger, each from its own θ_i = h(v_i; φ); batched ==
    each client's own `run_plan`."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans(model, batch_size=32, algorithm={"name": "pfedhn", "local_steps": 9})
    per_epoch = [-(-ctx.client_data(c).num_train // 32) for c in cids]
    assert min(per_epoch) < 9 < max(per_epoch)  # some clients reshuffle, some do not
    assert _max_diff(plans[0].start, plans[1].start) > 0  # each client its own start
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    _assert_each_own(cfg, ctx, cids, plans)


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn"])
def test_fedpacs_head_then_aligned_body_together_is_each_clients_own(model):
    """FedPAC's plan: the head phase (CE, body frozen), then the body phase on CE + λ·alignment of the features to
    the global prototypes (Eq. 8), the prototypes and the mask of classes that have one each client's own constants
    here (random: a first round has none); batched == each client's own `run_plan`."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans(model, algorithm={"name": "fedpac", "lam": 0.5, "head_epochs": 1, "body_epochs": 1,
                                                     "head_lr": 0.05})  # fmt: skip
    g = torch.Generator().manual_seed(3)
    protos, mask = plans[0].consts["protos"], plans[0].consts["proto_mask"]
    plans = [replace(p, finish=lambda t: (t, {}),
                     consts={"protos": 0.5 * torch.randn(protos.shape, generator=g),
                             "proto_mask": (torch.rand(mask.shape, generator=g) < 0.6).to(mask.dtype)})
             for p in plans]  # fmt: skip
    assert all(0 < p.consts["proto_mask"].sum() < len(mask) for p in plans)
    _assert_each_own(cfg, ctx, cids, plans)


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn", ALEXNET_TINY])
def test_fedbasis_steps_together_are_each_clients_own(model):
    """FedBasis's plan (Eq. 9): the ψ step (softmax(ψ), V frozen, at alpha_lr without weight decay), then the V
    step on every basis and v' with α† = SHARPEN(softmax(ψ); τ) fixed, each forward through the combined model
    and its BatchNorm statistics combined from the bases' and handed back to them (`basis.CombinedObjective`'s
    hooks). Batched == each client's own `run_plan`: ψ, the bases' weights and statistics."""
    torch.set_num_threads(1)
    algorithm = {"name": "fedbasis", "K": 2, "warmup_fraction": 0.0, "alpha_epochs": 1, "basis_epochs": 1,
                 "alpha_lr": 0.5, "tau": 0.3}  # fmt: skip
    cfg, ctx, cids, plans = _plans(model, 8, algorithm, lr=0.01)
    assert [ph.objective.alpha for ph in plans[0].phases] == ["softmax", "sharpened"]
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    together, alone = _each_own(cfg, ctx, cids, plans)
    stats = [k for k in plans[0].start if k.startswith("vs.") and "running_mean" in k]
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff({k: want[k] for k in got}, got) <= TOL64  # (`run_plan` adds the template's own tensors)
        assert float(got["psi"].abs().max()) > 1e-3 and _max_diff(got, plan.start) > 100 * TOL  # both steps trained
        assert not stats or _max_diff({k: got[k] for k in stats}, {k: plan.start[k] for k in stats}) > 100 * TOL


FEDBASIS = {"name": "fedbasis", "K": 2, "warmup_fraction": 0.0, "alpha_epochs": 1, "basis_epochs": 1}


@pytest.mark.parametrize("model, algorithm", [("lenet5", None), ("lenet5_bn", None), (ALEXNET_TINY, None),
                                              ("lenet5_bn", FEDBASIS), ("lenet5", {"name": "perfedavg",
                                                                                   "variant": "hf"})])  # fmt: skip
def test_convolutions_whose_weight_gradient_is_a_product_are_each_clients_own_sgd(monkeypatch, model, algorithm):
    """`executor.autotune`'s other form of a convolution (`conv_weight_grad`): where the timing chose the weight
    gradient as a product, every client's result is still its own `run_plan`'s — FedPer's two phases with a
    BatchNorm and a dropout model, FedBasis's combined model, Per-FedAvg's Hessian-vector products (a second
    derivative through the product). Each eligible convolution's shape is timed once, for the round's clients, and
    the product is what ran."""
    torch.set_num_threads(1)
    monkeypatch.setattr(conv_weight_grad, "_CHOICES", {})
    asked, ran = [], []
    monkeypatch.setattr(conv_weight_grad, "product_faster", lambda key: asked.append(key) or True)
    product = conv_weight_grad.weight_grad
    monkeypatch.setattr(conv_weight_grad, "weight_grad", lambda *a: ran.append(a[2]) or product(*a))
    cfg, ctx, cids, plans = _plans(model, 8, algorithm, lr=0.01)
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    together, alone = _each_own(cfg, ctx, cids, plans, autotune=True)
    convs = [m for m in (plans[0].model or ctx.model).modules() if conv_weight_grad.eligible(m)]
    assert len(asked) == len(set(asked)) == len({(m.in_channels, m.out_channels) for m in convs}) >= 2  # a
    # timing per shape (AlexNet's first convolution, of stride 4, is not eligible)
    assert {k[2:4] for k in asked} == {(len(cids), 8)}  # at the round's clients and batch
    assert len({tuple(s) for s in ran}) == len(convs)
    assert any(k[-1] for k in asked) == (model != ALEXNET_TINY)  # the first layer eligible: its input the data
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff({k: want[k] for k in got}, got) <= TOL64
        assert _max_diff(got, plan.start) > 100 * TOL


@pytest.mark.parametrize("mlg", ["sample", "batch"])
def test_gpfls_objective_together_is_each_clients_own(mlg):
    """GPFL's objective (`gpfl.GPFLObjective`, Eqs. 1-5): L^P + L^alg + λ·L^mlg per sample, weighted, and the
    (μ/2)·(‖C‖² + ‖V‖²) penalty once per client; under `mlg: batch` the batch norm ‖f^G − Ĉ_y‖ over each client's
    real rows only (a shorter batch's padding left out). λ = 0.5 so that L^mlg moves the result; batched == each
    client's own `run_plan`."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans("mlp", algorithm={"name": "gpfl", "mlg": mlg, "lam": 0.5, "mu": 0.1})
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    _assert_each_own(cfg, ctx, cids, plans)


@pytest.mark.parametrize("denominator", ["all", "others"])
def test_fedlcs_objective_together_is_each_clients_own(denominator):
    """FedLC's calibrated loss (`fedlc.CalibratedObjective`) on each client's own shift τ·n_y^(−1/4), under both
    denominators — the default softmax over every class and the paper's printed form without the true class —
    weighted per sample in the batched step (a shorter batch's padding left out): batched == each client's own
    `run_plan`."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans("mlp", algorithm={"name": "fedlc", "denominator": denominator, "tau": 2.0})
    assert len({tuple(p.consts["shift"].tolist()) for p in plans}) == 3  # each client its own calibration
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    _assert_each_own(cfg, ctx, cids, plans)


def _finished_together_and_alone(algorithm, random, seed):
    """Plans of `algorithm` on the mlp at lr 0.01, one epoch, their constants whose name starts with `random`
    replaced by random ones of size 0.05 (each client its own); per client, (the batched tensors, the batched
    (reply, state), the plan's own (reply, state) alone)."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans("mlp", algorithm=algorithm, lr=0.01, local_epochs=1)
    g = torch.Generator().manual_seed(seed)
    plans = [type(p)(p.start, p.phases, p.finish, p.objective,
                     {k: 0.05 * torch.randn(v.shape, generator=g) if k.startswith(random) else v
                      for k, v in p.consts.items()}) for p in plans]  # fmt: skip
    noise = [rng.global_stream(rng.derive_seed(cfg.seed, rng.CLIENT, 1, c), ctx.device) for c in cids]
    together = train_together(ctx.model, plans, [ctx.client_data(c) for c in cids], cfg.train,
                              [client_generator(cfg.seed, 1, c) for c in cids], noise)  # fmt: skip
    for c, plan, got in zip(cids, plans, together, strict=True):
        assert _max_diff(got, plan.start) > 100 * TOL  # it trained
        alone = run_plan(ctx.model, plan, ctx.client_data(c), cfg.train, client_generator(cfg.seed, 1, c))
        yield got, plan.finish(got), alone


def test_scaffolds_corrected_steps_together_are_each_clients_own():
    """SCAFFOLD's plan (`local_sgd.RegularizedObjective`, a linear term): each step's gradient g_i(y) + (c − c_i),
    the correction each client's own (random here: c and the c_i are zero in a first round), then option II's
    c_i⁺ from y. On the mlp at lr 0.01: with random corrections lenet5_bn's loop alone has kinks (a 1e-7 change of
    a start moved one client by 0.07), where no rounding tolerance holds; BatchNorm in batched plans is tested
    above."""
    for got, (reply, state), (want_reply, want_state) in _finished_together_and_alone({"name": "scaffold"}, "", 1):
        assert _max_diff({k: want_reply[k] for k in got}, got) <= TOL
        assert _max_diff(want_reply, reply) <= 10 * TOL and _max_diff(want_state, state) <= 10 * TOL  # ÷ Kη_l


def test_feddyns_dynamic_regularizer_together_is_each_clients_own():
    """FedDyn's plan (`local_sgd.RegularizedObjective`, a linear and a proximal term): L_k(θ) − ⟨g_k, θ⟩ +
    α/2·‖θ − θ^{t−1}‖², each client's own g_k (random here: zero in a first round), α = 0.1; batched == alone for
    θ_k^t and the new g_k (the mlp: see the SCAFFOLD test)."""
    for _, (reply, state), (want_reply, want_state) in _finished_together_and_alone(
        {"name": "feddyn", "alpha": 0.1}, "g/", 2
    ):
        assert _max_diff(want_reply, reply) <= TOL and _max_diff(want_state, state) <= TOL


@pytest.mark.parametrize("last", [1, 2, "all"])
def test_a_batchnorm_batch_of_one_sample_is_normalized_with_the_running_statistics_as_alone(last):
    """`SafeBatchNorm1d`: a last batch of one sample is normalized with the running statistics, which it leaves (and
    counts no batch); the other clients' batches of that step are normal ones. A last batch of two is a normal one,
    and so is every batch of one sample (`last="all"`, batch size 1: a step one row wide) at the convolutions' BN,
    which normalizes over each sample's pixels."""
    torch.set_num_threads(1)
    _, ctx, cids, _ = _plans("lenet5_bn")
    n = ctx.client_data(cids[0]).num_train
    size = 1 if last == "all" else n - last  # client 0: a batch of n − last, then one of `last`
    # batch size 1: one FedAvg epoch of clients a tenth the size (a step per sample)
    one = {"algorithm": {"name": "fedavg"}, "local_epochs": 1, "clients": 60} if size == 1 else {}
    cfg, ctx, cids, plans = _plans("lenet5_bn", batch_size=size, **one)
    together, alone = _each_own(cfg, ctx, cids, plans)
    for got, want in zip(together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64
    tracked = [k for k in together[0] if k.endswith("num_batches_tracked")]
    conv, fc = [k for k in tracked if "conv" in k][0], [k for k in tracked if "fc" in k][0]
    moved = {k: int(together[0][k] - plans[0].start[k]) for k in (conv, fc)}
    if last == 1:  # per epoch: two batches through the conv BN, one (the n − 1) through the FC BN
        assert moved[conv] == 2 * moved[fc] > 0
    elif last == 2:  # both batches through both
        assert moved[conv] == moved[fc] > 0
    else:  # every batch through the conv BN (pixels), none through the FC BN
        assert moved[conv] > 0 and moved[fc] == 0


@pytest.mark.parametrize("channels", [4, 1])
def test_batchnorm_of_a_bfloat16_batch_keeps_float32_statistics_as_torchs_own(channels):
    """`executor.precision: bf16`: autocast hands BatchNorm bfloat16 activations, and torch's kernel (the loop's)
    takes their statistics in float32 and keeps the running ones float32. The per-client forward must too: summed in
    bfloat16, a mean near 100 is off by 0.04 and the running statistics with it. Two clients vmapped, one padded;
    several channels and a single one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(channels)).train()
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
        model[0].bias.uniform_(-1, 1)
    layers = PerClientLayers(model)
    x = (torch.randn(2, 16, channels, 5, 5) * 3 + 100).to(torch.bfloat16)
    real = torch.arange(16) < torch.tensor([[16], [11]])  # client 1: 11 real rows, 5 of padding
    stats = {k: torch.stack([v, v]) for k, v in model.state_dict().items() if k in layers.buffer_keys}

    def step(stats, real, x):
        layers.enter(stats, real, [])
        return model(x), layers.leave()

    with layers.patched():
        y, new = torch.func.vmap(step)(stats, real, x)
    assert y.dtype == torch.bfloat16
    for i, n in enumerate((16, 11)):
        own = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = own(x[i, :n])
        assert want.dtype == torch.bfloat16 and own[0].running_mean.dtype == torch.float32
        torch.testing.assert_close(y[i, :n], want)  # bfloat16's tolerance: its rounding of the same value
        for s in ("running_mean", "running_var"):
            assert new[f"0.{s}"].dtype == torch.float32
            assert torch.allclose(new[f"0.{s}"][i], getattr(own[0], s), rtol=1e-5, atol=0), s


def test_a_forward_given_no_set_of_statistics_moves_the_clients_own_and_one_given_a_set_moves_that_set():
    """With sets (an objective's further models' statistics), a BatchNorm layer finds its set by the running mean
    the forward gives it: a set's, that set moves; its own buffer (a forward given no statistics, as a plain
    `model(x)`), the client's own statistics under the layer's name move — as in the loop, each where torch's
    kernel moves them — and nothing else does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3)).train()
    layers = PerClientLayers(model)
    x = torch.randn(2, 8, 3, 4, 4) * 2 + 1
    own = {k: torch.stack([v, v]) for k, v in model.state_dict().items() if k in layers.buffer_keys}
    ref = {f"ref.{k}": v + 0.5 for k, v in own.items() if k != "0.num_batches_tracked"}
    ref["ref.0.num_batches_tracked"] = own["0.num_batches_tracked"].clone()
    real = torch.ones(8, dtype=torch.bool)

    def step(stats, x):
        layers.enter(stats, real, [], sets=True)
        model(x)  # the layer's own running mean: none of the sets'
        torch.func.functional_call(model, {k[len("ref."):]: v for k, v in stats.items() if k.startswith("ref.")},
                                   (x * 3,))  # fmt: skip
        return layers.leave()

    with layers.patched():
        new = torch.func.vmap(step)({**own, **ref}, x)
    assert sorted(new) == sorted([*own, *ref])
    for i in range(2):
        mine, theirs = copy.deepcopy(model), copy.deepcopy(model)
        theirs.load_state_dict({k[len("ref."):]: v[i] for k, v in ref.items()}, strict=False)
        mine(x[i])
        theirs(x[i] * 3)
        for s in ("running_mean", "running_var"):
            torch.testing.assert_close(new[f"0.{s}"][i], getattr(mine[0], s))
            torch.testing.assert_close(new[f"ref.0.{s}"][i], getattr(theirs[0], s))


def test_batchnorm_in_eval_mode_normalizes_a_bfloat16_batch_with_its_float32_running_statistics_as_torchs_own():
    """A frozen model's BatchNorm inside the step (eval mode, MOON's) under `precision: bf16`: torch's kernel
    normalizes the bfloat16 activations with the float32 running statistics in float32, and so must the per-client
    forward (in bfloat16, x − 100.3 is off by up to 0.25 before scaling); nothing moves."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3)).eval()
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
        model[0].bias.uniform_(-1, 1)
        model[0].running_mean.uniform_(99.0, 101.0)
        model[0].running_var.uniform_(4.0, 9.0)
    layers = PerClientLayers(model)
    x = (torch.randn(2, 16, 3, 5, 5) * 3 + 100).to(torch.bfloat16)
    stats = {k: torch.stack([v, v]) for k, v in model.state_dict().items() if k in layers.buffer_keys}

    def step(stats, x):
        layers.enter(stats, torch.ones(16, dtype=torch.bool), [])
        return model(x), layers.leave()

    with layers.patched():
        y, new = torch.func.vmap(step)(stats, x)
    assert y.dtype == torch.bfloat16 and new == {}
    for i in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = model(x[i])
        torch.testing.assert_close(y[i], want)


def test_batched_clients_share_one_pool_and_each_has_its_own_generator():
    """A batched step gathers every client's batch from one pool in one indexing: clients whose samples, labels or
    augmentation are other objects are refused, and so are generators that are not one per client (a shorter list
    would leave the last clients without batches, silently)."""
    cfg, ctx, cids, plans = _plans("mlp")
    datas = [ctx.client_data(c) for c in cids]

    def gens(n=None):
        return [client_generator(cfg.seed, 1, c) for c in cids[:n]]

    own = r"^batched clients index one shared training pool \(`Context.client_data`\)$"
    d = datas[1]
    for other in (replace(d, x=d.x.clone()), replace(d, y=d.y.clone()), replace(d, augment=Augment(0, True, (0.0,)))):
        with pytest.raises(ValueError, match=own):
            train_together(ctx.model, plans, [datas[0], other, datas[2]], cfg.train, gens())
    with pytest.raises(ValueError, match=r"^zip\(\) argument 2 is shorter than argument 1$"):
        train_together(ctx.model, plans, datas, cfg.train, gens(2))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 30), size=st.integers(1, 12), epochs=st.integers(0, 3),
       steps=st.one_of(st.none(), st.integers(0, 12)), rule=st.booleans())  # fmt: skip
def test_a_phases_batches_at_once_are_its_batches_one_by_one(n, size, epochs, steps, rule):
    """`Phase.batches_at_once` gives `Phase.batches`' indices concatenated and their sizes, leaves the generator
    where taking them one by one leaves it (an epoch's order drawn only where one of its batches is taken) and
    counts the same work (a rule's batch as its forwards: pFedMe's K of them)."""
    train = validate_config({**TINY, "train": {**TINY["train"], "batch_size": size}}).train
    ph = Phase(blocks=(), epochs=epochs, lr=0.1, steps=steps, rule=MoreauStep(3, 1.0, 0.1, 0.1) if rule else None)
    idx = torch.arange(100, 100 + n)
    mine, theirs = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
    before = compute.total()
    order, sizes = ph.batches_at_once(idx, train, mine)
    counted = compute.total() - before
    batches = list(ph.batches(idx, train, theirs))
    assert counted == compute.total() - before - counted and isinstance(counted, int)
    assert sizes == [len(b) for b in batches] and order.dtype == idx.dtype
    assert torch.equal(order, torch.cat(batches) if batches else idx[:0])
    assert torch.equal(mine.get_state(), theirs.get_state())


def test_a_phase_of_negative_steps_is_refused():
    """`steps` counts batches to take: a negative count is a caller's mistake, refused when the phase is made (taken
    one by one, `islice` would refuse it; at once, it would give a schedule of nothing)."""
    with pytest.raises(ValueError, match=r"^a phase's steps cannot be negative: -1$"):
        Phase(blocks=(), epochs=1, lr=0.1, steps=-1)
    assert Phase(blocks=(), epochs=1, lr=0.1, steps=0).steps == 0


def _schedule_one_by_one(datas, train, ph, gens, draw):
    """`batched._schedule`'s layout filled batch by batch, sample for sample from the same generators: the rule
    its whole-tensor layout must keep."""
    per_client = []
    for d, g in zip(datas, gens, strict=True):
        per_client.append([])
        for b in ph.batches(d.train, train, g):  # a batch, then its augmentation's choices, then its inputs
            choices = None if d.augment is None else d.augment.draw(len(b), g)
            per_client[-1].append((b, choices, None if draw is None else draw(len(b), g)))
    steps, width = max(map(len, per_client)), max(len(b) for c in per_client for b, _, _ in c)
    rows = torch.zeros(steps, len(datas), width, dtype=torch.long)
    weights = torch.zeros(steps, len(datas), width)
    draws = torch.zeros(steps, len(datas), width, 3, dtype=torch.long)
    inputs = torch.zeros(steps, len(datas), width, 2)
    lengths = torch.zeros(steps, len(datas), dtype=torch.long)
    for c, batches in enumerate(per_client):
        for s, (b, choices, noise) in enumerate(batches):
            lengths[s, c], rows[s, c], weights[s, c, : len(b)] = len(b), b[0], 1.0 / len(b)
            rows[s, c, : len(b)] = b
            if choices is not None:
                draws[s, c, : len(b)] = choices
            if noise is not None:
                inputs[s, c, : len(b)] = noise
    active = [None if all(s < len(b) for b in per_client) else [c for c, b in enumerate(per_client) if s < len(b)]
              for s in range(steps)]  # fmt: skip
    return rows, weights, active, None if datas[0].augment is None else draws, lengths, None if draw is None else inputs


@pytest.mark.parametrize("augmented, drawn", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("epochs, steps", [(2, None), (3, 4), (1, 1), (2, 3), (2, 7), (3, 50)])
def test_the_schedule_lays_out_every_clients_batches_and_draws_as_drawn_batch_by_batch(epochs, steps, augmented,
                                                                                       drawn):
    """Clients of different sizes (batches of different counts, shorter last batches, one client of a single short
    batch), `augmented` or not, with per-sample random inputs (`drawn`) or not (with neither, each client's
    batches are drawn at once: `Phase.batches_at_once`): the whole-tensor layout equals the batch-by-batch one
    exactly, leaves every generator where drawing batch by batch leaves it, and counts the same work. Steps that
    stop inside an epoch, at its end (3: two clients' whole first epoch, the next one's order never drawn) and
    past the last."""
    x, y = torch.zeros(40, 1, 4, 4), torch.zeros(40, dtype=torch.long)
    augment = Augment(1, True, (0.0,)) if augmented else None
    starts = [0, 10, 13, 20]
    sizes = [10, 3, 7, 9]
    datas = [collections.namedtuple("Data", "x y augment train num_train")(x, y, augment, torch.arange(a, a + n), n)
             for a, n in zip(starts, sizes, strict=True)]  # fmt: skip
    train = validate_config({**TINY, "train": {**TINY["train"], "batch_size": 4}}).train
    ph = Phase(blocks=(), epochs=epochs, lr=0.1, steps=steps)

    def draw(n, g):
        return torch.randn(n, 2, generator=g)

    mine = [torch.Generator().manual_seed(c) for c in range(4)]
    theirs = [torch.Generator().manual_seed(c) for c in range(4)]
    before = compute.total()
    got = batched._schedule(datas, train, ph, mine, draw if drawn else None)
    counted = compute.total() - before
    want = _schedule_one_by_one(datas, train, ph, theirs, draw if drawn else None)
    assert counted == compute.total() - before - counted
    names = ("rows", "weights", "active", "draws", "lengths", "inputs")
    for name, a, b in zip(names, got, want, strict=True):
        if a is None or name == "active":
            assert a == b
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, theirs, strict=True))


def test_which_models_are_batched():
    assert batchable_model(build_model("mlp", (1, 8, 8), 10))
    assert batchable_model(build_model("cnn", (1, 8, 8), 10))
    assert batchable_model(build_model("cnn_bn", (1, 8, 8), 10))  # running statistics carried per client
    assert batchable_model(build_model("alexnet_small", (1, 8, 8), 10))  # masks drawn per client
    model = build_model("cnn_bn", (1, 8, 8), 10)
    next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)).momentum = None  # a cumulative average
    assert not batchable_model(model)
    model = build_model("mlp", (1, 8, 8), 10)
    model.blocks["fc1"].append(torch.nn.Dropout1d(0.5))  # channel-wise masks
    assert not batchable_model(model)
    model.blocks["fc1"].pop(-1)
    model.register_buffer("other", torch.zeros(1))
    assert not batchable_model(model)


def test_batch_clients_is_on_by_default_only_on_a_gpu_and_only_in_the_loop():
    algo = prepare(validate_config({**TINY, "algorithm": {"name": "fedavg"}}))
    from pflbed.engine.build import make_executor

    ex, _ = make_executor(algo)
    assert type(ex) is LoopExecutor  # CPU: off unless asked for
    with pytest.raises(ConfigError, match="executor: batch_clients applies to executor.name=loop"):
        validate_config({"executor": {"name": "procs", "batch_clients": True}})
    for executor in ({"batch_clients": False}, {"name": "procs"}):
        with pytest.raises(ConfigError, match="batch_max_clients applies to batched clients"):
            validate_config({"executor": {**executor, "batch_max_clients": 4}})


def test_a_phase_that_freezes_the_convolutions_computes_no_product(monkeypatch):
    """A frozen weight takes no gradient, so no product (`WeightGradAsProduct`: each gradient only where asked
    for): FedPer's head-only epoch computes none, its epoch of every block one per convolution and step; with the
    product chosen, each client's result is still its own `run_plan`'s."""
    torch.set_num_threads(1)
    monkeypatch.setattr(conv_weight_grad, "_CHOICES", {})
    monkeypatch.setattr(conv_weight_grad, "product_faster", lambda key: True)
    ran = []
    product = conv_weight_grad.weight_grad
    monkeypatch.setattr(conv_weight_grad, "weight_grad", lambda *a: ran.append(1) or product(*a))
    cfg, ctx, cids, plans = _plans("lenet5", 8, None, local_epochs=1)
    assert [len(ph.blocks) for ph in plans[0].phases] == [1, 5]  # the head's epoch, then every block's
    head = [replace(p, phases=p.phases[:1]) for p in plans]
    together, alone = _each_own(cfg, ctx, cids, head, autotune=True)
    assert not ran and all(_max_diff(a, b) <= TOL64 for a, b in zip(together, alone, strict=True))
    _each_own(cfg, ctx, cids, plans, autotune=True)
    steps = -(-max(ctx.client_data(c).num_train for c in cids) // 8)
    assert len(ran) == 2 * steps  # two convolutions a step, in the second phase's steps


def test_a_compiled_step_takes_the_product_form_in_its_graph(monkeypatch):
    """torch.compile keeps `conv_weight_grad.product_conv` in its graph (`allow_in_graph`) and AOT autograd runs
    its backward under `vmap` (aot_eager: dynamo and AOT autograd, as inductor takes them): the same graphs, with
    no break and no recompilation, computing the weight gradients as products — other rounding than without them —
    and each client's result still its own `run_plan`'s (float32: the compiled step's rounding), with a BatchNorm
    model."""
    from torch._dynamo.utils import counters

    from .test_batched_compile import on_aot_eager

    torch.set_num_threads(1)
    monkeypatch.setattr(conv_weight_grad, "_CHOICES", {})
    monkeypatch.setattr(conv_weight_grad, "product_faster", lambda key: True)
    ran = []
    product = conv_weight_grad.weight_grad
    monkeypatch.setattr(conv_weight_grad, "weight_grad", lambda *a: ran.append(a[2]) or product(*a))
    cfg, ctx, cids, plans = _plans("lenet5_bn", 8, None, local_epochs=1)
    data = [ctx.client_data(c) for c in cids]
    outs, stats = [], []
    for autotune in (False, True):
        noise = [rng.global_stream(rng.derive_seed(cfg.seed, rng.CLIENT, 1, c), ctx.device) for c in cids]
        with on_aot_eager() as modes:
            counters.clear()
            outs.append(train_together(ctx.model, plans, data, cfg.train,
                                       [client_generator(cfg.seed, 1, c) for c in cids], noise, "default",
                                       autotune=autotune))  # fmt: skip
            stats.append(dict(counters["stats"]))
            assert modes and not counters["graph_break"] and counters["frames"]["ok"] == 2  # (two phases)
        assert bool(ran) == autotune and {tuple(s) for s in ran} <= {(6, 1, 5, 5), (16, 6, 5, 5)}
    assert stats[1]["unique_graphs"] == stats[0]["unique_graphs"] == 2
    _, alone = _each_own(cfg, ctx, cids, plans, float64=False)
    for plain, got, want in zip(*outs, alone, strict=True):
        assert _max_diff(want, got) <= TOL and _max_diff(plain, got) > 0


def test_train_together_times_no_convolution_unless_asked(monkeypatch):
    """`train_together`'s default is `autotune` off: a caller that does not ask for the timing gets the grouped
    convolution's weight gradient, the client-by-client step's kernels, on any device."""
    torch.set_num_threads(1)
    monkeypatch.setattr(conv_weight_grad, "chosen", lambda *a, **k: pytest.fail("timed unasked"))
    cfg, ctx, cids, plans = _plans("lenet5", 8, None, local_epochs=1)
    train_together(ctx.model, plans, [ctx.client_data(c) for c in cids], cfg.train,
                   [client_generator(cfg.seed, 1, c) for c in cids])  # fmt: skip


def test_autotune_times_no_convolution_on_a_cpu(monkeypatch):
    """`executor.autotune` has no effect on a CPU: a batched run of a convolutional model there never times the
    product form of its convolutions' weight gradient (`conv_weight_grad`), which loses on a CPU."""
    torch.set_num_threads(1)
    monkeypatch.setattr(conv_weight_grad, "chosen", lambda *a, **k: pytest.fail("timed on a CPU"))
    calls = []
    together = batched.train_together
    monkeypatch.setattr(batched, "train_together", lambda *a, **k: calls.append(a) or together(*a, **k))
    cfg = validate_config({**TINY, "dataset": DATA, "model": {"name": "lenet5"},
                           "train": {**TINY["train"], "rounds": 1}, "algorithm": {"name": "fedavg"},
                           "executor": {"threads": 1, "batch_clients": True, "autotune": True}})  # fmt: skip
    run(cfg, write=False, progress=False)
    assert calls and all(a[-1] is False for a in calls)


def test_a_batched_client_that_diverges_stops_the_run_naming_its_round_and_itself():
    """The divergence guard sees a batched client's reply as the loop's: the same round, client and tensor."""
    torch.set_num_threads(1)
    errors = []
    for batch_clients in (False, True):
        with pytest.raises(DivergedError) as caught:
            run(_cfg("fedavg", batch_clients, 2, lr=1e4), write=False, progress=False)
        errors.append((caught.value.round, caught.value.where))
    assert errors[0] == errors[1] and errors[1][0] == 1 and "client" in errors[1][1]


def test_a_batched_round_screens_its_clients_together_and_checks_those_trained_alone(monkeypatch):
    """On a GPU every read of a value waits for the device: a round's batched clients have their replies and states
    screened once, together (`guard.screen_finite`), not one check each; the clients of FedDF's other architecture,
    trained one by one, are still checked one by one (and a diverged batched client is still named:
    `test_a_batched_client_that_diverges_stops_the_run_naming_its_round_and_itself`)."""
    from pflbed.engine import executor as executor_module

    torch.set_num_threads(1)
    checked, screens, together = [], [], []
    check, screen = executor_module.check_client, batched.screen_finite
    monkeypatch.setattr(executor_module, "check_client", lambda rnd, cid, *a: checked.append(cid) or
                        check(rnd, cid, *a))  # fmt: skip
    monkeypatch.setattr(batched, "screen_finite", lambda tensors: screens.append(1) or screen(tensors))
    real = BatchedExecutor.train
    monkeypatch.setattr(BatchedExecutor, "train", lambda self, plans, cids, streams: together.extend(cids) or
                        real(self, plans, cids, streams))  # fmt: skip
    run(_cfg("feddf", True, 1), write=False, progress=False)
    alone = sorted(set(range(FED["clients"])) - set(together))
    assert together and alone and checked == alone
    assert screens == [1]


def test_a_rounds_plans_leave_the_global_rng_where_they_found_it():
    """`BatchedExecutor.plans` seeds torch's global RNG for each client, as its update does, and puts it back after
    them all: what runs after the plans in this process draws as if they had not run."""
    torch.set_num_threads(1)
    algo = prepare(_cfg("fedala", True, 1))
    ex, server = BatchedExecutor(algo), algo.init_server()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    built = ex.plans(1, algo.configure(1, server, list(range(FED["clients"]))))
    assert len(built) == FED["clients"] and torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("name, after", [("fedavg", True), ("feddf", False)])
def test_a_round_of_batched_clients_only_is_checked_after_its_replies_were_folded_in(name, after, monkeypatch):
    """A round whose clients were all batched hands every reply on to the server before it reads its check (on a
    GPU the host queues the folding-in while the device runs the last steps: `guard.check_clients_later`), and
    before the round's server state is asked for; one with clients trained alone (FedDF's other architecture)
    screens its batched clients before it hands any reply on, as the loop checks its clients in order."""
    from pflbed.engine.driver import Driver

    torch.set_num_threads(1)
    screen, later = batched.screen_finite, batched.check_clients_later
    events = []
    monkeypatch.setattr(batched, "screen_finite", lambda tensors: events.append("screen") or screen(tensors))
    monkeypatch.setattr(batched, "check_clients_later", lambda rnd, clients: (
        lambda check: lambda: events.append("check") or check())(later(rnd, clients)))  # fmt: skip
    algo = prepare(_cfg(name, True, 1))
    agg = algo.aggregator
    monkeypatch.setattr(algo, "aggregator", lambda rnd, server, weights: _Recorded(agg(rnd, server, weights), events))
    Driver(algo, BatchedExecutor(algo)).train_round(1, algo.init_server())
    n = FED["clients"]
    assert events == (["add"] * n + ["check", "result"] if after else ["screen"] + ["add"] * n + ["result"])


class _Recorded:
    """An aggregator that records each reply folded in and its result asked for."""

    def __init__(self, agg, events):
        self.agg, self.events = agg, events

    def add(self, cid, reply):
        self.events.append("add")
        self.agg.add(cid, reply)

    def result(self):
        self.events.append("result")
        return self.agg.result()


def test_a_trace_records_the_dropout_calls_made_in_training_mode_and_moves_nothing():
    """`PerClientLayers.trace` records what the step will ask masks for: the dropout calls of a forward in training
    mode, not those a forward makes in eval mode (a frozen model's, as MOON's), which draw none; and it draws from
    no generator and moves no running statistic."""
    model = torch.nn.Sequential(ReproducibleDropout(0.3), torch.nn.BatchNorm1d(4), ReproducibleDropout(0.5))
    layers = PerClientLayers(model)
    before, rng_before = copy.deepcopy(model.state_dict()), torch.get_rng_state()

    def forward():
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
        model.eval()
        model(torch.ones(1, 4))  # frozen: no mask
        model.train()

    model.eval()  # the trace runs the forward as the step does, whatever the mode it is given
    layers.trace(model, forward)
    assert layers.calls == [("0", (4,)), ("2", (4,))]
    assert not model.training and torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_dropout_masks_drawn_per_client_are_the_layers_own_at_p_zero_one_and_between():
    """`PerClientLayers.draw` = `ReproducibleDropout`'s forward in the loop, call after call from each client's
    stream: p = 0 draws nothing (the next call's mask is unmoved), p = 1 drops everything without drawing, other p
    `bernoulli_(1 − p)` / (1 − p); a client's padding rows keep a mask of ones."""
    model = torch.nn.Sequential(ReproducibleDropout(0.0), ReproducibleDropout(1.0), ReproducibleDropout(0.3))
    layers = PerClientLayers(model)
    layers.trace(model, lambda: model(torch.zeros(1, 4)))
    sizes, width, seeds = [3, 2], 3, [11, 12]
    masks = layers.draw(sizes, width, [torch.Generator().manual_seed(s) for s in seeds], torch.device("cpu"))
    assert [m.shape for m in masks] == [(2, width, 4)] * 3
    model.train()
    for i, (n, seed) in enumerate(zip(sizes, seeds, strict=True)):
        torch.manual_seed(seed)  # the loop: each layer draws from torch's global RNG, in forward order
        own = [layer(torch.ones(n, 4)) for layer in model]
        for mask, want in zip(masks, own, strict=True):
            assert torch.equal(mask[i, :n], want) and torch.equal(mask[i, n:], torch.ones(width - n, 4))
    real = masks[2][0, : sizes[0]]
    assert not masks[1][:, :2].any() and (real == 0).any() and (real > 1).any()  # dropped; some kept and scaled


def test_clients_whose_plans_differ_are_trained_in_separate_groups(monkeypatch, together):
    """One vmapped step runs one plan: a round whose clients' plans differ (here FedAvg with twice the learning rate
    on odd clients) is trained as one group per plan, each client by its own plan, within TOL of the loop."""
    torch.set_num_threads(1)
    fedavg = ALGORITHMS["fedavg"]

    def sgd_plan(self, payload, state, data):
        t = self.ctx.cfg.train
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr * (1 + data.cid % 2))
        return LocalSGDPlan(payload, (phase,), lambda params: (params, state))

    monkeypatch.setattr(fedavg, "sgd_plan", sgd_plan)
    loop = run(_cfg("fedavg", False, 1), write=False, progress=False)
    both = run(_cfg("fedavg", True, 1), write=False, progress=False)
    assert sorted(together) == [3, 3]  # six clients: the even ones together, the odd ones together
    assert _max_diff(loop.server, both.server) <= TOL


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn", ALEXNET_TINY])
@pytest.mark.parametrize("algorithm", [{"name": "perfedavg", "variant": "fo", "alpha": 0.05},
                                       {"name": "perfedavg", "variant": "hf", "alpha": 0.05},
                                       {"name": "pfedme", "K": 3, "lam": 5.0, "personal_lr": 0.05}])  # fmt: skip
def test_step_rules_together_are_each_clients_own(algorithm, model):
    """A rule's steps (`local_sgd.StepRule`) batched == each client's own `run_plan`: Per-FedAvg's meta-step over
    two batches (three, and an exact Hessian-vector product, for HF), pFedMe's K inner steps on one batch then the
    local model's step — every forward's BatchNorm statistics carried to the next, every forward's own dropout
    masks, clients of unequal sizes that stop at their own last step; on lenet5_bn, augmented batches. (lenet5_bn
    at batch size 8: HF's steps amplify float64 rounding 10× every few steps, 1e-14 after one, 1e-6 after 40.)"""
    torch.set_num_threads(1)
    augment = ("crop", "flip") if model == "lenet5_bn" else ()  # each batch's choices drawn after its indices
    cfg, ctx, cids, plans = _plans(model, 16 if model == "lenet5_bn" else 8, algorithm, augment=augment)
    assert plans[0].phases[0].rule is not None and (ctx.client_data(cids[0]).augment is not None) == bool(augment)
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    together, alone = _each_own(cfg, ctx, cids, plans)
    if model == "mlp":  # no dropout: no stream needed
        with _in_float64(ctx, plans) as (m, data, p64):
            quiet = train_together(m, p64, [data(c) for c in cids], cfg.train,
                                   [client_generator(cfg.seed, 1, c) for c in cids])  # fmt: skip
        assert all(_max_diff(a, b) == 0 for a, b in zip(quiet, together, strict=True))
    names = [k for k, _ in ctx.model.named_parameters()]
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64
        assert _max_diff({k: got[k] for k in names}, {k: plan.start[k] for k in names}) > 100 * TOL  # it trained
        if algorithm["name"] == "pfedme":  # θ_i and w_i both moved, apart
            local = {k: got["local." + k] for k in names}
            assert _max_diff(local, {k: plan.start[k] for k in names}) > 100 * TOL
            assert _max_diff(local, {k: got[k] for k in names}) > 100 * TOL


def _apfl_state(algo, cid):
    """A client of a later round: v_i apart from w (parameters and statistics), α_i its own."""
    g = torch.Generator().manual_seed(cid)
    state = algo.init_client(cid)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g).abs() if v.is_floating_point() and v.dim() else v
            for k, v in state.items()} | {"alpha": torch.tensor(0.2 + 0.1 * cid)}  # fmt: skip


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn", ALEXNET_TINY])
@pytest.mark.parametrize("adaptive", [True, False])
def test_apfls_two_models_steps_together_are_each_clients_own(model, adaptive):
    """APFL's step (`apfl.MixedStep`): w's forward, then v̄'s, on one batch; w, v_i and α_i moved at once. Batched
    == each client's own `run_plan` in float64: every forward's dropout masks in that order, w's BatchNorm
    statistics moved by w's forward and v_i's by v̄'s, α_i learned per client (or held); on lenet5_bn, augmented
    batches."""
    torch.set_num_threads(1)
    augment = ("crop", "flip") if model == "lenet5_bn" else ()
    algorithm = {"name": "apfl", "alpha_lr": 0.05, "adaptive": adaptive}
    cfg, ctx, cids, plans = _plans(model, 16, algorithm, _apfl_state, augment=augment)
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    together, alone = _each_own(cfg, ctx, cids, plans)
    names = [k for k, _ in ctx.model.named_parameters()]
    stats = [k for k in ctx.model.state_dict() if k not in names]
    assert bool(stats) == (model == "lenet5_bn")
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64
        for prefix in ("", "local."):  # w and v_i each trained, their statistics each moved by its own forward
            keys = [prefix + k for k in names + stats]
            assert min(_max_diff({k: got[k]}, {k: plan.start[k]}) for k in keys) > 0
        assert _max_diff({"a": got["alpha"]}, {"a": plan.start["alpha"]}) > 100 * TOL if adaptive else (
            torch.equal(got["alpha"], plan.start["alpha"]))  # fmt: skip


@pytest.mark.parametrize(("name", "options"), [("pfedme", {"train_clients": "all"}), ("perfedavg", {"variant": "hf"})])
def test_step_rule_algorithms_end_to_end_equal_the_loop(name, options, together):
    """The executor end to end, half the clients sampled: pFedMe with `train_clients: all` trains the unsampled
    clients in the same batch as the sampled ones (one plan shape), and they reply nothing while their θ_i moves;
    Per-FedAvg's Hessian-free variant. Server and every client state within TOL after two rounds."""
    torch.set_num_threads(1)

    def cfg(batch_clients):
        c = _cfg(name, batch_clients, 2, lr=0.05).model_dump()
        c["federation"]["sample_fraction"] = 0.5
        return validate_config({**c, "algorithm": {"name": name, **options}})

    loop = run(cfg(False), write=False, progress=False)
    both = run(cfg(True), write=False, progress=False)
    clients = len(loop.executor.algo.ctx.federation.participated)
    assert together == [clients] * 2 if name == "pfedme" else together and all(1 < n < clients for n in together)
    assert _max_diff(loop.server, both.server) <= TOL
    assert loop.executor.states.keys() == both.executor.states.keys()
    assert all(_max_diff(loop.executor.states[c], both.executor.states[c]) <= TOL for c in loop.executor.states)
    assert _max_diff(loop.server, loop.executor.algo.init_server()) > 100 * TOL


@pytest.mark.parametrize("option", [{"extra": (("p.", 0.1),)}, {"keys": ("w",)}, {"entries": "m/"}, {"optimizer": "o"},
                                    {"model": "v."}, {"objective": lambda *a: 0}, {"momentum": 0.0},
                                    {"weight_decay": 0.0}])  # fmt: skip
def test_a_rule_phase_takes_its_step_from_the_rule_alone(option):
    """A step rule updates the tensors itself: an SGD option beside it would be silently ignored, so it is refused;
    without the rule the same option is a plain phase's."""
    rule = MoreauStep(1, 1.0, 0.1, 0.1)  # any rule will do
    assert Phase(("a",), 1, 0.1, **option).rule is None and Phase(("a",), 1, 0.1, rule=rule).rule is rule
    with pytest.raises(ValueError, match=r"^a phase with a step rule takes its step from the rule alone$"):
        Phase(("a",), 1, 0.1, rule=rule, **option)


def test_a_rule_phase_that_ends_inside_a_step_is_refused_in_both_paths():
    """Per-FedAvg's meta-step takes two batches: after a phase of one epoch a client with an odd number of
    batches (here 5 and 9 of 18, 5 and 9: two clients, not the longest) would have a last step half fed — a
    plan's error, said in the loop and in the batched step alike."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans("mlp", 19, {"name": "perfedavg"}, local_epochs=1)
    odd = [replace(p, phases=(replace(p.phases[0], epochs=1),)) for p in plans]
    message = r"^a rule's phase ended inside a step: its batches are not a whole number of steps$"
    with pytest.raises(ValueError, match=message):
        train_together(ctx.model, odd, [ctx.client_data(c) for c in cids], cfg.train,
                       [client_generator(cfg.seed, 1, c) for c in cids])  # fmt: skip
    counts = [-(-ctx.client_data(c).num_train // 19) for c in cids]  # ⌈n/19⌉ batches
    assert max(counts) % 2 == 0 and sum(n % 2 for n in counts) == 2
    c = cids[next(i for i, n in enumerate(counts) if n % 2)]
    with pytest.raises(ValueError, match=message):
        run_plan(ctx.model, odd[cids.index(c)], ctx.client_data(c), cfg.train, client_generator(cfg.seed, 1, c))


@pytest.mark.parametrize("preset", ["paper", "official"])
def test_distillation_together_is_each_clients_own(preset):
    """KT-pFL's round-2 plans (a phase on the public batch towards each client's own targets, then local epochs),
    batched per architecture == each client's own `run_plan`, in float64: paper — the distillation's batches and
    dropout from its own stream (`Phase.stream`), batch size `distill_batch_size`, the local optimizer's momentum,
    no weight decay, KL summed over classes; official — from the client's round stream, which local training
    continues, KL averaged over classes too. A BatchNorm architecture and a dropout one, three clients each."""
    torch.set_num_threads(1)
    cfg = validate_config({"dataset": {"name": "digits"}, "model": {"name": "lenet5_bn"},
                           "federation": {"clients": 8, "partition": "dirichlet", "alpha": 0.3, "public": 100},
                           "train": {"batch_size": 16, "lr": 0.05, "momentum": 0.5, "weight_decay": 0.01,
                                     "local_epochs": 1},
                           "algorithm": {"name": "ktpfl", "preset": preset, "public_batch": 80,
                                         "distill_batch_size": 24,
                                         "architectures": ["lenet5_bn", ALEXNET_TINY]}})  # fmt: skip
    algo = prepare(cfg)
    ctx, server = algo.ctx, algo.init_server()
    cids = sorted(ctx.federation.participated)
    states = {c: algo.init_client(c) for c in cids}
    payloads = algo.configure(1, server, cids)
    replies = {}
    for c in cids:
        replies[c], states[c] = update_client(algo, 1, c, payloads[c], states[c])
    server = algo.aggregate(1, server, replies, {c: 1.0 for c in cids})
    payloads = algo.configure(2, server, cids)
    for group in (cids[:3], cids[4:7]):  # lenet5_bn, then AlexNet
        plans = [algo.round_plan(payloads[c], states[c], ctx.client_data(c), ClientContext(2, c, torch.Generator()))
                 for c in group]  # fmt: skip
        distill, model = plans[0].phases[0], plans[0].model
        assert distill.data is not None and (distill.stream is not None) == (preset == "paper")
        assert all(p.model is model and p.phases[0].data is distill.data for p in plans)
        plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
        together, alone = _each_own(cfg, ctx, group, plans, 2)
        names = [k for k, _ in model.named_parameters()]
        for plan, got, want in zip(plans, together, alone, strict=True):
            assert _max_diff(want, got) <= TOL64
            assert _max_diff({k: got[k] for k in names}, {k: plan.start[k] for k in names}) > 100 * TOL



@pytest.mark.parametrize("preset", ["paper", "official"])
def test_a_zoo_of_architectures_is_batched_per_architecture_and_equals_the_loop(preset, together):
    """KT-pFL's executor end to end on two architectures, one with dropout: each architecture's clients trained
    together in every round (the distillation's too, from round 2 on), the server (coefficients, targets) and every
    client's state within TOL of the loop's after three rounds (seen: 1.5e-8). Not lenet5_bn: in float32 one of
    its tiny clients moved by 8e-6 after a round of plain local epochs and 3e-4 after two (the kinks of
    `test_a_batchnorm_or_dropout_model_is_batched_and_equals_the_loop`); its distillation is held to the loop in
    float64 (`test_distillation_together_is_each_clients_own`)."""
    torch.set_num_threads(1)

    def cfg(batch_clients):
        c = _cfg("ktpfl", batch_clients, 3, lr=0.05, momentum=0.5, weight_decay=0.01).model_dump()
        return validate_config({**c, "algorithm": {"name": "ktpfl", "preset": preset, "public_batch": 48,
                                                   "distill_batch_size": 16,
                                                   "architectures": ["lenet5", ALEXNET_TINY]}})  # fmt: skip

    loop = run(cfg(False), write=False, progress=False)
    both = run(cfg(True), write=False, progress=False)
    clients = len(loop.executor.algo.ctx.federation.participated)
    assert len(together) == 3 * 2 and sum(together) == 3 * clients and all(n > 1 for n in together)
    assert _max_diff(loop.server, both.server) <= TOL
    assert all(_max_diff(loop.executor.states[c], both.executor.states[c]) <= TOL for c in loop.executor.states)
    algo = loop.executor.algo
    assert all(f"t/{c}" in loop.server for c in loop.executor.states)  # every client had targets to distil towards
    assert all(_max_diff(s, algo.init_client(c)) > 100 * TOL for c, s in loop.executor.states.items())  # trained


def test_clients_distilling_on_different_rounds_batches_train_apart_and_equal_the_loop(monkeypatch):
    """Half the clients a round: a round's clients of one architecture may hold targets of different rounds (they
    last replied in different rounds), so their distillations read different public batches. Each batch is its own
    group (`Phase.data_key`); one group over both would index two pools. `after_local`: the phases are then equal
    but for their samples (no stream of their own tells them apart). Four rounds, within TOL of the loop (seen:
    2e-8). A distillation strong enough to tell the batches apart (T = 1, lr 0.3, two passes): at T = 10 and the
    run's lr, one group over both batches moved a client by only 8e-6; here by 4e-3."""
    torch.set_num_threads(1)
    seen = collections.defaultdict(set)
    plan_of = KTpFL.round_plan

    def spy(self, payload, state, data, cctx):
        assert cctx.cid == data.cid  # the client's context, as its update gets it
        if "batch_round" in payload:
            seen[(cctx.rnd, self.arch_of(data.cid))].add(int(payload["batch_round"]))
        return plan_of(self, payload, state, data, cctx)

    monkeypatch.setattr(KTpFL, "round_plan", spy)

    def cfg(batch_clients):
        c = _cfg("ktpfl", batch_clients, 4, lr=0.05).model_dump()
        c["federation"].update(sample_fraction=0.5, clients=8)
        return validate_config({**c, "seed": 3, "algorithm": {"name": "ktpfl", "public_batch": 48,
                                                              "distill_batch_size": 16,
                                                              "architectures": ["lenet5", "mlp"],
                                                              "score": "after_local", "temperature": 1.0,
                                                              "distill_lr": 0.3, "distill_epochs": 2}})  # fmt: skip

    loop = run(cfg(False), write=False, progress=False)
    both = run(cfg(True), write=False, progress=False)
    assert any(len(rounds) > 1 for rounds in seen.values())  # the case arose
    assert _max_diff(loop.server, both.server) <= TOL
    assert all(_max_diff(loop.executor.states[c], both.executor.states[c]) <= TOL for c in loop.executor.states)


def _zoo(architectures, batch_clients, rounds=1):
    c = _cfg("ktpfl", batch_clients, rounds, lr=0.05).model_dump()
    return validate_config({**c, "algorithm": {"name": "ktpfl", "public_batch": 48, "distill_batch_size": 16,
                                               "architectures": architectures}})  # fmt: skip


def test_architectures_of_the_same_keys_are_batched_apart(monkeypatch):
    """Two widths of one architecture have the same state keys and other shapes: the group is per model object,
    never per key set alone (one group would stack tensors of different shapes)."""
    torch.set_num_threads(1)
    calls = []
    monkeypatch.setattr(batched, "train_together", lambda *a: calls.append(a[0]) or train_together(*a))
    loop = run(_zoo([ALEXNET_TINY, "alexnet_small_x025"], False), write=False, progress=False)
    both = run(_zoo([ALEXNET_TINY, "alexnet_small_x025"], True), write=False, progress=False)
    models = both.executor.algo.models
    assert len(calls) == 2 and {id(m) for m in calls} == {id(models[ALEXNET_TINY]), id(models["alexnet_small_x025"])}
    assert all(_max_diff(loop.executor.states[c], both.executor.states[c]) <= TOL for c in loop.executor.states)


def test_an_architecture_the_batched_step_cannot_take_runs_client_by_client(monkeypatch):
    """Whether a plan's clients can be batched is asked of its own architecture, not the run's model: here lenet5
    is declared unbatchable, so its clients run one by one (the loop's code, bit for bit) and mlp's together."""
    torch.set_num_threads(1)
    calls = []
    monkeypatch.setattr(batched, "train_together", lambda *a: calls.append(a[0]) or train_together(*a))
    monkeypatch.setattr(batched, "batchable_model", lambda m: "conv1" not in m.blocks)  # lenet5 has one, mlp not
    loop = run(_zoo(["lenet5", "mlp"], False), write=False, progress=False)
    both = run(_zoo(["lenet5", "mlp"], True), write=False, progress=False)
    algo = both.executor.algo
    assert [id(m) for m in calls] == [id(algo.models["mlp"])]
    for c, state in loop.executor.states.items():
        if algo.arch_of(c) == "lenet5":
            assert all(torch.equal(state[k], both.executor.states[c][k]) for k in state)


def _fedcp_state(algo, cid):
    """A client of a later round: W_i^hd its own, apart from W^hd, and v_i from it."""
    g = torch.Generator().manual_seed(cid)
    head = {k: v + 0.1 * torch.randn(v.shape, generator=g) if k.endswith(("weight", "bias")) else v
            for k, v in algo.init_client(cid).items() if k.startswith("personal.")}  # fmt: skip
    return {**head, "context": algo.context(head)}


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn", ALEXNET_TINY])
def test_fedcps_policy_objective_together_is_each_clients_own(model):
    """FedCP's plan (`fedcp.LocalObjective`): each step's Gumbel noise drawn from the client's generator after its
    batch and that batch's augmentation, the policy of each client's own Θ_i and v_i, CE through W^hd and W_i^hd
    plus λ·MMD² against the frozen reference W^fe over the real rows alone, whose forward moves BatchNorm
    statistics of its own (a batch of one sample is normalized with them) and draws dropout masks after the
    trained model's. Batched == each client's own `run_plan` in float64; W^hd and the reference untouched."""
    torch.set_num_threads(1)
    augment = ("crop", "flip") if model == "lenet5_bn" else ()
    algorithm = {"name": "fedcp", "lam": 2.0, "tau": 0.5}
    bn = model == "lenet5_bn"
    cfg, ctx, cids, plans = _plans(model, 16 if bn else 8, algorithm, _fedcp_state, 8 if bn else 6, augment)
    assert model != "lenet5_bn" or any(ctx.client_data(c).num_train % 16 == 1 for c in cids)  # a batch of one
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    together, alone = _each_own(cfg, ctx, cids, plans)
    names = [k for k, _ in ctx.model.named_parameters()]
    head = [k for k in names if k.startswith("blocks.classifier.")]
    reference = [k for k in plans[0].start if k.startswith("reference.")]
    assert bool(reference) == (model == "lenet5_bn")
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64
        moved = [k for k in names if k not in head] + [k for k in got if k.startswith(("personal.", "cpn."))]
        assert min(_max_diff({k: got[k]}, {k: plan.start[k]}) for k in moved + reference) > 0  # every one trained
        assert all(torch.equal(got[k], plan.start[k]) for k in head)  # W^hd frozen


class _TwiceThrough:
    """An objective whose two forwards (the batch, then its mirror image) both move the model's own BatchNorm
    statistics in one step."""

    def __call__(self, model, params, consts, x, y, w):
        first = nn.functional.cross_entropy(model_forward(model, params, x), y, reduction="none")
        second = nn.functional.cross_entropy(model_forward(model, params, x.flip(-1)), y, reduction="none")
        return weighted_mean(first, w) + weighted_mean(second, w)


def test_statistics_moved_twice_in_one_step_move_on_from_the_first_move_as_alone():
    """A forward moves the running statistics from where an earlier forward of the same step left them (the loop
    moves them in place): batched == each client's own `run_plan`."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans("lenet5_bn")
    plans = [replace(p, objective=_TwiceThrough(), finish=lambda t: (t, {})) for p in plans]
    _assert_each_own(cfg, ctx, cids, plans)


def _bn_head(input_shape, num_classes):
    """A model whose head has BatchNorm and dropout between two linear layers: FedCP's W_i^hd and W^hd each move
    statistics of their own, and draw masks in the order the objective runs them."""
    from pflbed.models import BlockNet
    from pflbed.models.zoo import SafeBatchNorm1d

    width = int(torch.tensor(input_shape).prod())
    head = nn.Sequential(nn.Linear(16, 12), SafeBatchNorm1d(12), nn.ReLU(), ReproducibleDropout(0.3),
                         nn.Linear(12, num_classes))  # fmt: skip
    return BlockNet([("body", nn.Sequential(nn.Flatten(), nn.Linear(width, 16), nn.ReLU())), ("head", head)])


def test_fedcps_personal_head_with_batchnorm_and_dropout_together_is_each_clients_own(monkeypatch):
    """W_i^hd runs through the head's modules with the plan's `personal.` tensors: its BatchNorm statistics are a set
    of their own (moved by its forward, never trained), W^hd's the model's own; each head's dropout masks drawn in
    the objective's order. Batched == each client's own `run_plan` in float64."""
    torch.set_num_threads(1)
    from pflbed.models.zoo import MODELS

    monkeypatch.setitem(MODELS, "bn_head", _bn_head)
    cfg, ctx, cids, plans = _plans("bn_head", 8, {"name": "fedcp", "lam": 1.0}, _fedcp_state)
    plans = [replace(p, finish=lambda t: (t, {})) for p in plans]
    together, alone = _each_own(cfg, ctx, cids, plans)
    personal = [k for k in plans[0].start if k.startswith("personal.") and "running" in k]
    own = [k for k in ctx.model.state_dict() if k.startswith("blocks.head.") and "running" in k]
    assert personal and own
    for plan, got, want in zip(plans, together, alone, strict=True):
        assert _max_diff(want, got) <= TOL64
        assert min(_max_diff({k: got[k]}, {k: plan.start[k]}) for k in personal + own) > 0  # each set moved
        assert _max_diff({k: got[k] for k in personal}, {k: got[k[len("personal."):]] for k in personal}) > 0


def test_a_phase_after_one_whose_objective_traced_its_own_forwards_draws_the_models_masks():
    """The dropout calls traced for an objective with forwards of its own (FedCP's reference extractor) are that
    phase's: a later phase of plain cross-entropy draws the model's one forward's masks again. Batched == each
    client's own `run_plan` in float64."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans(ALEXNET_TINY, 8, {"name": "fedcp", "lam": 1.0}, _fedcp_state)
    plain = RegularizedObjective([k for k, _ in ctx.model.named_parameters()])  # CE, nothing added
    every = tuple(ctx.model.block_names())
    plans = [replace(p, phases=(*p.phases, Phase(every, 1, 0.05, objective=plain)), finish=lambda t: (t, {}))
             for p in plans]  # fmt: skip
    _assert_each_own(cfg, ctx, cids, plans)


def test_a_tensor_every_client_is_sent_is_taken_once_and_one_each_client_has_its_own_is_stacked():
    """Rule (`batched._one_or_stacked`): a key shared where every client's tensor is the same object, and the
    caller allows it; equal values in different objects (a strict run's copies through bytes) are stacked, as are
    the keys it does not allow and a lone client's."""
    one, other = torch.ones(2), torch.ones(2)
    shared, stacked = batched._one_or_stacked([{"a": one, "b": one, "c": one}, {"a": one, "b": other, "c": one}],
                                              lambda k: k != "c")  # fmt: skip
    assert list(shared) == ["a"] and shared["a"] is one
    assert sorted(stacked) == ["b", "c"] and stacked["b"].shape == (2, 2)
    alone, mine = batched._one_or_stacked([{"a": one}])
    assert alone == {} and mine["a"].shape == (1, 2)


def test_a_constant_every_client_is_sent_is_taken_once_and_entry_masks_always_per_client(monkeypatch):
    """`train_together` shares constants as it shares starts: Ditto's anchor (the global model every client is
    sent) is one tensor for all of them, not a model a client; FedSelect's entry masks, indexed per client by
    their phase, are stacked even where every client's is the same object."""
    torch.set_num_threads(1)
    got = []
    real = batched._one_or_stacked
    monkeypatch.setattr(batched, "_one_or_stacked", lambda *a: got.append(out := real(*a)) or out)
    cfg, ctx, cids, plans = _plans("mlp", algorithm={"name": "ditto", "lam": 0.5, "personal_lr": 0.01})
    anchor = set(plans[0].consts)
    assert anchor and all(p.consts[k] is plans[0].consts[k] for p in plans for k in anchor)
    train_together(ctx.model, plans, [ctx.client_data(c) for c in cids], cfg.train,
                   [client_generator(cfg.seed, 1, c) for c in cids])  # fmt: skip
    assert set(got[1][0]) == anchor and not got[1][1]  # (shared, stacked) of the constants
    got.clear()
    cfg, ctx, cids, plans = _plans("mlp", algorithm={"name": "fedselect"})
    phase = next(ph for ph in plans[0].phases if ph.entries is not None)
    masks = [k for k in plans[0].consts if k.startswith(phase.entries)]
    assert masks
    same = [replace(p, consts={**p.consts, **{k: plans[0].consts[k] for k in masks}}) for p in plans]
    train_together(ctx.model, same, [ctx.client_data(c) for c in cids], cfg.train,
                   [client_generator(cfg.seed, 1, c) for c in cids])  # fmt: skip
    assert not set(masks) & set(got[1][0]) and set(masks) <= set(got[1][1])


def test_a_shared_start_comes_back_fresh_and_a_finish_that_writes_into_it_is_stopped():
    """FedBABU's head, which its plan never trains, is the round's one tensor for every client batched together
    (`_one_or_stacked`): `train_together` hands it back as that object, the executor's `finish` returns a copy of
    it (a reply is fresh, as in the loop: the server may fold it in in place), and each client's own tensors as
    they are (a copy of those would cost a model a client for nothing) — and a plan whose `finish` wrote
    into it would have changed every other client's start: stopped."""
    torch.set_num_threads(1)
    cfg, ctx, cids, plans = _plans("mlp", algorithm={"name": "fedbabu"})
    head = [k for k in plans[0].start if "classifier" in k]
    assert head and all(p.start[k] is plans[0].start[k] for p in plans for k in head)
    together = train_together(ctx.model, plans, [ctx.client_data(c) for c in cids], cfg.train,
                              [client_generator(cfg.seed, 1, c) for c in cids])  # fmt: skip
    assert all(t[k] is plans[0].start[k] for t in together for k in head)  # one tensor, not one a client
    executor = BatchedExecutor.__new__(BatchedExecutor)  # its `finish` alone, outside a run's RNG and precision
    executor.as_its_update = lambda n: contextlib.nullcontext()
    noise = rng.global_stream(1, ctx.device)
    plan = replace(plans[0], finish=lambda t: (t, {"head": t[head[0]]}))
    reply, state = executor.finish(plan, together[0], noise)
    assert all(reply[k] is not plan.start[k] and torch.equal(reply[k], plan.start[k]) for k in head)
    assert state["head"] is not plan.start[head[0]]
    assert all(reply[k] is together[0][k] for k in reply if k not in head)  # each client's own: not copied again
    writes = replace(plans[0], finish=lambda t: (t, {"head": t[head[0]].mul_(2)}))
    with pytest.raises(RuntimeError, match="shares with other clients"):
        executor.finish(writes, together[0], noise)


def test_statistics_a_hook_moves_out_of_a_shared_tensor_become_each_clients_own(monkeypatch):
    """Plans' running statistics are never shared (`batched._statistic`); were one shared, the step whose hook
    moved it first (FedBasis's `hand_back` of its bases' statistics) gives each client its copy from then on:
    still batched == each client's own."""
    shared = []
    real = batched._one_or_stacked
    monkeypatch.setattr(batched, "_statistic", lambda key, buffers: False)
    monkeypatch.setattr(batched, "_one_or_stacked", lambda *a: shared.append(list((out := real(*a))[0])) or out)
    test_fedbasis_steps_together_are_each_clients_own("lenet5_bn")
    assert any(k.startswith("vs.") for k in shared[0])  # the starts' (the first call's): shared
