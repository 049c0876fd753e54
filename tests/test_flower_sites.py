"""Deployments with the data on the sites (`sites.local`): parity with the simulation, the server holding no data,
and the trust boundary. In-process, on the faked Flower runtime (`fake_flower.FakeGrid`), whose ClientApps run the
real node code with each site's own node config."""


import pytest
import torch

from pflbed.config import validate_config
from pflbed.engine.loop import experiment, run

from .tiny import TINY, figures

flwr = pytest.importorskip("flwr")

from pflbed.flower import client  # noqa: E402
from pflbed.flower.site_executor import SiteExecutor, discover_sites  # noqa: E402
from pflbed.flower.sites import export_sites, server_algorithm  # noqa: E402

from .fake_flower import FakeGrid  # noqa: E402

ALGOS = {"fedavg": {}, "fedper": {}, "fedrod": {}, "fedselect": {}, "fedbasis": {"K": 2}}


def _tree(name, **over):
    tree = {**TINY, "federation": {**TINY["federation"], "clients": 4, "sample_fraction": 0.75},
            "algorithm": {"name": name, **ALGOS.get(name, {})}, "executor": {"threads": 1},
            "eval": {"every": 2, "finetune": ["ft"]}}  # fmt: skip
    tree.update(over)
    return tree


def _site_cfg(tree, test=None):
    from pflbed.data import load_source

    source = load_source(validate_config(tree).dataset)
    return validate_config({**tree, "executor": {"name": "flower", "threads": 1},
                            "sites": {"local": True, "input_shape": list(source.input_shape),
                                      "num_classes": source.num_classes,
                                      **({"test": str(test)} if test else {})}})  # fmt: skip


def run_sites(cfg, grid):
    """What the ServerApp does for a site-local run (`flower.server.main`), on `grid`."""
    from flwr.supercore.task_identity import TaskIdentity

    keys = ("_run_id", "_task_id", "_node_id")
    saved = {k: getattr(TaskIdentity, k) for k in keys}
    for k in keys:
        setattr(TaskIdentity, k, 1)
    try:
        sizes = discover_sites(grid, cfg)
        algo = server_algorithm(cfg, sizes)
        return experiment(cfg, algo, SiteExecutor(algo, grid, sizes), None, False, False)
    finally:
        for k, v in saved.items():
            setattr(TaskIdentity, k, v)


def _sites(tmp_path, cfg):
    dirs = export_sites(cfg, tmp_path / "sites")
    nodes = {k: {"data": str(d), "state-dir": str(tmp_path / f"states-{k}")} for k, d in enumerate(dirs)}
    return dirs, FakeGrid(partitions=len(dirs), node_configs=nodes)


def _server_test(tmp_path, cfg):
    """The simulation's global test set, written for the server (`sites.test`)."""
    import numpy as np

    from pflbed.data import load_source
    from pflbed.federation import build_federation

    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    path = tmp_path / "server-test.npz"
    np.savez(path, x=source.test.x[fed.global_test].numpy(), y=source.test.y[fed.global_test].numpy())
    return path


def _no_diag(tree):
    """Without the algorithms' diagnostics, which read every client's state (kept on the sites in a site-local run,
    which records none)."""
    if isinstance(tree, dict):
        return {k: _no_diag(v) for k, v in tree.items() if k != "diag"}
    return [_no_diag(v) for v in tree] if isinstance(tree, list) else tree


@pytest.mark.parametrize("name", list(ALGOS))
def test_a_site_local_run_gives_the_simulation_s_figures(name, tmp_path):
    tree = _tree(name)
    sim = run(validate_config(tree), write=False, progress=False)
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    sites = run_sites(_site_cfg(tree, _server_test(tmp_path, validate_config(tree))), grid)
    a, b = _no_diag(figures(sim.summary)), figures(sites.summary)
    assert b.pop("gfl_source") == "sites.test (on the server)"
    assert a == b
    assert all(torch.equal(sim.server[k], sites.server[k]) for k in sim.server)
