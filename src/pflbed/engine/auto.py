"""`executor.name: auto` (the default): the fastest executor for the run, which never changes its figures.

The rule (measured: docs/guide/speed.md, and benchmarks/auto_executor.py, benchmarks/gpu.py):
- on a GPU: `loop`, whose round trains the plain-SGD clients batched (`executor.batch_clients` is on there by
  default) — FedAvg's CNN at 100 clients ran 7.3× faster than client by client on an H100, and 3.9× faster than
  `procs` with 4 workers sharing it;
- on a CPU with several cores: `procs` (one single-threaded worker per core) when the round trains at least two
  clients and the run's training is worth the workers' start-up — at least `PROCS_MIN_MACS` multiply-accumulates
  (`training_macs`); `loop` otherwise (a test-sized run would spend longer starting workers than training).
`procs` gives `loop`'s figures bit for bit at one thread per process (tests/engine/test_procs.py), so the choice only
changes speed. A model whose forward the default thread policy would run on all cores (`engine.threads`) keeps
`loop`: its steps already use every core.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pflbed.algorithms.base import Context
from pflbed.config import ExecutorConfig
from pflbed.engine.threads import choose_threads

# Below this much training, the workers' start-up (spawning processes that import torch, shipping the data) costs
# more than the second core saves. Measured on 2 cores, idle (benchmarks/results/auto_executor.txt): loop won at
# 147 GMAC (loop ÷ procs 0.96), procs at 442 GMAC (1.20×) and 1.5 TMAC (1.51×).
PROCS_MIN_MACS = 2e11


def forward_macs(model: nn.Module, input_shape: tuple[int, ...], device: torch.device) -> int:
    """Multiply-accumulates of one sample's forward through `model`'s linear and convolution layers."""
    total = 0

    def count(module: nn.Module, _: object, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Linear):
            total += module.in_features * module.out_features
        elif isinstance(module, nn.modules.conv._ConvNd):
            per_output = module.weight[0].numel()  # in_channels / groups × kernel
            total += per_output * out[0].numel()

    layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.modules.conv._ConvNd)]
    hooks = [m.register_forward_hook(count) for m in layers]
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, device=device))
        model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    return total


def training_macs(ctx: Context) -> float:
    """The run's training work, estimated: 3 × forward MACs (forward and backward) × the samples its rounds train
    (`train.rounds` × the round's share of the participated clients × their training samples × local epochs).
    Algorithms with extra local passes (FedBasis's two steps, Ditto's personal epochs) do more: a lower bound."""
    cfg, fed = ctx.cfg, ctx.federation
    samples = sum(fed.num_train(c) for c in fed.participated) * cfg.federation.sample_fraction
    per_run = samples * cfg.train.local_epochs * cfg.train.rounds
    return 3.0 * forward_macs(ctx.model, ctx.source.input_shape, ctx.device) * per_run


def clients_per_round(ctx: Context) -> float:
    return len(ctx.federation.participated) * ctx.cfg.federation.sample_fraction


def choose_executor(ex: ExecutorConfig, ctx: Context) -> str:
    """`loop` or `procs` for `executor.name: auto` (the module's rule); any other name as it is."""
    if ex.name != "auto":
        return ex.name
    if ctx.device.type != "cpu" or (os.cpu_count() or 1) < 2 or clients_per_round(ctx) < 2:
        return "loop"
    if ex.threads is None and choose_threads(ctx.model) > 1:  # the default thread policy gives it every core
        return "loop"
    return "procs" if training_macs(ctx) >= PROCS_MIN_MACS else "loop"
