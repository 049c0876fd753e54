"""`executor.compile`: the batched step under torch.compile (engine/batched.py, `compiled`).

Inductor, the backend `torch.compile` uses, takes a minute per graph on a small CPU and needs a C++ compiler, so
these tests swap in the `aot_eager` backend: the same capture of the vmapped step (dynamo, then AOT autograd) run
with the eager kernels. On the cases below the compiled run equals the eager one bit for bit; that is a property of
these shapes, not a promise of aot_eager, whose decompositions may round differently elsewhere (KT-pFL's zoo with
AlexNet at 1/16 width moved a client by 4e-9 in its first round). What inductor changes on top is float rounding,
measured on the GPU (`tests/engine/test_cuda.py`, `benchmarks/gpu.py`).
"""

import contextlib

import pytest
import torch
import yaml

from pflbed.config import validate_config
from pflbed.engine import batched
from pflbed.errors import ConfigError
from pflbed.results.experiment import run

from ..tiny import DATA, TINY

REAL_COMPILE = torch.compile


@contextlib.contextmanager
def on_aot_eager():
    """`torch.compile` (as `engine.batched` calls it) on the aot_eager backend meanwhile, dynamo's cache emptied on
    entry and exit; yields the modes it was asked for. Also the executor probe's `compiled` comparison."""
    modes = []

    def compile_(fn, mode):
        modes.append(mode)
        return REAL_COMPILE(fn, backend="aot_eager")

    torch._dynamo.reset()
    batched.torch.compile = compile_
    try:
        yield modes
    finally:
        batched.torch.compile = REAL_COMPILE
        torch._dynamo.reset()


@pytest.fixture
def aot_eager():
    with on_aot_eager() as modes:
        yield modes


# pFedMe traces its K inner forwards into each step: two show the statistics carried from one to the next at less
# than half the tracing of its default five.
OPTIONS = {"pfedme": {"K": 2}}


def _cfg(name, model, compile_, rounds=3, epochs=1):
    """Clients of different sizes (a Dirichlet split): later steps of a round have fewer clients with a batch."""
    return validate_config({**TINY, "dataset": DATA, "model": {"name": model},
                            "federation": {**TINY["federation"], "sample_fraction": 1.0},
                            "train": {**TINY["train"], "rounds": rounds, "lr": 0.05, "momentum": 0.5,
                                      "local_epochs": epochs},
                            "algorithm": {"name": name, **OPTIONS.get(name, {})},
                            "executor": {"threads": 1, "batch_clients": True, "compile": compile_}})  # fmt: skip


@pytest.mark.parametrize(("name", "model", "graphs"), [
    ("fedavg", "lenet5_bn", 1),  # BatchNorm statistics handed back from inside the compiled step
    ("fedavg", "alexnet_small_x025", 1),  # dropout masks drawn outside it
    ("fedselect", "lenet5", 1),  # per-client entry masks
    ("fedbasis", "lenet5_bn", 3),  # a warm-start round, then two phases (ψ, V) of statistics derived per step
    ("pfedme", "lenet5_bn", 1),  # a step rule: K forwards on a batch, statistics carried from one to the next
    ("perfedavg", "alexnet_small_x025", 1),  # a step rule over two batches, each forward its own masks
    ("apfl", "lenet5_bn", 1),  # a step rule's two models, each forward moving its own model's statistics
    ("fedcp", "lenet5_bn", 1),  # each batch's noise an input; a second extractor moving statistics of its own
])  # fmt: skip
def test_the_compiled_step_trains_as_the_eager_one_and_compiles_once_per_step_kind(name, model, graphs, aot_eager):
    """Three rounds (FedBasis: its warm-start round and one of its own) equal the eager step's bit for bit, finished
    clients' tensors untouched by the steps they sit out, and each kind of step was captured once for the whole run:
    a step with fewer clients left is computed at the round's shape (not compiled again), and a later round reuses
    the graphs."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    rounds = 2 if name == "fedbasis" else 3
    eager = run(_cfg(name, model, "off", rounds), write=False, progress=False)
    assert aot_eager == []  # off: nothing compiled
    counters.clear()
    fast = run(_cfg(name, model, "default", rounds), write=False, progress=False)
    assert aot_eager and set(aot_eager) == {"default"}
    assert counters["stats"]["unique_graphs"] == graphs and counters["frames"]["ok"] == graphs
    assert all(torch.equal(eager.server[k], fast.server[k]) for k in eager.server)
    states = eager.executor.states
    assert all(torch.equal(states[c][k], fast.executor.states[c][k]) for c in states for k in states[c])
    assert not all(torch.equal(eager.server[k], v) for k, v in eager.executor.algo.init_server().items())


def test_cuda_graphs_start_a_step_per_call_and_hand_back_copies(monkeypatch):
    """Under `reduce-overhead` a call's outputs live in the graph's memory, which its next replay overwrites: each
    call must open a new step and return copies, never the graph's own tensors."""
    held = {"g": torch.ones(3)}
    steps = []
    monkeypatch.setattr(batched.torch, "compile", lambda fn, mode: lambda *a: (held, [held["g"]]))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    step = batched.compiled(lambda *a: None, "reduce-overhead", torch.nn.Linear(1, 1))
    for n in (1, 2):
        g, moved = step()
        assert len(steps) == n
        assert torch.equal(g["g"], held["g"]) and g["g"] is not held["g"] and moved[0] is not held["g"]
        assert g["g"].data_ptr() != held["g"].data_ptr()
    plain = batched.compiled(lambda *a: None, "default", torch.nn.Linear(1, 1))
    assert plain()[0] is held and len(steps) == 2  # fused kernels alone: no graph memory to copy out of


@pytest.mark.parametrize(("name", "model"), [("fedper", "lenet5_bn"), ("pfedme", "lenet5_bn")])
def test_what_a_step_keeps_past_the_next_replay_is_copied_out_of_the_graphs_memory(name, model, monkeypatch):
    """CUDA graphs on a CPU: a stand-in for `torch.compile(mode="reduce-overhead")` whose outputs are valid until
    the next step begins (`cudagraph_mark_step_begin`), then overwritten (here with NaN: the graphs' memory reused
    by the next replay). A plain phase (FedPer's) uses its gradients within the step and copies the statistics it
    keeps (`compiled`'s `kept`); a rule's phase (pFedMe's) copies all: the run equals the eager one bit for bit —
    a step that kept the graphs' own tensors would find them overwritten."""
    torch.set_num_threads(1)
    eager = run(_cfg(name, model, "off", 2), write=False, progress=False)
    live = []  # the outputs of the steps since the last began

    def graph(fn, mode):
        assert mode == "reduce-overhead"

        def replay(*args):
            out = fn(*args)
            live.extend(torch.utils._pytree.tree_leaves(out))
            return out

        return replay

    def next_step():
        for t in live:
            t.fill_(float("nan") if t.is_floating_point() else -1)
        live.clear()

    monkeypatch.setattr(batched.torch, "compile", graph)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", next_step)
    graphs = run(_cfg(name, model, "reduce-overhead", 2), write=False, progress=False)
    assert all(torch.equal(eager.server[k], graphs.server[k]) for k in eager.server)
    states = eager.executor.states
    assert all(torch.equal(states[c][k], graphs.executor.states[c][k]) for c in states for k in states[c])


def test_a_compiler_failure_names_the_setting_in_one_line(monkeypatch):
    def broken(*a):
        raise torch._dynamo.exc.BackendCompilerFailed("inductor", RuntimeError("no C++ compiler\nfound"), None)

    monkeypatch.setattr(batched.torch, "compile", lambda fn, mode: broken)
    with pytest.raises(ConfigError) as e:
        batched.compiled(lambda *a: None, "default", torch.nn.Linear(1, 1))()
    assert str(e.value).startswith("executor.compile=default: torch.compile failed here (BackendCompilerFailed")
    assert "no C++ compiler found" in str(e.value) and "set executor.compile=off" in str(e.value)
    assert "\n" not in str(e.value)
    oom = torch.OutOfMemoryError("out of memory")  # a GPU's memory running out is the executor's to handle

    def full(*a):
        raise oom

    monkeypatch.setattr(batched.torch, "compile", lambda fn, mode: full)
    with pytest.raises(torch.OutOfMemoryError):
        batched.compiled(lambda *a: None, "default", torch.nn.Linear(1, 1))()


@pytest.mark.parametrize("executor", [{"batch_clients": False}, {"name": "procs", "workers": 1},
                                      {"batch_clients": False, "device": "auto"}])
def test_compile_is_refused_where_no_client_is_batched(executor):
    with pytest.raises(ConfigError, match="^executor: compile applies to batched clients"):
        validate_config({**TINY, "dataset": DATA, "executor": {**executor, "compile": "default"}})


def test_compile_is_taken_where_clients_are_batched():
    """Taken as `batch_max_clients` is: wherever clients may run batched, `batch_clients` unset included (on a GPU
    it is on; on a CPU the setting then goes unused), so a GPU run's config still loads on a CPU."""
    for executor in ({"batch_clients": True}, {"device": "auto"}, {}):
        assert validate_config({**TINY, "dataset": DATA, "executor": {**executor, "compile": "default"}})


def test_a_compiled_gpu_run_loads_on_a_cpu_and_resumes_with_compile_changed(tmp_path):
    """`compile` is placement, like `batch_clients`: how a run computes (float rounding at most), not what."""
    from pflbed.config import validate_config as valid
    from pflbed.results.rundir import run_config, same_config

    tree = {**TINY, "dataset": DATA, "executor": {"device": "cuda", "compile": "reduce-overhead"}}
    assert run_config(tree).executor.device == ("cuda" if torch.cuda.is_available() else "cpu")  # CPU: no GPU here
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({**TINY, "dataset": DATA, "executor": {"batch_clients": True,
                                                                          "compile": "default"}}))  # fmt: skip
    assert same_config(saved, valid({**TINY, "dataset": DATA, "executor": {"batch_clients": False}}))
    assert not same_config(saved, valid({**TINY, "dataset": DATA, "seed": 7, "executor": {"batch_clients": True}}))


def test_each_run_compiles_its_own_steps_however_many_ran_before_in_the_process(aot_eager, monkeypatch):
    """A run's graphs cannot serve the next run's model: they are dropped when it starts compiling, so that dynamo's
    limit of graphs per code (here lowered to 1) never turns a later run's steps silently eager."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    counters.clear()
    for rounds in (1, 1):
        run(_cfg("fedavg", "lenet5", "default", rounds), write=False, progress=False)
    assert counters["stats"]["unique_graphs"] == 2 and counters["frames"]["ok"] == 2  # one each, both compiled


def test_a_finished_clients_tensors_are_kept_whatever_their_shape():
    """`_kept` picks per client (the leading dimension) between the step's result and the tensor as it was."""
    keep = torch.tensor([True, False, True])
    for shape in ((3,), (3, 2), (3, 2, 4)):
        new, old = torch.full(shape, 1.0), torch.full(shape, 2.0)
        out = batched._kept(keep, new, old)
        assert out.shape == new.shape
        assert out[0].eq(1).all() and out[1].eq(2).all() and out[2].eq(1).all()
    new = torch.ones(3, 2)
    assert batched._kept(None, new, torch.zeros(3, 2)) is new  # nothing finished: the result itself


def test_compiled_wraps_the_step_in_its_mode_and_empties_the_cache_for_a_new_model(monkeypatch):
    made, resets = [], []
    monkeypatch.setattr(batched.torch, "compile", lambda fn, mode: made.append((fn, mode)) or fn)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(batched, "_compiled_for", [])

    def step(*a):
        return {"g": torch.zeros(1)}, {}

    one, two = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    assert batched.compiled(step, "off", one) is step and not made and not resets  # off: the step itself
    for mode, model, n_resets in (("default", one, 1), ("reduce-overhead", one, 1), ("default", two, 2)):
        batched.compiled(step, mode, model)
        assert made[-1] == (step, mode) and len(resets) == n_resets  # the same model: its graphs kept


@pytest.mark.parametrize(("name", "model", "epochs"), [
    ("fedavg", "lenet5_bn", 1), ("fedavg", "alexnet_small_x025", 1),
    ("fedselect", "lenet5", 2),  # each side's momentum carried into its pass of the next epoch
    ("fedbasis", "lenet5_bn", 1),  # statistics handed back to the bases
    ("pfedme", "lenet5_bn", 1),  # a step rule, which would move a finished client's θ toward w_i without data
])  # fmt: skip
def test_a_compiled_phase_computes_finished_clients_and_drops_their_results(name, model, epochs, monkeypatch):
    """The compiled path's one shape, eagerly (torch.compile as the identity): every client computed at every step
    of the phase, those whose batches ran out left as they were (parameters, statistics, momentum) — the eager
    path's results, bit for bit."""
    torch.set_num_threads(1)
    masked, real = [], batched._kept

    def kept(keep, new, old):
        masked.append(keep is not None)
        return real(keep, new, old)

    monkeypatch.setattr(batched, "_kept", kept)
    eager = run(_cfg(name, model, "off", 2, epochs), write=False, progress=False)
    assert masked and not any(masked)  # eager: finished clients are left out of the step, not computed
    monkeypatch.setattr(batched.torch, "compile", lambda fn, mode: fn)
    static = run(_cfg(name, model, "default", 2, epochs), write=False, progress=False)
    assert any(masked)  # some steps had finished clients
    assert all(torch.equal(eager.server[k], static.server[k]) for k in eager.server)
    states = eager.executor.states
    assert all(torch.equal(states[c][k], static.executor.states[c][k]) for c in states for k in states[c])


def test_a_zoos_architectures_compile_once_each_per_step_kind_in_one_cache(aot_eager):
    """KT-pFL's heterogeneous clients: each architecture's steps are compiled into the run's one cache (switching
    architecture does not empty it). Round 1 captures each architecture's local phase; round 2 its distillation
    and its local phase again (the plan's targets are now among the step's inputs); round 3 reuses all six.
    The compiled run equals the eager one bit for bit."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)

    def cfg(compile_):
        c = _cfg("ktpfl", "lenet5_bn", compile_, rounds=3).model_dump()
        c["federation"]["public"] = 64
        return validate_config({**c, "algorithm": {"name": "ktpfl", "public_batch": 48, "distill_batch_size": 16,
                                                   "architectures": ["lenet5_bn", "alexnet_small_x025"]}})  # fmt: skip

    eager = run(cfg("off"), write=False, progress=False)
    counters.clear()
    fast = run(cfg("default"), write=False, progress=False)
    assert counters["stats"]["unique_graphs"] == 6 and counters["frames"]["ok"] == 6
    assert all(torch.equal(eager.server[k], fast.server[k]) for k in eager.server)
    states = eager.executor.states
    assert all(torch.equal(states[c][k], fast.executor.states[c][k]) for c in states for k in states[c])
