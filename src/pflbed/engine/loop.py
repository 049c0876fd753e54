"""The one round loop (DESIGN §5): sample → configure → client updates → aggregate → evaluate → log.

Everything that can fail on user input (config, data, federation, output directory) is checked in `prepare`
before the run directory is touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pflbed.algorithms import get_algorithm
from pflbed.algorithms.base import Algorithm, Context
from pflbed.algorithms.training import get_params
from pflbed.config import Config
from pflbed.data import load_source
from pflbed.engine import rng, wire
from pflbed.engine.executor import LoopExecutor
from pflbed.evaluation.evaluate import evaluate, evaluate_personalized
from pflbed.federation import build_federation, sample_clients
from pflbed.models import build_model
from pflbed.results.rundir import RunDir, default_out
from pflbed.results.summary import build_summary


@dataclass
class RunResult:
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    out: Path | None
    server: dict[str, torch.Tensor]
    executor: LoopExecutor


def prepare(cfg: Config) -> Algorithm:
    """Load data, build the federation and the initial model, and instantiate the algorithm."""
    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    algo_cls = get_algorithm(cfg.algorithm.name)
    options = algo_cls.Config.model_validate(cfg.algorithm_options())
    torch.manual_seed(rng.derive_seed(cfg.seed, rng.INIT))
    model = build_model(cfg.model.name, source.input_shape, source.num_classes)
    ctx = Context(cfg, source, fed, options, model, initial_params=get_params(model))
    return algo_cls(ctx)


def run(cfg: Config, out: Path | None = None, *, write: bool = True, progress: bool = True) -> RunResult:
    """Run one experiment; with `write`, results go to `out` (default `runs/<algo>-<data>-seed<seed>`)."""
    algo = prepare(cfg)
    rundir = RunDir.check(out or default_out(cfg), cfg) if write else None
    if rundir:
        rundir.start(cfg)
    fed = algo.ctx.federation
    executor = LoopExecutor(algo, strict=cfg.executor.strict)
    server = algo.init_server()
    history: list[dict[str, Any]] = []
    train_s = eval_s = 0.0
    up = down = 0
    t_start = time.perf_counter()
    with _progress(progress) as bar:
        task = bar.add_task(f"{cfg.algorithm.name} on {cfg.dataset.name}", total=cfg.train.rounds, status="")
        for rnd in range(1, cfg.train.rounds + 1):
            t0 = time.perf_counter()
            cids = sample_clients(cfg.seed, rnd, fed.participated, cfg.federation.sample_fraction)
            payloads = algo.configure(rnd, server, cids)
            replies = executor.run(rnd, payloads)
            server = algo.aggregate(rnd, server, replies, {c: fed.num_train(c) for c in cids})
            down = sum(wire.num_bytes(p) for p in payloads.values())
            up = sum(wire.num_bytes(r) for r in replies.values())
            train_s += time.perf_counter() - t0
            if rnd % cfg.eval.every == 0 or rnd == cfg.train.rounds:
                t1 = time.perf_counter()
                scores, per_client = evaluate(algo, server, executor.state)
                record = {"round": rnd, **scores}
                record.update(up_bytes_per_round=up, down_bytes_per_round=down)
                history.append(record)
                if rundir:
                    rundir.log(record)
                eval_s += time.perf_counter() - t1
                bar.update(task, status=_status(record))
            bar.update(task, advance=1)
        t1 = time.perf_counter()
        finetuned = {}
        methods = cfg.eval.finetune if algo.generic_model(server) is not None else []
        for i, method in enumerate(methods):
            stats = evaluate_personalized(
                algo, server, method, lambda c, i=i: rng.generator(cfg.seed, rng.FINETUNE, i, c)
            )
            finetuned[method] = stats
        eval_s += time.perf_counter() - t1
    wall = time.perf_counter() - t_start
    timing = {
        "wall_s": round(wall, 3),
        "train_s": round(train_s, 3),
        "eval_s": round(eval_s, 3),
        "s_per_round": round(train_s / cfg.train.rounds, 4),
    }
    summary = build_summary(cfg, fed, history, finetuned, per_client, timing)
    if rundir:
        rundir.write_summary(summary)
    return RunResult(summary, history, rundir.path if rundir else None, server, executor)


def _status(record: dict[str, Any]) -> str:
    parts = [f"{k.split('_')[0].upper()} {100 * record[k]:.1f}" for k in ("gfl_acc", "pfl_acc") if record.get(k)]
    return " · ".join(parts)


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("round {task.completed}/{task.total}"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=False,
    )
