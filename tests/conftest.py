import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Federation caches go to a per-session temp dir, never the user's home."""
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
