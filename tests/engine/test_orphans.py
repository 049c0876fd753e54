"""A `procs` run killed outright (SIGKILL: no handler runs) leaves no process behind: its workers notice that their
parent is gone and exit, and with them the multiprocessing resource tracker, which exits once nobody holds its pipe."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RUN = ["--set", "dataset.name=synthetic", "--set", "model.name=mlp", "--set", "federation.clients=4",
       "--set", "train.rounds=100000", "--set", "eval.every=100000", "--set", "eval.finetune=[]",
       "--set", "executor.name=procs", "--set", "executor.workers=2", "--set", "executor.threads=1",
       "--no-progress"]  # fmt: skip


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process; None where it is gone (a zombie counts as gone: it runs nothing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else (fields[0], int(fields[1]))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "(gone)"


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            children.setdefault(st[1], []).append(int(d))
    found, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_workers_and_the_resource_tracker_exit_when_the_run_is_killed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "pflbed", "run", *RUN, "--out", str(tmp_path / "r")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        # two workers and the resource tracker, and the workers past start-up (the run's first checkpoint is
        # written after round 10, when they have trained clients)
        while time.monotonic() < deadline and proc.poll() is None:
            kids = _descendants(proc.pid)
            if len(kids) >= 3 and (tmp_path / "r" / "checkpoints" / "last.pt").exists():
                break
            time.sleep(0.1)
        assert proc.poll() is None and len(kids) >= 3, (kids, proc.stderr.read().decode() if proc.poll() else "")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_stat(p) for p in kids):
            time.sleep(0.1)
        left = {p: _cmdline(p) for p in kids if _stat(p)}
        assert not left, f"still running 10 s after the run was killed: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in kids:  # only the processes this test started, if the check above failed
            if _stat(p):
                os.kill(p, signal.SIGKILL)
        proc.stderr.close()


WAITING_WORKER = """
import time, torch
from pflbed.engine.procs import WorkerError, WorkerPool
pool = WorkerPool(1, threads=1)
try:  # the worker answers (with the error of an empty predictor) once it is past its start-up
    pool.forward(b'', 'logits', 'test', [torch.arange(1)], 1)
except WorkerError:
    print(pool.procs[0].pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_an_idle_worker_exits_when_its_parent_is_killed():
    """The case no pipe ends: the worker waits on an empty task queue whose write end it holds itself, so only its
    watch on the parent (`procs.exit_with_parent`) can end it. (In a killed run a worker may also die reading a
    task whose shared tensors the dead parent can no longer hand over, which let the run-level test above pass
    with the watch removed.)"""
    proc = subprocess.Popen([sys.executable, "-c", WAITING_WORKER], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _stat(worker):
            time.sleep(0.05)
        assert not _stat(worker), f"the worker still runs 10 s after its parent was killed: {_cmdline(worker)}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        if worker is not None and _stat(worker):  # only if the check above failed
            os.kill(worker, signal.SIGKILL)
