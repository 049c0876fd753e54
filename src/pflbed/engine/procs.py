"""The worker-process executor (DESIGN §5, `executor.name: procs`): a round's clients train in parallel processes.

Why processes and not threads: a client's step on the small models PFL papers use is milliseconds of small matrix
work that torch's intra-op threads parallelize badly (docs/guide/configuration.md); separate processes with one thread
each keep every core busy on a different client.

How it stays identical to `loop`: a client's update depends only on (payload, state, data, its generator), and the
generator and torch's global RNG are seeded from (seed, round, client id) exactly as in `LoopExecutor` — so which
worker runs a client, and in which order, changes nothing. Workers run with the same per-process thread count as the
loop executor's process, which makes the two bit-identical (the parity tests check it for every algorithm).

What crosses the process boundary and how:
- the algorithm object (config, data, federation, model template) once per run: `torch.multiprocessing` moves the
  data's tensors to shared memory, so the dataset is shared by all workers rather than copied; the rest, the
  federation's indices included, is copied, and each worker builds its models once;
- per client, the payload and the client's state out, the reply and the new state back, each message's tensors
  packed into one shared-memory buffer (`Packed`: one file descriptor to pass instead of one per tensor; a payload
  sent to many clients is packed once); both sides copy them into private memory on receipt, so no worker can
  write into another's payload and the executor keeps no shared-memory handle per client (10,000 client states
  would otherwise hold 10,000 of them).
Client states live in this process, where evaluation and checkpoints need them. Workers exit by themselves when
this process is gone, even killed with SIGKILL (`exit_with_parent`): a killed run leaves no process behind.

On a GPU run (`executor.device`), everything crosses the boundary as CPU tensors and is moved to the device by the
receiver: the data once per worker, payloads, states and replies per client. CUDA tensors could be shared between
processes too, but only while their producer keeps them alive — a lifetime rule this executor would have to police.

Clients are assigned to workers before the round, largest training set first to the least-loaded worker (a
client's cost grows with its samples); the assignment only affects speed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import sys
import threading
import traceback
from collections.abc import Iterator
from multiprocessing import connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp

from pflbed import compute, rng
from pflbed.algorithms.base import Algorithm, Predictor, Tensors
from pflbed.allocator import kept_freed_memory
from pflbed.engine.executor import LoopExecutor, update_client
from pflbed.engine.packed import Packed, pack, unpack

_POLL_S = 1.0  # how often a waiting executor checks that its workers are alive


def _put(q: Any, obj: object) -> None:
    """Pickle now, in this thread (tensors move to shared memory here), then queue the bytes.

    `Queue.put` would pickle in a background thread per queue; two queues pickling the same tensors at once (the
    algorithm sent to every worker, one payload to several) race on moving their storage to shared memory, and a
    worker then reads garbage.
    """
    q.put(bytes(ForkingPickler.dumps(obj)))


def _get(q: Any, **kw: Any) -> Any:
    return pickle.loads(q.get(**kw))


def exit_with_parent() -> None:
    """In a process started by `multiprocessing`: exit as soon as the process that started it is gone.

    Why: a parent killed outright (SIGKILL, the out-of-memory killer, a batch system's hard limit) cannot stop its
    workers, and a worker blocked on its task queue would wait forever — it holds that queue's write end itself, so
    it never sees end-of-file; orphaned, workers held their memory, and the multiprocessing resource tracker (which
    exits by itself once no process holds its pipe), for hours. A thread waits on the parent's sentinel, a pipe whose
    other end only the parent holds: it becomes readable when the parent exits, however it died, on every platform,
    with no polling (unlike Linux's PR_SET_PDEATHSIG, which also fires when the thread that started
    the worker ends). In a process not started by `multiprocessing` there is no parent to watch: nothing happens."""
    parent = mp.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def starting_worker() -> bool:
    """Whether this process is a spawned worker still starting: importing the script that started the pool.

    Why it matters: "spawn" runs the parent's `__main__` script again in each worker, as `__mp_main__`, before the
    worker's own code; a script that calls `pflbed.run` at its top level, not under `if __name__ == "__main__":`,
    would start a run in every worker. The flag is the one `multiprocessing` sets for that phase (and reads itself to
    refuse starting processes in it)."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def why_workers_cannot_start(algo: Algorithm) -> str | None:
    """Why a spawned worker could not take `algo`, or None. A worker imports the parent's `__main__` again, from its
    file, and unpickles classes by module and name: a script read from standard input has no file to import (every
    worker would fail as it started), and a class defined in an interactive session (a notebook, `python -c`) no
    module a worker could import it from."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main.__spec__, "name", None) is None and path is not None and not os.path.isfile(path):
        return f"the script calling pflbed.run was read from {path}, which its worker processes cannot import"
    if path is None:
        for what, obj in [("algorithm", algo), *(("model", m) for m in algo.ctx.model.modules())]:
            if type(obj).__module__ == "__main__":
                return (f"the {what} class {type(obj).__qualname__} is defined in this interactive session, where its "
                        "worker processes cannot import it; define it in a module")  # fmt: skip
    return None


def _worker(threads: int, tasks: Any, results: Any, started: Any) -> None:
    """A worker's loop: receive an algorithm, then clients to update with it (or evaluation forwards to run on its
    data), until told to stop (None), or until its parent is gone (`exit_with_parent`). `started` is set first: a
    worker that dies before it is set died while starting (`WorkerPool._next`)."""
    started.set()
    exit_with_parent()
    torch.set_num_threads(threads)
    algo: Algorithm | None = None
    device = torch.device("cpu")
    with contextlib.ExitStack() as kept:  # the run's allocator setting, for the worker's life (`pflbed.allocator`)
        while (msg := _get(tasks)) is not None:
            kind, body = msg
            if kind == "algorithm":
                private, (source, federation) = body
                algo = pickle.loads(private)
                ex, device = algo.ctx.cfg.executor, algo.ctx.device
                kept.close()
                kept.enter_context(kept_freed_memory(ex.keep_freed_memory))
                rng.gpu_kernels(device, ex.deterministic, ex.autotune, ex.tf32)
                algo.ctx.source, algo.ctx.federation = source.to(device), pickle.loads(federation).to(device)
                continue
            if kind == "forward":
                tag, predictor, method, split, parts, batch_size = body
                try:
                    pred = pickle.loads(predictor)
                    x = getattr(algo.ctx.source, split).x
                    outs = [getattr(pred, method)(x[p.to(device)], batch_size).cpu() for p in parts]
                    _put(results, (tag, outs, None, None))
                except BaseException as e:
                    _put(results, (tag, None, None, (type(e).__name__, str(e), traceback.format_exc())))
                continue
            rnd, cid, payload, state = body
            try:
                before = compute.total()
                reply, new_state = update_client(algo, rnd, cid, *unpack(payload, device), *unpack(state, device))
                _put(results, (cid, pack(reply, new_state), compute.total() - before, None))
            except BaseException as e:  # report it; the executor raises it in the main process
                _put(results, (cid, None, None, (type(e).__name__, str(e), traceback.format_exc())))


class WorkerError(RuntimeError):
    """A client update failed in a worker process (the worker's traceback is in the message)."""


class WorkerPool:
    """`workers` processes with `threads` torch threads each; reusable for several runs (one algorithm at a time).

    Started with the "spawn" method: forking a process that already ran torch's thread pools can deadlock, and CUDA
    cannot be used in forked children at all.
    """

    def __init__(self, workers: int, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.threads = threads
        self.device = torch.device("cpu")  # the loaded algorithm's (`load`)
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(workers)]
        self.started = [ctx.Event() for _ in range(workers)]
        self.procs = [ctx.Process(target=_worker, args=(threads, q, self.results, e), daemon=True)
                      for q, e in zip(self.tasks, self.started, strict=True)]  # fmt: skip
        for p in self.procs:
            p.start()

    @property
    def size(self) -> int:
        return len(self.procs)

    def load(self, algo: Algorithm) -> None:
        """Send `algo` to every worker: its data shared, everything else (models!) a private copy.

        Model templates are trained in place, so workers sharing one would write into each other's weights. The
        shared data go as CPU tensors; each worker moves them to the run's device.
        """
        ctx = algo.ctx
        self.device = ctx.device
        shared = ctx.source, ctx.federation
        ctx.source = ctx.federation = None  # type: ignore[assignment]
        try:
            private = pickle.dumps(algo)  # plain pickle: tensors are copied into the bytes
        finally:
            ctx.source, ctx.federation = shared
        # The federation is copied, not shared: it is small (indices and priors) but holds a few tensors per
        # client, and each shared tensor costs a file descriptor in every process — 10,000 clients exceeded the
        # open-file limit.
        on_cpu = ctx.source.to("cpu"), pickle.dumps(ctx.federation.to("cpu"))
        for q in self.tasks:
            _put(q, ("algorithm", (private, on_cpu)))

    def submit(self, worker: int, rnd: int, cid: int, payload: Packed, state: Tensors) -> None:
        """Client `cid`'s update to `worker`: its payload packed by the caller (one packing serves every client
        sent the same payload), its state packed here."""
        _put(self.tasks[worker], ("client", (rnd, cid, payload, pack(state))))

    def forward(self, predictor: bytes, method: str, split: str, parts: list[torch.Tensor],
                batch_size: int) -> list[torch.Tensor]:  # fmt: skip
        """`getattr(pred, method)(x[part], batch_size)` for every part, x the `split` of the loaded algorithm's data
        and `pred` the pickled `predictor`: contiguous runs of parts, one run per worker, on the run's device."""
        per = -(-len(parts) // self.size)
        runs = [parts[i : i + per] for i in range(0, len(parts), per)]
        for w, run in enumerate(runs):
            _put(self.tasks[w], ("forward", (("forward", w), predictor, method, split, [p.cpu() for p in run],
                                             batch_size)))  # fmt: skip
        done = [self._next() for _ in runs]  # every run's result taken before any error is raised
        for _, _, _, error in done:
            _raise(error, "an evaluation forward")
        outs = {w: out for (_, w), out, _, _ in done}
        return [o.to(self.device, copy=True) for w in range(len(runs)) for o in outs[w]]

    def collect(self) -> tuple[int, tuple[Tensors, Tensors]]:
        """The next finished client's (cid, (reply, state)); raises if the update failed or a worker died."""
        cid, packed, work, error = self._next()
        _raise(error, f"client {cid}")
        compute.add(work)  # the worker's training, counted where the run is (`pflbed.compute`)
        reply, state = unpack(packed, self.device)
        return cid, (reply, state)

    def _next(self) -> tuple:
        """The next (tag, result, result or sample passes, error) from any worker; raises if a worker died."""
        while True:
            try:
                return _get(self.results, timeout=_POLL_S)
            except queue.Empty:
                dead = [(p, e) for p, e in zip(self.procs, self.started, strict=True) if not p.is_alive()]
                if dead:
                    p, started = dead[0]
                    when = "" if started.is_set() else " as it started; what it printed is above"
                    raise WorkerError(f"a worker process died (exit code {p.exitcode}){when}") from None

    def discard(self, n: int) -> None:
        """Collect and drop `n` outstanding results."""
        for _ in range(n):
            try:
                self.collect()
            except WorkerError:
                if not all(p.is_alive() for p in self.procs):
                    return

    def close(self) -> None:
        """Stop the workers: each is told to once it has run what it was sent, and killed if it has not stopped
        within 10 s.

        Then what is still queued for them is dropped. A worker killed while still starting up (slow under load)
        or one that died leaves its queue's background thread blocked on a full pipe that nobody reads, and the
        interpreter joins that thread at exit: the process that started the pool never exited."""
        for q, p in zip(self.tasks, self.procs, strict=True):
            if p.is_alive():
                _put(q, None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        for q in self.tasks:
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise(error: tuple[str, str, str] | None, what: str) -> None:
    if error is not None:
        name, message, trace = error
        raise WorkerError(f"{what}: {name}: {message}\n--- worker traceback ---\n{trace}")


def assign(sizes: dict[int, int], workers: int) -> dict[int, int]:
    """cid → worker: largest client first to the least-loaded worker (ties: lower cid, lower worker)."""
    load = [0] * workers
    out: dict[int, int] = {}
    for cid in sorted(sizes, key=lambda c: (-sizes[c], c)):
        w = min(range(workers), key=lambda i: (load[i], i))
        out[cid] = w
        load[w] += max(sizes[cid], 1)
    return out


class ProcsExecutor(LoopExecutor):
    """Runs a round's client updates in a `WorkerPool`; keeps the client states like `LoopExecutor`."""

    def __init__(self, algo: Algorithm, pool: WorkerPool, strict: bool = False) -> None:
        super().__init__(algo, strict)
        self.pool = pool
        pool.load(algo)

    def forward(self, pred: Predictor, method: str, split: str, parts: list[torch.Tensor],
                batch_size: int) -> list[torch.Tensor] | None:  # fmt: skip
        """An evaluation's forwards (`evaluation.evaluate.Forward`) split over the workers, idle between rounds; None
        (run them here) where that would not give this process's numbers or could not pay: workers with another
        thread count than this process, fewer than two parts or workers. Each part runs whole in one worker with
        the chunking it has here, so the outputs are bit-identical."""
        if len(parts) < 2 or self.pool.size < 2 or self.pool.threads != torch.get_num_threads():
            return None
        return self.pool.forward(pickle.dumps(pred), method, split, parts, batch_size)

    def stream(self, rnd: int, payloads: dict[int, Tensors]) -> Iterator[tuple[int, Tensors]]:
        """Results arrive in any order; each is handed on as soon as every client before it has been."""
        fed = self.algo.ctx.federation
        where = assign({cid: fed.num_train(cid) for cid in payloads}, self.pool.size)
        order = sorted(payloads)
        packed: dict[int, Packed] = {}  # per payload object (alive in `payloads`): most rounds send one to all
        for cid in order:
            if id(payloads[cid]) not in packed:
                packed[id(payloads[cid])] = pack(self.prepare(payloads[cid]))
            self.pool.submit(where[cid], rnd, cid, packed[id(payloads[cid])], self.state(cid))
        early: dict[int, tuple[Tensors, Tensors]] = {}
        outstanding = len(order)
        try:
            for cid in order:
                while cid not in early:
                    outstanding -= 1
                    early.update([self.pool.collect()])  # no name left holding a reply after it is handed on
                yield cid, self.keep(rnd, cid, *early.pop(cid))
        finally:  # stopped early (a diverged or failed client): a reused pool must not hand this round's rest on
            self.pool.discard(outstanding)
