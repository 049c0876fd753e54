"""`Algorithm.server_view`: what a site of a site-local run receives to evaluate its clients. It must hold no other
client's entry of the server state (the declared ones: `client_entries`, per-client rows) and still evaluate the
site's clients exactly as the whole state does."""

import re

import pytest
import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.algorithms.base import Budget, own_rows
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import update_client
from pflbed.evaluation.evaluate import last

from ..tiny import FED, LIGHT, TINY

PUBLIC = {"feddf", "fedmd", "ktpfl", "pfeddf", "sim_pfl", "topk_pfl"}  # refused site-local: no public data there
# Options that put per-client entries in the server state by round 2: FedBasis pools the warm-up's local models
# (warm-up rounds 1–3 of 4), FedFomo's `deltas` adds its per-client counter.
OPTIONS = {"fedbasis": {"K": 4, "warmup_fraction": 0.75}, "fedfomo": {"affinity": "deltas"}}
ROUNDS = {1: [0, 1, 2], 2: [0, 1, 3]}  # clients 4 and 5 never train


def _trained(name):
    """`name` on TINY after two rounds: (algorithm, server state, every participated client's state)."""
    fields = ALGORITHMS[name].Config.model_fields
    algorithm = {"name": name, **{k: v for k, v in LIGHT.items() if k in fields}, **OPTIONS.get(name, {})}
    algo = prepare(validate_config({**TINY, "federation": FED, "algorithm": algorithm, "executor": {"threads": 1}}))
    server = algo.init_server()
    states = {c: algo.init_client(c) for c in algo.ctx.federation.participated}
    for rnd, cids in ROUNDS.items():
        payloads, replies = algo.configure(rnd, server, cids), {}
        for c in cids:
            replies[c], states[c] = update_client(algo, rnd, c, payloads[c], states[c])
        server = algo.aggregate(rnd, server, replies, dict.fromkeys(cids, 1.0))
    return algo, server, states


def _same(a, b, x):
    return (a is None) == (b is None) and (a is None or torch.equal(a.logits(x), b.logits(x)))


@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) - PUBLIC))
def test_a_site_s_view_evaluates_its_clients_as_the_whole_server_state_does(name):
    """Each client's personal model, the generic model and (where the run fine-tunes at the end) one epoch of
    +FT, from the view of a site holding that client alone, predict bit for bit as from the whole state."""
    algo, server, states = _trained(name)
    x = algo.ctx.source.test.x[:16]
    for c in (1, 2, 5):  # trained in both rounds, in round 1, never
        view = algo.server_view(server, [c])
        assert _same(algo.personal_model(view, states[c]), algo.personal_model(server, states[c]), x)
        assert _same(algo.generic_model(view), algo.generic_model(server), x)
    if algo.finetune_methods(server, ["ft"]):
        budget, data = Budget("ft", 1, 0.05, 16), algo.ctx.client_data(1)
        tuned = [last(algo.personalize(s, data, budget, torch.Generator().manual_seed(0))) for s in (view, server)]
        assert _same(*tuned, x)


@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) - PUBLIC))
def test_no_algorithm_leaves_an_entry_that_looks_like_another_client_s_in_a_site_s_view(name):
    """A guard for algorithms to come: in the view of a site holding client 1, no key names another client
    (`…/<cid>/…`) and no table of one row per participated client has a non-zero row but client 1's. An
    algorithm that keeps such entries declares them (`client_entries`) or overrides `server_view`."""
    algo, server, _ = _trained(name)
    n = len(algo.ctx.federation.participated)
    view = algo.server_view(server, [1])
    assert not [k for k in view if any(int(c) != 1 for c in re.findall(r"(?:^|/)(\d+)(?=/|$)", k))]
    rows = [k for k, v in view.items() if v.dim() and len(v) == n and k not in algo.ctx.initial_params]
    assert not [k for k in rows if view[k][[c for c in range(n) if c != 1]].any()]


@pytest.mark.parametrize("name, prefix", [("fedamp", "local/{}/"), ("fedfomo", "local/{}/"), ("fedpac", "head/{}/"),
                                          ("fedselect", "mask/{}/"), ("fedbasis", "pool{}.")])  # fmt: skip
def test_client_0_s_keyed_entries_are_declared_and_left_out_of_another_site_s_view(name, prefix):
    """The server state holds entries of client 0 (trained in both rounds); a site of clients 1 and 2 gets none of
    them, and gets its own clients' (what `personal_model` may read)."""
    algo, server, _ = _trained(name)
    view = algo.server_view(server, [1, 2])

    def of(c, state):
        return [k for k in state if k.startswith(prefix.format(c))]

    assert of(0, server) and of(1, server), f"{name}: no entries of clients 0 and 1 (test setup)"
    assert not of(0, view)
    assert of(1, view) == of(1, server) and all(view[k] is server[k] for k in of(1, server))


def test_fedfomo_s_view_keeps_only_the_site_s_rows_of_its_per_client_tables():
    """P's row i (what client i gained from each other model), client i's last upload round and update count."""
    algo, server, _ = _trained("fedfomo")
    view = algo.server_view(server, [1, 2])
    assert server["P"][0].any() and server["last_upload"][0] == 2, "client 0 has no figures (test setup)"
    for key in ("P", "last_upload", "updates"):
        assert torch.equal(view[key][[1, 2]], server[key][[1, 2]])
        assert not view[key][[0, 3, 4, 5]].any()


def test_pfedhn_s_view_is_the_site_s_clients_generated_weights_and_no_embedding_or_hypernetwork():
    """A site gets θ_i for its clients, bit for bit their training payloads' values — not φ, not an embedding,
    so it cannot generate client 0's model."""
    algo, server, _ = _trained("pfedhn")
    view = algo.server_view(server, [1, 2])
    assert {k.split("/")[1] for k in view} == {"1", "2"} and all(k.startswith("theta/") for k in view)
    payload = algo.configure(3, server, [1])[1]
    assert all(torch.allclose(view[f"theta/1/{k}"], v) for k, v in payload.items())


def test_own_rows_zeroes_the_other_rows_and_keeps_the_shape():
    t = torch.arange(12.0).view(4, 3)
    assert torch.equal(own_rows(t, [1, 3]), torch.tensor([[0.0] * 3, [3, 4, 5], [0.0] * 3, [9, 10, 11]]))
    assert torch.equal(own_rows(torch.tensor([5, 6]), []), torch.tensor([0, 0]))
