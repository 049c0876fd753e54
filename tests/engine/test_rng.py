"""The derived streams' own rules (`pflbed.rng`): what a seed is, and what privacy draws from the OS."""

from __future__ import annotations

import numpy as np
import pytest

from pflbed import rng


def test_a_derived_seed_is_a_63_bit_hash_of_every_key() -> None:
    """63 bits, so that any seed fits torch's `manual_seed` and the streams of 10⁵ keys do not collide: of 4,000
    seeds, none reaches 2⁶³ and some use the top bit (none would with probability 2⁻⁴⁰⁰⁰)."""
    seeds = [rng.derive_seed(7, rng.CLIENT, r, c) for r in range(40) for c in range(100)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert max(seeds) >= 2**62 and len(set(seeds)) == len(seeds)
    assert rng.derive_seed(7, 1, 2) != rng.derive_seed(7, 2, 1) != rng.derive_seed(8, 1, 2)


@pytest.mark.parametrize("n", [0, 1, 2, 1000])
def test_os_uniform_gives_n_float64_numbers_on_the_53_bit_grid_of_0_1(n: int) -> None:
    u = rng.os_uniform(n)
    assert u.shape == (n,) and u.dtype == np.float64
    assert np.all((u >= 0) & (u < 1)) and np.array_equal(u * 2.0**53, np.floor(u * 2.0**53))
    if n == 1000:  # 1,000 draws of 53 bits: distinct, and they cover the interval
        assert len(set(u.tolist())) == n and u.min() < 0.01 and u.max() > 0.99
