"""The ServerApp of a Flower deployment (`pflbed flower local`, `pflbed flower app`).

Its run config names the experiment: `config` (the pflbed config as JSON), `out` (the run directory, written by
the ServerApp's process on the SuperLink's machine), `resume` (continue the run in `out` from its last
checkpoint: `pflbed flower local --resume`, or `flwr run … --run-config resume=true`) and `force` (replace the run
in `out`). The experiment is `results.experiment.experiment`
on a `FlowerExecutor` over this run's grid — the same rounds, files and summary as any other executor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from pflbed.config import Config, validate_config
from pflbed.engine.build import prepare
from pflbed.errors import PflbedError
from pflbed.flower.executor import FlowerExecutor
from pflbed.flower.secagg import SecAggExecutor
from pflbed.flower.site_executor import SiteExecutor, discover_sites
from pflbed.flower.sites import server_algorithm
from pflbed.results.experiment import experiment
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
    rundir, resume = run_directory(cfg, context.run_config)
    out = rundir.path
    result = experiment(cfg, algo, executor, rundir, False, resume)
    timing = {**{k: round(v, 4) for k, v in executor.timing.items()}, "rounds": result.summary["rounds"]}
    (out / "flower").mkdir(exist_ok=True)  # where a round's time went (benchmarks/flower_speed.py)
    (out / "flower" / "executor_timing.json").write_text(json.dumps(timing, indent=1) + "\n")


def run_directory(cfg: Config, run_config: Mapping[str, object]) -> tuple[RunDir, bool]:
    """The run directory the ServerApp writes (the run config's `out`) and whether it continues the run there.

    `pflbed flower local` checks and starts the directory before it submits: this config's config.yaml and no
    result yet, taken as it is. Anything else (`flwr run` of a `pflbed flower app` project, once or again) is checked
    as `pflbed run` checks `--out`, so that a second `flwr run` neither replaces a finished run nor starts an
    unfinished one over unless the run config says `force = true` (`resume = true` continues it)."""
    out = Path(str(run_config["out"]))
    resume, force = _flag(run_config, "resume"), _flag(run_config, "force")
    rundir, started = RunDir(out), out / "config.yaml"
    if not (started.is_file() and started.read_text() == config_text(cfg) and not rundir.has_results):
        RunDir.check(out, cfg, force=force, resume=resume, out_name="out", force_name="--run-config force=true",
                     resume_with="flwr run DIR CONNECTION --run-config resume=true")  # as the Flower guide names them
    return rundir, resume


def _flag(run_config: Mapping[str, object], key: str) -> bool:
    """A yes/no of the run config: TOML's true or false only (`resume="true"`, a string, is refused, not read as
    a yes)."""
    value = run_config.get(key, False)
    if not isinstance(value, bool):
        raise PflbedError(f"run config {key}: {value!r} is not true or false")
    return value
