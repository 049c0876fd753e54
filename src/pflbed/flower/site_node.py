"""A site's side of a deployment with the data on the sites (`sites.local`): the node builds the run's algorithm over
its own data (`sites.site_algorithm`), keeps its clients' states in its own state directory, and answers the
server's start-up question (`report`) and evaluations (`site_eval.evaluate_site`).

What the node takes from the server: the run's config — refused if it names a path (`sites.refuse_server_paths`) or
if the run is not site-local while the node holds data of its own — and, per message, which of its clients to
train or score. Where the node reads data and writes states comes from its node config alone.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from pflbed.algorithms.base import Algorithm
from pflbed.config import Config, validate_config
from pflbed.errors import PflbedError
from pflbed.flower.node_states import NODE_CONFIG_KEY, NodeStates
from pflbed.flower.sites import (
    DATA,
    DATASET,
    SiteError,
    num_clients,
    own_clients,
    read_site,
    refuse_server_paths,
    report,
    site_algorithm,
)

DEFAULT_STATE_DIR = "pflbed-states"
PARTITION = "partition-id"


def _node(context: Any) -> dict[str, Any]:
    return dict(context.node_config)


@lru_cache(maxsize=4)
def _validated(config_json: str) -> Config:
    """The config a message carries, validated once per process (every TRAIN message carries it)."""
    return validate_config(json.loads(config_json))


def site_config(node: dict[str, Any], config_json: str) -> Config | None:
    """The server's config as this node accepts it; None where the node holds no data (a simulated client)."""
    cfg = _validated(config_json)
    if DATA not in node and DATASET not in node:
        if cfg.sites.local:
            raise SiteError("the run keeps the data on the sites (sites.local=true), but this node's config names "
                            "no data=")  # fmt: skip
        return None
    if not cfg.sites.local:
        raise SiteError(f"this site holds its own data ({DATA}= in its node config), but the server's run is not "
                        "site-local (sites.local=false): it would read data the server names")  # fmt: skip
    refuse_server_paths(cfg)
    return cfg


@lru_cache(maxsize=4)
def _algorithm(config_json: str, sizes_json: str, node: tuple) -> Algorithm:
    conf = dict(node)
    cfg = _validated(config_json)
    files = read_site(conf, cfg)
    assert files is not None
    return site_algorithm(cfg, files, num_clients(conf), int(conf.get(PARTITION, 0)), json.loads(sizes_json),
                          str(conf.get("device", "cpu")))  # fmt: skip


def site_algorithm_of(context: Any, config_json: str, sizes_json: str) -> tuple[Algorithm, NodeStates]:
    """This site's algorithm (built once per process and run) and its clients' state store."""
    node = _node(context)
    algo = _algorithm(config_json, sizes_json, tuple(sorted((k, v) for k, v in node.items())))
    states = NodeStates(str(node.get(NODE_CONFIG_KEY) or DEFAULT_STATE_DIR), config_json, algo)
    return algo, states


def check_clients(algo: Algorithm, cids: list[int]) -> None:
    own = set(own_clients(algo))
    foreign = sorted(set(cids) - own)
    if foreign:
        raise SiteError(f"the server asked this site for clients {foreign[:5]}, which it does not hold")


def site_report(context: Any, config_json: str) -> dict[str, Any]:
    """What the site tells the server at start-up (`sites.report`)."""
    node = _node(context)
    site = int(node.get(PARTITION, 0))
    try:
        cfg = site_config(node, config_json)
        if cfg is None:
            raise SiteError("the server asked for this node's data, but its config names no data=")
        files = read_site(node, cfg)
        assert files is not None
        return report(files, num_clients(node), cfg, site)
    except PflbedError as e:  # which site, in the one line the server shows
        raise SiteError(f"site {site}: {e}") from None
