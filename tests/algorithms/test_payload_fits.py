"""`payload_fits(rnd, cid, payload, state)`: what a site takes from a site-local deployment's server as a client's
payload. Every algorithm (and each variant that changes what crosses) runs a few rounds through the engine: each
payload a client receives fits, and each tampering of one entry (a key added, dropped, widened, of another dtype)
is refused naming it. A site checks every payload with this before its client trains on it
(`pflbed.flower.site_message`), so a wrong structure here is either an honest run refused or a server's entry
taken."""

from __future__ import annotations

import pytest
import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.algorithms.base import Tensors
from pflbed.config import validate_config
from pflbed.models import MODELS
from pflbed.runs import run

from ..tiny import FED, PARITY_CASES, TINY, parity_config
from .test_reply_fits import _bn_net, other_dtype  # a tiny BatchNorm model; float32 ↔ float64

# Four rounds: FedBasis's warm start (30 %) ends after round 2; KT-pFL's family sends distillation targets from a
# client's second round; FedSelect's payloads are flat in a client's third; FedFomo sends others' models once any
# uploaded; FedDBE's consensus comes after round 1.
ROUNDS = 4


# Beyond PARITY_CASES: options that change a payload's structure, on the BatchNorm model where it crosses.
EXTRA = {
    "fedbasis+no-warm-start": ({"name": "fedbasis", "K": 2, "warmup_fraction": 0.0}, "bn_net"),
    "fedbasis+no-major": ({"name": "fedbasis", "K": 2, "major": False, "coordinate_descent": False}, "mlp"),
    "fedselect+official": ({"name": "fedselect", "preset": "official", "update_every": 1, "selection": "random"},
                           "bn_net"),  # fmt: skip
    "fedfomo+last-round": ({"name": "fedfomo", "M": 1, "candidates": "last_round"}, "mlp"),
    "fedavg+bn": ({"name": "fedavg"}, "bn_net"),
    "feddbe+momentum": ({"name": "feddbe", "mean_momentum": 0.5}, "mlp"),
    "pfedhn+bn": ({"name": "pfedhn", "local_steps": 2, "hidden": 16, "hidden_layers": 1}, "bn_net"),  # no buffers
    "apple+bn": ({"name": "apple"}, "bn_net"),
    "ktpfl+homogeneous": ({"name": "ktpfl", "homogeneous": True, "public_batch": 32}, "mlp"),
}
CASES = PARITY_CASES + sorted(EXTRA)


def _config(case: str):
    if case not in EXTRA:
        return parity_config(case, TINY["executor"], rounds=ROUNDS)
    algorithm, model = EXTRA[case]
    return validate_config({**TINY, "federation": FED, "train": {**TINY["train"], "rounds": ROUNDS},  # TINY's data:
                            "algorithm": algorithm, "model": {"name": model}})  # no BatchNorm batch of one sample


_SEEN: dict[str, tuple[object, list[tuple[int, int, Tensors, Tensors]]]] = {}


def _copy(tensors: Tensors) -> Tensors:
    return {k: v.clone() for k, v in tensors.items()}


def seen(case: str):
    """The algorithm and (round, client, payload, state) of every client update of a run, copied as the client got
    them. Kept per case (the run is the costly part, and does not call `payload_fits`): each test calls
    `payload_fits` itself, so that a mutated rule is the one checked (a verdict kept from an earlier run would not)."""
    if case not in _SEEN:
        record: list = []

        def recorded(self, payload, state, data, cctx):
            record.append((cctx.rnd, data.cid, _copy(payload), _copy(state)))
            _SEEN.setdefault(case, (self, record))
            return honest(self, payload, state, data, cctx)

        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(MODELS, "bn_net", _bn_net)
            cfg = _config(case)
            cls = ALGORITHMS[cfg.algorithm.name]
            honest = cls.client_update
            mp.setattr(cls, "client_update", recorded)
            run(cfg, write=False, progress=False)
    return _SEEN[case]


@pytest.mark.parametrize("case", CASES)
def test_every_payload_of_a_run_fits(case):
    algo, record = seen(case)
    assert {rnd for rnd, *_ in record} == set(range(1, ROUNDS + 1))
    fits = [(rnd, cid, algo.payload_fits(rnd, cid, payload, state)) for rnd, cid, payload, state in record]
    assert fits == [(rnd, cid, None) for rnd, cid, *_ in record]


@pytest.mark.parametrize("case", CASES)
def test_each_tampered_payload_entry_is_refused_naming_it(case):
    """The last round's largest payload, each entry in turn widened ([2, *shape]), dropped and of another dtype;
    a key added: an arbitrary one, and each of the client's state (its personal entries, where the update would
    read them under the same name)."""
    algo, record = seen(case)
    optional = {"pfedme/keep"}  # without it, the payload of a client in the round's sample (`train_clients: all`)
    rnd, cid, payload, state = max((r for r in record if r[0] == ROUNDS), key=lambda r: len(r[2]))
    for k, v in payload.items():
        for how, bad in {"wide": {**payload, k: v.expand(2, *v.shape).clone()},
                         "dropped": {j: u for j, u in payload.items() if j != k},
                         "dtype": {**payload, k: v.to(other_dtype(v))}}.items():  # fmt: skip
            if how == "dropped" and k in optional:
                continue
            why = algo.payload_fits(rnd, cid, bad, state)
            assert why is not None and f"'{k}'" in why, (k, how, why)
    for k in ["extra", *sorted(set(state) - set(payload))]:
        why = algo.payload_fits(rnd, cid, {**payload, k: state.get(k, torch.zeros(3))}, state)
        assert why == f"has key '{k}', which this algorithm's server does not send", (k, why)
