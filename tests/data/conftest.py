"""Fixtures the data tests share: a look-up environment that sees only what a test writes, and a fetch that records
instead of downloading."""

from __future__ import annotations

from pathlib import Path

import pytest

from pflbed.data import fmnist, store


@pytest.fixture
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No PFLBED_DATA, an empty cache and no Debian copy, so look-ups only see what a test creates."""
    monkeypatch.delenv("PFLBED_DATA", raising=False)
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fmnist, "DEBIAN_DIR", tmp_path / "no-debian")
    return tmp_path


@pytest.fixture
def env(isolated_env: Path) -> Path:
    """`isolated_env` by a shorter name (a module may define its own `env`, as `test_loaders` does)."""
    return isolated_env


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records every attempt to fetch (none may happen) instead of reaching the network."""
    calls: list = []
    monkeypatch.setattr(store, "fetch", lambda remotes, dest: calls.append((remotes, dest)))
    return calls
