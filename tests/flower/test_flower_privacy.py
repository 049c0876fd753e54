"""Client-level DP in a Flower run: unless its config names the seeded stream, the noise and the sample come from
the operating system, so two runs of one config differ and neither can be recomputed from the config that every
site receives (`privacy.randomness`, tests/engine/test_privacy_deployed.py)."""

import pytest
import torch

from pflbed.config import validate_config
from pflbed.results.experiment import run

from ..tiny import parity_config

pytest.importorskip("flwr")  # the `flower` extra

from ..fake_flower import FakeGrid, FakeSimulation  # noqa: E402

DP = {"clip": 0.5, "noise_multiplier": 0.8}  # no randomness named: the Flower default


def test_a_flower_run_draws_its_noise_from_the_os_unless_its_config_names_the_seed():
    """Two Flower runs of one DP config end with different server states and say `os`; named `seeded`, two runs are
    identical. Planted: `Config.privacy_randomness` defaulting to `seeded` for Flower turns this red."""
    ends = {}
    for how in (None, "seeded"):
        privacy = {**DP, **({"randomness": how} if how else {})}
        servers = []
        for _ in range(2):
            tree = parity_config("fedper", {"name": "flower", "threads": 1}, rounds=2).to_dict()
            cfg = validate_config({**tree, "privacy": {**tree["privacy"], **privacy}})
            result = run(cfg, write=False, progress=False, simulation=FakeSimulation(FakeGrid()))
            assert result.summary["privacy"]["randomness"] == (how or "os")
            servers.append(result.server)
        ends[how] = all(torch.equal(servers[0][k], servers[1][k]) for k in servers[0])
    assert ends == {None: False, "seeded": True}
