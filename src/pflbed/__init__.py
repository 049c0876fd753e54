"""pflbed — personalized federated learning: faithful algorithms, an honest protocol, a fast simulator.

Python API: `pflbed.run(config)` runs one experiment; `pflbed.load_config(path, overrides)` builds a config;
`pflbed.load_run(dir)` loads a trained run (models, predictions, personalization for new clients).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None):
    from pflbed.config import load_config as _load

    return _load(path, overrides)


def run(
    config: Any = None, out: str | Path | None = None, *, write: bool = True, progress: bool = False,
    force: bool = False,
):  # fmt: skip
    """Run one experiment from a `Config`, a dict of config keys, or None (the embedded default).

    A run already in `out` is refused (`PflbedError`) unless `force`; a diverging run raises `DivergedError`."""
    from pflbed.config import Config, validate_config
    from pflbed.engine.loop import run as _run

    cfg = config if isinstance(config, Config) else validate_config(dict(config or {}))
    return _run(cfg, Path(out) if out else None, write=write, progress=progress, force=force)


def load_run(path: str | Path, device: str | None = None):
    """A trained run: `.config`, `.summary`, `.generic_model()`, `.personal_model(cid)`, `.predict(x)`,
    `.personalize(x, y, ...)` (`pflbed.results.trained.TrainedRun`), on `device` (unset: the run's own where this
    machine has it, else the CPU)."""
    from pflbed.results.trained import load_run as _load

    return _load(path, device)
