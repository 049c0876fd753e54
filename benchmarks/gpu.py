"""GPU: one command that proves the CUDA paths and measures the simulator on a GPU.

1. Correctness: the test suite's `cuda`-marked tests (tests/engine/test_cuda.py) on the device — every algorithm in
   `loop`, batched clients and `procs` (two workers sharing the device) against the CPU and each other, a checkpoint
   crossing devices both ways, a GPU run loaded and personalized on the CPU — with each comparison's measured
   differences tabulated.
2. Speed on CIFAR-shaped generated data (3×32×32, 10 classes: CIFAR-10's compute, no download): FedAvg, FedPer,
   FedRoD, FedSelect and FedBasis, 100 clients × 500 training samples all participating, 1 local epoch, batch 32,
   McMahan's CNN and ResNet-18 — seconds per round for `loop`, batched clients and `procs` (k workers on the one
   GPU); the centralized limit (plain SGD of the same model and batch on the device, samples/s) and each round's
   share of it; GPU utilisation (sampled) and peak memory. The same at 3×64×64 with the ImageNet-style ResNet-18
   (`paper64`: FedAvg, FedRoD, FedSelect, FedBasis).
3. pfl-research's benchmark shape: 1,000 users × 50 images, cohort 50, batch 10, 1 local epoch, a 2-conv CNN.
4. A profile of one batched FedAvg CNN round (paper shape, after a warm-up round; `--profile ALG/MODEL` another
   seed method's or model's, `--profile-clients N` at N clients, `--profile-executor batched-graphs` its CUDA
   graphs): the operators that take the device's time and
   the host's, and how often the host waits on the device (`profile.txt`) — what stands between the round and the
   device's limit.
5. Where a batched step's time goes: one batched CNN step of 100 clients (vmapped gradient and SGD update, the
   batched executor's step without its bookkeeping) beside one plain model stepping on all those samples at once;
   and each layer's forward and backward as the step runs it (vmapped per-client weights: grouped convolutions),
   as unfold + batched matrix products, as one dense layer on all the samples, and vmapped again autotuned, in
   channels-last memory and with the weight gradient as one batched matrix product (the convolutions), and in TF32
   (the first linear layer).
6. What a batched round spends outside its steps' gradients (`outside`): FedAvg's CNN round batched, then the
   same with each step's vmapped gradient replaced by zeros — the plans, the batches' layout, each step's gather
   and SGD update, the finish, the divergence check and the server's folding-in as a round runs them: the part of
   the round no faster step can lift.
7. What FedBasis's combination of its bases costs in a batched step (θ = ½·v' + ½·Σ α_k·v_k over ResNet-18's
   parameters, 100 clients, forward and backward for its ψ and V steps) in three forms of the same sum, beside
   one pass over the bases' memory.
8. The goals of the GPU work, judged from the figures above (`goals` in gpu.txt / gpu.json).

A full run runs the tests, then measures the goals' cases (FedAvg's CNN batched, ResNet-18 batched for FedAvg,
FedRoD, FedSelect and FedBasis, FedAvg's CNN compiled and as CUDA graphs, with NHWC weights and autotuned), then
profiles, then probes the round outside its gradients and a step, then the ImageNet-style ResNet-18's batched rows,
then the rest: a short GPU allocation answers the questions still open before it spends time on rows already known.
`--part goals` measures the goals' cases alone (and the centralized limit they are judged against), `--part rest`
everything else: two calls on one machine, so that the goals' figures come back even if the machine fails during
the second.

Rounds are timed one by one with the device synchronized at both ends; the first round of each case is a warm-up
(CUDA context, cuDNN heuristics, allocator) and reported apart. Cases run in priority order, each written to the
results as it finishes, and the ones that would start after `--budget-s` are listed as skipped; within a case, no
round starts that the previous round's time says would end after `--deadline-s` (the case is kept, marked
incomplete), so a call under a hard time limit still returns its results.

    python benchmarks/gpu.py                                  # on a GPU: results in a new runs/gpu-<time>/
    python benchmarks/gpu.py --device cpu --quick             # the same end to end on a CPU, small (CI-sized)
    python benchmarks/gpu.py --out benchmarks/results         # replace the committed GPU results (on the GPU)

Output: `<out>/gpu.txt` (tables) and `<out>/gpu.json` (every figure, the GPU's name), `<out>/gpu_tests.log`. `--out`
defaults to a new directory `runs/gpu-<date>-<time>` under the working directory, printed first: a trial on a CPU
never overwrites the committed GPU figures, which only an explicit `--out benchmarks/results` replaces.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from pflbed.allocator import kept_freed_memory
from pflbed.config import validate_config
from pflbed.engine import batched, conv_weight_grad
from pflbed.engine.build import make_executor, prepare
from pflbed.engine.conv_weight_grad import product_conv
from pflbed.engine.driver import Driver
from pflbed.engine.procs import WorkerPool
from pflbed.models import build_model
from pflbed.rng import CUBLAS_DETERMINISTIC_WORKSPACE, gpu_kernels

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ["fedavg", "fedper", "fedrod", "fedselect", "fedbasis"]
# Last in a full run: the baselines whose batched step is a step rule (`local_sgd.StepRule`; APFL's over two
# models), FedCP (an objective drawing each batch's noise, a second extractor's forward), and KT-pFL (a distillation
# phase on the public batch; its zoo reduced to the case's model, 1,000 public samples held out)
LAST = ["perfedavg", "pfedme", "apfl", "fedcp", "ktpfl"]
PUBLIC = 1000  # KT-pFL's public samples, held out of the training pool besides the clients'
# FedBasis replaces train.local_epochs by its ψ and V steps' own epochs (5 each by default): one each here, so its
# round passes over the client's data twice (once per step) where the others pass once. No FedAvg warm start
# (`warmup_fraction` 0: the K bases independent initializations): with the default 30 % of a case's 2 rounds, the
# untimed first round was FedAvg's and the one timed was FedBasis's first, which paid FedBasis's own warm-up: on the
# H200 33 s, the card full (143,298 of its 143,771 MiB: ResNet-18, all 100 clients' five models, their gradients
# and activations — the V step's gradients and momenta are one model's since; the executor halves a round's
# clients once they run out of memory — `batched_calls` says when).
CASE_OPTIONS = {"fedbasis": {"alpha_epochs": 1, "basis_epochs": 1, "warmup_fraction": 0.0}}
SIZE = {"paper": 32, "paper64": 64, "pflr": 32}  # image side of each shape


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh(device: torch.device) -> None:
    """The GPU's cache emptied of the blocks earlier cases left: held there, they would count in this case's memory
    in use (NVML sees what the allocator holds) and make its allocations flush the cache (`cache_flushes`)."""
    if device.type == "cuda":
        gc.collect()  # what a reference cycle still holds
        torch.cuda.empty_cache()


class Sampler:
    """GPU utilisation and memory in use (all processes: `procs` workers too), sampled every 20 ms by NVML."""

    def __init__(self, device: torch.device) -> None:
        self.util: list[int] = []
        self.mem: list[int] = []
        self.handle = None
        if device.type == "cuda" and importlib.util.find_spec("pynvml"):
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        self.stop = threading.Event()

    def __enter__(self) -> Sampler:
        if self.handle is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.util.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            self.mem.append(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.handle is not None:
            self.thread.join()

    def figures(self) -> dict[str, float | None]:
        return {"util_pct": statistics.mean(self.util) if self.util else None,
                "nvml_peak_mem_mb": max(self.mem) / 2**20 if self.mem else None}  # fmt: skip


def config(algorithm: str, model: str, executor: dict, a: argparse.Namespace, shape: str,
           clients: int | None = None, channels_last: bool = False) -> dict:
    """The measured experiment: `shape` = "paper" (the seeds' 100 × 500), "paper64" (the same at 64 px) or "pflr"
    (pfl-research's 1,000 × 50); `clients`: that many clients instead of the shape's (`--profile-clients`);
    `channels_last`: `model.channels_last` (the `-nhwc` cases)."""
    n, per_client, fraction, batch = (1000, 50, 0.05, 10) if shape == "pflr" else (100, 500, 1.0, 32)
    if a.quick:
        n, per_client = max(4, n // 25), max(10, per_client // 25)
    clients = clients or n
    # val 10 % and test 10 % of each client's samples: per_client / 0.8 samples each, per_client of them to train
    public = (PUBLIC // 25 if a.quick else PUBLIC) if algorithm == "ktpfl" else 0
    n_train = int(clients * per_client / 0.8) + public
    options = {"architectures": [model], "public_batch": public} if algorithm == "ktpfl" else {}
    return validate_config({
        "dataset": {"name": "synthetic", "synthetic": {"shape": [3, SIZE[shape], SIZE[shape]], "n_train": n_train,
                                                       "n_test": 1000}},
        "model": {"name": model, "channels_last": channels_last},
        "federation": {"clients": clients, "partition": "iid", "sample_fraction": fraction, "val_fraction": 0.1,
                       "test_fraction": 0.1, "public": public},
        "train": {"rounds": a.rounds if model == a.models[0] and shape != "paper64" else a.big_rounds,
                  "batch_size": batch, "lr": 0.01,
                  "checkpoint_every": 0},
        "eval": {"every": 10**6, "finetune": []},
        "executor": {"device": a.device, "threads": 1, **executor},
        "algorithm": {"name": algorithm, **CASE_OPTIONS.get(algorithm, {}), **options},
    })  # fmt: skip


def time_rounds(cfg, pool: WorkerPool | None, deadline: float = float("inf")) -> dict:
    """Seconds of each training round (device synchronized), samples trained, whether clients ran batched. No round
    after the first starts if the one before says it would end after `deadline` (a `time.perf_counter` value):
    the case is then `incomplete`, with the rounds it has. The kernel flags are put back after the case
    (`kernel_flags`): its `prepare` sets them for the case (`executor.deterministic`, `executor.autotune`), not for
    the cases after."""
    calls, products = [], set()
    real, choose = batched.train_together, conv_weight_grad.chosen

    def counted(*args, **kw):
        calls.append(len(args[1]))
        return real(*args, **kw)

    def chosen(*args, **kw):
        out = choose(*args, **kw)
        products.add(tuple(sorted(out)))
        return out

    batched.train_together, conv_weight_grad.chosen = counted, chosen
    try:
        with kernel_flags():  # as they were before the case, after it
            algo = prepare(cfg)
            device = algo.ctx.device
            executor, own = make_executor(algo, pool)
            driver = Driver(algo, executor)
            server = algo.init_server()
            fresh(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times, flushes = [], []
            with Sampler(device) as sampler, kept_freed_memory(cfg.executor.keep_freed_memory):  # as a run's rounds
                # (`results.experiment`)
                for rnd in range(1, cfg.train.rounds + 1):
                    if times and time.perf_counter() + times[-1] > deadline:
                        break
                    if rnd == 2:
                        sampler.util.clear()  # utilisation of the timed rounds only
                    sync(device)
                    t0, flushed = time.perf_counter(), batched.cache_flushes(device)
                    server, _ = driver.train_round(rnd, server)
                    sync(device)
                    times.append(time.perf_counter() - t0)
                    flushes.append(batched.cache_flushes(device) - flushed)
            if own is not None:
                own.close()
    finally:
        batched.train_together, conv_weight_grad.chosen = real, choose
    fed = algo.ctx.federation
    per_round = len(fed.participated) * cfg.federation.sample_fraction
    samples = round(per_round * statistics.mean(fed.num_train(c) for c in fed.participated))
    timed = times[1:] if cfg.train.rounds > 1 else times
    # every batched computation's clients in order: a call that ran out of memory, then its halves, shows as 100, 50, 50
    out = {"warmup_s": times[0], "rounds_timed": len(timed), "samples_per_round": samples,
           "batched_clients": max(calls, default=0), "batched_calls": calls, "cache_flushes": flushes,
           **sampler.figures()}  # fmt: skip
    if products:  # `executor.autotune`'s choice for a batched step: the convolutions whose weight gradient
        out["conv_products"] = sorted(set().union(*products))  # it computed as a product (`conv_weight_grad`)
    if len(times) < cfg.train.rounds:
        out["incomplete"] = f"{len(times)} of {cfg.train.rounds} rounds: the next would pass --deadline-s"
    if timed:
        out["s_per_round"] = statistics.median(timed)
        out["samples_per_s"] = samples / out["s_per_round"]
    if device.type == "cuda":
        out["torch_peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def centralized(model: str, batch: int, device: torch.device, steps: int, size: int = 32) -> float:
    """Plain SGD steps of `model` at `batch` on `device` (size × size images), data resident there: the most one
    device trains — with the GPU's default kernels (not deterministic: faster than a round's by default, whatever
    ran before), in the fastest of the two layouts (`model.channels_last` off and on) and cuDNN's two ways of
    choosing its algorithms (heuristics, autotuned: `executor.autotune`), as a round may run in either (the `-nhwc`
    and `-tuned` cases)."""
    rates = []
    for last in (False, True):
        for tuned in (False, True):
            with kernel_flags(deterministic=False, autotune=tuned):
                rates.append(_centralized(model, batch, device, steps, size, last))
    return max(rates)


def _centralized(model: str, batch: int, device: torch.device, steps: int, size: int, channels_last: bool) -> float:
    torch.manual_seed(0)
    net = build_model(model, (3, size, size), 10, device, channels_last)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    net.train()

    def step() -> None:
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(max(3, steps // 10)):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return batch * steps / (time.perf_counter() - t0)


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "cudaMemcpyAsync", "aten::item", "aten::_local_scalar_dense", "aten::nonzero")  # host waits


def profile_round(a: argparse.Namespace, out: Path) -> dict:
    """One batched round of `--profile`'s algorithm and model (FedAvg's CNN; paper shape) under `torch.profiler`,
    after a warm-up round: the top operators by device time and by host time, and the count of each host–device
    synchronization, written to `profile.txt`; returns the round's seconds and the synchronization counts."""
    from torch.profiler import ProfilerActivity, profile

    alg, model = a.profile
    ex = a.profile_executor
    cfg = config(alg, model, EXECUTORS[ex], a, "paper", a.profile_clients, channels_last=channels_last(ex))
    algo = prepare(cfg)
    device = algo.ctx.device
    executor, _ = make_executor(algo, None)
    driver = Driver(algo, executor)
    with kept_freed_memory(cfg.executor.keep_freed_memory):  # as a run's rounds
        server, _ = driver.train_round(1, algo.init_server())
        sync(device)
        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            server, _ = driver.train_round(2, server)
            sync(device)
        seconds = time.perf_counter() - t0
        table = prof.key_averages()
        syncs = {e.key: e.count for e in table if e.key in SYNC_EVENTS}
        by_device = table.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30)
        by_host = table.table(sort_by="self_cpu_time_total", row_limit=30)
        with profile(activities=activities, with_stack=True) as traced, warnings.catch_warnings():  # a third round:
            # where the waits come from; the stack tracer reads every module parameter's .grad, which warns for the
            # stacked (non-leaf) parameters a batched step swaps in: a warning about the tracer, not the round
            warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf", UserWarning)
            driver.train_round(3, server)
            sync(device)
    waits = collections.Counter((e.name, python_frames(e)) for e in traced.events() if e.name in SYNC_EVENTS)
    where = "\n".join(f"{n:6d} {name}\n" + "".join(f"         {frame}\n" for frame in frames)
                      for (name, frames), n in waits.most_common(20))  # fmt: skip
    (out / "profile.txt").write_text(
        f"one {ex} {alg} round, {model}, paper shape, {cfg.federation.clients} clients, {device} "
        f"({seconds:.3f} s under the profiler)\n"
        f"host waits on the device (calls): {syncs}\n\nby device time:\n{by_device}\n\nby host time:\n{by_host}\n"
        f"\nwhere the host waits (the next round, calls by their innermost {STACK} Python frames):\n{where}")
    return {"case": f"{alg} {model} {ex}", "clients": cfg.federation.clients, "seconds": seconds, "syncs": syncs}


STACK = 5  # Python frames that tell one place a host wait comes from from another


def python_frames(event) -> tuple[str, ...]:
    """The innermost `STACK` Python functions around a profiled event, innermost first: its enclosing events that
    the profiler's Python tracer (`with_stack`) named `file(line): function`, torch's own files left out."""
    frames: list[str] = []
    parent = event.cpu_parent
    while parent is not None and len(frames) < STACK:
        if re.match(r"^[^<].*\(\d+\): ", parent.name) and not parent.name.startswith("torch/"):
            frames.append(parent.name)
        parent = parent.cpu_parent
    return tuple(frames)


def step_probe(a: argparse.Namespace, device: torch.device) -> dict:
    """Where a batched CNN step's time goes. One step of `clients` clients at batch 32 — the vmapped gradient of
    each client's mean loss and its SGD update, as `engine.batched` runs it, without the executor's bookkeeping —
    beside one plain model stepping on all clients' samples at once (the same arithmetic without the client
    dimension), and each layer's forward and backward in several forms (`layer_probe`); ms per step. All with
    deterministic kernels, as a round runs by default (`executor.deterministic`), so the figures explain the
    rounds'; the step also autotuned (`executor.autotune`)."""
    from torch.func import functional_call, grad, vmap

    clients, steps = (2, 1) if a.quick else (100, 50)
    torch.manual_seed(0)
    model = build_model(a.models[0], (3, 32, 32), 10, device)
    p = {k: v.detach().unsqueeze(0).repeat(clients, *[1] * v.dim()) for k, v in model.state_dict().items()}
    x = torch.randn(clients, 32, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (clients, 32), device=device)
    w = torch.full((clients, 32), 1 / 32, device=device)

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (F.cross_entropy(functional_call(model, p, (x,)), y, reduction="none") * w).sum()

    grads_of = vmap(grad(loss))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def batched_step() -> None:
        g = grads_of(p, x, y, w)
        p.update({k: v - 0.01 * g[k] for k, v in p.items()})

    def one_model_step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.flatten(0, 1)), y.flatten()).backward()
        opt.step()

    out: dict = {"clients": clients, "batch": 32, "steps_per_round": 16}
    for name, step, tuned in (("batched_step_ms", batched_step, False), ("one_model_step_ms", one_model_step, False),
                              ("batched_step_tuned_ms", batched_step, True)):  # fmt: skip
        with kernel_flags(deterministic=True, autotune=tuned):
            for k in range(steps + 3):  # 3 steps of warm-up (and cuDNN's autotuning, where on)
                if k == 3:
                    sync(device)
                    t0 = time.perf_counter()
                step()
            sync(device)
        out[name] = (time.perf_counter() - t0) / steps * 1e3
    out["layers_ms"] = layer_probe(device, clients, steps)
    return out


def outside_probe(a: argparse.Namespace, device: torch.device) -> dict:
    """FedAvg's batched CNN round (paper shape) timed as it runs, then with each step's vmapped gradient replaced by
    zeros of its shape (`engine.batched.compiled` patched for the second timing, put back after): what the round
    spends outside its gradients — the host's plans and layout before the first step, each step's gather and SGD
    update, and after the last the finish, the divergence check and the server's folding-in — and so the least a
    round can take whatever the step's speed. s per round (`time_rounds`: median of the timed rounds). The
    replaced step stands in for a plain SGD phase's (FedAvg's), whose output is the gradients; eager, as the
    `batched` executor runs it."""
    cfg = config("fedavg", a.models[0], EXECUTORS["batched"], a, "paper")
    real = batched.compiled

    def no_gradients(step: Callable, mode: str, model: torch.nn.Module, kept: Callable = batched.copies) -> Callable:
        return lambda p, q, b, *rest: ({k: torch.zeros_like(v) for k, v in p.items()}, dict(b))

    whole = time_rounds(cfg, None)
    batched.compiled = no_gradients
    try:
        outside = time_rounds(cfg, None)
    finally:
        batched.compiled = real
    return {"model": a.models[0], "clients": cfg.federation.clients, "round_s": whole["s_per_round"],
            "outside_s": outside["s_per_round"]}  # fmt: skip


def combine_forms(keys: list[str], group_of: dict[str, int], k: int) -> dict[str, Callable]:
    """Forms of FedBasis's θ = ½·v' + ½·Σ_k α_k·v_k (`basis.combine` with a major basis), each `(v, alpha, m)` →
    θ for one client: `combine` (the library's: a tensor contraction over k, batched matrix products under vmap),
    `mul-add` (K scaled tensors added one by one) and `bcast` (α broadcast over the bases, summed over k)."""
    from pflbed.algorithms.basis import combine, mixing_weights

    def mul_add(v: dict, alpha: torch.Tensor, m: dict) -> dict:
        w_major, w = mixing_weights(alpha, True)
        out = {}
        for key in keys:
            mixed = v[key][0] * w[group_of[key], 0]
            for j in range(1, k):
                mixed = mixed + v[key][j] * w[group_of[key], j]
            out[key] = mixed + w_major * m[key]
        return out

    def bcast(v: dict, alpha: torch.Tensor, m: dict) -> dict:
        w_major, w = mixing_weights(alpha, True)
        return {key: (w[group_of[key]].view(k, *[1] * (v[key].dim() - 1)) * v[key]).sum(0) + w_major * m[key]
                for key in keys}  # fmt: skip

    return {"combine": lambda v, alpha, m: combine(v, alpha, group_of, m, keys), "mul-add": mul_add, "bcast": bcast}


def combine_probe(a: argparse.Namespace, device: torch.device) -> dict:
    """What FedBasis's combination of bases costs in its batched step, on the ResNet model's parameters (K = 4
    bases and the major one, α per block, `clients` clients vmapped), the bases held once for all clients as the
    batched executor holds them (`engine.batched`: unbatched in the vmapped step).

    `alpha`: its ψ step, θ(α, V) (`combine_forms`) forward and backward of ⟨θ, G⟩ with respect to α, the bases
    fixed; each form's θ and gradient against `combine`'s (`max_gap`: the largest difference relative to the
    largest value): a form that computes something else is no alternative, and its time compares nothing.
    `v_step`: its V step, θ = a·θ(α†, V⁰) + P (`basis.v_step_theta`) forward and backward with respect to P and a,
    against what it must give: S·G for P (S = Σ c_i² of the key's group), 0 for a. `pass_ms`: one multiplication of
    every client's θ-sized tensor by a number, one pass over a model a client: the device's floor for producing
    each client's θ. ms per forward and backward."""
    from torch.func import grad, vmap

    from pflbed.algorithms.basis import v_step_theta

    (clients, steps), k = ((4, 2) if a.quick else (100, 10)), 4
    fresh(device)
    torch.manual_seed(0)
    model = build_model(a.models[1], (3, 32, 32), 10, device)
    named = dict(model.named_parameters())
    keys = list(named)
    group_of = {key: gi for gi, b in enumerate(model.block_names()) for key in model.state_keys([b]) if key in named}
    v = {key: torch.randn(k, *t.shape, device=device) for key, t in named.items()}  # shared by every client
    m = {key: torch.randn(*t.shape, device=device) for key, t in named.items()}
    cot = {key: torch.randn(clients, *t.shape, device=device) for key, t in named.items()}
    alpha = torch.softmax(torch.randn(clients, len(model.block_names()), k, device=device), -1)

    def timed(fn: Callable[[], object]) -> float:
        for j in range(steps + 2):
            if j == 2:
                sync(device)
                t0 = time.perf_counter()
            fn()
        sync(device)
        return (time.perf_counter() - t0) / steps * 1e3

    def gap(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got - want).abs().max() / want.abs().max())

    def flat(t: torch.Tensor | dict) -> torch.Tensor:
        return torch.cat([t[key].flatten() for key in keys]) if isinstance(t, dict) else t.flatten()

    shared = (None, 0, None)  # in_dims: the bases once, α per client
    forms = combine_forms(keys, group_of, k)
    want = flat(vmap(forms["combine"], in_dims=shared)(v, alpha, m))
    theta_gap = {name: gap(flat(vmap(form, in_dims=shared)(v, alpha, m)), want) for name, form in forms.items()}
    del want  # a model's worth per client: not held while the forms are timed
    out: dict = {"clients": clients, "K": k, "model": a.models[1], "params": sum(t.numel() for t in named.values()),
                 "alpha": {}}  # fmt: skip
    ref = None
    for name, form in forms.items():
        def inner(v: dict, alpha: torch.Tensor, m: dict, g: dict, form=form) -> torch.Tensor:
            theta = form(v, alpha, m)
            return sum((theta[key] * g[key]).sum() for key in keys)

        grads_of = vmap(grad(inner, argnums=1), in_dims=(*shared, 0))
        got = grads_of(v, alpha, m, cot)
        ref = got if ref is None else ref
        worst = max(gap(got, ref), theta_gap[name])
        out["alpha"][name] = {"ms": timed(lambda grads_of=grads_of: grads_of(v, alpha, m, cot)), "max_gap": worst}

    def v_step(p: dict, decay: torch.Tensor, v: dict, alpha: torch.Tensor, m: dict, g: dict) -> torch.Tensor:
        theta = v_step_theta(v, m, alpha, p, decay, group_of, keys)
        return sum((theta[key] * g[key]).sum() for key in keys)

    p0 = {key: torch.zeros_like(t) for key, t in cot.items()}
    decay = torch.ones(clients, device=device)
    step_of = vmap(grad(v_step, argnums=(0, 1)), in_dims=(0, 0, None, 0, None, 0))
    dp, da = step_of(p0, decay, v, alpha, m, cot)
    s = 0.25 + 0.25 * alpha.pow(2).sum(-1)  # S = Σ c_i², c = (½, ½·α): [clients, groups]
    want_p = {key: s[:, group_of[key]].view(-1, *[1] * (t.dim() - 1)) * t for key, t in cot.items()}
    out["v_step"] = {"v_step_theta": {"ms": timed(lambda: step_of(p0, decay, v, alpha, m, cot)),
                                      "max_gap": max(gap(flat(dp), flat(want_p)), float(da.abs().max()))}}
    out["pass_ms"] = timed(lambda: [t.mul(1.0) for t in cot.values()])
    return out


@contextlib.contextmanager
def kernel_flags(deterministic: bool | None = None, autotune: bool = False, tf32: bool | None = None) -> Iterator[None]:
    """How the GPU chooses its kernels, put back after: cuDNN's flags, torch's deterministic mode, which decides
    cuDNN's convolutions as much as cuDNN's own flag does, and the matrix products' TF32 flag (a case's `prepare`
    sets them all, process-wide). Given `deterministic`, they are set as a GPU run with `executor.deterministic`,
    `executor.autotune` and `executor.tf32` would set them (`rng.gpu_kernels`, told a GPU: the flags are the
    process's, whatever device is measured). cuDNN's autotuner times every algorithm for a new shape and keeps the
    fastest, among the deterministic ones while `deterministic` is on: whether it finds faster grouped convolutions
    (the vmapped step's) than the heuristics is what the `tuned` probes measure."""
    cudnn = torch.backends.cudnn
    now = {"enabled": cudnn.enabled, "benchmark": cudnn.benchmark, "deterministic": cudnn.deterministic,
           "allow_tf32": cudnn.allow_tf32}  # fmt: skip
    mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    matmul = torch.backends.cuda.matmul.allow_tf32
    try:
        with cudnn.flags(**now):
            if deterministic is not None:
                gpu_kernels(torch.device("cuda"), deterministic, autotune, tf32)
            yield
    finally:
        torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
        torch.backends.cuda.matmul.allow_tf32 = matmul


def conv_as_bmm(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each client's 5×5 convolution (padding 2) of its batch as one batched matrix product over unfolded patches:
    `w` [clients, out, in, 5, 5], `x` [clients, batch, in, H, W] → [clients, batch, out, H, W]."""
    b, n, c, h, wd = x.shape
    cols = F.unfold(x.flatten(0, 1), 5, padding=2).view(b, n, c * 25, h * wd)
    out = torch.bmm(w.flatten(2), cols.transpose(1, 2).reshape(b, c * 25, n * h * wd))  # [clients, out, batch·H·W]
    return out.view(b, -1, n, h, wd).transpose(1, 2)


def layer_probe(device: torch.device, clients: int, steps: int) -> dict:
    """Where the batched CNN step's time goes: each layer of McMahan's CNN at 32 px (conv1 3→32 5×5 at 32×32,
    conv2 32→64 5×5 at 16×16, fc1 4096→512), forward and backward for `clients` clients × batch 32, as the batched
    step runs it (`vmap` over per-client weights: a grouped convolution), as unfold + batched matrix product (the
    same arithmetic as one `bmm` per layer), and as one dense layer on all those samples with one weight (the
    arithmetic without the client dimension); and the vmapped convolutions again autotuned by cuDNN (`tuned`:
    `kernel_flags`) and in channels-last memory (`nhwc`: inputs and weights; cuDNN's own grouped kernels work in it, and
    the profile shows it converting every group's tensors to it and back) and with its weight gradient as one
    batched matrix product (`wgrad_bmm`: `conv_weight_grad.product_conv`, which `executor.autotune` times against
    cuDNN's for a batched step); fc1 vmapped again in TF32 (`tf32`: `executor.tf32`; the convolutions are TF32
    already, PyTorch's default); ms per forward and backward."""
    from torch.func import vmap

    n = 32

    def conv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, w, padding=2)

    layers = {"conv1": ((32, 3, 5, 5), (3, 32, 32)), "conv2": ((64, 32, 5, 5), (32, 16, 16)),
              "fc1": ((512, 4096), (4096,))}  # fmt: skip
    out: dict = {}
    for name, (wshape, xshape) in layers.items():
        w = torch.randn(clients, *wshape, device=device, requires_grad=True)
        x = torch.randn(clients, n, *xshape, device=device, requires_grad=True)
        if name == "fc1":
            forms = {"vmap": lambda w, x: vmap(F.linear)(x, w), "bmm": lambda w, x: torch.bmm(x, w.transpose(1, 2)),
                     "dense": lambda w, x: F.linear(x.flatten(0, 1), w[0]),
                     "tf32": lambda w, x: vmap(F.linear)(x, w)}  # fmt: skip
        else:
            forms = {"vmap": vmap(conv), "bmm": conv_as_bmm,
                     "dense": lambda w, x: F.conv2d(x.flatten(0, 1), w[0], padding=2),
                     "tuned": vmap(conv), "nhwc": nhwc(vmap(conv)),
                     "wgrad_bmm": vmap(lambda w, x: product_conv(x, w, (2, 2)))}  # fmt: skip
        out[name] = {}
        for form, fn in forms.items():
            # as the step probe's steps; `tf32`: TF32 matrix products too, as `executor.tf32: true` sets them
            with kernel_flags(deterministic=True, autotune=form == "tuned", tf32=True if form == "tf32" else None):
                for k in range(steps + 3):
                    if k == 3:
                        sync(device)
                        t0 = time.perf_counter()
                    fn(w, x).square().mean().backward()
                sync(device)
            out[name][form] = (time.perf_counter() - t0) / steps * 1e3
    return out


def nhwc(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor],
                                                                              torch.Tensor]:  # fmt: skip
    """`fn(w, x)` on channels-last copies of each client's weights [clients, out, in, k, k] and samples
    [clients, batch, in, H, W] (the copies in the autograd graph: gradients reach `w` and `x`)."""

    def last(t: torch.Tensor) -> torch.Tensor:
        return t.flatten(0, 1).contiguous(memory_format=torch.channels_last).view(t.shape)

    def run(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return fn(last(w), last(x))

    return run


def run_tests(a: argparse.Namespace, out: Path) -> dict:
    """tests/engine/test_cuda.py on the device; the per-comparison differences it reports, summarized."""
    report = out.resolve() / "gpu_parity.jsonl"  # the tests run in the repository, perhaps not the working dir
    report.unlink(missing_ok=True)
    env = {**os.environ, "PFLBED_TEST_DEVICE": a.device, "PFLBED_CUDA_REPORT": str(report),
           # the compiled-step tests: each test worker's inductor compiles on its share of the cores, not on all
           "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, a.test_workers)))}
    cmd = [sys.executable, "-m", "pytest", "tests/engine/test_cuda.py", "-m", "cuda", "-p", "no:cacheprovider", "-rf"]
    if a.quick:
        cmd += ["-k", "fedavg-global-test or resume or loads"]
    if importlib.util.find_spec("xdist") and a.test_workers > 1:
        cmd += ["-n", str(a.test_workers)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.tests_timeout_s)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = f"{e.stdout or ''}{e.stderr or ''}\nTIMED OUT after {a.tests_timeout_s} s", -1
    (out / "gpu_tests.log").write_text(log if isinstance(log, str) else log.decode())
    lines = [json.loads(x) for x in report.read_text().splitlines()] if report.exists() else []
    by_test: dict[str, dict] = {}
    for r in lines:
        t = by_test.setdefault(r["test"], {"comparisons": 0, "max_figure_gap": 0.0, "max_state_gap": 0.0,
                                           "bit_equal": 0, "worst": "", "int_figures_differ": 0})  # fmt: skip
        t["comparisons"] += 1
        t["bit_equal"] += r["bit_equal"]
        t["int_figures_differ"] += bool(r["int_figures_differ"])
        if r["figure_gap"] >= t["max_figure_gap"]:
            t["max_figure_gap"], t["worst"] = r["figure_gap"], f"{r['case']} ({r['figure']})"
        t["max_state_gap"] = max(t["max_state_gap"], r["state_gap"])
    tail = [x for x in log.splitlines() if re.search(r"\d+ (passed|failed|error)", x)][-1:]  # pytest's closing line
    return {"exit_code": rc, "seconds": time.perf_counter() - t0, "result": tail[0] if tail else "", "by_test": by_test,
            "comparisons": lines}  # fmt: skip


def goal_cases(a: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """The cases the goals are judged on (`goals`), in the order a full run measures them first, before the probes:
    batched; FedAvg's CNN also compiled (torch.compile, and its CUDA graphs: `executor.compile`), its graphs with NHWC
    weights (`model.channels_last`: the profile shows cuDNN converting each client's tensors to NHWC and back) and
    under cuDNN's autotuner (`executor.autotune`: the vmapped convolutions are grouped ones, which its heuristics
    may serve poorly, and where it also times the convolutions' weight gradient as one product over the clients,
    `conv_weight_grad`), with NHWC weights and without, and eager under the autotuner; FedBasis's ResNet-18
    autotuned. Not `procs`: batched met FedSelect's goal on the H200 (0.56; `procs` 0.38), and its `procs` row took
    69 s of a ten-minute call."""
    cnn, resnet = a.models
    out = [("paper", "fedavg", cnn, "batched")] + [("paper", alg, resnet, "batched") for alg in RESNET_GOALS]
    out += [("paper", "fedavg", cnn, e) for e in ("batched-compile", "batched-graphs", "batched-graphs-nhwc",
                                                   "batched-graphs-nhwc-tuned", "batched-graphs-tuned",
                                                   "batched-tuned")]  # fmt: skip
    return out + [("paper", "fedbasis", resnet, "batched-tuned")]


def cases(a: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """(shape, algorithm, model, executor) in priority order: the goals' cases, then FedAvg's CNN batched with its
    weights NHWC (`-nhwc`), then the ImageNet-style ResNet-18 at 64 px batched
    (FedAvg, FedRoD, FedSelect, FedBasis: rows no GPU has measured yet), FedAvg's CNN as CUDA graphs with its linear
    layers in TF32 (`-tf32`: what they weigh), then FedAvg's CNN on every executor,
    pfl-research's shape, the other algorithms on the CNN, then ResNet-18 (BatchNorm: batched with per-client running
    statistics; every algorithm here declares a plan), then the rest of the ImageNet-style ResNet-18's rows, then
    Per-FedAvg's, pFedMe's and APFL's CNN rounds, loop against batched (their step rules: several gradients a step), and
    KT-pFL's (from round 2, a distillation on the public batch before the local epochs)."""
    cnn, resnet = a.models
    execs = ["loop", "batched", "procs"]
    if a.quick:  # every code path once: the executors on both shapes, the other algorithms, ResNets, KT-pFL's data
        return [("paper", "fedavg", cnn, e) for e in execs] + [("pflr", "fedavg", cnn, "batched")] + \
            [("paper", alg, cnn, e) for alg in ALGORITHMS[1:] for e in ("loop", "batched")] + \
            [("paper", "fedavg", resnet, "procs"), ("paper", "fedavg", resnet, "batched"),
             ("paper64", "fedbasis", a.imagenet_model, "batched"), ("paper", "ktpfl", cnn, "batched"),
             ("paper", "fedavg", cnn, "batched-tuned"), ("paper", "fedavg", cnn, "batched-nhwc")]  # fmt: skip
    out = [("paper", "fedavg", cnn, e) for e in execs] + [("pflr", "fedavg", cnn, e) for e in execs]
    out += [("paper", "fedavg", cnn, e) for e in ("loop-fast", "batched-fast", "batched-compile", "batched-graphs")]
    out += [("paper", alg, cnn, e) for alg in ALGORITHMS[1:] for e in execs]
    out += [("paper", "fedavg", cnn, e) for e in ("loop-bf16", "batched-bf16")]
    out += [("paper", alg, resnet, e) for alg in ALGORITHMS for e in execs]
    out += [("paper", "fedavg", resnet, "loop-bf16")]
    out += [("paper64", alg, a.imagenet_model, e) for alg in ALGORITHMS if alg != "fedper" for e in execs]
    out += [("paper", "fedavg", resnet, "batched-compile")]
    out += [("paper", alg, cnn, e) for alg in LAST for e in ("loop", "batched")]
    first = goal_cases(a) + [("paper", "fedavg", cnn, "batched-nhwc")]
    first += [("paper64", alg, a.imagenet_model, "batched") for alg in RESNET_GOALS]
    first += [("paper", "fedavg", cnn, "batched-graphs-tf32")]
    return first + [c for c in out if c not in first]


# The goals of the GPU work: ResNet-18's round (paper shape, the best of `GOAL_EXECUTORS`)
# against the centralized samples/s of the same model and batch on the same GPU ...
RESNET_GOALS = {"fedavg": 0.8, "fedrod": 0.8, "fedselect": 0.5, "fedbasis": 0.5}
# ... and FedAvg's batched CNN round (float32, deterministic kernels; compiled or not), 100 clients × 500 samples:
# 0.25 s on an H100; on another GPU, the same multiple of that GPU's centralized CNN rate at batch 32 as 0.25 s is
# of the H100's (measured there: benchmarks/results/gpu_h100.json).
# bf16, TF32 matrix products and nondeterministic kernels change the figures beyond float rounding: they do not count.
CNN_GOAL_S = 0.25
GOAL_EXECUTORS = ("loop", "batched", "procs", "batched-compile", "batched-graphs", "batched-nhwc",
                  "batched-graphs-nhwc", "batched-tuned", "batched-graphs-tuned", "batched-graphs-nhwc-tuned")


def goals(result: dict, reference: Path = ROOT / "benchmarks" / "results" / "gpu_h100.json") -> list[dict]:
    """Each goal: the figure it is judged on, its target, the case that gave it, and whether it is met (None: not
    measured in this run)."""
    a = result["args"]
    cnn, resnet = a["models"]
    speed = [m for m in result.get("speed", []) if m["shape"] == "paper" and m["executor"] in GOAL_EXECUTORS
             and "samples_per_s" in m]  # fmt: skip
    out = []
    for alg, target in RESNET_GOALS.items():
        ms = [m for m in speed if m["algorithm"] == alg and m["model"] == resnet]
        best = max(ms, key=lambda m: m["of_centralized"], default=None)
        out.append({"goal": f"{alg} {resnet} round ÷ centralized samples/s", "target": f">= {target}",
                    "measured": best and round(best["of_centralized"], 3), "via": best and best["executor"],
                    "met": None if best is None else best["of_centralized"] >= target})  # fmt: skip
    ms = [m for m in speed if m["algorithm"] == "fedavg" and m["model"] == cnn]
    best = min(ms, key=lambda m: m["s_per_round"], default=None)
    goal: dict = {"goal": f"fedavg {cnn} s/round", "target": f"<= {CNN_GOAL_S}", "measured": None, "met": None}
    if best is not None and "H100" in (result.get("gpu") or ""):
        goal |= {"measured": round(best["s_per_round"], 3), "met": best["s_per_round"] <= CNN_GOAL_S}
    elif best is not None and cnn == "cnn":  # the H100's 0.25 s as a multiple of its centralized rate
        h100 = json.loads(reference.read_text())["centralized"]["cnn"]["32"]
        target = best["samples_per_round"] / CNN_GOAL_S / h100
        mine = best["of_centralized"]
        goal = {"goal": f"fedavg {cnn} round ÷ centralized samples/s (0.25 s on the H100: {target:.2f} × its "
                f"{h100:.0f})", "target": f">= {target:.2f}", "measured": round(mine, 3),
                "met": mine >= target}  # fmt: skip
    out.append(goal | {"via": best and best["executor"]})
    if result.get("quick"):  # tiny federations: the figures say nothing about the goals
        out = [g | {"met": None} for g in out]
    return out


def chosen_cases(a: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """`--cases shape/algorithm/model/executor …` in the order given (a short GPU allocation measures what is still
    missing first); otherwise every case of `cases`."""
    if not a.cases:
        return cases(a)
    out = []
    for text in a.cases:
        parts = tuple(text.split("/"))
        if len(parts) != 4 or parts[0] not in SIZE or parts[1] not in (*ALGORITHMS, *LAST) \
                or parts[2] not in (*a.models, a.imagenet_model) or parts[3] not in (*EXECUTORS, "procs"):
            raise SystemExit(f"--cases: {text!r} is not shape/algorithm/model/executor, e.g. paper/fedavg/cnn/loop")
        out.append(parts)
    return out


# `-compile` / `-graphs`: executor.compile default / reduce-overhead (the step under torch.compile, and replayed as a
# CUDA graph); `-fast`: executor.deterministic off (the GPU's default, faster kernels whose rounding varies run to run);
# `-bf16`: executor.precision=bf16 (autocast forwards and backwards, float32 parameters and updates); `-tuned`:
# executor.autotune (cuDNN's autotuner: whether a whole round gains what the step probe's `tuned` step gains; it
# times deterministic algorithms only, but which wins is timed anew each run, so a run's rounding may differ from the
# last's: float rounding, as between the loop and batched clients, so it counts for the goals); `-nhwc`:
# model.channels_last (each client's convolution weights NHWC, as the step probe's `nhwc` layers: whether a whole
# round gains what they gain; a setting of the library's, float32 and deterministic, so it counts for the goals);
# `-tf32`: executor.tf32 (linear layers' matrix products in TensorFloat-32 too, as the convolutions are by default:
# what they weigh in a round; a change of precision, so it does not count, as bf16 does not)
EXECUTORS = {"loop": {"batch_clients": False}, "batched": {"batch_clients": True},
             "loop-fast": {"batch_clients": False, "deterministic": False},
             "batched-fast": {"batch_clients": True, "deterministic": False},
             "batched-compile": {"batch_clients": True, "compile": "default"},
             "batched-graphs": {"batch_clients": True, "compile": "reduce-overhead"},
             "batched-tuned": {"batch_clients": True, "autotune": True},
             "batched-graphs-tuned": {"batch_clients": True, "compile": "reduce-overhead", "autotune": True},
             "loop-bf16": {"batch_clients": False, "precision": "bf16"},
             "batched-bf16": {"batch_clients": True, "precision": "bf16"},
             "batched-nhwc": {"batch_clients": True},
             "batched-graphs-nhwc": {"batch_clients": True, "compile": "reduce-overhead"},
             "batched-graphs-nhwc-tuned": {"batch_clients": True, "compile": "reduce-overhead",
                                           "autotune": True},
             "batched-graphs-tf32": {"batch_clients": True, "compile": "reduce-overhead", "tf32": True}}  # fmt: skip


PROFILED = ("batched", "batched-compile", "batched-graphs", "batched-nhwc", "batched-graphs-nhwc", "batched-tuned",
            "batched-graphs-tuned", "batched-graphs-nhwc-tuned")


def channels_last(executor: str) -> bool:
    """Whether a case's convolution weights are channels-last (`model.channels_last`): an `-nhwc` executor."""
    return "nhwc" in executor.split("-")


def fresh_dir(parent: Path = Path("runs")) -> Path:
    """A new directory `parent/gpu-<date>-<time>` (`-2`, `-3`, … if that one exists), created."""
    stem = parent / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}"
    for k in range(1, 1000):
        try:
            (out := stem if k == 1 else stem.with_name(f"{stem.name}-{k}")).mkdir(parents=True)
            return out
        except FileExistsError:
            continue
    raise RuntimeError(f"{stem}: no free name")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny federations, a test subset: the script end to end")
    ap.add_argument("--out", type=Path, help="results directory (default: a new runs/gpu-<date>-<time>; "
                    "--out benchmarks/results replaces the committed GPU results)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="rounds per case; the first is the warm-up")
    ap.add_argument("--big-rounds", type=int, default=2, help="rounds per ResNet case (one timed after the warm-up)")
    ap.add_argument("--workers", type=int, default=4, help="procs: worker processes sharing the device")
    ap.add_argument("--models", nargs=2, default=["cnn", "resnet18"], metavar=("CNN", "RESNET"))
    ap.add_argument("--imagenet-model", default="resnet18_imagenet", help="the paper64 cases' model")
    ap.add_argument("--cases", nargs="*", default=[], metavar="SHAPE/ALG/MODEL/EXEC",
                    help="measure only these speed cases, in this order (default: all, in priority order)")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["tests", "speed", "profile", "outside", "step", "combine"])  # fmt: skip
    ap.add_argument("--part", default="all", choices=["all", "goals", "rest"],
                    help="goals: the goals' cases alone (no tests, no probes); rest: all but them (default: all)")
    ap.add_argument("--profile", default="fedavg", metavar="ALG/MODEL",
                    help="the profiled round's seed method and model (default: FedAvg, the first of --models)")
    ap.add_argument("--profile-executor", default="batched", choices=PROFILED,
                    help="the profiled round's executor (default: batched; batched-graphs: what stands between a "
                    "round of CUDA graphs and the device, the host's work around the steps)")
    ap.add_argument("--profile-clients", type=int, default=None, metavar="N",
                    help="the profiled round's clients (default: the paper shape's): fewer profile a round that "
                    "fills the memory at its own size, its kernels without the allocator's pressure")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no speed case or probe after this many s")
    ap.add_argument("--deadline-s", type=float, default=540.0,
                    help="start no round that would end after this many seconds")
    ap.add_argument("--tests-timeout-s", type=float, default=300.0)
    ap.add_argument("--test-workers", type=int, default=8, help="pytest-xdist workers for the tests, where installed")
    a = ap.parse_args(argv)
    alg, _, model = a.profile.partition("/")
    model = model or a.models[0]
    if alg not in ALGORITHMS or model not in (*a.models, a.imagenet_model):
        ap.error(f"--profile: {a.profile!r} is not a seed method and a model of this run, e.g. fedbasis/cnn")
    if a.profile_clients is not None and a.profile_clients < 1:
        ap.error(f"--profile-clients: {a.profile_clients} is not a number of clients (1 or more)")
    a.profile = (alg, model)
    a.out = a.out or fresh_dir()
    return a


def main() -> None:
    a = parse_args()
    print(f"results: {a.out}", flush=True)
    if a.quick:
        a.rounds, a.big_rounds, a.workers = min(a.rounds, 2), min(a.big_rounds, 2), min(a.workers, 2)
        if a.models == ["cnn", "resnet18"]:
            a.models = ["cnn", "resnet18_x025"]
    t_start = time.perf_counter()
    # cuBLAS reads it when the process first uses it; a run's `prepare` sets it before its first step. Set later (by
    # the first case's), the deterministic cases after the centralized limit would run with cuBLAS's default one. The
    # limit's matrix products (the models' linear layers) run with it too, a negligible part of its steps
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    device = torch.device(a.device)
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    result: dict = {"device": a.device, "gpu": gpu, "torch": torch.__version__, "quick": a.quick,
                    "python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "args": vars(a) | {"out": str(a.out)}}  # fmt: skip
    tests, first, probing, rest = parts(a)
    result["tests"] = run_tests(a, a.out) if tests else None
    result["speed"], result["skipped"] = [], []
    if first or rest:
        steps = 20 if a.quick else 200
        result["centralized"] = {m: {b: centralized(m, b, device, steps) for b in (32, 10)} for m in a.models}
        if any(c[0] == "paper64" for c in first + rest):
            result["centralized"]["paper64"] = {32: centralized(a.imagenet_model, 32, device, steps, 64)}
    procs = any(c[3] == "procs" for c in first + rest)
    with WorkerPool(a.workers, threads=1) if procs else contextlib.nullcontext() as pool:
        speed_cases(a, result, first, pool, t_start)
        if probing:
            probes(a, result, device, t_start)
        speed_cases(a, result, rest, pool, t_start)
    result["seconds"] = time.perf_counter() - t_start
    write(result, a.out)
    print((a.out / "gpu.txt").read_text())
    print(f"results: {a.out}")
    tests = result["tests"]
    failed = [f"{m['algorithm']} {m['model']} {m['executor']}: {m['error']}" for m in result["speed"] if "error" in m]
    if failed:
        print("failed cases:\n" + "\n".join(failed), file=sys.stderr)
    sys.exit(1 if (tests and tests["exit_code"] != 0) or failed else 0)


def parts(a: argparse.Namespace) -> tuple[bool, list, bool, list]:
    """What this call measures, in its order: whether the tests run, the speed cases measured first (the goals';
    with `--cases`, those), whether the probes run, the speed cases after them. `--part goals`: the first cases
    alone; `--part rest`: all but them; `--skip` leaves out what it names either way."""
    todo = chosen_cases(a) if "speed" not in a.skip else []
    first = todo if a.cases else [c for c in todo if c in goal_cases(a)]
    rest = [c for c in todo if c not in first]
    goals, others = a.part != "rest", a.part != "goals"
    return others and "tests" not in a.skip, first if goals else [], others, rest if others else []


def speed_cases(a: argparse.Namespace, result: dict, todo: list, pool: WorkerPool | None, t_start: float) -> None:
    """Time `todo`'s cases into `result["speed"]` (written out after each), those past `--budget-s` skipped."""
    for shape, alg, model, ex in todo:
        if time.perf_counter() - t_start > a.budget_s:
            result["skipped"].append(f"{shape} {alg} {model} {ex}")
            continue
        executor = EXECUTORS.get(ex, {"name": "procs", "workers": a.workers})
        try:
            m = time_rounds(config(alg, model, executor, a, shape, channels_last=channels_last(ex)),
                            pool if ex == "procs" else None,
                            t_start + a.deadline_s)  # fmt: skip
        except Exception as e:  # a failed case is a result too; the next ones still run
            m = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
        m.update(shape=shape, algorithm=alg, model=model, executor=ex)
        batch = 10 if shape == "pflr" else 32
        if "samples_per_s" in m:
            limit = result["centralized"]["paper64" if shape == "paper64" else model][batch]
            m["of_centralized"] = m["samples_per_s"] / limit
        result["speed"].append(m)
        write(result, a.out)
        print(line(m), flush=True)


def probes(a: argparse.Namespace, result: dict, device: torch.device, t_start: float) -> None:
    """The profile of a batched round, the outside, step and combine probes, each unless skipped or past
    `--budget-s`."""
    for name, probe in (("profile", lambda: profile_round(a, a.out)), ("outside", lambda: outside_probe(a, device)),
                        ("step", lambda: step_probe(a, device)), ("combine", lambda: combine_probe(a, device))):
        if name in a.skip:
            continue
        if time.perf_counter() - t_start > a.budget_s:
            result["skipped"].append(name)
            continue
        try:
            with kernel_flags():  # as they were before the probe, after it (a profiled `-tuned` round's `prepare`)
                result[name] = probe()
        except Exception as e:  # a failed probe is a result too; the cases after it still run
            result[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
        write(result, a.out)


def line(m: dict) -> str:
    head = f"{m['shape']:7s} {m['algorithm']:9s} {m['model']:17s} {m['executor']:15s}"
    if "error" in m:
        return f"{head} ERROR {m['error']}"
    if "s_per_round" not in m:
        return f"{head} {'-':>9s} {m['warmup_s']:8.2f}  incomplete: {m['incomplete']}"
    util = f"{m['util_pct']:5.0f}" if m.get("util_pct") is not None else "    -"
    mem = m.get("nvml_peak_mem_mb") or m.get("torch_peak_mem_mb")
    mem_s = f"{mem:8.0f}" if mem is not None else "       -"
    return (f"{head} {m['s_per_round']:9.3f} {m['warmup_s']:8.2f} {m['samples_per_s']:11.0f} "
            f"{m.get('of_centralized', float('nan')):6.2f} {m['batched_clients']:7d} {util} {mem_s}")  # fmt: skip


def write(result: dict, out: Path) -> None:
    result["goals"] = goals(result)
    (out / "gpu.json").write_text(json.dumps(result, indent=1, default=str))
    rows = [f"device: {result['device']} ({result['gpu'] or 'no GPU'}), torch {result['torch']}, "
            f"{result['cpu_count']} CPU cores{', quick' if result['quick'] else ''}"]  # fmt: skip
    if t := result.get("tests"):
        rows += ["", f"cuda tests: exit {t['exit_code']}, {t['result']} ({t['seconds']:.0f} s)",
                 f"{'comparison':24s} {'n':>4s} {'bit-equal':>9s} {'max figure gap':>14s} {'max state gap':>13s} "
                 f"{'int differ':>10s}  worst"]  # fmt: skip
        for name, s in t["by_test"].items():
            rows.append(f"{name:24s} {s['comparisons']:4d} {s['bit_equal']:9d} {s['max_figure_gap']:14.2e} "
                        f"{s['max_state_gap']:13.2e} {s['int_figures_differ']:10d}  {s['worst']}")  # fmt: skip
    if c := result.get("centralized"):
        rows += ["", "centralized limit (plain SGD, data on the device), samples/s: "
                 + ", ".join(f"{m} batch {b}: {v:.0f}" for m, d in c.items() for b, v in d.items())]  # fmt: skip
    if result.get("speed"):
        rows += ["", "paper: 100 clients × 500 samples, all per round, batch 32 (paper64: at 64 px, the "
                 "centralized limit paper64's); pflr: 1,000 users × 50, cohort 50, batch 10; 1 local epoch; "
                 "s/round = median of the timed rounds (first round: warm-up, apart)",
                 f"{'shape':7s} {'algorithm':9s} {'model':17s} {'exec':15s} {'s/round':>9s} {'warm-up':>8s} "
                 f"{'samples/s':>11s} {'÷cent.':>6s} {'batched':>7s} {'util%':>5s} {'peak MB':>8s}"]  # fmt: skip
        rows += [line(m) for m in result["speed"]]
        loops = {(m["shape"], m["algorithm"], m["model"]): m for m in result["speed"] if m["executor"] == "loop"
                 and "s_per_round" in m}  # fmt: skip
        ratios = [f"{m['shape']} {m['algorithm']} {m['model']} {m['executor']}: "
                  f"{loops[(m['shape'], m['algorithm'], m['model'])]['s_per_round'] / m['s_per_round']:.2f}×"
                  for m in result["speed"] if m["executor"] != "loop" and "s_per_round" in m
                  and (m["shape"], m["algorithm"], m["model"]) in loops]  # fmt: skip
        if ratios:
            rows += ["", "speed-up over loop (loop s/round ÷ s/round):", *ratios]
        ceiling = [f"{m['shape']} {m['algorithm']} {m['model']} {m['executor']}: {m['cache_flushes']} a round; "
                   f"batched computations of {m['batched_calls']} clients" for m in result["speed"]
                   if any(m.get("cache_flushes") or ())]  # fmt: skip
        if ceiling:
            rows += ["", "allocator cache flushes (memory at the GPU's ceiling; the executor then halves):", *ceiling]
        tuned = [f"{m['shape']} {m['algorithm']} {m['model']} {m['executor']}: "
                 f"{', '.join(m['conv_products']) or 'none'}" for m in result["speed"] if "conv_products" in m]
        if tuned:
            rows += ["", "convolutions whose weight gradient autotune computed as a product (conv_weight_grad):",
                     *tuned]  # fmt: skip
    if (p := result.get("profile")) and "error" not in p:
        rows += ["", f"profiled {p['case']} round, {p['clients']} clients: {p['seconds']:.3f} s; "
                 f"host waits: {p['syncs']} (profile.txt)"]  # fmt: skip
    for name in ("profile", "outside", "step", "combine"):
        if "error" in (result.get(name) or {}):
            rows += ["", f"{name}: ERROR {result[name]['error']}"]
    if (c := result.get("outside")) and "error" not in c:
        rows += ["", f"outside probe: FedAvg's {c['model']} round batched, {c['clients']} clients: "
                 f"{c['round_s']:.3f} s; with each step's gradient replaced by zeros: {c['outside_s']:.3f} s (the "
                 "plans, the layout, each step's gather and update, the finish, the check, the folding-in)"]
    if (c := result.get("step")) and "error" not in c:
        rows += ["", f"step probe: one batched {result['args']['models'][0]} step, {c['clients']} clients × batch "
                 f"{c['batch']} (a paper-shape round: {c['steps_per_round']} steps): {c['batched_step_ms']:.2f} ms; "
                 f"one plain model on all those samples at once: {c['one_model_step_ms']:.2f} ms; the batched step "
                 f"autotuned by cuDNN: {c['batched_step_tuned_ms']:.2f} ms"]  # fmt: skip
        for name, forms in c["layers_ms"].items():
            rows.append(f"  {name} forward + backward, ms: " + ", ".join(f"{f} {v:.2f}" for f, v in forms.items()))
    if (c := result.get("combine")) and "error" not in c:
        rows += ["", f"combine probe: FedBasis's θ = ½·v' + ½·Σ α_k·v_k over {c['model']}'s {c['params']:,} "
                 f"parameters, K = {c['K']}, the bases shared by {c['clients']} clients vmapped; forward + backward, "
                 f"ms (largest gap to what it must give); one pass over a model a client: {c['pass_ms']:.2f} ms"]
        for step, what in (("alpha", "ψ step, with respect to α"), ("v_step", "V step, with respect to P and a")):
            rows.append(f"  {what}: " + ", ".join(f"{f} {r['ms']:.2f} ({r['max_gap']:.1e})"
                                                  for f, r in c[step].items()))  # fmt: skip
    if g := result.get("goals"):
        rows += ["", "goals:"] + [f"  {x['goal']}: {x['measured'] if x['measured'] is not None else 'not measured'} "
                                  f"({x['target']}{'; via ' + x['via'] if x['via'] else ''}) — "
                                  f"{ {True: 'met', False: 'NOT met', None: 'not judged'}[x['met']]}" for x in g]
    if result.get("skipped"):
        rows += ["", "skipped (time budget): " + "; ".join(result["skipped"])]
    (out / "gpu.txt").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
