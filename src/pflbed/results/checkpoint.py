"""Checkpoints: everything a run needs to continue bit-identically, as tensors and plain values.

Client randomness is derived from (seed, round, client id) and client sampling from (seed, round), so no RNG
state has to be saved: the server state, the client states, the round and the metrics so far are enough. The
file holds only tensors, strings and numbers, so it loads with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pflbed.errors import PflbedError
from pflbed.private_files import private_dir, save_private

_FORMAT = 1


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.pt"


def save_checkpoint(
    run_dir: Path, rnd: int, server: dict[str, torch.Tensor], states: dict[int, dict[str, torch.Tensor]],
    history: list[dict[str, Any]], timing: dict[str, float], extra: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    path = checkpoint_path(run_dir)
    private_dir(path.parent)  # it holds client states: private, as a node's state files
    blob = {
        "format": _FORMAT, "round": rnd, "server": _on_cpu(server),
        "clients": {str(c): _on_cpu(s) for c, s in states.items()},
        "history": json.dumps(history), "timing": json.dumps(timing), "extra": json.dumps(extra or {}),
    }  # fmt: skip
    save_private(blob, path)  # atomic: a kill mid-write leaves the previous checkpoint intact


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints hold CPU tensors: a run saved on a GPU resumes on any device (`load_checkpoint`'s `device`)."""
    return {k: v.cpu() for k, v in tensors.items()}


def checkpoint_round(run_dir: Path) -> int | None:
    """The round of `run_dir`'s last checkpoint, read without loading its tensors (memory-mapped); None where
    there is none or it cannot be read."""
    try:
        return int(torch.load(checkpoint_path(run_dir), mmap=True, weights_only=True)["round"])
    except Exception:
        return None


def load_checkpoint(run_dir: Path, device: torch.device | str = "cpu") -> dict[str, Any] | None:
    """The last checkpoint of `run_dir` (None: none yet), its tensors on `device`, the resumed run's device."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    try:
        blob = torch.load(path, map_location=device, weights_only=True)
        if blob.get("format") != _FORMAT:
            raise ValueError(f"format {blob.get('format')}")
    except Exception as e:
        reason = " ".join(str(e).split())[:80]
        raise PflbedError(
            f"{path}: unreadable checkpoint ({type(e).__name__}: {reason}); to start the run over, delete that file "
            f"and run 'pflbed run --resume {run_dir}' again (or rerun it with --force)"
        ) from None
    return {
        "round": int(blob["round"]), "server": blob["server"],
        "clients": {int(c): s for c, s in blob["clients"].items()},
        "history": json.loads(blob["history"]), "timing": json.loads(blob["timing"]),
        "extra": json.loads(blob["extra"]),
    }  # fmt: skip
