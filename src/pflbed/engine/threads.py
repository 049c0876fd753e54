"""The default torch thread count, and the machine facts a result depends on (`summary.json` → `provenance`).

Why one thread for small models: a client's step on LeNet-5 / the FedAvg CNN / an MLP is milliseconds of small
matrix work, and torch's intra-op threads stall as soon as anything else wants a core. `benchmarks/threads.py`
measures it side by side (docs/guide/configuration.md): on an idle 2-core machine all cores are 1.1–1.9× faster, with
one other busy process 1 thread is 1.1–2.9× faster, under heavier load 5–20×. Small models therefore get one
thread; models above `LARGE_MODEL_PARAMS`, whose gain from cores grows with the machine, get all cores. The choice
depends on the model alone (never on the load), so the same config always runs with the same thread count —
results are bit-identical only then.
"""

from __future__ import annotations

import os
import platform

import numpy as np
import torch

LARGE_MODEL_PARAMS = 5_000_000


def choose_threads(model: torch.nn.Module) -> int:
    params = sum(p.numel() for p in model.parameters())
    return 1 if params < LARGE_MODEL_PARAMS else (os.cpu_count() or 1)


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; elsewhere what the platform module knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(device: torch.device | None = None) -> dict[str, object]:
    """What a bit-for-bit comparison of two results needs to know about where they ran (`device`: the run's)."""
    device = device or torch.device("cpu")
    extra = {"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
    return {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        **extra,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
    }
