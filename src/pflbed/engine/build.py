"""What one experiment runs on (DESIGN §5): its data, federation, model and algorithm (`prepare`), and the executor
its clients run in (`make_executor`).

Everything that can fail on user input (config, data, federation, initial weights) is checked in `prepare`, before
a run directory is touched. The experiment around these, with its run directory, checkpoints and summary, is the
results layer's (`pflbed.results.experiment`): the engine writes no file.
"""

from __future__ import annotations

import os

import torch

from pflbed import rng
from pflbed.algorithms import get_algorithm
from pflbed.algorithms.base import Algorithm, Context
from pflbed.algorithms.training import get_params
from pflbed.config import Config, resolve_device
from pflbed.data import DataSource, base_dataset, load_source
from pflbed.data.augment import make_augment
from pflbed.engine.auto import choose_executor
from pflbed.engine.batched import BatchedExecutor
from pflbed.engine.executor import LoopExecutor
from pflbed.engine.procs import ProcsExecutor, WorkerPool, why_workers_cannot_start
from pflbed.engine.threads import choose_threads
from pflbed.errors import ConfigError, PflbedError
from pflbed.federation import Federation, build_federation
from pflbed.federation.federation import check_disjoint
from pflbed.federation.manifest import check_fractions
from pflbed.models import build_model
from pflbed.models.pretrained import apply_weights, load_weights


def prepare(cfg: Config, threads: int | None = None) -> Algorithm:
    """Load data, build the federation and the initial model, and instantiate the algorithm.

    Torch threads: `executor.threads` if set, else the caller's `threads` (a bench worker's one thread), else the
    model-size policy of `choose_threads` (oversubscribed cores slow small models by orders of magnitude).

    Device (`executor.device`): the data and the federation are built on the CPU (partitioning is NumPy, the
    federation cache is keyed by content) and moved to the device once, here; the model is initialized on the CPU
    and moved, so one seed gives the same initial weights on every device.
    """
    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    check_fractions(fed, cfg)
    return build_algorithm(cfg, source, fed, threads)


def build_algorithm(cfg: Config, source: DataSource, fed: Federation, threads: int | None = None,
                    context: type[Context] = Context) -> Algorithm:  # fmt: skip
    """`prepare`'s algorithm over a given data source and federation (a Flower site's or server's: `flower.sites`),
    its context of class `context`."""
    device = resolve_device(cfg.executor.device)
    rng.gpu_kernels(device, cfg.executor.deterministic, cfg.executor.autotune, cfg.executor.tf32)
    algo_cls = get_algorithm(cfg.algorithm.name)
    options = algo_cls.Config.model_validate(cfg.algorithm_options())
    torch.manual_seed(rng.derive_seed(cfg.seed, rng.INIT))
    model = build_model(cfg.model.name, source.input_shape, source.num_classes, device, cfg.model.channels_last)
    if cfg.model.init_from:
        init_model(model, cfg, fed)
    torch.set_num_threads(cfg.executor.threads or threads or choose_threads(model))
    augment = make_augment(cfg.dataset.augment, source.input_shape, source.pixel_norm)
    ctx = context(cfg, source.to(device), fed.to(device), options, model, get_params(model), device, augment)
    algo = algo_cls(ctx)
    if cfg.privacy.enabled and fed.participated:
        check_dp_payload(algo)
    return algo


def check_dp_payload(algo: Algorithm) -> None:
    """Refuse, before anything runs, a DP run whose clients would receive integer entries, each named with its
    dtype: a client replies the new values of the entries it received, and an integer one (BatchNorm's
    `num_batches_tracked`) can be neither clipped nor noised (`privacy.clip_reply` would refuse the first reply).

    Exempt: the entries an algorithm declares in `dp_instructions`, instructions to the clients that are never
    replied and hold nothing private (L2GD's run lengths, drawn from the round and the seed); the driver noises the
    float entries only."""
    cfg, first = algo.ctx.cfg, algo.ctx.federation.participated[0]
    exempt = set(algo.dp_instructions)
    ints = [f"{k} ({str(v.dtype).removeprefix('torch.')})" for k, v in
            sorted(algo.configure(1, algo.init_server(), [first])[first].items())
            if not v.is_floating_point() and k not in exempt]  # fmt: skip
    if not ints:
        return
    more = " …" if len(ints) > 3 else ""
    hint = "; use a model without BatchNorm, or fedbn, which keeps BatchNorm on the clients" if any(
        "num_batches_tracked" in k for k in ints) else ""  # fmt: skip
    raise ConfigError(f"privacy.clip: {cfg.algorithm.name} on {cfg.model.name} sends integer entries that cannot "
                      f"be clipped or noised: {', '.join(ints[:3])}{more}{hint}")  # fmt: skip


def init_model(model: torch.nn.Module, cfg: Config, fed: Federation) -> None:
    """`model.init_from` into `model` (the blocks of `model.init_blocks`), after checking that a recorded pretraining
    source shares no sample with `fed`. Every algorithm starts from the result (`Context.initial_params`); models an
    algorithm draws afresh (FedBasis's independent bases without warm-up, other architectures) stay random."""
    weights = load_weights(cfg.model.init_from)
    if weights.source is not None:
        check_disjoint(fed, base_dataset(cfg.dataset), weights.source, "model.init_from")
    apply_weights(model, weights, cfg.model.init_blocks, cfg.model.name)


def make_executor(algo: Algorithm, pool: WorkerPool | None = None) -> tuple[LoopExecutor, WorkerPool | None]:
    """The configured executor, and the worker pool it started (None: none, or the caller's `pool` was used)."""
    ex = algo.ctx.cfg.executor
    name = "loop" if ex.batch_clients else choose_executor(ex, algo.ctx)
    if name == "procs" and (why := why_workers_cannot_start(algo)) is not None:
        if ex.name == "procs":
            raise PflbedError(f"executor.name: procs: {why}; or use executor.name: loop")
        name = "loop"  # auto's choice changes only the speed
    if name == "loop":
        batched = ex.batch_clients if ex.batch_clients is not None else algo.ctx.device.type == "cuda"
        return (BatchedExecutor if batched else LoopExecutor)(algo, strict=ex.strict), None
    own = None
    if pool is None:
        pool = own = WorkerPool(ex.workers or os.cpu_count() or 1, ex.threads or 1)
    return ProcsExecutor(algo, pool, strict=ex.strict), own
