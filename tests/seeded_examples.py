"""Hypothesis examples that depend on their seed alone.

Now and then hypothesis takes a number from the literals of the project's modules imported so far. Which modules a
process has imported depends on what ran before (a test's imports, an xdist worker's earlier tests, a Flower probe's
simulation), and any code change edits those literals: a derandomized property test, or a seeded probe draw, would
then draw other examples from run to run. Hypothesis has no setting for it; `no_local_constants` replaces its pool by
an empty one while it is entered (a hypothesis without the pool has nothing to replace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hypothesis.internal.conjecture import providers

HYPOTHESIS_POOL = getattr(providers, "_get_local_constants", None)  # hypothesis's own (a test draws with it)


@contextlib.contextmanager
def no_local_constants() -> Iterator[None]:
    if HYPOTHESIS_POOL is None:
        yield
        return
    real = providers._get_local_constants
    providers._get_local_constants = providers.Constants
    providers.CONSTANTS_CACHE.cache.clear()  # the allowed constants per kind, computed from the pool
    try:
        yield
    finally:
        providers._get_local_constants = real
        providers.CONSTANTS_CACHE.cache.clear()
