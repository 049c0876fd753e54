"""Run directories: `config.yaml` (resolved), `metrics.jsonl` (one line per evaluation), `summary.json`.

The directory is created only after the config, data and federation have been validated, so bad input never
leaves a half-written run behind. A directory that holds a run of a *different* config is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from pflbed.config import Config
from pflbed.errors import PflbedError


def default_out(cfg: Config) -> Path:
    return Path("runs") / f"{cfg.algorithm.name}-{cfg.dataset.name}-seed{cfg.seed}"


def config_text(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def check(cls, path: Path, cfg: Config) -> RunDir:
        """Refuse a directory that is a file or holds another config's run; create nothing yet."""
        if path.exists() and not path.is_dir():
            raise PflbedError(f"--out {path}: exists and is not a directory")
        existing = path / "config.yaml"
        if existing.exists() and existing.read_text() != config_text(cfg):
            raise PflbedError(f"--out {path}: holds a run of a different config; choose another --out")
        if path.exists() and not existing.exists() and any(path.iterdir()):
            raise PflbedError(f"--out {path}: is a non-empty directory that holds no pflbed run")
        return cls(path)

    def start(self, cfg: Config) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in ("metrics.jsonl", "summary.json"):
            (self.path / stale).unlink(missing_ok=True)
        _atomic_write(self.path / "config.yaml", config_text(cfg))

    @classmethod
    def for_resume(cls, path: Path, cfg: Config | None) -> tuple[RunDir, Config]:
        """Open an existing run dir to continue it; `cfg`, if given, must equal the run's own config."""
        from pflbed.config import load_config

        saved = path / "config.yaml"
        if not saved.is_file():
            raise PflbedError(f"--resume {path}: not a pflbed run directory (no config.yaml)")
        run_cfg = load_config(saved)
        if cfg is not None and config_text(cfg) != saved.read_text():
            raise PflbedError(f"--resume {path}: the run was started with a different config")
        return cls(path), run_cfg

    def rewrite_metrics(self, history: list[dict[str, Any]]) -> None:
        """Make metrics.jsonl exactly the checkpointed history (drops lines logged after the checkpoint)."""
        _atomic_write(self.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in history))
        (self.path / "summary.json").unlink(missing_ok=True)

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        _atomic_write(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
