"""Every script under `benchmarks/` imports: the reproduction page sends users to them after a suite, and a name one
imports that moved in the package (`build_federation`, once in `federation.federation`) broke two of them unseen,
as no test ran them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def test_there_are_scripts():
    assert len(SCRIPTS) > 20


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))  # as when run: a script imports its siblings
    spec = importlib.util.spec_from_file_location(f"_bench_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: its definitions, without running it
    assert callable(getattr(module, "main", None)) or hasattr(module, "__doc__")
