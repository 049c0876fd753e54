"""The timing benchmarks time the executor each row is named after: every compared executor is named in its
config, since the default (`auto`) picks `procs` for a large enough run and would time it under `loop`'s name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def script(name: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run: its sibling scripts import
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("table", ["VARIANTS", "SCALE_VARIANTS"])
def test_speed_rows_name_their_executor(table: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for row, (executor, _) in getattr(script("speed", monkeypatch), table).items():
        assert executor.get("name") == ("procs" if row == "procs" else "loop"), row


def test_flower_speed_rows_name_their_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {row: ex.get("name") for row, ex in script("flower_speed", monkeypatch).executors(2).items()} == {
        "loop": "loop", "procs": "procs", "flower": "flower"}
