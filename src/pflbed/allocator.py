"""Keeping the memory a process frees for its next allocation, instead of handing it back to the system (glibc).

Why: a batched step on a CPU allocates tensors of tens to hundreds of MB many times a round (activations of every
client at once, FedBasis's K + 1 stacked models and their gradients). glibc's malloc serves each of them with a
fresh `mmap` and unmaps it when freed, so the next allocation of the same size starts from pages the kernel must
fault in and zero again: on a 2-core machine FedBasis's batched ResNet-18 round spent more time in the kernel
than in torch (`benchmarks/allocator.py` measures it). With per-allocation `mmap` off and trimming of the heap's
top put off, a freed block stays in the heap and the next one reuses its pages.

The cost: the process's memory no longer shrinks while this is on, so it is on only while a run trains and
evaluates (`results.experiment`, a `procs` worker for its life) and put back afterwards, the heap trimmed
then. Results do not change (the allocator decides where a tensor lives, never its values). Elsewhere than glibc
(macOS, musl, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# mallopt parameters (glibc's malloc.h) and glibc's defaults, which are put back when the last user leaves
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536
KEEP_TRIM_THRESHOLD = 2**31 - 1  # the largest mallopt takes (an int): trim the heap's top past 2 GiB free only

_lock = threading.Lock()
_users = 0


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the only one whose mallopt takes these parameters), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _set(libc: ctypes.CDLL, mmap_max: int, trim_threshold: int) -> None:
    libc.mallopt(M_MMAP_MAX, mmap_max)
    libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)


@contextmanager
def kept_freed_memory(on: bool = True) -> Iterator[None]:
    """Within: freed memory stays with the process for reuse (no `mmap` per allocation, no trimming). Nests and
    may be entered from several threads: glibc's defaults come back, and the heap is trimmed, when the last one
    leaves. `on=False` (`executor.keep_freed_memory: false`) does nothing."""
    global _users
    libc = _glibc() if on else None
    if libc is None:
        yield
        return
    with _lock:
        if _users == 0:
            _set(libc, 0, KEEP_TRIM_THRESHOLD)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                _set(libc, DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
                libc.malloc_trim(0)
