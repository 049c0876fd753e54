"""pflbed — personalized federated learning: faithful algorithms, an honest protocol, a fast simulator.

Python API: `pflbed.run(config)` runs one experiment; `pflbed.load_config(path, overrides)` builds a config;
`pflbed.load_run(dir)` loads a trained run (models, predictions, personalization for new clients).
"""

from pathlib import Path as _Path
from typing import Any as _Any

from pflbed import hooks as _hooks
from pflbed.version import __version__
from pflbed.version import check_torch as _check_torch

_check_torch()


def _load_algorithms() -> None:
    """Import the algorithm registry, which registers its check of a config's algorithm options in `pflbed.hooks`:
    the config (the bottom layer) asks for it there, without importing the layers above it; this package, the API
    layer on top, is the one that knows where it lives."""
    import pflbed.algorithms  # noqa: F401


_hooks.load_algorithms = _load_algorithms

__all__ = ["__version__", "load_config", "load_run", "run"]


def load_config(path: str | _Path | None = None, overrides: list[str] | None = None):
    """A validated `Config` from an optional YAML file and `key=value` overrides (`ConfigError`: one line naming
    the field)."""
    from pflbed.config import load_config as _load

    return _load(path, overrides)


def run(
    config: _Any = None, out: str | _Path | None = None, *, write: bool = True, progress: bool = False,
    force: bool = False,
):  # fmt: skip
    """Run one experiment from a `Config`, a dict of config keys, a YAML config file's path, or None (the embedded
    default). A dict's keys may be nested (`{"train": {"rounds": 5}}`) or dotted as `--set` and a suite's `set`
    write them (`{"train.rounds": 5}`); a dotted key is set after the nested ones.

    A run already in `out` is refused (`PflbedError`) unless `force`; a diverging run raises `DivergedError`.

    A script calling it must do so under `if __name__ == "__main__":`: the `procs` executor's workers (the default
    executor's choice for a sizeable run on a CPU with several cores) import the script again as they start."""
    import copy
    from collections.abc import Mapping

    from pflbed.config import Config, set_dotted, validate_config
    from pflbed.engine.procs import starting_worker
    from pflbed.results.experiment import run as _run

    if starting_worker():  # the run it would start, in every worker, was "a run is in progress there" at best
        raise SystemExit("pflbed.run was called in a worker process as it started: each worker of executor procs "
                         "imports the script that started the run, so call pflbed.run under "
                         "`if __name__ == \"__main__\":`")  # fmt: skip

    if isinstance(config, str | _Path):  # `pflbed.run("config.yaml")`, as `pflbed run -c`: was a bare ValueError
        cfg = load_config(config)
    elif isinstance(config, Config):
        cfg = config
    elif config is None or isinstance(config, Mapping):
        tree = {k: copy.deepcopy(v) for k, v in (config or {}).items() if "." not in str(k)}
        for key, value in (config or {}).items():  # "train.rounds: unknown key" was all a dotted key got
            if "." in str(key):
                set_dotted(tree, str(key), copy.deepcopy(value))
        cfg = validate_config(tree)
    else:
        raise TypeError(f"pflbed.run: config must be a Config, a dict of config keys, a YAML file's path or None, not "
                        f"{type(config).__name__}")  # fmt: skip
    for name, flag in (("write", write), ("progress", progress), ("force", force)):  # "no" was true: force="no"
        if not isinstance(flag, bool):  # replaced an existing run
            raise TypeError(f"pflbed.run: {name} must be True or False, not {type(flag).__name__} {flag!r}")
    if out is not None and (not isinstance(out, str | _Path) or not str(out)):  # "" wrote to the default place
        raise TypeError(f"pflbed.run: out must be a directory's path or None, not {type(out).__name__} {out!r}")
    return _run(cfg, _Path(out) if out is not None else None, write=write, progress=progress, force=force)


def load_run(path: str | _Path, device: str | None = None):
    """A trained run: `.config`, `.summary`, `.generic_model()`, `.personal_model(cid)`, `.predict(x)`,
    `.personalize(x, y, ...)` (`pflbed.results.trained.TrainedRun`), on `device` (unset: the run's own where this
    machine has it, else the CPU)."""
    from pflbed.results.trained import load_run as _load

    return _load(path, device)
