"""Run one experiment on any executor: the engine's own (`loop`, `procs`, `auto`), or Flower (`executor.name:
flower`). This sits above both the engine and `pflbed.flower` (which builds on the engine), so the engine never
imports Flower; `pflbed.run` and `pflbed run` come here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pflbed.algorithms import only_here
from pflbed.engine import loop
from pflbed.errors import PflbedError

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from pflbed.config import Config
    from pflbed.engine.procs import WorkerPool


def run(
    cfg: Config, out: Path | None = None, *, write: bool = True, progress: bool = True, resume: bool = False,
    force: bool = False, threads: int | None = None, pool: WorkerPool | None = None, simulation: Any = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> loop.RunResult:  # fmt: skip
    """`pflbed.engine.loop.run` (every argument but `simulation` means what it means there), with `executor.name:
    flower` hosted inside a Flower ServerApp, in `simulation` (a running `flower.simulation.FlowerSimulation` to
    reuse) or in a simulation of its own."""
    host = None
    if cfg.executor.name == "flower" and only_here(cfg.algorithm.name):  # each app failed, "unknown algorithm"
        raise PflbedError(f"executor.name: flower: algorithm {cfg.algorithm.name} was registered in this process "
                          "(pflbed.algorithms.register), and Flower's apps build it by name in processes of their "
                          "own: make it a plugin (docs/guide/plugins.md)")  # fmt: skip
    if cfg.executor.name == "flower":  # the experiment runs inside a ServerApp of Flower's simulation runtime
        def host(algo, experiment):
            from pflbed.flower.simulation import simulate  # after prepare and the run directory's check, as before

            return simulate(algo, experiment, simulation)

    return loop.run(cfg, out, write=write, progress=progress, resume=resume, force=force, threads=threads, pool=pool,
                    host=host, on_record=on_record)  # fmt: skip
