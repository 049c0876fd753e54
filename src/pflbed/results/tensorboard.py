"""TensorBoard scalars of a run (`log.tensorboard: true`, the `tensorboard` extra): every number of every
evaluation record, under the record's own names (nested ones joined with '/', e.g. `diag/personal_fraction/all`),
at its round — so `tensorboard --logdir runs/` compares runs' curves live while they train. On resume, the
rounds between the checkpoint and the interruption are logged again (TensorBoard shows the later points)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardLog:
    def __init__(self, path: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(path))

    def log(self, record: dict[str, Any]) -> None:
        rnd = int(record["round"])
        for key, value in _numbers(record):
            if key != "round":
                self.writer.add_scalar(key, value, rnd)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _numbers(record: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for k, v in record.items():
        if isinstance(v, dict):
            out += _numbers(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((f"{prefix}{k}", float(v)))
    return out
