"""One experiment (DESIGN §5, §7): the rounds of the engine's `Driver`, with the run directory, checkpoints and
resume, progress, timing, the final fine-tuning and new-client stages, and the summary around them; on any
executor: the engine's own (`loop`, `procs`, `auto`), or Flower's simulation (`executor.name: flower`).

This is the results layer: it builds on the engine (`engine.build` prepares the run and its executor) and on
Flower's executor, which the engine never imports. `pflbed.run`, `pflbed run`, benches and tuning trials come here;
a Flower deployment's ServerApp (`flower.server`) runs `experiment` on its own executor.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pflbed import privacy, rng
from pflbed.algorithms import only_here
from pflbed.algorithms.base import Algorithm
from pflbed.allocator import kept_freed_memory
from pflbed.config import Config
from pflbed.engine.build import make_executor, prepare
from pflbed.engine.driver import Driver
from pflbed.engine.executor import LoopExecutor, precision
from pflbed.engine.procs import WorkerPool
from pflbed.engine.progress import RunProgress, announce, interval_s, plain_lines
from pflbed.engine.threads import provenance
from pflbed.errors import DivergedError, PflbedError
from pflbed.evaluation.evaluate import evaluate_personalized
from pflbed.evaluation.newclients import evaluate_new_clients
from pflbed.evaluation.newclients import work as new_client_work
from pflbed.evaluation.pretrained import pretrained_accuracy
from pflbed.results.checkpoint import check_config, check_fits, load_checkpoint, save_checkpoint
from pflbed.results.rundir import RunDir, config_record, default_out
from pflbed.results.summary import build_summary
from pflbed.results.tensorboard import TensorBoardLog

Host = Callable[[Algorithm, Callable[[LoopExecutor], "RunResult"]], "RunResult"]


@dataclass
class RunResult:
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    out: Path | None
    server: dict[str, torch.Tensor]
    executor: LoopExecutor



def run(
    cfg: Config, out: Path | None = None, *, write: bool = True, progress: bool = True, resume: bool = False,
    force: bool = False, threads: int | None = None, pool: WorkerPool | None = None, simulation: Any = None,
    host: Host | None = None, on_record: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:  # fmt: skip
    """Run one experiment; with `write`, results go to `out` (default `runs/<algo>-<data>-seed<seed>`).

    With `resume`, continue from the run directory's last checkpoint (or from the start if it has none). An
    existing run in `out` is refused unless `force` (see `RunDir.check`). A non-finite loss or parameter stops
    the run with `DivergedError`, keeping the metrics logged so far and the last checkpoint. `pool`: worker
    processes to reuse for `executor.name: procs` (else the run starts and stops its own). `on_record` is called
    with each evaluation's record once it is logged (`pflbed tune` reports the validation curve to its pruner
    there; an exception it raises stops the run, which keeps its metrics and last checkpoint).

    With `executor.name: flower` the experiment runs inside a ServerApp: `host(algo, experiment)` runs
    `experiment` (a function of the executor) there; by default Flower's simulation, `simulation` (a running
    `flower.simulation.FlowerSimulation` to reuse) or one of its own, imported only then (Flower is an extra).
    """
    if cfg.executor.name == "flower" and only_here(cfg.algorithm.name):  # each app failed, "unknown algorithm"
        raise PflbedError(f"executor.name: flower: algorithm {cfg.algorithm.name} was registered in this process "
                          "(pflbed.algorithms.register), and Flower's apps build it by name in processes of their "
                          "own: make it a plugin (docs/guide/plugins.md)")  # fmt: skip
    started = time.perf_counter()
    if plain_lines(progress):  # a bad PFLBED_PROGRESS_INTERVAL is refused before anything is written
        interval_s()
    announce(progress, f"{cfg.algorithm.name} on {cfg.dataset.name}: {cfg.train.rounds} rounds"
                       f"{', resuming' if resume else ''}; loading the data…")  # fmt: skip
    algo = prepare(cfg, threads)
    rundir = RunDir.check(out or default_out(cfg), cfg, force=force, resume=resume) if write else None
    if cfg.executor.name == "flower":  # the experiment runs inside a ServerApp of Flower's simulation runtime
        if host is None:
            from pflbed.flower.simulation import simulate  # after prepare and the run directory's check

            def host(algo, experiment):
                return simulate(algo, experiment, simulation)

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
    if saved:
        check_fits(saved, algo, cfg.train.rounds, rundir.path)
        check_config(saved, cfg, rundir.path)
    initial = None if saved else algo.init_server()  # before the directory is written: a refusal there leaves none
    if rundir and not resume:
        rundir.start(cfg)
    fed = algo.ctx.federation
    if saved:
        server, executor.states, history = saved["server"], saved["clients"], saved["history"]
        timing = saved["timing"]
        per_client = {int(c): v for c, v in saved["extra"].get("per_client", {}).items()}
        first = saved["round"] + 1
        rundir.rewrite_metrics(history)
    else:
        if rundir and resume:
            rundir.start(cfg)
        server, history, per_client, first = initial, [], {}, 1
        timing = {"wall_s": 0.0, "train_s": 0.0, "eval_s": 0.0}
    t_start, wall_before = time.perf_counter(), timing["wall_s"]
    record = config_record(cfg)  # kept in each checkpoint: a config.yaml edited since is refused on resume
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
                                    {"per_client": per_client, "config": record})  # fmt: skip
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
    if cfg.model.init_from:  # what the starting weights alone score on the same test sets
        on_sites = hasattr(executor, "evaluate_on_sites")  # the test data is on the sites, not here
        with precision(algo):
            summary["init_from"]["test_acc"] = ({"why": "the test data is on the sites"} if on_sites
                                                else pretrained_accuracy(algo.ctx))  # fmt: skip
    summary["provenance"] = provenance(algo.ctx.device)
    summary.update(getattr(executor, "summary_extra", {}))
    if rundir:
        if files:
            summary["artifacts"] = {k: f"plots/{v}" for k, v in files.items()}
        rundir.write_summary(summary)
    return RunResult(summary, history, rundir.path if rundir else None, server, executor)

