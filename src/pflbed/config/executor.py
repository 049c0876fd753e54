"""`executor.*`: where and how a run's clients train (in this process, worker processes, Flower; CPU or GPU)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from pflbed.config.base import Strict, max_threads

if TYPE_CHECKING:
    import torch

class ExecutorConfig(Strict):
    name: Literal["auto", "loop", "procs", "flower"] = Field(
        "auto", description="auto: the fastest of loop and procs for the run (engine.auto: batched loop on a GPU, "
        "procs on a multi-core CPU when the run's training outweighs the workers' start-up, loop otherwise; the "
        "figures are the same either way); loop: clients one after another in this process; procs: a round's "
        "clients in parallel worker processes (identical results at the same thread count per process); flower: "
        "clients as Flower ClientApps in Flower's simulation runtime (the `flower` extra)"
    )
    workers: int | None = Field(
        None, description="procs: worker processes; flower: ClientApp processes running at once; 1 to 4 × cores; "
        "unset: one per core"
    )
    supernodes: int | None = Field(
        None, ge=1, description="flower: simulated SuperNodes; node k serves the clients whose id is k modulo their "
        "number; unset: one per client"
    )
    round_timeout: float | None = Field(
        None, gt=0, description="flower: seconds a round waits for its replies; clients that have not replied by "
        "then (or whose node failed) are left out of the round and listed in its record's failed_clients; unset: "
        "wait for every reply"
    )
    state_dir: str | None = Field(
        None, min_length=1, description="flower: keep each client's state on its SuperNode, in files under this "
        "directory (or the node's state-dir node config), so a node that restarts continues its clients; states "
        "then travel only when the server evaluates or checkpoints. Unset: states stay with the server and travel "
        "with each round's messages"
    )
    strict: bool = Field(False, description="round-trip every payload, reply and client state through bytes")
    threads: int | None = Field(
        None,
        description="torch CPU threads (per process), 1 to 4 × cores; unset (auto): 1 for small models (measured "
        "fastest, and safe when several runs share the machine), all cores for large ones "
        "(engine.threads.choose_threads); procs workers: 1",
    )

    keep_freed_memory: bool = Field(
        True, description="while the run trains and evaluates, keep the memory the process frees for its next "
        "allocations (glibc's malloc: no mmap per large allocation, no trimming; pflbed.allocator) instead of "
        "returning it to the system and faulting it in again — batched rounds on a CPU allocate hundreds of MB a "
        "step (benchmarks/allocator.py); the process's memory does not shrink until the run ends; figures are the "
        "same either way; no effect off glibc"
    )
    batch_clients: bool | None = Field(
        None, description="executor.name=loop: train a round's clients together as one batched computation where "
        "the algorithm's update is a plan of local SGD (engine.batched; the algorithms index says which; equal to one "
        "by one up to float rounding); unset: on when executor.device is a GPU, off on CPU, where it is slower"
    )
    batch_max_clients: int | None = Field(
        None, ge=1, description="batched clients: at most this many in one batched computation; unset: all of a "
        "round's, and on a GPU half as many whenever they do not fit in its memory, or fit only by flushing its "
        "allocator's cache (kept for the rounds after)"
    )
    compile: Literal["off", "default", "reduce-overhead"] = Field(
        "off", description="batched clients: the vmapped step under torch.compile (`default`: fused kernels; "
        "`reduce-overhead`: also replayed as a CUDA graph, on a GPU) — compiled once per run and step shape (a "
        "minute or more, a C++ compiler on a CPU), then equal to the eager step up to float rounding "
        "(docs/guide/gpu.md); off: the eager step"
    )
    device: str = Field(
        "cpu", description="where the data, the models and every tensor of the run live: cpu, cuda (the current "
        "GPU), cuda:N or auto (cuda when available, else cpu); random draws stay on CPU generators"
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: forwards and backwards under torch.autocast in bfloat16 (parameters, optimizer "
        "updates and exchanged tensors stay float32) — faster on GPUs with bf16 tensor cores, and it changes "
        "results (docs/guide/gpu.md); fp32: plain float32"
    )
    tf32: bool | None = Field(
        None, description="on a GPU, the float32 precision of matrix products and convolutions: unset, PyTorch's "
        "defaults (convolutions in TensorFloat-32, matrix products such as linear layers in float32); true: both in "
        "TF32, faster where linear layers weigh, and results change beyond float32's rounding; false: both in "
        "float32, the most exact, with slower convolutions (docs/guide/gpu.md). No effect on a CPU"
    )
    deterministic: bool = Field(
        True, description="on a GPU: reproducible kernels (cuDNN, cuBLAS and torch's deterministic modes), so one "
        "config and seed give the same figures run after run; false: the faster defaults, whose figures vary by "
        "float rounding from run to run (docs/guide/gpu.md). No effect on a CPU"
    )
    autotune: bool = Field(
        False, description="on a GPU: cuDNN times its convolution algorithms on each new shape and keeps the fastest "
        "(torch.backends.cudnn.benchmark) instead of choosing by heuristics — under executor.deterministic only "
        "reproducible ones, but which wins may differ from one process to the next, and with it the figures' float "
        "rounding (docs/guide/gpu.md); a run's first steps of each shape pay the timing. Batched clients' steps "
        "also time each convolution's weight gradient as one matrix product over the clients against cuDNN's "
        "grouped kernels and keep the faster. No effect on a CPU"
    )

    @model_validator(mode="after")
    def _check(self) -> ExecutorConfig:
        if self.batch_clients and self.name not in ("loop", "auto"):
            raise ValueError("batch_clients applies to executor.name=loop or auto (batched clients run in the loop "
                             "executor)")  # fmt: skip
        if self.batch_max_clients is not None and (self.batch_clients is False or self.name not in ("loop", "auto")):
            raise ValueError("batch_max_clients applies to batched clients (executor.batch_clients, "
                             "executor.name=loop)")  # fmt: skip
        if self.compile != "off" and (self.batch_clients is False or self.name not in ("loop", "auto")):
            raise ValueError("compile applies to batched clients (executor.batch_clients, executor.name=loop)")
        for key in ("supernodes", "round_timeout", "state_dir"):
            if getattr(self, key) is not None and self.name != "flower":
                raise ValueError(f"{key} applies to executor.name=flower")
        if self.name == "flower" and importlib.util.find_spec("flwr") is None:
            raise ValueError("executor.name=flower needs the flower extra: pip install 'pflbed[flower]'")
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in ("cpu", "auto"):  # always valid; any other name is checked now (one config line), not mid-run
            resolve_device(v)
        return v

    @field_validator("threads", "workers")
    @classmethod
    def _per_core(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= max_threads():
            raise ValueError(f"must be unset (auto) or 1 to {max_threads()} (4 × this machine's cores)")
        return v


def resolve_device(name: str) -> torch.device:
    """`executor.device` as a `torch.device`: `auto` becomes `cuda` where CUDA is available, else `cpu`.

    Raises ValueError (a config error) for anything else than cpu / cuda / cuda:N / auto, and for a CUDA device this
    machine does not have — checked at validation, so a run never starts and then fails on its first tensor.
    """
    kind, sep, index = name.partition(":")
    if name not in ("cpu", "auto") and (kind != "cuda" or (sep and not (index.isascii() and index.isdigit()))):
        raise ValueError("must be cpu, cuda, cuda:N (N = 0, 1, …) or auto")  # before torch: a typo is said at once
    import torch  # late: reading or checking a config needs no torch until a device is asked for

    if name == "auto":
        return resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("CUDA is not available on this machine; use cpu or auto")
    count = torch.cuda.device_count()
    if sep and int(index) >= count:
        raise ValueError(f"no such CUDA device: this machine has {count} (cuda:0 to cuda:{count - 1})")
    # with its index: tensors report `cuda:0`, never `cuda`, so only an indexed device compares equal to theirs
    return torch.device("cuda", int(index) if sep else torch.cuda.current_device())
