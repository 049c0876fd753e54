"""Attack: a site of a site-local run reads another client's part of the server state out of the messages that ask
it to evaluate its clients. Each EVALUATE message the server sends must carry the shared entries and only that
site's clients' own (`Algorithm.server_view`): site 1 (client 1) must find nothing of client 0 — FedAMP's and
FedFomo's stored models, FedPAC's personalized head, FedSelect's mask, FedBasis's pooled warm-up model, FedFomo's
row of the affinity matrix, pFedHN's embedding (with which and φ it would generate client 0's model)."""

import re

import pytest
import torch

from pflbed.config import validate_config

pytest.importorskip("flwr")

from flwr.app import MessageType  # noqa: E402

from pflbed.flower import client  # noqa: E402
from pflbed.flower.records import from_record  # noqa: E402
from pflbed.flower.sites import server_algorithm  # noqa: E402

from .site_setup import _site_cfg, _sites, _tree, run_sites  # noqa: E402

# algorithm → (its options, the pattern of a client's keyed entries: group 1 its id). FedBasis pools the local
# models of warm-up rounds 2–3 (K = 4 needs four distinct clients; client 0 trains in round 3), evaluated in round 3.
KEYED = {
    "fedamp": ({}, r"local/(\d+)/"),
    "fedfomo": ({"affinity": "deltas"}, r"local/(\d+)/"),
    "fedpac": ({}, r"head/(\d+)/"),
    "fedselect": ({}, r"mask/(\d+)/"),
    "fedbasis": ({"K": 4, "warmup_fraction": 1.0}, r"pool(\d+)\."),
}


def _evaluations(tmp_path, name, options):
    """A site-local run of `name` (4 clients, one per site, 4 rounds, evaluated every round): the server states of the
    EVALUATE messages the server sent, [(evaluation, site, tensors)] in sending order; the final server state;
    the config."""
    tree = _tree(name, algorithm={"name": name, **options}, eval={"every": 1, "finetune": ["ft"]})
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    sent, send, asked = [], grid.send_and_receive, [0]

    def spy(msgs, timeout=None):
        evaluate = [m for m in msgs if m.metadata.message_type == MessageType.EVALUATE]
        asked[0] += bool(evaluate)
        for m in evaluate:
            sent.append((asked[0], grid.nodes.index(m.metadata.dst_node_id), from_record(m.content["server"])))
        return send(msgs, timeout)

    grid.send_and_receive = spy
    result = run_sites(_site_cfg(tree), grid)
    return sent, result.server, _site_cfg(tree)


def _of(state, pattern, cid):
    """The entries of client `cid` in `state`."""
    return {k: v for k, v in state.items() if (m := re.match(pattern, k)) and int(m.group(1)) == cid}


def _holds(state, values):
    """Whether `state` holds one of the floating-point tensors `values`, under any name."""
    return any(torch.equal(v, w) for v in values if v.is_floating_point() for w in state.values() if v.shape == w.shape)


@pytest.mark.parametrize("name", list(KEYED))
def test_a_site_receives_no_other_client_s_entries_of_the_server_state(name, tmp_path):
    """Site 0 is sent client 0's entries (it evaluates client 0 from them); site 1, in the same evaluation, none
    of them — under their names or any other — and only its own client's."""
    options, pattern = KEYED[name]
    sent, _, _ = _evaluations(tmp_path, name, options)
    to = {(e, site): state for e, site, state in sent}
    leaks = [e for e, site, _ in sent if site == 0 and _of(to[e, 0], pattern, 0)]
    assert leaks, "client 0 has no entries when evaluated (test setup)"
    for e in leaks:
        owners = {int(m.group(1)) for k in to[e, 1] if (m := re.match(pattern, k))}
        assert owners <= {1}
        assert not _holds(to[e, 1], _of(to[e, 0], pattern, 0).values())


def test_fedfomo_site_receives_only_its_own_row_of_the_per_client_tables(tmp_path):
    """P's row 0 is what client 0 gained from each other client's model, measured on its own validation data."""
    sent, final, _ = _evaluations(tmp_path, "fedfomo", KEYED["fedfomo"][0])
    assert final["P"][0].any() and final["last_upload"][0] > 0, "client 0 has no row (test setup)"
    last = [state for _, site, state in sent if site == 1][-1]
    for key in ("P", "last_upload", "updates"):
        assert not last[key][[0, 2, 3]].any()
        assert torch.equal(last[key][1], final[key][1])


def test_pfedhn_site_receives_its_client_s_weights_and_neither_the_hypernetwork_nor_any_embedding(tmp_path):
    """With φ and client 0's embedding a site would generate client 0's model: site 1 gets θ_1 alone."""
    sent, final, cfg = _evaluations(tmp_path, "pfedhn", {})
    to_1 = [state for _, site, state in sent if site == 1]
    for state in to_1:
        assert state and all(k.startswith("theta/") for k in state) and {k.split("/")[1] for k in state} == {"1"}
    algo = server_algorithm(cfg, [[1]] * 4)
    theta_0 = algo.generate(final, algo.embedding(final, 0))
    assert not _holds(to_1[-1], theta_0.values())
