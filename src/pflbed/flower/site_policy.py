"""What a site lets a server decide: the one check a site-local node runs on every message, before anything else.

A site (a SuperNode whose node config names its own `data=` or `dataset=`) receives the run's config from the
server in every message. A server may be malicious, so the site trusts it with nothing it did not list here: the
config is held against an allow-list, the sizes it chooses against bounds the node can afford, and the run's
privacy against what the site requires — all on the config's JSON text, before a model, a dataset or a file is
touched. Any refusal is one line naming the key (`SiteError`), which the node returns as its error reply.

The allow-list (`ALLOWED`: a key, or a section whose every key is allowed). A key not on it must keep its default:
- `seed`: seeds every draw; it chooses no size and no file;
- `algorithm` (its name and options): what the run is; every integer option other than its default is bounded
  (`max-option`), since options size the state an algorithm allocates (FedBasis's K bases, a hypernetwork's width);
- `model.name`, `model.channels_last`, `model.init_blocks`: the model (its parameters bounded, `max-parameters`);
  not `model.init_from`, a file the site would read;
- `train`, `eval`: the training and evaluation recipe; the rounds (`max-rounds`) and every epoch count
  (`max-epochs`) bounded, since they are the site's work;
- `federation.clients` (bounded, `max-clients`), `sampling`, `sample_fraction`, `val_fraction`, `test_fraction`
  (how a site splits its own data), and the simulation's partition options (`partition`, `alpha`,
  `classes_per_client`, `min_size`, `min_samples`, `train_per_client`), which a site never applies to its own data
  but a config exported from a simulation carries; not `manifest` (a file), `protocol`, `pflbed`, `new_clients`,
  `public` (data a site does not hold);
- `privacy`: the server runs the mechanism; the site may require it (`REQUIREMENTS`);
- `sites.local`, `input_shape` (bounded, `max-sample`: image-folder sites resize to it), `num_classes` (bounded,
  `max-classes`: every client's prior is that long), `secagg`, `test` (the server's own file: a site never opens
  it), `max_client_samples`, `max_update` (the server's own checks of what the sites send);
- `executor.name`, `round_timeout`, `supernodes`, `workers`, `threads`, `strict`, `device`, `precision`, `tf32`,
  `deterministic`, `batch_clients`: how the server runs; a site's device is its own `device` node config; not
  `state_dir` (a directory the site would write);
- `dataset.name` and the preprocessing a site holding `dataset=NAME` applies (`label`, `corruptions`, `severity`,
  `split`, `domains`, `image_size` (bounded, `max-sample`), `augment`, `normalize`, and `hf`'s columns, splits,
  subset, image size and normalization); not `path`, `download`, `hf.id` (what a site reads or fetches), nor
  `synthetic` (generated data up to 4 GiB: a site's data is its own);
- `log.tensorboard`: the server's logging.
Not `pretrain`: centralized pretraining never runs on a site.

Bounds (`BOUNDS`): each a default the node can afford, which its node config may raise (`max-rounds=100000`).
Requirements (`REQUIREMENTS`), none by default: `require-secagg=true` (the run must use `sites.secagg`), and
`max-clip`, `max-epsilon`, `max-delta` (the run must use client-level DP with at most this clip, this ε after
`train.rounds` rounds (Opacus's RDP accountant, as the server reports it) and this δ).

The result is cached per (node config, config JSON): every TRAIN message carries the config, and its check then
costs a dictionary look-up.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from pflbed.config import Config, validate_config
from pflbed.errors import ConfigError
from pflbed.flower.sites import DATA, DATASET, SiteError

ALLOWED = frozenset({
    "seed", "algorithm", "model.name", "model.channels_last", "model.init_blocks", "train", "eval",
    "federation.clients", "federation.sampling", "federation.sample_fraction", "federation.val_fraction",
    "federation.test_fraction", "federation.partition", "federation.alpha", "federation.classes_per_client",
    "federation.min_size", "federation.min_samples", "federation.train_per_client", "privacy", "sites.local",
    "sites.input_shape", "sites.num_classes", "sites.secagg", "sites.test", "executor.name", "executor.round_timeout",
    "executor.supernodes", "executor.workers", "executor.threads", "executor.strict", "executor.device",
    "executor.precision", "executor.tf32", "executor.deterministic", "executor.batch_clients", "dataset.name",
    "dataset.label", "dataset.corruptions", "dataset.severity", "dataset.split", "dataset.domains",
    "dataset.image_size", "dataset.augment", "dataset.normalize", "dataset.hf.subset", "dataset.hf.splits",
    "dataset.hf.image_column", "dataset.hf.label_column", "dataset.hf.user_column", "dataset.hf.image_size",
    "dataset.hf.normalize", "sites.max_client_samples", "sites.max_update", "log.tensorboard",
})  # fmt: skip

# Node-config key → the default bound: what a modest node affords (a node with more raises it in its node config).
BOUNDS = {
    "max-rounds": 10_000,  # train.rounds
    "max-epochs": 100,  # train.local_epochs, eval.ft_epochs, eval.new_clients.epochs
    "max-clients": 10_000,  # federation.clients, and the clients the server's site-sizes counts
    "max-classes": 1_000,  # sites.num_classes
    "max-sample": 2**20,  # values in one sample: sites.input_shape, 3 × dataset.image_size² (hf's too)
    "max-parameters": 50_000_000,  # the model's parameters (ResNet-18: 11 M), counted without allocating them
    "max-option": 1_000,  # every integer algorithm option other than its default
}
REQUIREMENTS = ("require-secagg", "max-clip", "max-epsilon", "max-delta")


def holds_data(node: Mapping[str, Any]) -> bool:
    """Whether the node is a site: its node config names data of its own."""
    return DATA in node or DATASET in node


def check(node: Mapping[str, Any], config_json: str) -> Config:
    """The server's config as this site accepts it, or `SiteError` (one line naming the key)."""
    return _check(tuple(sorted(node.items())), config_json)


def limits(node: Mapping[str, Any]) -> dict[str, int]:
    """The node's bounds: `BOUNDS`, each raised or lowered by the node config's own value."""
    out = {}
    for key, default in BOUNDS.items():
        value = node.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SiteError(f"{key}={value!r} in the node config: a positive integer is needed")
        out[key] = value
    return out


@lru_cache(maxsize=8)
def _check(node_items: tuple, config_json: str) -> Config:
    node = dict(node_items)
    bounds = limits(node)
    tree = _tree(config_json)
    _allowed(tree)
    try:
        cfg = validate_config(tree)
    except ConfigError as e:
        raise SiteError(f"the server's config: {e}") from None
    if not cfg.sites.local:
        raise SiteError(f"this site holds its own data ({DATA}= in its node config), but the server's run is not "
                        "site-local (sites.local=false): it would read data the server names")  # fmt: skip
    _bounded(cfg, bounds)
    _required(cfg, node)
    return cfg


def _tree(config_json: str) -> dict[str, Any]:
    try:
        tree = json.loads(config_json)
    except (ValueError, RecursionError):
        raise SiteError("the server's config is not JSON") from None
    if not isinstance(tree, dict):
        raise SiteError("the server's config is not a mapping of config keys")
    return tree


@lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    return Config().model_dump(mode="json")


def _leaves(tree: dict[str, Any], default: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value, default) of every key in `tree`, descending only into the config's own sections."""
    out = []
    for key, value in tree.items():
        dotted, base = f"{prefix}{key}", default.get(key) if isinstance(default, dict) else None
        if isinstance(value, dict) and isinstance(base, dict) and dotted != "algorithm":
            out += _leaves(value, base, f"{dotted}.")
        else:
            out.append((dotted, value, base))
    return out


def _allowed(tree: dict[str, Any]) -> None:
    """Refuse a key off the allow-list set to anything but its default (on the JSON, before it is validated)."""
    for key, value, default in _leaves(tree, _defaults()):
        parts = key.split(".")
        if value != default and not any(".".join(parts[:i]) in ALLOWED for i in range(1, len(parts) + 1)):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise SiteError(f"the server's config sets {key}={shown}, which a server may not decide for a site (a "
                            "path, a download or data the site does not hold): the site refuses the run")  # fmt: skip


def _over(value: float, bound: int, key: str, node_key: str) -> None:
    if value > bound:
        raise SiteError(f"the server's config sets {key}={value:g}, above this site's bound {node_key}={bound} "
                        f"(raise it in the site's node config to accept the run)")  # fmt: skip


def _bounded(cfg: Config, bounds: dict[str, int]) -> None:
    """Every size the server chooses within the node's bounds, before anything is allocated."""
    _over(cfg.train.rounds, bounds["max-rounds"], "train.rounds", "max-rounds")
    for key, value in (("train.local_epochs", cfg.train.local_epochs), ("eval.ft_epochs", cfg.eval.ft_epochs),
                       ("eval.new_clients.epochs", cfg.eval.new_clients.epochs)):  # fmt: skip
        _over(value, bounds["max-epochs"], key, "max-epochs")
    _over(cfg.federation.clients, bounds["max-clients"], "federation.clients", "max-clients")
    _over(cfg.sites.num_classes or 0, bounds["max-classes"], "sites.num_classes", "max-classes")
    shape = list(cfg.sites.input_shape or [])
    _over(math.prod(shape), bounds["max-sample"], "sites.input_shape (values per sample)", "max-sample")
    sizes = {"dataset.image_size": cfg.dataset.image_size, "dataset.hf.image_size": cfg.dataset.hf.image_size or 0}
    for key, size in sizes.items():
        _over(3 * size * size, bounds["max-sample"], f"{key} (3 × its square: values per sample)", "max-sample")
    _options(cfg, bounds["max-option"])
    _over(_parameters(cfg), bounds["max-parameters"], f"model.name={cfg.model.name} (its parameters)",
          "max-parameters")  # fmt: skip


def _options(cfg: Config, bound: int) -> None:
    """Every integer algorithm option (or integer in an option's list) other than the algorithm's default."""
    from pflbed.algorithms import get_algorithm

    defaults = get_algorithm(cfg.algorithm.name).Config().model_dump()
    for key, value in cfg.algorithm_options().items():
        if value == defaults.get(key):
            continue
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, int) and not isinstance(x, bool):
                _over(x, bound, f"algorithm.{key}", "max-option")


def _parameters(cfg: Config) -> int:
    """The model's parameter count for the run's input shape and classes, built on the meta device (no memory)."""
    import torch

    from pflbed.models.zoo import models

    shape = tuple(cfg.sites.input_shape or [])
    try:
        with torch.device("meta"):
            model = models()[cfg.model.name](shape, int(cfg.sites.num_classes or 0))
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise SiteError(f"model.name={cfg.model.name} cannot take samples of shape {list(shape)}: {e}") from None
    return sum(p.numel() for p in model.parameters())


def _required(cfg: Config, node: Mapping[str, Any]) -> None:
    """The privacy this site requires of the run (`REQUIREMENTS` in its node config)."""
    secagg = node.get("require-secagg", False)
    if not isinstance(secagg, bool):
        raise SiteError(f"require-secagg={secagg!r} in the node config: true or false is needed")
    if secagg and not cfg.sites.secagg:
        raise SiteError("sites.secagg: this site requires secure aggregation (require-secagg in its node config), "
                        "and the server's run does not use it")  # fmt: skip
    caps = {key: _cap(node, key) for key in ("max-clip", "max-epsilon", "max-delta")}
    asked = {k: v for k, v in caps.items() if v is not None}
    if not asked:
        return
    if not cfg.privacy.enabled:
        first = next(iter(asked))
        raise SiteError(f"privacy.clip: this site requires client-level DP ({first}={asked[first]:g} in its node "
                        "config), and the server's run has none")  # fmt: skip
    if cfg.privacy_randomness() != "os":  # a seeded stream: anyone with the config subtracts the noise
        raise SiteError("privacy.randomness: this site requires client-level DP, and the server's run draws its "
                        "noise from the seed in its config (seeded), which anyone who knows the config can "
                        "subtract")  # fmt: skip
    clip = cfg.privacy.clip or 0.0
    if caps["max-clip"] is not None and clip > caps["max-clip"]:
        raise SiteError(f"privacy.clip={clip:g} is above this site's max-clip={caps['max-clip']:g}")
    if caps["max-delta"] is not None and cfg.privacy.delta > caps["max-delta"]:
        raise SiteError(f"privacy.delta={cfg.privacy.delta:g} is above this site's max-delta={caps['max-delta']:g}")
    if caps["max-epsilon"] is not None:
        from pflbed.privacy import mechanism

        dp = mechanism(cfg, cfg.federation.clients)
        eps = dp.epsilon(cfg.train.rounds) if dp is not None else math.inf
        if eps > caps["max-epsilon"]:
            raise SiteError(f"privacy: the run's ε after {cfg.train.rounds} rounds is {eps:.3g}, above this site's "
                            f"max-epsilon={caps['max-epsilon']:g}")  # fmt: skip


def _cap(node: Mapping[str, Any], key: str) -> float | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SiteError(f"{key}={value!r} in the node config: a positive number is needed")
    return float(value)
