import pytest
import torch

# Tiny models run fastest single-threaded, and a single thread keeps parallel test processes from thrashing.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Federation caches go to a per-session temp dir, never the user's home."""
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
