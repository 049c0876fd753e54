"""What the site-local Flower tests share: a tiny run's config as a server sends it, its sites exported from the
simulated federation onto a fake grid (`fake_flower.FakeGrid`), the server's side run as the ServerApp runs it, and
the config JSON a server that skips pflbed's validation could send. Import only after
`pytest.importorskip("flwr")`."""

import contextlib
import json

from pflbed.config import validate_config
from pflbed.flower.site_executor import SiteExecutor, discover_sites
from pflbed.flower.sites import export_sites, server_algorithm
from pflbed.results.experiment import experiment

from ..fake_flower import FakeGrid
from ..tiny import TINY

ALGOS = {"fedavg": {}, "fedper": {}, "fedrod": {}, "fedselect": {}, "fedbasis": {"K": 2}}


def _tree(name, **over):
    tree = {**TINY, "federation": {**TINY["federation"], "clients": 4, "sample_fraction": 0.75},
            "algorithm": {"name": name, **ALGOS.get(name, {})}, "executor": {"threads": 1},
            "eval": {"every": 2, "finetune": ["ft", "lp"]}}  # fmt: skip
    tree.update(over)
    return tree


def _site_cfg(tree, test=None):
    from pflbed.data import load_source

    source = load_source(validate_config(tree).dataset)
    return validate_config({**tree, "executor": {"name": "flower", "threads": 1},
                            "sites": {"local": True, "input_shape": list(source.input_shape),
                                      "num_classes": source.num_classes,
                                      **({"test": str(test)} if test else {})}})  # fmt: skip


@contextlib.contextmanager
def _server_task():
    """Messages stamped as Flower's runtime stamps a ServerApp's (as `fake_flower.FakeSimulation` does)."""
    from flwr.supercore.task_identity import TaskIdentity

    keys = ("_run_id", "_task_id", "_node_id")
    saved = {k: getattr(TaskIdentity, k) for k in keys}
    for k in keys:
        setattr(TaskIdentity, k, 1)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(TaskIdentity, k, v)


def _discover(grid, cfg):
    with _server_task():
        return discover_sites(grid, cfg)[0]


def server_executor(grid, cfg, kind=SiteExecutor):
    """The server's executor of a site-local run on `grid`, as the ServerApp builds it: the sites found and bound
    (`discover_sites`), the server's algorithm over their counts (`kind`: `SiteExecutor` or a subclass)."""
    with _server_task():
        sizes, nodes = discover_sites(grid, cfg)
        return kind(server_algorithm(cfg, sizes), grid, sizes, nodes)


def run_sites(cfg, grid, rundir=None, resume=False):
    """What the ServerApp does for a site-local run (`flower.server.main`), on `grid`."""
    ex = server_executor(grid, cfg)
    with _server_task():
        return experiment(cfg, ex.algo, ex, rundir, False, resume)


def _sites(tmp_path, cfg, **grid):
    """`cfg`'s simulated clients exported as sites, one node each on a `FakeGrid` (`grid`: its other options)."""
    dirs = export_sites(cfg, tmp_path / "sites")
    nodes = {k: {"data": str(d), "state-dir": str(tmp_path / f"states-{k}")} for k, d in enumerate(dirs)}
    return dirs, FakeGrid(partitions=len(dirs), node_configs=nodes, **grid)


def _tampered(cfg, **sections):
    """The config JSON a server that skips pflbed's own validation could send."""

    tree = cfg.model_dump(mode="json")
    for key, value in sections.items():
        section, field = key.split("__")
        tree[section][field] = value
    return json.dumps(tree, sort_keys=True)
