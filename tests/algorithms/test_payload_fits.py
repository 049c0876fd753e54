"""`payload_fits(rnd, cid, payload, state)`: what a site takes from a site-local deployment's server as a client's
payload. Every algorithm (and each variant that changes what crosses) runs a few rounds through the engine: each
payload a client receives fits, and each tampering of one entry (a key added, dropped, widened, of another dtype)
is refused naming it. A site checks every payload with this before its client trains on it
(`pflbed.flower.site_message`), so a wrong structure here is either an honest run refused or a server's entry
taken."""

from __future__ import annotations

import pytest
import torch

from .recorded import CASES, ROUNDS, recorded
from .test_reply_fits import other_dtype  # float32 ↔ float64


@pytest.mark.parametrize("case", CASES)
def test_every_payload_of_a_run_fits(case):
    seen = recorded(case)
    algo, record = seen.algo, seen.updates
    assert {rnd for rnd, *_ in record} == set(range(1, ROUNDS + 1))
    fits = [(rnd, cid, algo.payload_fits(rnd, cid, payload, state)) for rnd, cid, payload, state in record]
    assert fits == [(rnd, cid, None) for rnd, cid, *_ in record]


@pytest.mark.parametrize("case", CASES)
def test_each_tampered_payload_entry_is_refused_naming_it(case):
    """The last round's largest payload, each entry in turn widened ([2, *shape]), dropped and of another dtype;
    a key added: an arbitrary one, and each of the client's state (its personal entries, where the update would
    read them under the same name)."""
    seen = recorded(case)
    algo, record = seen.algo, seen.updates
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
