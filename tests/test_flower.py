"""pflbed on Flower's simulation runtime (`executor.name: flower`) gives the loop executor's results, bit for bit.

One simulation (`FlowerSimulation`, started once for the module) serves every experiment here: starting Flower's
runtime and Ray costs seconds.
"""

import pytest
import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.config import validate_config
from pflbed.engine.loop import prepare, run
from pflbed.errors import ConfigError

from .tiny import TINY

flwr = pytest.importorskip("flwr")  # the `flower` extra; CI installs it, so these tests run there

from pflbed.flower.executor import FlowerClientError  # noqa: E402
from pflbed.flower.simulation import FlowerSimulation  # noqa: E402

FED = {**TINY["federation"], "public": 64}
LIGHT = {"architectures": ["alexnet_small_x025", "mlp"], "server_steps": 3}  # as in test_procs: light zoo


@pytest.fixture(scope="module")
def sim():
    with FlowerSimulation(supernodes=3, workers=2) as s:
        yield s


def _cfg(name, executor, **train):
    fields = ALGORITHMS[name].Config.model_fields
    algorithm = {"name": name, **{k: v for k, v in LIGHT.items() if k in fields}}
    return validate_config({**TINY, "federation": FED, "train": {**TINY["train"], **train}, "algorithm": algorithm,
                            "executor": executor})  # fmt: skip


def _figures(summary):
    return {k: v for k, v in summary.items() if k not in ("timing", "provenance")}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_flower_simulation_equals_loop_bit_for_bit(name, sim):
    """Same summary, server state and client states as `loop` at one thread per process: the ClientApp runs the
    loop's own `update_client` on what crossed as Flower records (NumPy arrays: exact for every dtype used)."""
    torch.set_num_threads(1)
    loop = run(_cfg(name, {"threads": 1}), write=False, progress=False)
    flower = run(_cfg(name, {"name": "flower", "threads": 1}), write=False, progress=False, simulation=sim)
    assert _figures(flower.summary) == _figures(loop.summary)
    assert _same(flower.server, loop.server)
    assert all(_same(flower.executor.states[c], loop.executor.states[c]) for c in loop.executor.states)
