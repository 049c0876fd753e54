"""Algorithm registry. Every module in this package that defines an `Algorithm` subclass with a `name` is
registered automatically, so adding an algorithm means adding one file — no engine or registry edits."""

from __future__ import annotations

import importlib
import pkgutil

from pflbed.algorithms.base import Algorithm
from pflbed.errors import ConfigError

_SHARED = {"base", "common", "training", "partial"}  # modules with shared pieces, not algorithms
ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Add an algorithm defined outside pflbed (usable as a class decorator)."""
    ALGORITHMS[cls.name] = cls
    return cls


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _SHARED or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, Algorithm) and obj.__module__ == module.__name__
                    and "name" in vars(obj)):  # fmt: skip
                register(obj)


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        from pflbed.hints import did_you_mean

        known = ", ".join(sorted(ALGORITHMS))
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; known: {known}"
                          f"{did_you_mean(name, ALGORITHMS)}") from None  # fmt: skip


_discover()

__all__ = ["ALGORITHMS", "Algorithm", "get_algorithm", "register"]
