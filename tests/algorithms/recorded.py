"""One short run of each algorithm (and each variant that changes what crosses), recorded for the tests of what a
site takes from a site-local deployment's server: every client update's payload and state (`test_payload_fits`),
every evaluated server state (`test_view_fits`).

A run is kept per case (the run is the costly part, and calls neither `payload_fits` nor `view_fits`): each test
calls the rule itself, so that a mutated rule is the one checked (a verdict kept from an earlier run would not)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pflbed.algorithms import ALGORITHMS
from pflbed.algorithms.base import Algorithm, Tensors
from pflbed.config import validate_config
from pflbed.engine.driver import Driver
from pflbed.models import MODELS
from pflbed.results.experiment import run

from ..tiny import FED, PARITY_CASES, TINY, parity_config
from .test_reply_fits import _bn_net  # a tiny BatchNorm model

# Four rounds, each evaluated: FedBasis's warm start (30 %) ends after round 2, pooling local models before; KT-pFL's
# family sends distillation targets from a client's second round; FedSelect's payloads are flat in a client's third;
# FedFomo sends others' models once any uploaded; FedDBE's consensus comes after round 1; the servers of FedAMP,
# FedCAC, FedFomo, FedPAC and FedSelect store a client's entries from its first reply.
ROUNDS = 4


# Beyond PARITY_CASES: options that change a payload's or a view's structure, on the BatchNorm model where it crosses.
EXTRA = {
    "fedbasis+no-warm-start": ({"name": "fedbasis", "K": 2, "warmup_fraction": 0.0}, "bn_net"),
    "fedbasis+no-major": ({"name": "fedbasis", "K": 2, "major": False, "coordinate_descent": False}, "mlp"),
    "fedbasis+bn": ({"name": "fedbasis", "K": 2}, "bn_net"),
    "fedselect+official": ({"name": "fedselect", "preset": "official", "update_every": 1, "selection": "random"},
                           "bn_net"),  # fmt: skip
    "fedfomo+last-round": ({"name": "fedfomo", "M": 1, "candidates": "last_round"}, "mlp"),
    "fedavg+bn": ({"name": "fedavg"}, "bn_net"),
    "feddbe+momentum": ({"name": "feddbe", "mean_momentum": 0.5}, "mlp"),
    "pfedhn+bn": ({"name": "pfedhn", "local_steps": 2, "hidden": 16, "hidden_layers": 1}, "bn_net"),  # no buffers
    "apple+bn": ({"name": "apple"}, "bn_net"),
    "ktpfl+homogeneous": ({"name": "ktpfl", "homogeneous": True, "public_batch": 32}, "mlp"),
    **{f"{name}+bn": ({"name": name}, "bn_net") for name in ("fedamp", "fedcac", "fedfomo", "fedpac")},
}
CASES = PARITY_CASES + sorted(EXTRA)


def _config(case: str):
    every = {"every": 1}
    if case not in EXTRA:
        return parity_config(case, TINY["executor"], every, rounds=ROUNDS)
    algorithm, model = EXTRA[case]
    return validate_config({**TINY, "federation": FED, "train": {**TINY["train"], "rounds": ROUNDS},  # TINY's data:
                            "eval": {**TINY["eval"], **every},  # no BatchNorm batch of one sample
                            "algorithm": algorithm, "model": {"name": model}})  # fmt: skip


def _copy(tensors: Tensors) -> Tensors:
    return {k: v.clone() for k, v in tensors.items()}


@dataclass
class Recorded:
    algo: Algorithm
    updates: list[tuple[int, int, Tensors, Tensors]] = field(default_factory=list)  # round, client, payload, state
    servers: list[tuple[int, Tensors]] = field(default_factory=list)  # round, server state: each one evaluated


_SEEN: dict[str, Recorded] = {}


def recorded(case: str) -> Recorded:
    """The algorithm of `case`'s run and, copied as they were, every client update's payload and state and every
    server state it evaluated."""
    if case not in _SEEN:
        updates: list = []
        servers: list = []
        algo: list[Algorithm] = []

        def update(self, payload, state, data, cctx):
            algo[:] = algo or [self]
            updates.append((cctx.rnd, data.cid, _copy(payload), _copy(state)))
            return honest_update(self, payload, state, data, cctx)

        def evaluate(self, rnd, server, comm):
            servers.append((rnd, _copy(server)))
            return honest_evaluate(self, rnd, server, comm)

        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(MODELS, "bn_net", _bn_net)
            cfg = _config(case)
            cls = ALGORITHMS[cfg.algorithm.name]
            honest_update, honest_evaluate = cls.client_update, Driver.evaluate
            mp.setattr(cls, "client_update", update)
            mp.setattr(Driver, "evaluate", evaluate)
            run(cfg, write=False, progress=False)
        _SEEN[case] = Recorded(algo[0], updates, servers)
    return _SEEN[case]
