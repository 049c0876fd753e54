"""Building a run's federation: from its manifest (`federation.manifest`) or by partitioning the data
(`federation.federation`, cached in memory and on disk). Above both, so the manifest reader can use the federation's
types without a cycle; `pflbed.federation.build_federation` re-exports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pflbed.federation import federation as F
from pflbed.federation.federation import Federation
from pflbed.federation.manifest import read_manifest

if TYPE_CHECKING:
    from pflbed.config import FederationConfig
    from pflbed.data.arrays import DataSource


def build_federation(source: DataSource, cfg: FederationConfig, seed: int, use_disk_cache: bool = True) -> Federation:
    """The federation `cfg` makes of `source` with `seed`, or the one its manifest (`federation.manifest`) holds."""
    if cfg.manifest is not None:
        return read_manifest(cfg.manifest, source)
    key = F.federation_key(source, cfg, seed)
    if key in F._MEMORY:
        return F._MEMORY[key]
    path = F.cache_dir() / "federations" / f"{key}.pt"
    fed = F._load_cached(path, key) if use_disk_cache else None
    if fed is None:
        excluded = None
        if cfg.exclude_test_of:  # the same settings' federations of those seeds: their test samples left out
            plain = cfg.model_copy(update={"exclude_test_of": []})
            tests = [build_federation(source, plain, s, use_disk_cache).test_indices() for s in cfg.exclude_test_of]
            excluded = torch.unique(torch.cat(tests)).numpy()
        fed = F._partition(source, cfg, seed, key, excluded)
        if use_disk_cache:
            F._save_cached(fed, path)
    F._MEMORY[key] = fed
    return fed
