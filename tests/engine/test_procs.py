"""The worker-process executor gives the loop executor's results, bit for bit, for every algorithm; its pool
reports failed and dead workers, leaves no result of a stopped round behind, and never keeps a process from
exiting."""

import subprocess
import sys

import pytest
import torch

import pflbed
from pflbed.algorithms.fedavg import FedAvg
from pflbed.engine.build import prepare
from pflbed.engine.procs import ProcsExecutor, WorkerError, assign
from pflbed.errors import ConfigError, DivergedError
from pflbed.results.experiment import run

from ..tiny import PARITY_CASES, TINY, loop_run, parity_config
from ..tiny import figures as _figures
from ..tiny import same_tensors as _same


@pytest.mark.parametrize("name", PARITY_CASES)
def test_procs_equals_loop_bit_for_bit(name, pool):
    """Same summary, server state and client states as `loop` at one thread per process: a client's update depends
    on (payload, state, data, seed of (round, client)) only, whichever worker runs it and in whichever order."""
    torch.set_num_threads(1)
    loop = loop_run(name)
    procs_cfg = parity_config(name, {"name": "procs", "workers": 2, "threads": 1})
    procs = run(procs_cfg, write=False, progress=False, pool=pool)
    assert _figures(procs.summary) == _figures(loop.summary)
    assert _same(procs.server, loop.server)
    assert procs.executor.states.keys() == loop.executor.states.keys()
    assert all(_same(procs.executor.states[c], loop.executor.states[c]) for c in loop.executor.states)


@pytest.mark.parametrize("name, method, widest", [("fedavg", "logits", 3), ("fedper", "features", None)])
def test_evaluation_forwards_run_in_the_idle_workers_with_the_loops_numbers(name, method, widest, pool, monkeypatch):
    """Between rounds the workers are idle, so procs runs an evaluation's forwards there: a shared model's logits
    (FedAvg) or a shared body's features (FedPer), in parts of whole inference chunks, each part whole in one worker
    — the chunks `loop` runs, hence its records bit for bit. A small eval batch makes the tiny sets many parts; for
    the logits, an activation budget of 3 rows of the MLP's widest layer (200 floats) makes a chunk 3 rows, so
    parts of 16 batches (128 rows) would cut chunks."""
    from pflbed.models import inference

    if widest:
        monkeypatch.setattr(inference, "ACTIVATION_BYTES", widest * 200 * 4)
    torch.set_num_threads(1)
    parts = []
    real = pool.forward

    def counted(pred, m, split, ps, bs):
        parts.append((m, ps))
        return real(pred, m, split, ps, bs)

    monkeypatch.setattr(pool, "forward", counted)
    small = {"batch_size": 8}
    loop = run(parity_config(name, {"threads": 1}, small), write=False, progress=False)
    procs = run(parity_config(name, {"name": "procs", "workers": 2, "threads": 1}, small), write=False,
                progress=False, pool=pool)  # fmt: skip
    assert _figures(procs.summary) == _figures(loop.summary)
    assert parts and {m for m, _ in parts} == {method} and all(len(ps) >= 2 for _, ps in parts)
    rows = widest or 8
    assert all(len(p) % rows == 0 for _, ps in parts for p in ps[:-1])  # every part but the last: whole chunks


def test_procs_in_strict_mode_and_with_its_own_pool():
    """The run starts (and stops) its own workers when given none; strict mode still round-trips through bytes."""
    torch.set_num_threads(1)
    cfg = {**TINY, "algorithm": {"name": "fedper"}, "train": {**TINY["train"], "rounds": 2}}
    loop = pflbed.run({**cfg, "executor": {"strict": True, "threads": 1}}, write=False, progress=False)
    procs = pflbed.run({**cfg, "executor": {"name": "procs", "workers": 2, "strict": True, "threads": 1}},
                       write=False, progress=False)  # fmt: skip
    assert _figures(procs.summary) == _figures(loop.summary)


class FailingFedAvg(FedAvg):
    """FedAvg whose clients fail (importable by the workers, which unpickle it by its module path)."""

    def client_update(self, payload, state, data, cctx):
        raise ValueError(f"no data for client {data.cid}")


def test_a_failing_client_update_is_reported_with_the_client(pool):
    """An exception in a worker reaches the caller as WorkerError naming the client and the worker's traceback.
    The round's other results, failed ones too, are collected and dropped: the pool's next round gets its own."""
    cfg = parity_config("fedavg", {"name": "procs", "workers": 2, "threads": 1})
    algo = FailingFedAvg(prepare(cfg).ctx)
    cids = algo.ctx.federation.participated[:4]
    with pytest.raises(WorkerError, match=r"client \d+: ValueError: no data for client \d+\n.*worker traceback"):
        ProcsExecutor(algo, pool).run(1, algo.configure(1, algo.init_server(), cids))
    fine = FedAvg(prepare(cfg).ctx)
    replies = ProcsExecutor(fine, pool).run(1, fine.configure(1, fine.init_server(), cids))
    assert sorted(replies) == sorted(cids)


class BatchSizeEcho:
    """A predictor whose every row's output is the batch size it was asked to use (importable by the workers)."""

    def logits(self, x, batch_size):
        return torch.full((len(x),), float(batch_size))

    def features(self, x, batch_size):
        raise ValueError(f"no features of {len(x)} rows")


def test_evaluation_forwards_stay_here_unless_two_parts_two_workers_and_this_process_s_threads():
    """`ProcsExecutor.forward` sends the parts to the workers only where that gives this process's numbers (the
    workers' thread count is this process's) and can pay (two parts and two workers at least); None: run here."""
    from types import SimpleNamespace

    threads = torch.get_num_threads()
    algo = FedAvg(prepare(parity_config("fedavg", {"threads": 1})).ctx)

    def sent(parts: int, workers: int = 2, pool_threads: int = threads):
        pool = SimpleNamespace(size=workers, threads=pool_threads, load=lambda a: None,
                               forward=lambda pred, *rest: "sent")  # fmt: skip
        return ProcsExecutor(algo, pool).forward(BatchSizeEcho(), "logits", "test", [torch.arange(1)] * parts, 8)

    assert sent(2) == sent(5) == "sent"
    assert sent(1) is None
    assert sent(3, workers=1) is None
    assert sent(3, pool_threads=threads + 1) is None


class NanFedAvg(FedAvg):
    """FedAvg whose every reply has a NaN bias (importable by the workers)."""

    def client_update(self, payload, state, data, cctx):
        reply, new_state = super().client_update(payload, state, data, cctx)
        bias = reply["blocks.classifier.bias"]
        return {**reply, "blocks.classifier.bias": torch.full_like(bias, float("nan"))}, new_state


def test_a_non_finite_reply_from_a_worker_stops_the_round_naming_round_and_client(pool):
    algo = NanFedAvg(prepare(parity_config("fedavg", {"name": "procs", "workers": 2, "threads": 1})).ctx)
    cids = algo.ctx.federation.participated[:2]
    with pytest.raises(DivergedError) as caught:
        ProcsExecutor(algo, pool).run(3, algo.configure(3, algo.init_server(), cids))
    assert caught.value.round == 3
    assert caught.value.where == f"client {min(cids)}'s reply has non-finite values in 'blocks.classifier.bias'"


def test_a_workers_forward_uses_the_callers_batch_size_and_reports_its_error(pool):
    """The eval batch size bounds a worker's memory as it bounds the loop's (`eval.batch_size`). A forward that
    fails in a worker is raised here with its type, message and traceback, once every worker's result is in: the
    pool's next forward gets its own results, not the failed one's leftovers."""
    import pickle

    algo = prepare(parity_config("fedavg", {"name": "procs", "workers": 2, "threads": 1}))
    pool.load(algo)
    parts = [torch.arange(0, 4), torch.arange(4, 6), torch.arange(6, 7)]
    echo = pickle.dumps(BatchSizeEcho())
    with pytest.raises(WorkerError, match=r"an evaluation forward: ValueError: no features of \d rows\n.*traceback"):
        pool.forward(echo, "features", "test", parts, 3)
    out = pool.forward(echo, "logits", "test", parts, 3)
    assert [o.tolist() for o in out] == [[3.0] * 4, [3.0] * 2, [3.0]]


def test_a_federation_of_many_clients_reaches_the_workers_as_a_copy(pool):
    """Each tensor shared with the workers holds a file descriptor: 10,000 clients' index tensors passed the
    open-file limit. The federation goes as plain bytes, only the data is shared: under a soft limit of 256 open
    files, 400 clients (1,600 index and prior tensors) still load and train."""
    import resource

    torch.set_num_threads(1)
    cfg = pflbed.config.validate_config({**TINY, "federation": {"clients": 400, "partition": "iid", "min_size": 1},
                                         "executor": {"name": "procs", "workers": 2, "threads": 1}})  # fmt: skip
    algo = prepare(cfg)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        cids = algo.ctx.federation.participated[:4]
        replies = ProcsExecutor(algo, pool).run(1, algo.configure(1, algo.init_server(), cids))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert sorted(replies) == sorted(cids)


def test_a_pool_whose_worker_died_with_its_queue_full_lets_its_process_exit():
    """What was sent to a worker that died (or was killed at `close` while still starting up, under load) is
    dropped: its queue's background thread, blocked on a full pipe nobody reads, was joined at interpreter exit,
    and the process that ran the pool never exited. Waiting on a dead worker's answer raises, naming its exit
    code (the pool looks for dead workers each second it waits). The live worker stops by itself when told (exit
    code 0, not killed): its parent-watching thread (`exit_with_parent`) must not keep it alive. A pool left open
    does not keep its process from exiting either: its workers are daemons, stopped at exit."""
    script = (
        "import torch\n"
        "from pflbed.engine.procs import WorkerError, WorkerPool, _put\n"
        "left_open = WorkerPool(1, threads=1)\n"
        "pool = WorkerPool(2, threads=1)\n"
        "try:  # worker 0 is up once it answers (here with the error of an empty predictor)\n"
        "    pool.forward(b'', 'logits', 'test', [torch.arange(1)], 1)\n"
        "except WorkerError:\n"
        "    pass\n"
        "pool.started[1].wait()  # killed once it started: dying as it starts is another message\n"
        "pool.procs[1].kill()\n"
        "pool.procs[1].join()\n"
        "try:  # one part to each worker: worker 1 will never answer\n"
        "    pool.forward(b'', 'logits', 'test', [torch.arange(1), torch.arange(1, 2)], 1)\n"
        "except WorkerError as e:\n"
        "    print(e)\n"
        "_put(pool.tasks[1], ('algorithm', b'x' * (1 << 20)))  # more than a pipe holds\n"
        "pool.close()\n"
        "print(pool.procs[0].exitcode)\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung at exit after closing its pool")
    assert (done.returncode, done.stdout) == (0, "a worker process died (exit code -9)\n0\n"), done.stderr


def test_a_process_not_started_by_multiprocessing_has_no_parent_to_watch():
    import threading

    from pflbed.engine.procs import exit_with_parent

    before = threading.active_count()
    exit_with_parent()  # this test's process: nothing to watch, nothing started
    assert threading.active_count() == before


def test_assign_balances_by_training_size():
    """Largest client first to the least-loaded worker: loads 10+1 vs 6+5, deterministic on ties."""
    where = assign({0: 1, 1: 10, 2: 6, 3: 5}, 2)  # the largest first, not the lowest cid
    assert where == {1: 0, 2: 1, 3: 1, 0: 0}
    assert assign({5: 3, 2: 3}, 2) == {2: 0, 5: 1}
    # a client of one sample counts one, a client of none counts one too: both still take a worker's time
    assert assign({0: 3, 1: 1, 2: 1, 3: 1}, 2) == {0: 0, 1: 1, 2: 1, 3: 1}
    assert assign({0: 0, 1: 0, 2: 0}, 2) == {0: 0, 1: 1, 2: 0}


@pytest.mark.parametrize("value", [0, 10**6])
def test_workers_out_of_range_is_a_config_error(value):
    with pytest.raises(ConfigError, match="executor.workers"):
        pflbed.config.validate_config({"executor": {"workers": value}})


@pytest.mark.parametrize("deterministic, autotune, tf32", [(True, False, None), (False, True, True),
                                                          (True, True, False)])  # fmt: skip
def test_the_run_and_each_worker_set_the_kernels_its_executor_config_asks_for(monkeypatch, deterministic, autotune,
                                                                              tf32):  # fmt: skip
    """`executor.deterministic`, `executor.autotune` and `executor.tf32` reach torch's flags where the run prepares
    and in a `procs` worker (the worker loop run here on plain queues), which sets the process's own flags: they are
    per process."""
    from pflbed import rng
    from pflbed.config import validate_config

    from .worker_here import run_worker_here

    seen = []
    monkeypatch.setattr(rng, "gpu_kernels", lambda *args: seen.append(args))
    cfg = validate_config({**TINY, "executor": {**TINY["executor"], "deterministic": deterministic,
                                                "autotune": autotune, "tf32": tf32}})  # fmt: skip
    run_worker_here(prepare(cfg))
    assert seen == [(torch.device("cpu"), deterministic, autotune, tf32)] * 2


@pytest.mark.parametrize("keep", [True, False])
def test_each_worker_keeps_freed_memory_as_its_executor_config_asks(monkeypatch, keep):
    """`executor.keep_freed_memory` reaches the allocator of a `procs` worker, whose allocator is its own
    process's (the worker loop run here on plain queues)."""
    import contextlib

    from pflbed.engine import procs

    from .worker_here import run_worker_here

    seen = []
    monkeypatch.setattr(procs, "kept_freed_memory", lambda on: seen.append(on) or contextlib.nullcontext())
    cfg = pflbed.config.validate_config({**TINY, "executor": {**TINY["executor"], "keep_freed_memory": keep}})
    run_worker_here(prepare(cfg))
    assert seen == [keep]


GUARD = ('pflbed.run was called in a worker process as it started: each worker of executor procs imports the script '
         'that started the run, so call pflbed.run under `if __name__ == "__main__":`')


def test_a_script_calling_run_at_its_top_level_is_told_to_guard_the_call(tmp_path):
    """"spawn" runs the script again in each worker as it starts: a script calling `pflbed.run` at its top level
    started a run in every worker, which was refused there as "a run is in progress" (or started workers of its
    own), and all the script's caller read was "a worker process died". Each worker now says why in one line, and
    the run that the script started says its worker died as it started."""
    script = tmp_path / "train.py"
    script.write_text(f"import pflbed\npflbed.run({{**{TINY!r}, 'executor': {{'name': 'procs', 'workers': 2}}}}, "
                      "out='run')\n")  # fmt: skip
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    lines = done.stderr.splitlines()
    assert done.returncode == 1
    assert GUARD in lines and {x for x in lines if x.startswith("pflbed.run")} == {GUARD}, done.stderr
    assert lines[-1] == ("pflbed.engine.procs.WorkerError: a worker process died (exit code 1) as it started; what "
                         "it printed is above")  # fmt: skip
    assert done.stderr.count("Traceback") == 1  # the script's own; a worker's is its one line


@pytest.mark.parametrize("source", ["stdin", "interactive class"])
def test_workers_that_could_not_import_the_script_or_its_class_are_refused_and_auto_runs_the_loop(tmp_path, source):
    """A worker imports the script that started the run again, from its file, and a class by its module: a script
    read from standard input, or an algorithm class defined in an interactive session (`python -c`, a notebook),
    left every worker dying as it started. `procs` named outright is refused before anything is written; `auto`,
    whose choice changes only the speed, runs the loop instead."""
    algorithm = ("from pflbed.algorithms import register\nfrom pflbed.algorithms.fedavg import FedAvg\n"
                 "class Mine(FedAvg):\n    name = 'mine'\nregister(Mine)\n")  # fmt: skip
    body = (f"import pflbed, pflbed.engine.auto, sys\n{algorithm if source != 'stdin' else ''}"
            "pflbed.engine.auto.PROCS_MIN_MACS = 0  # auto would choose procs for any run\n"
            f"cfg = {{**{TINY!r}, 'algorithm': {{'name': '{'mine' if source != 'stdin' else 'fedavg'}'}}}}\n"
            "try:\n"
            "    pflbed.run({**cfg, 'executor': {'name': 'procs', 'workers': 2}}, out='procs')\n"
            "except pflbed.errors.PflbedError as e:\n"
            "    print(e)\n"
            "r = pflbed.run({**cfg, 'executor': {'name': 'auto', 'workers': 2}}, out='auto')\n"
            "print(type(r.executor).__name__)\n")  # fmt: skip
    command = [sys.executable, "-"] if source == "stdin" else [sys.executable, "-c", body]
    done = subprocess.run(command, input=body if source == "stdin" else None, cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    why = ("the script calling pflbed.run was read from <stdin>, which its worker processes cannot import"
           if source == "stdin" else "the algorithm class Mine is defined in this interactive session, where its "
           "worker processes cannot import it; define it in a module")  # fmt: skip
    assert (done.returncode, done.stdout) == (0, f"executor.name: procs: {why}; or use executor.name: loop\n"
                                                 "LoopExecutor\n"), done.stderr  # fmt: skip
    assert not (tmp_path / "procs").exists()


def test_a_worker_is_starting_while_multiprocessing_says_it_inherits_its_parent_s_state(monkeypatch):
    import multiprocessing

    from pflbed.engine.procs import starting_worker

    assert starting_worker() is False
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    assert starting_worker() is True


def _main(monkeypatch, path, spec=None):
    """This process's `__main__` as a script at `path` (None: an interactive session) run with `-m spec`, or not."""
    import types

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=spec) if spec else None
    if path is not None:
        main.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "__main__", main)


def test_why_workers_cannot_start_names_a_script_without_a_file_and_an_interactive_session_s_class(monkeypatch,
                                                                                                   tmp_path):
    from torch import nn

    from pflbed.config import validate_config
    from pflbed.engine.procs import why_workers_cannot_start

    algo = prepare(validate_config(TINY))
    script = tmp_path / "train.py"
    script.write_text("")
    for path, spec in [(script, None), (tmp_path / "gone.py", "pkg.train"), (None, None)]:
        _main(monkeypatch, path, spec)
        assert why_workers_cannot_start(algo) is None, (path, spec)
    _main(monkeypatch, "<stdin>")
    assert why_workers_cannot_start(algo) == ("the script calling pflbed.run was read from <stdin>, which its worker "
                                              "processes cannot import")  # fmt: skip
    _main(monkeypatch, None)
    head = algo.ctx.model.blocks["classifier"]
    monkeypatch.setattr(head, "__class__", type("MyLinear", (nn.Linear,), {"__module__": "__main__"}))
    assert why_workers_cannot_start(algo) == ("the model class MyLinear is defined in this interactive session, "
                                              "where its worker processes cannot import it; define it in a module")
    monkeypatch.setattr(algo, "__class__", type("Mine", (FedAvg,), {"name": "mine", "__module__": "__main__"}))
    assert why_workers_cannot_start(algo).startswith("the algorithm class Mine is defined in this interactive session")
    _main(monkeypatch, script)  # a script's classes: its file is imported again in each worker
    assert why_workers_cannot_start(algo) is None
