"""The ServerApp of a Flower deployment (`pflbed flower local`, `pflbed flower app`).

Its run config names the experiment: `config` (the pflbed config as JSON), `out` (the run directory, written by
the ServerApp's process on the SuperLink's machine) and `resume` (continue the run in `out` from its last
checkpoint: `pflbed flower local --resume`). The experiment is `engine.loop.experiment` on a
`FlowerExecutor` over this run's grid — the same rounds, files and summary as any other executor.
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from pflbed.config import validate_config
from pflbed.engine.loop import experiment, prepare
from pflbed.flower.executor import FlowerExecutor
from pflbed.flower.secagg import SecAggExecutor
from pflbed.flower.site_executor import SiteExecutor, discover_sites
from pflbed.flower.sites import server_algorithm
from pflbed.results.rundir import RunDir, config_text

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = validate_config(json.loads(str(context.run_config["config"])))
    if cfg.sites.local:  # the data is on the sites: ask them what they hold; the server loads none
        sizes, nodes = discover_sites(grid, cfg)
        algo = server_algorithm(cfg, sizes)
        kind = SecAggExecutor if cfg.sites.secagg else SiteExecutor
        executor: FlowerExecutor = kind(algo, grid, sizes, nodes)
    else:
        algo = prepare(cfg, threads=1)
        executor = FlowerExecutor(algo, grid)
    out = Path(str(context.run_config["out"]))
    resume = bool(context.run_config.get("resume", False))
    started = out / "config.yaml"  # `flower local` checked and started the run directory before submitting
    if not (started.is_file() and started.read_text() == config_text(cfg)):
        RunDir.check(out, cfg, force=bool(context.run_config.get("force", False)), resume=resume)
    result = experiment(cfg, algo, executor, RunDir(out), False, resume)
    timing = {**{k: round(v, 4) for k, v in executor.timing.items()}, "rounds": result.summary["rounds"]}
    (out / "flower").mkdir(exist_ok=True)  # where a round's time went (benchmarks/flower_speed.py)
    (out / "flower" / "executor_timing.json").write_text(json.dumps(timing, indent=1) + "\n")
