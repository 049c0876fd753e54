"""The training work a process has done, in sample passes: `pflbed tune`'s unit of compute.

A sample pass is one training sample through one gradient computation. Every algorithm's local training, the final
fine-tuning and the new clients' personalization draw their mini-batches from `algorithms.training.index_batches`,
which counts here each batch's samples times the gradient computations its caller makes on it (`passes`: pFedMe's K
inner steps, APFL's two models). Evaluation forwards are not counted: they are the protocol's, the same for every
method. Counted per process; the worker-process executor adds its workers' counts to the run's process
(`engine.procs`), so a study's compute is the same whatever executor ran its trials.

Why sample passes and not trials or rounds: methods do very different amounts of training in one round (Ditto
trains two models, FedRep a head and then a body, FedAvg+FT fine-tunes at the end), so equal trials or rounds are
not equal compute; samples through a gradient are what the methods pay for on any hardware.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_total = 0


def add(samples: int) -> None:
    """Count `samples` sample passes (from any thread: the threads executor trains clients concurrently)."""
    global _total
    with _lock:
        _total += samples


def total() -> int:
    """Sample passes counted in this process so far; a run's work is the difference across it."""
    return _total
