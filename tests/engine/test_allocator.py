"""Keeping freed memory (`pflbed.allocator`, `executor.keep_freed_memory`): what glibc's malloc does inside and
outside it, that a run's rounds and a `procs` worker hold it, and that it changes no figure.

glibc's own statistics (`mallinfo2`) tell whether an allocation was served by `mmap` (`hblkhd`: bytes in mmapped
blocks) and how much freed memory the heap keeps (`fordblks`)."""

from __future__ import annotations

import ctypes
import pickle
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pflbed import allocator
from pflbed.allocator import kept_freed_memory
from pflbed.config import validate_config
from pflbed.engine import procs
from pflbed.engine.build import prepare
from pflbed.results.experiment import run
from tests.engine.worker_here import run_worker_here
from tests.tiny import TINY, figures

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")

BIG = 64 * 2**20  # bytes: far above glibc's largest dynamic mmap threshold (32 MiB)


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def mallinfo() -> MallInfo2:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2()


def big_is_mmapped() -> bool:
    """Whether a new tensor of at least 64 MiB is served by its own mmap. Larger than all the heap's free memory
    together, so that no freed block can serve it (a block kept while the setting was on may still be free)."""
    info = mallinfo()
    size = max(BIG, info.fordblks + BIG)
    t = torch.empty(size, dtype=torch.uint8)
    mapped = mallinfo().hblkhd - info.hblkhd >= size
    del t
    return mapped


def test_inside_a_large_allocation_comes_from_the_heap_and_stays_there_when_freed() -> None:
    assert big_is_mmapped()  # glibc's default: the baseline the setting changes
    with kept_freed_memory():
        assert not big_is_mmapped()
        t = torch.empty(BIG // 4)
        free = mallinfo().fordblks
        del t
        assert mallinfo().fordblks - free > BIG - 2**20  # freed, kept in the heap (not trimmed) for the next one
    assert big_is_mmapped()  # glibc's defaults back after


def test_nested_uses_keep_it_until_the_last_leaves_and_off_does_nothing() -> None:
    with kept_freed_memory():
        with kept_freed_memory():
            pass
        assert not big_is_mmapped()
        with kept_freed_memory(False):  # off inside on: leaves it on
            assert not big_is_mmapped()
    assert big_is_mmapped()
    with kept_freed_memory(False):
        assert big_is_mmapped()
    assert allocator._users == 0


class FakeLibc:
    """Records what the allocator asks of glibc."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


def test_it_turns_off_mmap_and_trimming_and_puts_back_glibcs_defaults_then_trims(monkeypatch) -> None:
    """The exact settings (the heap statistics above cannot see a trim threshold that is merely large)."""
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    with kept_freed_memory():
        assert libc.calls == [("mallopt", -4, 0), ("mallopt", -1, 2**31 - 1)]
    assert libc.calls[2:] == [("mallopt", -4, 65536), ("mallopt", -1, 128 * 1024), ("malloc_trim", 0)]


@pytest.mark.parametrize(("system", "libc"), [("Linux", "musl"), ("Darwin", "glibc"), ("Windows", "")])
def test_only_glibc_on_linux_is_touched(system, libc, monkeypatch) -> None:
    """Another C library's mallopt takes other parameters (or none): off glibc on Linux nothing is loaded or set."""
    monkeypatch.setattr(allocator.platform, "system", lambda: system)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda *a, **k: (libc, "1.0"))
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda *a, **k: pytest.fail("a C library was loaded"))
    assert allocator._glibc() is None
    with kept_freed_memory():
        pass


def test_glibc_is_loaded_where_ctypes_finds_it_else_by_its_usual_name_else_not_at_all(monkeypatch) -> None:
    found, loaded = [], []

    def load(name):
        loaded.append(name)
        if name == "missing":
            raise OSError(name)
        return name

    monkeypatch.setattr(allocator.ctypes, "CDLL", load)
    for where in ("/lib/libc-found.so", None, "missing"):
        monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda n, w=where: found.append(n) or w)
        assert allocator._glibc() == (None if where == "missing" else where or "libc.so.6")
    assert found == ["c"] * 3 and loaded == ["/lib/libc-found.so", "libc.so.6", "missing"]


@pytest.mark.parametrize("keep", [True, False])
def test_a_runs_rounds_and_evaluations_hold_it_as_configured(keep: bool) -> None:
    seen: list[bool] = []
    cfg = validate_config({**TINY, "executor": {**TINY["executor"], "keep_freed_memory": keep}})
    run(cfg, write=False, progress=False, on_record=lambda _: seen.append(big_is_mmapped()))
    assert seen and all(mapped is not keep for mapped in seen)
    assert big_is_mmapped()  # and puts glibc's defaults back after


def test_the_figures_are_the_same_with_and_without_it() -> None:
    on, off = (validate_config({**TINY, "executor": {**TINY["executor"], "threads": 1, "keep_freed_memory": keep}})
               for keep in (True, False))  # fmt: skip
    assert figures(run(on, write=False, progress=False).summary) == figures(run(off, write=False, progress=False)
                                                                            .summary)  # fmt: skip


class Probe:
    """A `procs` worker's forward task that answers whether a large allocation in the worker is mmapped."""

    def mmapped(self, x: torch.Tensor, batch_size: int) -> torch.Tensor:
        return torch.tensor(big_is_mmapped())


@pytest.mark.parametrize("keep", [True, False])
def test_a_procs_worker_holds_it_as_its_run_says_and_puts_it_back_when_it_stops(keep: bool) -> None:
    """The worker loop, run here on plain queues: the algorithm's message, then a forward that probes, then stop."""
    cfg = {**TINY, "executor": {**TINY["executor"], "keep_freed_memory": keep}}
    results = run_worker_here(prepare(validate_config(cfg)),
                              ("forward", (0, pickle.dumps(Probe()), "mmapped", "test", [torch.arange(1)], 1)))
    tag, outs, _, error = procs._get(results)
    assert error is None and bool(outs[0]) is not keep
    assert big_is_mmapped() and allocator._users == 0


def test_the_side_by_side_benchmark_runs_and_finds_the_same_state_both_ways() -> None:
    """`benchmarks/allocator.py` as the configuration guide names it, at a tiny size: one row, states equal."""
    script = Path(__file__).parents[2] / "benchmarks" / "allocator.py"
    out = subprocess.run([sys.executable, str(script), "--repeats", "1", "--clients", "2", "--samples", "20",
                          "--rounds", "2", "--cases", "fedavg/mlp/batched"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    row = out.stdout.strip().splitlines()[-1].split()
    assert row[0] == "fedavg/mlp/batched" and row[-1] == "yes"
