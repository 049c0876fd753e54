import os
import random
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

from pflbed.engine.procs import WorkerPool
from pflbed.models.zoo import MODELS, alexnet_small

from .seeded_examples import no_local_constants
from .tiny import ALEXNET_TINY

# Property tests: the same examples in every run by default (a CI failure reproduces locally); `explore` draws
# fresh ones, many more (HYPOTHESIS_PROFILE=explore python -m pytest tests/project/test_config_properties.py).
_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much]
settings.register_profile("default", derandomize=True, database=None, deadline=None, max_examples=150,
                          suppress_health_check=_QUIET)  # fmt: skip
settings.register_profile("explore", deadline=None, max_examples=300, suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True, scope="session")
def _examples_from_the_seed_alone():
    """The default profile's examples depend on nothing but the test: not on the modules an xdist worker imported
    for the tests it ran before (`seeded_examples`). `explore` keeps hypothesis's pool of the project's literals."""
    if os.environ.get("HYPOTHESIS_PROFILE", "default") != "default":
        yield
        return
    with no_local_constants():
        yield


def pytest_collection_modifyitems(items):
    """The real Flower deployments (minutes each, a process per message) first, where a run selects them
    (`-m deployment`, or `-m ""` for everything). Under `-n` (`--dist loadgroup`) they run in two lanes (their
    `xdist_group`), each one worker taking its deployments one after the other while any other worker takes the
    rest test by test: started last they would leave a worker running them alone after the others finished, and all
    at once a dozen processes each importing torch per message thrash the cores."""
    items.sort(key=lambda item: item.get_closest_marker("deployment") is None)  # stable: the rest keep their order


# Tiny models run fastest single-threaded, and a single thread keeps parallel test processes from thrashing.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _global_generators_from_the_seed_alone():
    """Every test starts torch's, numpy's and Python's global generators from the same state: data a test draws
    without a generator of its own is the same whichever tests an xdist worker ran before it (a CI run once drew
    data on which a test's own sanity check did not hold, and no local run could reproduce it)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Federation caches go to a per-session temp dir, never the user's home."""
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(autouse=True)
def _no_network_downloads(monkeypatch):
    """Tests never download: a dataset fetch from anything but a `file://` mirror fails at once, so a config that
    asks for `dataset.download=true` is exercised without the network (and without a 3 GB surprise)."""
    from pflbed.data import store
    from pflbed.errors import DataError

    real = store._download

    def local_only(url, *args, **kwargs):
        if not url.startswith("file://"):
            raise DataError(f"{url}: network downloads are off in tests")
        return real(url, *args, **kwargs)

    monkeypatch.setattr(store, "_download", local_only)


@pytest.fixture(scope="session")
def pool():
    """Two worker processes at one thread each, shared by every test of the procs executor (starting them costs
    seconds). A test that leaves results behind in it breaks the next one: `ProcsExecutor.stream` must not."""
    with WorkerPool(2, threads=1) as p:
        yield p


@pytest.fixture
def alexnet_tiny(monkeypatch):
    """`ALEXNET_TINY` in the zoo for one test, in this process only (a worker process would not know it)."""
    monkeypatch.setitem(MODELS, ALEXNET_TINY, partial(alexnet_small, width=1 / 16))  # as the zoo's own widths


@pytest.fixture
def together(monkeypatch):
    """How many clients each call of `engine.batched.train_together` trained at once, call by call: whether and how
    the batched executor took a round's clients, which its results cannot tell (they are the loop's)."""
    from pflbed.engine import batched

    calls, real = [], batched.train_together

    def counted(model, plans, *rest):
        calls.append(len(plans))
        return real(model, plans, *rest)

    monkeypatch.setattr(batched, "train_together", counted)
    return calls
