"""The DP noise warning (`privacy.Mechanism.noise_warning`) on Flower: the ServerApp's driver releases through the
same mechanism, so a deployment whose noise swamps its few clients' updates is warned at its first release, and a
divergence names the noise (a real `flower local --secagg` on 4 sites: docs/guide/privacy.md's table)."""

import pytest

from pflbed.config import validate_config
from pflbed.errors import DivergedError
from pflbed.results.experiment import run

from ..tiny import parity_config

pytest.importorskip("flwr")  # the `flower` extra

from ..fake_flower import FakeGrid, FakeSimulation  # noqa: E402


def _config(**train):
    tree = parity_config("fedper+dp", {"name": "flower", "threads": 1}, rounds=2, **train).to_dict()
    return validate_config(tree)


def test_a_flower_run_whose_noise_swamps_its_clients_is_warned_once(capsys):
    """FedPer under DP on 6 clients at q = 0.5 (qN = 3): the figure is far above 1."""
    run(_config(), write=False, progress=False, simulation=FakeSimulation(FakeGrid()))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pflbed: warning:")]
    assert len(warnings) == 1 and "with qN = 3 clients per round (σC/qN: σ = 0.8, C = 0.5)" in warnings[0]


def test_a_flower_run_that_diverges_under_dp_names_the_noise():
    with pytest.raises(DivergedError, match=r"non-finite values in .*, after privacy noise of std 0\.133 per entry and "
                                            r"round with qN = 3 clients per round"):  # fmt: skip
        run(_config(lr=1e30), write=False, progress=False, simulation=FakeSimulation(FakeGrid()))
