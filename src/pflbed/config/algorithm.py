"""`algorithm.*`: the algorithm's name and its own options.

The options are checked by the algorithm registry (`pflbed.algorithms.check_config`), which knows each algorithm's
options model; the config reaches it through `pflbed.hooks` once every other key has passed. The name is checked
here first, against the built-in names listed below, so a misspelt one is reported without importing the
algorithms (and torch); `tests/project/test_config_package.py` keeps the list equal to the registry's. Once the
registry is imported, it is the authority: it also holds algorithms registered from outside pflbed.
"""

from __future__ import annotations

from collections.abc import Collection

from pydantic import BaseModel, ConfigDict

from pflbed import hooks, plugins
from pflbed.errors import ConfigError
from pflbed.hints import did_you_mean

ALGORITHM_NAMES = (
    "apfl", "apple", "ditto", "fedala", "fedamp", "fedas", "fedavg", "fedbabu", "fedbasis", "fedbn", "fedcac", "fedcp",
    "feddbe", "feddf", "feddyn", "fedfomo", "fedlc", "fedmd", "fedmtl", "fedpac", "fedper", "fedproto", "fedprox",
    "fedrep", "fedrod", "fedrod_hyper", "fedselect", "gpfl", "knnper", "ktpfl", "l2gd", "lg_fedavg", "local", "moon",
    "perfedavg", "pfeddf", "pfedhn", "pfedme", "scaffold", "sim_pfl", "topk_pfl",
)  # fmt: skip


class AlgorithmConfig(BaseModel):
    """`name` plus algorithm-specific keys, validated by the algorithm's own Config."""

    model_config = ConfigDict(extra="allow")
    name: str = "fedavg"


def unknown_algorithm(name: str, known: Collection[str]) -> ConfigError:
    """The one-line error for an `algorithm.name` that is not in `known`: why, where it is a plugin the registry left
    out (`pflbed.plugins`), else the near miss it probably meant."""
    if (why := plugins.problem(plugins.ALGORITHMS, name)) is not None:
        return ConfigError(f"algorithm.name: {why}")
    return ConfigError(f"algorithm.name: unknown algorithm {name!r}; known: {', '.join(sorted(known))}"
                       f"{did_you_mean(name, known)}")  # fmt: skip


def check_algorithm_name(name: str) -> None:
    """`ConfigError` unless `name` is a known algorithm: the registry's, else (not imported yet) a built-in one or a
    plugin's (`pflbed.plugins`: named in its package's metadata; whether it loads is checked with the registry)."""
    known = hooks.registered_algorithms()
    known = {*ALGORITHM_NAMES, *plugins.names(plugins.ALGORITHMS)} if known is None else known
    if name not in known:
        raise unknown_algorithm(name, known)
