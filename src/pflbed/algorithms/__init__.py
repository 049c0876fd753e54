"""Algorithm registry. Every module in this package that defines an `Algorithm` subclass with a `name` is
registered automatically, so adding an algorithm means adding one file — no engine or registry edits. Algorithms
of other installed packages join it as plugins (`pflbed.plugins`: the entry points of "pflbed.algorithms").

The registry also checks a config's algorithm section (`check_config`): the options models are the algorithms'
own, so they are checked here, where the classes are known. `pflbed.config.validate_config` reaches this check
through `pflbed.hooks`, into which this package registers itself on import: the config never imports it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from pydantic import ValidationError

from pflbed import hooks, plugins
from pflbed.algorithms.base import Algorithm
from pflbed.config.algorithm import unknown_algorithm
from pflbed.config.base import boolean_for_a_number, check_numbers
from pflbed.config.hints import first_error
from pflbed.errors import ConfigError
from pflbed.hints import then

if TYPE_CHECKING:
    from pflbed.config import Config

_SHARED = {"base", "common", "training", "partial"}  # modules with shared pieces, not algorithms
ALGORITHMS: dict[str, type[Algorithm]] = {}
REGISTERED_HERE: set[str] = set()  # names `register` added: this process's alone (`only_here`)


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Add an algorithm defined outside pflbed (usable as a class decorator), in this process only: the command
    line and Flower's apps do not see it; a plugin (`pflbed.plugins`) is seen by every process."""
    ALGORITHMS[cls.name] = cls
    REGISTERED_HERE.add(cls.name)
    return cls


def only_here(name: str) -> bool:
    """Whether algorithm `name` was registered in this process (`register`), where no other process finds it."""
    return name in REGISTERED_HERE


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _SHARED or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, Algorithm) and obj.__module__ == module.__name__
                    and "name" in vars(obj)):  # fmt: skip
                ALGORITHMS[obj.name] = obj


def _plugin_problem(name: str, obj: object) -> str | None:
    """What is wrong with a plugin declared as algorithm `name`, or None."""
    if not (isinstance(obj, type) and issubclass(obj, Algorithm)):
        return f"is {plugins.what(obj)}, not a subclass of pflbed.algorithms.base.Algorithm"
    if getattr(obj, "name", None) != name:
        return f"is named {getattr(obj, 'name', None)!r} in its class, not {name!r} as its entry point"
    return None


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise unknown_algorithm(name, ALGORITHMS) from None


def check_config(cfg: Config) -> None:
    """The config's algorithm section, one `ConfigError` line per mistake: a known `algorithm.name`, options its
    `Config` model accepts (and within the bounds every number shares), and nothing SecAgg+ (`sites.secagg`) or
    client-level DP (`privacy.clip`) refuses for it. Run by `pflbed.config.validate_config` after the other keys."""
    name = cfg.algorithm.name
    algo_cls = get_algorithm(name)
    given = cfg.algorithm_options()
    for key, value in given.items():  # the options' models are plain pydantic ones, which took true for 1
        field = algo_cls.Config.model_fields.get(key)
        if field is not None and boolean_for_a_number(field.annotation, value):
            raise ConfigError(f"algorithm.{key}: must be a number, not a boolean (got {value!r})")
    try:
        options = algo_cls.Config.model_validate(given)
    except ValidationError as e:
        message = first_error(e, "algorithm.", algo_cls.Config)
        if e.errors()[0]["type"] == "extra_forbidden":
            message = _options_hint(message, name, str(e.errors()[0]["loc"][0]))
        raise ConfigError(message) from None
    check_numbers(options.model_dump(), "algorithm.")
    if cfg.sites.secagg and algo_cls.dp_refused is not None:
        raise ConfigError(f"sites.secagg: SecAgg+ gives the server only the mean of the replies, and {name} needs "
                          f"more: {algo_cls.dp_refused}")  # fmt: skip
    if cfg.sites.secagg and (why := algo_cls.secagg_refusal(options)) is not None:
        raise ConfigError(why)
    if cfg.privacy.enabled and algo_cls.dp_refused is not None:
        raise ConfigError(f"privacy.clip: client-level DP does not apply to {name}: {algo_cls.dp_refused}")


def _options_hint(message: str, name: str, key: str) -> str:
    """`message` about an unknown `algorithm.<key>`, with the options `name` takes and the algorithms taking `key`."""
    own = list(ALGORITHMS[name].Config.model_fields)
    message = then(message, f"options of {name}: {', '.join(own)}" if own else f"{name} has no options of its own")
    takers = sorted(n for n, c in ALGORITHMS.items() if key in c.Config.model_fields)
    return f"{message}; {key} is an option of {', '.join(takers)}" if takers else message


__all__ = ["ALGORITHMS", "Algorithm", "check_config", "get_algorithm", "register"]

_discover()
hooks.register_algorithms(ALGORITHMS, check_config)
# Last: a plugin's module may import anything of this package's (its base classes, `register`).
ALGORITHMS.update(plugins.load(plugins.ALGORITHMS, ALGORITHMS, _plugin_problem))  # type: ignore[arg-type]
