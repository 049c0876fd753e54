"""`view_fits(view, cids)`: what a site holding clients `cids` takes from a site-local deployment's server as the
view it evaluates them on. Every algorithm (and each variant that changes what crosses) runs a few rounds through
the engine, evaluating each: every site's view of each evaluated server state fits, and each tampering of one
entry (a key added, dropped, widened, of another dtype) is refused naming it. A site checks every view with this
before it evaluates (`pflbed.flower.site_message`), so a wrong structure here is either an honest run refused or a
server's entry taken."""

from __future__ import annotations

import pytest

from .recorded import CASES, ROUNDS, recorded
from .test_reply_fits import other_dtype  # float32 ↔ float64

# Entries a server state gains one at a time, so that a view without one of them is a view of another round: FedDBE's
# consensus, and FedSelect's mask of one tensor of one client (a reply sends masks of the tensors it has personal
# entries in).
ALONE = {"feddbe": ("consensus",), "fedselect": ("mask/",)}


def _sites(clients: list[int]) -> list[list[int]]:
    """The client sets a site may hold: each client alone, the first half, all."""
    return [[c] for c in clients] + [clients[: len(clients) // 2], clients]


@pytest.mark.parametrize("case", CASES)
def test_every_view_of_a_run_fits(case):
    seen = recorded(case)
    algo, clients = seen.algo, list(seen.algo.ctx.federation.participated)
    assert [rnd for rnd, _ in seen.servers] == list(range(1, ROUNDS + 1))
    fits = [(rnd, cids, algo.view_fits(algo.server_view(server, cids), cids)) for rnd, server in seen.servers
            for cids in _sites(clients)]  # fmt: skip
    assert fits == [(rnd, cids, None) for rnd, cids, _ in fits]


@pytest.mark.parametrize("case", CASES)
def test_each_tampered_view_entry_is_refused_naming_it(case):
    """The last evaluation's view for a site of half the clients, each entry in turn widened ([2, *shape]),
    dropped and of another dtype; a key added: an arbitrary one, each entry of the other clients' (in the view of
    all) and each of the site's clients' states (their personal entries, where an evaluation would read them under
    the same name)."""
    seen = recorded(case)
    algo, clients = seen.algo, list(seen.algo.ctx.federation.participated)
    server, cids = seen.servers[-1][1], clients[: len(clients) // 2]
    view = algo.server_view(server, cids)
    alone = ALONE.get(algo.name, ())
    for k, v in view.items():
        for how, bad in {"wide": {**view, k: v.expand(2, *v.shape).clone()},
                         "dropped": {j: u for j, u in view.items() if j != k},
                         "dtype": {**view, k: v.to(other_dtype(v))}}.items():  # fmt: skip
            why = algo.view_fits(bad, cids)
            if how == "dropped" and k.startswith(alone):
                assert why is None, (k, why)  # the view of an earlier round
            else:
                assert why is not None and f"'{k}'" in why, (k, how, why)
    states = {k: t for _, c, _, state in seen.updates if c in cids for k, t in state.items()}
    others = algo.server_view(server, clients)
    for k in ["extra", *sorted((set(others) | set(states)) - set(view))]:
        why = algo.view_fits({**view, k: others.get(k, states.get(k))}, cids)
        assert why == f"has key '{k}', which this algorithm's server does not send", (k, why)
