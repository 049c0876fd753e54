"""Derived random streams: every random draw is keyed by what it is for, never by what ran before it."""

from __future__ import annotations

import numpy as np
import torch


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed from (seed, *keys) via NumPy's SeedSequence hashing."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def generator(seed: int, *keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, *keys))


# Stream tags, so that e.g. round 3 of client 5 never collides with the fine-tuning stream of client 5.
CLIENT, INIT, FINETUNE, NEWCLIENT = 1, 2, 3, 4
