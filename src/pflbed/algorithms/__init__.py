"""Algorithm registry: one file per algorithm, registered here by name."""

from __future__ import annotations

from pflbed.algorithms.base import Algorithm
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.local import LocalOnly
from pflbed.errors import ConfigError

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FedAvg, LocalOnly)}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Add an algorithm defined outside pflbed (usable as a class decorator)."""
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            f"algorithm.name: unknown algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}"
        ) from None


__all__ = ["ALGORITHMS", "Algorithm", "get_algorithm", "register"]
