"""A site's side of a deployment with the data on the sites (`sites.local`): the node builds the run's algorithm over
its own data (`sites.site_algorithm`), keeps its clients' states in its own state directory, and answers the
server's start-up question (`report`) and evaluations (`site_eval.evaluate_site`).

What the node takes from the server: the run's config — held against what a server may decide for a site, the
node's bounds and its privacy requirements (`site_policy.check`) — the deployment's clients per site (`site-sizes`,
checked against the node's bound and against what this site holds), and, per message, which of its clients to
train or score, with what (`site_message`: every field of a TRAIN or EVALUATE message held to what an honest server
sends). Where the node reads data and writes states comes from its node config alone.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from pflbed.algorithms.base import Algorithm
from pflbed.config import Config, validate_config
from pflbed.errors import PflbedError
from pflbed.flower import site_policy
from pflbed.flower.node_states import NODE_CONFIG_KEY, NodeStates
from pflbed.flower.site_claims import TOKEN, site_token
from pflbed.flower.sites import SiteError, num_clients, read_site, report, site_algorithm

DEFAULT_STATE_DIR = "pflbed-states"
PARTITION = "partition-id"


def _node(context: Any) -> dict[str, Any]:
    return dict(context.node_config)


@lru_cache(maxsize=4)
def _validated(config_json: str) -> Config:
    """The config a message carries, validated once per process (every TRAIN message carries it)."""
    return validate_config(json.loads(config_json))


def clear_caches() -> None:
    """Forget the configs and algorithms built so far (a long-lived process starting another run)."""
    _validated.cache_clear()
    _algorithm.cache_clear()


def site_config(node: dict[str, Any], config_json: str) -> Config | None:
    """The server's config as this node accepts it (a site: `site_policy.check`); None where the node holds no data
    (a simulated client, whose data the server decides)."""
    if site_policy.holds_data(node):
        return site_policy.check(node, config_json)
    if _validated(config_json).sites.local:
        raise SiteError("the run keeps the data on the sites (sites.local=true), but this node's config names no data=")
    return None


def site_sizes(node: dict[str, Any], cfg: Config, sizes_json: str) -> list[list[int]]:
    """The server's `site-sizes` (each site's clients' training-sample counts), refused unless it is a list of sites
    holding at least one client each, as many clients as the run's and within the node's `max-clients`. That this
    site's own entry is what it holds is checked where its clients' splits are drawn (`sites.site_algorithm`)."""
    try:
        sizes = json.loads(sizes_json)
    except (ValueError, RecursionError):
        sizes = None
    if not isinstance(sizes, list) or not all(isinstance(s, list) and s for s in sizes):
        raise SiteError("site-sizes: a list of sites, each a non-empty list of its clients' sample counts, is needed")
    bound = site_policy.limits(node)["max-clients"]
    total = sum(len(s) for s in sizes)
    if len(sizes) > bound or total != cfg.federation.clients:
        raise SiteError(f"site-sizes: {len(sizes)} sites holding {total} clients, but the run has federation.clients="
                        f"{cfg.federation.clients} (this site's bound: max-clients={bound})")  # fmt: skip
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for s in sizes for n in s):
        raise SiteError("site-sizes: every client's sample count must be a non-negative integer")
    site = int(node.get(PARTITION, 0))
    if not 0 <= site < len(sizes):
        raise SiteError(f"site-sizes: {len(sizes)} sites, but this is site {site} (partition-id)")
    return sizes


@lru_cache(maxsize=4)
def _algorithm(config_json: str, sizes_json: str, node: tuple) -> Algorithm:
    conf = dict(node)
    cfg = site_policy.check(conf, config_json)
    sizes = site_sizes(conf, cfg, sizes_json)
    files = read_site(conf, cfg)
    assert files is not None
    return site_algorithm(cfg, files, num_clients(conf), int(conf.get(PARTITION, 0)), sizes,
                          str(conf.get("device", "cpu")))  # fmt: skip


def site_algorithm_of(context: Any, config_json: str, sizes_json: str) -> tuple[Algorithm, NodeStates]:
    """This site's algorithm (built once per process and run) and its clients' state store; the config and the
    site sizes checked first (`site_policy.check`, `site_sizes`)."""
    node = _node(context)
    algo = _algorithm(config_json, sizes_json, tuple(sorted((k, v) for k, v in node.items())))
    states = NodeStates(str(node.get(NODE_CONFIG_KEY) or DEFAULT_STATE_DIR), config_json, algo)
    return algo, states


def site_report(context: Any, config_json: str) -> dict[str, Any]:
    """What the site tells the server at start-up (`sites.report`), with its token (`site_claims`): a node claiming
    this site later, a restart of it, must show the same one."""
    node = _node(context)
    site = int(node.get(PARTITION, 0))
    try:
        cfg = site_config(node, config_json)
        if cfg is None:
            raise SiteError("the server asked for this node's data, but its config names no data=")
        files = read_site(node, cfg)
        assert files is not None
        token = site_token(str(node.get(NODE_CONFIG_KEY) or DEFAULT_STATE_DIR))  # binds this site to its node
        return {**report(files, num_clients(node), cfg, site), TOKEN: token}
    except PflbedError as e:  # which site, in the one line the server shows (once: some messages name it already)
        raise SiteError(f"site {site}: {str(e).removeprefix(f'site {site}: ')}") from None
