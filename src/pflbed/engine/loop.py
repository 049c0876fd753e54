"""One experiment (DESIGN §5): the rounds of `driver.Driver`, with the run directory, checkpoints, progress, timing
and the final fine-tuning and new-client stages around them.

Everything that can fail on user input (config, data, federation, output directory) is checked in `prepare`
before the run directory is touched.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pflbed import privacy, rng
from pflbed.algorithms import get_algorithm
from pflbed.algorithms.base import Algorithm, Context
from pflbed.algorithms.training import get_params
from pflbed.allocator import kept_freed_memory
from pflbed.config import Config, resolve_device
from pflbed.data import DataSource, base_dataset, load_source
from pflbed.data.augment import make_augment
from pflbed.engine.auto import choose_executor
from pflbed.engine.batched import BatchedExecutor
from pflbed.engine.driver import Driver
from pflbed.engine.executor import LoopExecutor, precision
from pflbed.engine.procs import ProcsExecutor, WorkerPool, why_workers_cannot_start
from pflbed.engine.progress import RunProgress, announce, interval_s, plain_lines
from pflbed.engine.threads import choose_threads, provenance
from pflbed.errors import ConfigError, DivergedError, PflbedError
from pflbed.evaluation.evaluate import evaluate_personalized
from pflbed.evaluation.newclients import evaluate_new_clients
from pflbed.evaluation.newclients import work as new_client_work
from pflbed.federation import Federation, build_federation
from pflbed.federation.federation import check_disjoint
from pflbed.federation.manifest import check_fractions
from pflbed.models import build_model
from pflbed.models.pretrained import apply_weights, load_weights
from pflbed.results.checkpoint import load_checkpoint, save_checkpoint
from pflbed.results.rundir import RunDir, default_out
from pflbed.results.summary import build_summary
from pflbed.results.tensorboard import TensorBoardLog


@dataclass
class RunResult:
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    out: Path | None
    server: dict[str, torch.Tensor]
    executor: LoopExecutor


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


def run(
    cfg: Config, out: Path | None = None, *, write: bool = True, progress: bool = True, resume: bool = False,
    force: bool = False, threads: int | None = None, pool: WorkerPool | None = None,
    host: Callable[[Algorithm, Callable[[LoopExecutor], RunResult]], RunResult] | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:  # fmt: skip
    """Run one experiment; with `write`, results go to `out` (default `runs/<algo>-<data>-seed<seed>`).

    With `resume`, continue from the run directory's last checkpoint (or from the start if it has none). An
    existing run in `out` is refused unless `force` (see `RunDir.check`). A non-finite loss or parameter stops
    the run with `DivergedError`, keeping the metrics logged so far and the last checkpoint. `pool`: worker
    processes to reuse for `executor.name: procs` (else the run starts and stops its own). With `executor.name:
    flower` the same experiment runs inside a Flower ServerApp: `host(algo, experiment)` runs `experiment` (a
    function of the executor) there. The engine does not import Flower: `pflbed.runs.run` (what `pflbed.run` and
    the CLI call) passes Flower's simulation as the host. `on_record` is called with each evaluation's record once
    it is logged (`pflbed tune` reports the validation curve to its pruner there; an exception it raises stops the
    run, which keeps its metrics and last checkpoint).
    """
    if cfg.executor.name == "flower" and host is None:
        raise PflbedError("executor.name: flower runs through pflbed.runs.run (or pflbed.run, the CLI), which hosts "
                          "the experiment in Flower; pflbed.engine.loop.run does not import Flower")  # fmt: skip
    started = time.perf_counter()
    if plain_lines(progress):  # a bad PFLBED_PROGRESS_INTERVAL is refused before anything is written
        interval_s()
    announce(progress, f"{cfg.algorithm.name} on {cfg.dataset.name}: {cfg.train.rounds} rounds"
                       f"{', resuming' if resume else ''}; loading the data…")  # fmt: skip
    algo = prepare(cfg, threads)
    rundir = RunDir.check(out or default_out(cfg), cfg, force=force, resume=resume) if write else None
    if cfg.executor.name == "flower":  # the experiment runs inside a ServerApp of Flower's simulation runtime
        return host(algo, lambda ex: experiment(cfg, algo, ex, rundir, progress, resume, on_record, started))
    executor, own_pool = make_executor(algo, pool)
    try:
        return experiment(cfg, algo, executor, rundir, progress, resume, on_record, started)
    finally:
        if own_pool is not None:
            own_pool.close()


def experiment(
    cfg: Config, algo: Algorithm, executor: LoopExecutor, rundir: RunDir | None, progress: bool, resume: bool,
    on_record: Callable[[dict[str, Any]], None] | None = None, started: float | None = None,
) -> RunResult:
    """The experiment around the rounds of `Driver(algo, executor)`: resume from `rundir`'s checkpoint, progress,
    metrics and checkpoints per round, the final fine-tuning and new-client stages, timing and the summary. Run
    in this process for `loop` and `procs`, inside a Flower ServerApp for `flower` (`flower.server`). `started`:
    when the command started (`time.perf_counter`), where the progress lines' clock starts.

    Checkpoints: every `train.checkpoint_every` rounds, after every evaluation (an interrupted run keeps every
    round it has scored: resumed, it ends as if never stopped) and after the last round. The process that writes
    the run directory holds it throughout (`RunDir.hold`): not two runs at once there."""
    if rundir is None:
        return _experiment(cfg, algo, executor, rundir, progress, resume, on_record, started)
    rundir.hold()  # before its checkpoint is read or its files replaced; a new directory: once `start` makes it
    try:
        return _experiment(cfg, algo, executor, rundir, progress, resume, on_record, started)
    finally:
        rundir.release()


def _experiment(
    cfg: Config, algo: Algorithm, executor: LoopExecutor, rundir: RunDir | None, progress: bool, resume: bool,
    on_record: Callable[[dict[str, Any]], None] | None, started: float | None,
) -> RunResult:
    saved = load_checkpoint(rundir.path, algo.ctx.device) if (rundir and resume) else None
    initial = None if saved else algo.init_server()  # before the directory is written: a refusal there leaves none
    if rundir and not resume:
        rundir.start(cfg)
    fed = algo.ctx.federation
    if saved:
        server, executor.states, history = saved["server"], saved["clients"], saved["history"]
        timing = saved["timing"]
        per_client = {int(c): v for c, v in saved["extra"]["per_client"].items()}
        first = saved["round"] + 1
        rundir.rewrite_metrics(history)
    else:
        if rundir and resume:
            rundir.start(cfg)
        server, history, per_client, first = initial, [], {}, 1
        timing = {"wall_s": 0.0, "train_s": 0.0, "eval_s": 0.0}
    t_start, wall_before = time.perf_counter(), timing["wall_s"]
    ledger = None  # a DP run's releases, durable in the run directory: kept across a resume, whatever it replays
    if cfg.privacy.enabled:
        ledger = privacy.Ledger(rundir.path / privacy.LEDGER if rundir else None, cfg.privacy_randomness(),
                                fresh=not resume)  # fmt: skip
    driver = Driver(algo, executor, ledger)
    checkpointed = saved["round"] if saved else None
    title = f"{cfg.algorithm.name} on {cfg.dataset.name}"
    board = TensorBoardLog(rundir.path / "tensorboard") if (rundir and cfg.log.tensorboard) else None
    with RunProgress(progress, title, cfg.train.rounds, first - 1, t0=started) as bar, contextlib.ExitStack() as stack:
        if board is not None:
            stack.callback(board.close)
        stack.enter_context(kept_freed_memory(cfg.executor.keep_freed_memory))
        try:
            for r in driver.rounds(server, first):
                server = r.server
                timing["train_s"] += r.train_s
                timing["eval_s"] += r.eval_s
                if r.record is not None:
                    history.append(r.record)
                    per_client = r.per_client or {}
                    if rundir:
                        rundir.log(r.record)
                    if board is not None:
                        board.log(r.record)
                    if on_record is not None:
                        on_record(r.record)
                bar.round_done(r.rnd, r.record)
                every = cfg.train.checkpoint_every
                if rundir and (r.record is not None or (every and r.rnd % every == 0) or r.rnd == cfg.train.rounds):
                    timing["wall_s"] = wall_before + time.perf_counter() - t_start
                    save_checkpoint(rundir.path, r.rnd, server, executor.states, history, timing,
                                    {"per_client": per_client})  # fmt: skip
                    checkpointed = r.rnd
                del r  # the round's server state lives on in `server` only
        except DivergedError as e:  # the driver knows the round; the experiment adds what it kept
            logged = history[-1]["round"] if history else None
            raise DivergedError(e.round, e.where, str(rundir.path) if rundir else None, checkpointed,
                                logged, e.hint) from None  # fmt: skip
        t1 = time.perf_counter()
        finetuned = {}
        methods = algo.finetune_methods(server, list(cfg.eval.finetune))
        for i, method in enumerate(methods):
            gen_for = lambda c, i=i: rng.generator(cfg.seed, rng.FINETUNE, i, c)  # noqa: E731
            on_sites = getattr(executor, "personalize_on_sites", None)  # the data is on the sites
            with bar.stage(f"fine-tuning every client ({method})", len(fed.participated)) as tick, precision(algo):
                if on_sites is not None:
                    finetuned[method] = on_sites(server, method, i)
                else:
                    finetuned[method] = evaluate_personalized(algo, server, method, gen_for, tick)
        timing["eval_s"] += time.perf_counter() - t1
        t1 = time.perf_counter()
        new_clients = None
        if fed.new:
            with bar.stage(f"personalizing {len(fed.new)} new clients", new_client_work(algo)) as tick, \
                    precision(algo):  # fmt: skip
                new_clients = evaluate_new_clients(algo, server, tick)
        timing["new_clients_s"] = time.perf_counter() - t1
        files = {}
        if rundir and not hasattr(executor, "evaluate_on_sites"):  # plots of client states: not on the server
            with bar.stage("artifacts", 1) as tick:
                files = algo.artifacts(server, executor.state, rundir.path / "plots")
                tick()
    timing["wall_s"] = wall_before + time.perf_counter() - t_start
    timing["s_per_round"] = timing["train_s"] / cfg.train.rounds
    timing = {k: round(v, 4) for k, v in timing.items()}
    summary = build_summary(cfg, fed, history, finetuned, per_client, timing, new_clients)
    summary["provenance"] = provenance(algo.ctx.device)
    summary.update(getattr(executor, "summary_extra", {}))
    if rundir:
        if files:
            summary["artifacts"] = {k: f"plots/{v}" for k, v in files.items()}
        rundir.write_summary(summary)
    return RunResult(summary, history, rundir.path if rundir else None, server, executor)

