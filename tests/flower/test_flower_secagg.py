"""Secure aggregation (`sites.secagg`, `pflbed flower local --site-data … --secagg`): a real deployment whose server
learns only the rounds' mean updates gives the simulation's results up to SecAgg+'s quantization; what it cannot
carry is refused."""

import json

import numpy as np
import pytest
import torch

from pflbed.cli import main
from pflbed.config import load_config, validate_config
from pflbed.errors import ConfigError
from pflbed.runs import run

pytest.importorskip("flwr")  # the `flower` extra

from flwr.common import parameters_to_ndarrays  # noqa: E402

from pflbed.flower.secagg_node import site_update  # noqa: E402
from pflbed.flower.sites import export_sites  # noqa: E402

# the seeded noise named: the deployment is compared with the simulation, and a Flower run's default is the OS's
SETS = ["dataset.name=synthetic", "model.name=mlp", "federation.clients=3", "federation.alpha=0.5",
        "train.rounds=1", "train.batch_size=16", "train.lr=0.1", "eval.every=1", "eval.finetune=[]",
        "executor.threads=1", "algorithm.name=fedper", "privacy.clip=0.5", "privacy.noise_multiplier=0.3",
        "privacy.randomness=seeded"]  # fmt: skip
# SecAgg+'s quantization: each site's entry rounded to a step of 2·8/2²² (its range ±8 in 2²² levels); under DP the
# sites weigh equally, so the mean is off by less than one step (later rounds train from that start: SGD amplifies)
TOLERANCE = 2 * 8 / 2**22 * 1.05


def _args(sets):
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-1")
def test_a_secure_deployment_gives_the_simulations_dp_run_up_to_quantization(tmp_path):
    """FedPer under client-level DP on three sites of their own data, through SecAgg+, one round: the shared body
    equals the simulation's to within the quantization step, and ε is the same."""
    sim_cfg = load_config(None, SETS)
    sim = run(sim_cfg, write=False, progress=False)
    dirs = export_sites(sim_cfg, tmp_path / "sites")
    out = tmp_path / "run"
    sets = [s for s in SETS if not s.startswith("federation.clients")]
    main(["flower", "local", "--site-data", *map(str, dirs), "--secagg", "--out", str(out), *_args(sets)])
    summary = json.loads((out / "summary.json").read_text())
    server = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["server"]
    assert server.keys() == sim.server.keys()
    gap = max(float((server[k] - sim.server[k]).abs().max()) for k in server)
    assert 0 < gap < TOLERANCE  # quantized (not bit-equal), and close
    assert summary["privacy"] == sim.summary["privacy"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["pfl_acc"] for r in records] == pytest.approx([r["pfl_acc"] for r in sim.history], abs=0.02)


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-1")
def test_distributed_noise_on_a_secure_deployment_assembles_the_central_release(tmp_path):
    """`privacy.noise: distributed` with σ = 0 and every client sampled (q = 1, so the OS's sample is everyone's):
    each site sends (Σ_c Δ̃_c + 0)/qN with weight 1, the server multiplies the unmasked mean by the sites and the
    mechanism adds nothing, so the release is the central simulation's up to each site's quantization step (three
    sites: three steps). Wrong scaling (a mean instead of a sum, qN twice) is off by a factor; the noise shares
    themselves are `test_distributed_noise.py`'s."""
    common = [s for s in SETS if not s.startswith(("privacy.noise_multiplier", "privacy.randomness"))]
    common += ["privacy.noise_multiplier=0", "federation.sample_fraction=1.0"]
    sim = run(load_config(None, [*common, "privacy.randomness=seeded"]), write=False, progress=False)
    dirs = export_sites(load_config(None, common), tmp_path / "sites")
    out = tmp_path / "run"
    sets = [s for s in common if not s.startswith("federation.clients")] + ["privacy.noise=distributed"]
    main(["flower", "local", "--site-data", *map(str, dirs), "--secagg", "--out", str(out), *_args(sets)])
    summary = json.loads((out / "summary.json").read_text())
    server = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["server"]
    gap = max(float((server[k] - sim.server[k]).abs().max()) for k in server)
    assert 0 < gap < 3 * TOLERANCE
    assert summary["privacy"]["noise"] == "distributed" and summary["privacy"]["randomness"] == "os"


def test_a_site_sends_its_weighted_mean_update_and_zeros_when_it_has_no_client():
    w = {"a": torch.tensor([1.0, 1.0]), "b": torch.zeros(3)}
    r1, r2 = {"a": torch.tensor([2.0, 1.0])}, {"a": torch.tensor([1.0, 4.0])}  # b: not updated (FedBABU's head)
    fitres = site_update(w, [(r1, 1), (r2, 3)], {})
    a, b = parameters_to_ndarrays(fitres.parameters)
    assert np.allclose(a, [0.25, 2.25]) and np.allclose(b, 0) and fitres.num_examples == 4
    assert json.loads(fitres.metrics["keys"]) == ["a"]
    empty = site_update(w, [], {})
    assert [x.shape for x in parameters_to_ndarrays(empty.parameters)] == [(2,), (3,)] and empty.num_examples == 0


def test_what_secure_aggregation_cannot_carry_is_refused(capsys):
    base = {"dataset": {"name": "synthetic"}, "executor": {"name": "flower"}}
    with pytest.raises(ConfigError, match="secagg applies to sites.local=true"):
        validate_config({**base, "sites": {"secagg": True}})
    sites = {"local": True, "secagg": True, "input_shape": [1, 8, 8], "num_classes": 10}
    with pytest.raises(ConfigError, match="sites.secagg: SecAgg\\+ gives the server only the mean .* ktpfl needs"):
        validate_config({**base, "sites": sites, "algorithm": {"name": "ktpfl"}})
    validate_config({**base, "sites": sites, "algorithm": {"name": "fedrep"}})
    assert main(["flower", "local", "--secagg"]) == 2
    assert "--secagg needs --site-data" in capsys.readouterr().err
