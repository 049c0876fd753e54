"""`tests/seeded_examples.py`: under the default profile the suite draws without hypothesis's pool of the project's
literals, so a derandomized property test draws the same examples whatever its xdist worker ran before it."""

import os

import pytest
from hypothesis.internal.conjecture import providers

from tests import seeded_examples


@pytest.mark.skipif(seeded_examples.HYPOTHESIS_POOL is None, reason="this hypothesis keeps no pool of literals")
def test_the_default_profile_draws_without_the_project_s_literals():
    own = seeded_examples.HYPOTHESIS_POOL()
    assert len(own.integers) > 10  # the project's modules imported by now hold many
    in_use = providers._get_local_constants()
    if os.environ.get("HYPOTHESIS_PROFILE", "default") == "default":
        assert not in_use.integers and not in_use.floats and not in_use.strings
    else:
        assert in_use.integers == own.integers
