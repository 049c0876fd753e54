"""How the configuration reaches the algorithm registry, layers above it, without importing it (DESIGN §2).

A config is checked whole before a run starts, its algorithm's options included, and those options' models live
with the algorithms, whose package imports torch (about a second). The config, the bottom layer, does not import
it: no layer imports upwards, and a mistake in any other key is reported before torch is loaded. Instead:

- `pflbed.algorithms` registers itself here when it is imported (`register_algorithms`): its live registry (which
  may hold algorithms registered from outside pflbed) and its check of a config's algorithm section;
- `pflbed/__init__`, the API layer above both, says how to import it (`load_algorithms`); the config asks for the
  check (`check_algorithm`) only once its own checks have passed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

_registry: Mapping[str, Any] | None = None
_check: Callable[[Any], None] | None = None
load_algorithms: Callable[[], object] | None = None  # set by pflbed/__init__


def register_algorithms(registry: Mapping[str, Any], check: Callable[[Any], None]) -> None:
    """Called by `pflbed.algorithms` on import: its registry (name → class) and its check of a config."""
    global _registry, _check
    _registry, _check = registry, check


def registered_algorithms() -> Mapping[str, Any] | None:
    """The algorithm registry once `pflbed.algorithms` is imported; None before (nothing is imported here)."""
    return _registry


def check_algorithm(cfg: Any) -> None:
    """Check the algorithm section of `cfg` (a `pflbed.config.Config`) with the registry's check, loading the
    registry first where it is not yet; `ConfigError` (one line) for a mistake."""
    if _check is None and load_algorithms is not None:
        load_algorithms()
    if _check is None:
        raise RuntimeError("pflbed.algorithms is not imported: a config's algorithm options cannot be checked")
    _check(cfg)
