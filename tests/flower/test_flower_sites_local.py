"""`pflbed flower local --site-data`: a real deployment (SuperLink and SuperNodes as processes, TLS on) whose three
sites each hold one client's data, of different sizes, and whose server holds none."""

import json

import numpy as np
import pytest
import torch

from pflbed.cli import main
from pflbed.config import load_config
from pflbed.data import load_source
from pflbed.errors import DataError
from pflbed.results.experiment import run

pytest.importorskip("flwr")  # the `flower` extra

from pflbed.flower.sites import export_sites  # noqa: E402

SETS = ["dataset.name=synthetic", "model.name=mlp", "federation.clients=3", "federation.alpha=0.5",
        "train.rounds=1", "train.batch_size=16", "train.lr=0.1", "eval.every=1", "eval.finetune=[ft]",
        "executor.threads=1", "algorithm.name=fedavg"]  # fmt: skip
P_FL = ("pfl_acc", "pfl_acc_std", "pfl_acc_min", "pfl_acc_p10", "pfl_val", "gfl_val")


def _args(sets):
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-0")
def test_three_sites_of_their_own_data_give_the_simulation_s_figures_with_a_server_that_has_no_dataset(tmp_path):
    """Each site gets exactly a simulated client's samples; the server's config names a dataset this machine does
    not have (CIFAR-10), so a ServerApp that loaded any data would fail. Every record's P-FL and validation
    figures, the +FT stage and the server's final state equal the simulation's; G-FL comes from the sites."""
    sim_cfg = load_config(None, SETS)
    sim = run(sim_cfg, write=False, progress=False)
    dirs = export_sites(sim_cfg, tmp_path / "sites")
    sizes = [len(np.load(d / "train.npz")["y"]) for d in dirs]
    assert len(set(sizes)) == 3  # three sites of different sizes
    with pytest.raises(DataError):  # the premise: no CIFAR-10 here
        load_source(load_config(None, ["dataset.name=cifar10"]).dataset)
    out = tmp_path / "run"
    sets = [s for s in SETS if not s.startswith(("dataset.name", "federation.clients"))] + ["dataset.name=cifar10"]
    before = {p: p.stat().st_mtime_ns for d in dirs for p in d.iterdir()}
    main(["flower", "local", "--site-data", *map(str, dirs), "--tls", "--out", str(out), *_args(sets)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gfl_source"] == "the sites' test data, sample-weighted"
    assert [{k: r[k] for k in P_FL} for r in sim.history] == [
        {k: r[k] for k in P_FL} for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    ]
    assert summary["final"].get("ft") == sim.summary["final"].get("ft")
    assert summary["selected"]["round"] == sim.summary["selected"]["round"]
    server = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["server"]
    assert all(torch.equal(server[k], sim.server[k]) for k in sim.server)
    # each site's states stayed in its own state directory; its data directory is as it was
    assert sorted(p.name for p in (out / "flower").glob("site-*-states")) == ["site-0-states", "site-1-states",
                                                                              "site-2-states"]  # fmt: skip
    assert {p: p.stat().st_mtime_ns for d in dirs for p in d.iterdir()} == before
