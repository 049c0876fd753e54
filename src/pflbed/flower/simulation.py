"""Experiments in Flower's simulation runtime (`executor.name: flower`).

An experiment runs inside a ServerApp: its `main(grid, context)` builds a `FlowerExecutor` on the grid and hands
it to the same experiment function as every other executor (`results.experiment`: round driver, run directory,
checkpoints, final stages). The ClientApp is `flower.client.app`.

`FlowerSimulation` keeps one simulation runtime running for several experiments, as `engine.procs.WorkerPool`
keeps worker processes: starting Flower's runtime (and Ray under it) costs seconds, so a sweep or a test suite
starts it once. Its ServerApp serves experiments one after another until the simulation is closed. Flower runs
the ServerApp in a thread of this process and the ClientApps in `workers` Ray worker processes of one CPU each;
every ClientApp process builds each run's algorithm once (`flower.client.algorithm`).

On a GPU the workers share it: each asks Ray for 1 / `workers` of one GPU. Ray hides every GPU from a worker that asks
for none (it sets `CUDA_VISIBLE_DEVICES` to empty), so a ClientApp without that share could not train on the device.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from pflbed.algorithms.base import Algorithm
from pflbed.flower.client import app as client_app
from pflbed.flower.executor import FlowerExecutor

Experiment = Callable[[FlowerExecutor], Any]


class _NoDeprecationNotice(logging.Filter):
    """`run_simulation` is the in-process entry point pflbed needs (an experiment object, not an app directory);
    Flower logs it as deprecated in favour of `flwr run`, which `pflbed flower app` projects use. Only that notice
    is left out: any other of Flower's deprecation notices is news to pflbed's users and its developers."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("DEPRECATED FEATURE" in message and "`run_simulation`" in message)


logging.getLogger("flwr").addFilter(_NoDeprecationNotice())


class _Job:
    def __init__(self, algo: Algorithm, experiment: Experiment) -> None:
        self.algo, self.experiment = algo, experiment
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class FlowerSimulation:
    """A running Flower simulation with `supernodes` SuperNodes and `workers` ClientApp processes, which share one
    GPU where `gpu` is set (the runs it serves then use `cuda`)."""

    def __init__(self, supernodes: int, workers: int | None = None, gpu: bool = False) -> None:
        self.supernodes = supernodes
        self.workers = max(1, min(workers or os.cpu_count() or 1, supernodes))
        self.gpu_share = 1.0 / self.workers if gpu else 0.0
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="flower-simulation", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        server_app = ServerApp()

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            while (job := self.jobs.get()) is not None:
                try:
                    job.value = job.experiment(FlowerExecutor(job.algo, grid))
                except BaseException as e:  # handed to the caller of `run`
                    job.error = e
                finally:
                    job.done.set()

        backend = {"client_resources": {"num_cpus": 1, "num_gpus": self.gpu_share},
                   "init_args": {"num_cpus": self.workers, "include_dashboard": False, "log_to_driver": False,
                                 "logging_level": logging.ERROR}}  # fmt: skip
        try:
            run_simulation(server_app=server_app, client_app=client_app, num_supernodes=self.supernodes,
                           backend_config=backend)  # fmt: skip
        except BaseException as e:
            self.failure = e

    def run(self, algo: Algorithm, experiment: Experiment) -> Any:
        """`experiment(executor)` inside the ServerApp; its return value, or the exception it raised."""
        job = _Job(algo, experiment)
        self.jobs.put(job)
        while not job.done.wait(0.5):
            if not self.thread.is_alive():
                raise RuntimeError(f"the Flower simulation stopped: {self.failure!r}")
        if job.error is not None:
            raise job.error
        return job.value

    def close(self) -> None:
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join()

    def __enter__(self) -> FlowerSimulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def simulate(algo: Algorithm, experiment: Experiment, simulation: FlowerSimulation | None = None) -> Any:
    """`experiment(executor)` in `simulation`, or in a simulation of its own (`executor.supernodes`, default one
    per client; `executor.workers` ClientApp processes, default one per core; sharing the run's GPU, if any)."""
    if simulation is not None:
        gpu = getattr(simulation, "gpu_share", 0.0) > 0  # any object with `run` may stand in (tests' fakes)
        if (algo.ctx.device.type == "cuda") != gpu:
            raise ValueError(f"a Flower simulation started with gpu={gpu} cannot serve a run on {algo.ctx.device}")
        return simulation.run(algo, experiment)
    ex = algo.ctx.cfg.executor
    gpu = algo.ctx.device.type == "cuda"
    with FlowerSimulation(ex.supernodes or len(algo.ctx.federation.clients), ex.workers, gpu=gpu) as sim:
        return sim.run(algo, experiment)
