"""A Flower app project that runs one pflbed experiment (`pflbed flower app`, and `flower local`'s app).

The project holds no code: its components are pflbed's own ServerApp and ClientApp (`pflbed.flower.server:app`,
`pflbed.flower.client:app`), so every site needs pflbed installed (with the `flower` extra) and, for datasets read
from disk, the same data — or, with `sites.local`, each site its own data, named in its own node config
(`flower.sites`). Its run config carries the experiment's pflbed config (JSON) and the run directory the
ServerApp writes, on the SuperLink's machine.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pflbed.config import Config
from pflbed.errors import PflbedError

PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pflbed-experiment"
version = "1.0.0"
description = "A pflbed experiment ({what}) as a Flower app"
license = "Apache-2.0"
dependencies = []  # pflbed[flower] must be installed at every site (sites.local: each with its data= node config)

[tool.flwr.app]
publisher = "pflbed"

[tool.flwr.app.components]
serverapp = "pflbed.flower.server:app"
clientapp = "pflbed.flower.node_app:app"

[tool.flwr.app.config]
config = {config}
out = {out}
resume = {resume}
force = false
"""


SITE_TOML = """# A site's SuperNode config, for
#   flower-supernode --superlink HOST:PORT --root-certificates ca.crt --node-config site.toml
# Only this file decides what the site reads and writes; the server's config names no path.
partition-id = 0                        # this site's number: 0 … num-partitions − 1
num-partitions = {n}                      # how many sites ({n} clients in all: one per site, unless `clients` says)
data = "/path/to/this/site/data"        # train.npz (+ val.npz, test.npz): x {shape}, y in 0…{top}; or image folders
state-dir = "/path/to/this/site/states" # where its clients' states live
# clients = 1                           # clients this site holds
# device = "cpu"                        # or "cuda"
"""


def config_json(cfg: Config) -> str:
    return json.dumps(cfg.model_dump(mode="json"), sort_keys=True)


FILES = ("pyproject.toml", "site.toml")  # what `write_app` writes, and all it writes


def _is_ours(pyproject: Path) -> bool:
    """Whether `pyproject` is a project `write_app` wrote: pflbed's ServerApp as its component."""
    try:
        tree = tomllib.loads(pyproject.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    node: object = tree
    for key in ("tool", "flwr", "app", "components"):  # any of them may be missing, or no table (`tool = 1`)
        node = node.get(key) if isinstance(node, dict) else None
    return isinstance(node, dict) and node.get("serverapp") == "pflbed.flower.server:app"


def write_app(path: Path, cfg: Config, out: Path, resume: bool = False, force: bool = False) -> Path:
    """Write the project into `path` (created); returns `path`. `out`: the run directory on the SuperLink's side;
    `resume`: the ServerApp continues the run there from its last checkpoint.

    An earlier project in `path` is replaced only with `force` (a site's edited site.toml would go with it), and
    another project's pyproject.toml never: `--out .` in a user's own repository replaced theirs."""
    if path.exists() and not path.is_dir():
        raise PflbedError(f"--out {path}: is a file; give the directory to write the project into")
    if (path / FILES[0]).exists() and not _is_ours(path / FILES[0]):
        raise PflbedError(f"--out {path}: holds the pyproject.toml of another project; choose another --out")
    held = [name for name in FILES if (path / name).exists()]
    if held and not force:
        raise PflbedError(f"--out {path}: holds a Flower app project already ({', '.join(held)}); --force replaces "
                          "it")  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / FILES[1]).unlink(missing_ok=True)  # an earlier site-local project's, which this one may not be
    what = f"{cfg.algorithm.name} on {cfg.dataset.name}, seed {cfg.seed}"
    text = PYPROJECT.format(what=what, config=json.dumps(config_json(cfg)), out=json.dumps(str(out)),
                          resume=json.dumps(resume))
    (path / FILES[0]).write_text(text)
    if cfg.sites.local:  # what each site writes for its own SuperNode (`--node-config site.toml`); with `local`,
        # the config has both the sample shape and the classes (`SitesConfig`)
        (path / FILES[1]).write_text(SITE_TOML.format(n=cfg.federation.clients, shape=cfg.sites.input_shape,
                                                         top=cfg.sites.num_classes - 1))  # fmt: skip
    return path
