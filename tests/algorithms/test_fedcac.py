"""FedCAC (Wu et al., ICCV 2023): after local SGD each client marks its critical parameters, the ⌊τ·n⌋ largest
|Δθ ⊙ θ| per tensor; the server averages every client's model over its collaborators — those whose masks overlap
its own, O_ij = 1 − ‖m_i − m_j‖₁/(2‖m_i‖₁), at least E_t = Ō + ((t + 1)/β)(O_max − Ō) — unweighted, and the next
personalized model takes the critical entries from it and the rest from the FedAvg model; BatchNorm statistics
stay on the client."""

import math

import pytest
import torch

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.fedcac import COLLABORATORS, CUSTOM, MASK, collaborators, critical_mask, overlap_matrix
from pflbed.algorithms.masks import pack_bits, unpack_bits
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import update_client
from pflbed.errors import ConfigError

from ..tiny import TINY, same_tensors

BN = {"model": {"name": "cnn_bn"}, "dataset": {"name": "digits"}}


def _cfg(name="fedcac", sections=None, **options):
    return validate_config({**TINY, "train": {**TINY["train"], "momentum": 0.0}, "algorithm": {"name": name, **options},
                            "executor": {"threads": 1}, **(sections or {})})  # fmt: skip


def _update(algo, payload, state, cid=0, seed=7):
    data = algo.ctx.client_data(cid)
    return algo.client_update(payload, state, data, ClientContext(1, cid, torch.Generator().manual_seed(seed)))


def _paper_mask(before, after, tau):
    """Eqs. 1–2 as the authors' code writes them: topk, the nz-th largest as threshold, the zero fallback."""
    metric = torch.abs((after - before) * after).view(-1)
    nz = int(tau * metric.numel())
    top = torch.topk(metric, nz).values
    thresh = top[-1] if len(top) > 0 else math.inf
    if thresh <= 1e-10:
        positive = metric[metric > 1e-20]
        if len(positive):
            thresh = positive.sort()[0][0]
    return torch.abs((after - before) * after) >= thresh


# --- Eqs. 1–2: the critical parameters ---------------------------------------------------------------------------
def test_the_critical_entries_are_the_largest_update_times_value_per_tensor():
    z = torch.zeros(4)
    after = torch.tensor([3.0, -1.0, 2.0, 0.5])
    assert critical_mask(z, after, 0.5).tolist() == [True, False, True, False]  # |Δ·θ| = 9, 1, 4, 0.25
    before = torch.tensor([2.9, -3.0, 1.0, 0.5])  # |Δ·θ| = 0.3, 2, 2, 0: the largest update is not the largest Δ·θ
    assert critical_mask(before, after, 0.25).tolist() == [False, True, True, False]  # a tie: both critical
    none = critical_mask(before, after, 0.2)  # ⌊0.2·4⌋ = 0: none
    assert none.dtype == torch.bool and not none.any() and none.shape == after.shape
    assert critical_mask(before, after, 1.0).tolist() == [True, True, True, False]  # a zero is never critical
    assert critical_mask(after, after, 0.5).tolist() == [True] * 4  # nothing moved: no positive value, all critical
    tiny = torch.tensor([0.0, 0.0, 1e-6, 0.0])  # |Δ·θ| = 1e-12 ≤ 1e-10 at the threshold: the smallest positive
    assert critical_mask(z, tiny, 0.75).tolist() == [False, False, True, False]
    g = torch.Generator().manual_seed(0)
    for shape, tau in [((50, 30), 0.5), ((7,), 0.4), ((3, 4, 5), 0.9), ((1,), 0.5), ((64,), 1.0)]:
        before, after = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        after.view(-1)[::3] = before.view(-1)[::3]  # unmoved entries
        assert torch.equal(critical_mask(before, after, tau), _paper_mask(before, after, tau))


# --- the client ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sections", [None, BN], ids=["mlp", "cnn_bn"])
def test_the_client_trains_from_its_model_and_replies_it_with_its_masks(sections):
    """The reply is FedAvg's local SGD from the payload (with the client's own BatchNorm statistics), plus one
    packed mask per parameter from (start, trained); the state keeps the id and the trained statistics."""
    algo, avg = prepare(_cfg(sections=sections, tau=0.3)), prepare(_cfg("fedavg", sections))
    server = algo.init_server()
    payload = algo.configure(1, server, [0])[0]
    buffers = [k for k, v in payload.items() if k not in dict(algo.ctx.model.named_parameters())]
    assert bool(buffers) == (sections is not None)
    g = torch.Generator().manual_seed(3)
    own = {k: (payload[k] + torch.rand(payload[k].shape, generator=g)) if payload[k].is_floating_point()
           else payload[k] + 5 for k in buffers}  # fmt: skip
    state = {**algo.init_client(0), **own}
    reply, new_state = _update(algo, payload, state)
    start = {**payload, **own}
    plain, _ = _update(avg, start, {})
    params = [k for k, _ in algo.ctx.model.named_parameters()]
    assert same_tensors({k: reply[k] for k in plain}, plain)
    assert set(reply) == set(plain) | {MASK + k for k in params}
    for k in params:
        m = unpack_bits(reply[MASK + k], plain[k].shape)
        assert torch.equal(m, _paper_mask(start[k], plain[k], 0.3))
        assert 0 < int(m.sum()) < m.numel()
    assert same_tensors(new_state, {"cid": state["cid"], **{k: plain[k] for k in buffers}})
    assert algo.reply_fits(payload, reply) is None
    k = params[0]
    assert algo.reply_fits(payload, {**reply, MASK + k: reply[MASK + k][:-1]}) is not None
    assert algo.reply_fits(payload, {**reply, MASK + k: unpack_bits(reply[MASK + k], plain[k].shape)}) is not None


# --- the server: Eqs. 3–5 ----------------------------------------------------------------------------------------
def _replies(algo, cids, seed=0):
    """Trained models (the initial one moved) and masks of graded similarity and unequal sizes: client c's mask is
    a common base with a growing share of its entries redrawn at its own density."""
    g = torch.Generator().manual_seed(seed)
    init = algo.ctx.initial_params
    base = {k: torch.rand(p.shape, generator=g) < 0.5 for k, p in algo.ctx.model.named_parameters()}
    replies, masks = {}, {}
    for n, c in enumerate(cids):
        redraw = 0.12 * n
        density = 0.25 + 0.12 * n
        masks[c] = {k: torch.where(torch.rand(b.shape, generator=g) < redraw,
                                   torch.rand(b.shape, generator=g) < density, b) for k, b in base.items()}  # fmt: skip
        model = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in init.items()}
        replies[c] = {**model, **{MASK + k: pack_bits(m) for k, m in masks[c].items()}}
    return replies, masks


def _by_hand(replies, masks, weights, rnd, beta):
    """Eqs. 3–5 written out in float64: overlaps, threshold, collaborators, customized and global models."""
    cids = sorted(replies)
    flat = {c: torch.cat([masks[c][k].reshape(-1) for k in sorted(masks[c])]).double() for c in cids}
    overlap = {(i, j): 1 - float((flat[i] - flat[j]).abs().sum()) / (2 * float(flat[i].sum()))
               for i in cids for j in cids if i != j}  # fmt: skip
    mean, top = sum(overlap.values()) / len(overlap), max(overlap.values())
    threshold = mean + (rnd / beta) * (top - mean)
    collab = {i: [i] + [j for j in cids if j != i and overlap[i, j] >= threshold] for i in cids}
    keys = [k for k in replies[cids[0]] if not k.startswith(MASK)]
    total = sum(weights.values())
    glob = {k: sum(weights[c] / total * replies[c][k].double() for c in cids) for k in keys}
    custom = {i: {k: sum(replies[j][k].double() for j in collab[i]) / len(collab[i]) for k in keys} for i in cids}
    return glob, custom, collab, overlap


@pytest.mark.parametrize("rnd", [1, 2, 3])
def test_the_server_averages_each_client_s_collaborators_unweighted_and_everyone_by_size_for_the_global(rnd):
    algo = prepare(_cfg(beta=4))
    cids = [0, 2, 3, 4, 5]
    replies, masks = _replies(algo, cids)
    weights = {0: 10.0, 2: 30.0, 3: 5.0, 4: 20.0, 5: 7.0}
    server = algo.init_server()
    server[f"{CUSTOM}1/x"] = torch.ones(2)  # another client's stored entries survive the round
    out = algo.aggregate(rnd, server, replies, weights)
    glob, custom, collab, overlap = _by_hand(replies, masks, weights, rnd, 4)
    sizes = {len(v) for v in collab.values()}
    assert 1 in sizes or min(sizes) < max(sizes), collab  # the threshold separates (test setup)
    assert any(len(v) > 1 for v in collab.values()), collab
    for k in glob:
        assert torch.allclose(out[k].double(), glob[k], atol=1e-6), k
    params = [k for k, _ in algo.ctx.model.named_parameters()]
    assert set(out) == set(server) | {f"{p}{c}/{k}" for p in (CUSTOM, MASK) for c in cids for k in params}
    for c in cids:
        for k in params:
            assert torch.allclose(out[f"{CUSTOM}{c}/{k}"].double(), custom[c][k], atol=1e-6), (c, k)
            assert torch.equal(unpack_bits(out[f"{MASK}{c}/{k}"], out[k].shape), masks[c][k])
    assert out[f"{CUSTOM}1/x"] is server[f"{CUSTOM}1/x"]
    assert float(out[COLLABORATORS]) == pytest.approx(sum(len(v) - 1 for v in collab.values()) / len(cids))
    assert algo.diagnostics(rnd, out, lambda c: {}) == {"collaborators": float(out[COLLABORATORS])}


def test_the_overlap_matrix_is_eq_3_for_every_ordered_pair():
    """O_ij = 1 − ‖m_i − m_j‖₁/(2‖m_i‖₁) over every entry of every key (the first of each too), for masks of one
    entry, of many and empty ones (0); a round of one client: [[1]], or [[0]] for an empty mask."""
    g = torch.Generator().manual_seed(5)
    shapes = {"w": (4, 3), "b": (3,)}
    masks = [{k: torch.rand(sh, generator=g) < 0.5 for k, sh in shapes.items()} for _ in range(4)]
    masks.append({k: torch.zeros(sh, dtype=torch.bool) for k, sh in shapes.items()})
    masks[1] = {k: torch.zeros(sh, dtype=torch.bool) for k, sh in shapes.items()}
    masks[1]["w"][0, 0] = True  # a mask of one entry, the first
    flat = [torch.cat([m[k].reshape(-1) for k in shapes]).double() for m in masks]
    want = [[1 - float((a - b).abs().sum()) / (2 * float(a.sum())) if a.sum() > 0 else 0.0 for b in flat]
            for a in flat]  # fmt: skip
    got = overlap_matrix(masks, list(shapes))
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert overlap_matrix(masks[:1], list(shapes)).tolist() == [[1.0]]
    assert overlap_matrix(masks[-1:], list(shapes)).tolist() == [[0.0]]


def test_two_clients_collaborate_where_their_overlap_reaches_the_threshold():
    """r = 2: the pairs are O_01 and O_10; at t = 0 the threshold is their mean, so the larger one collaborates."""
    overlap = torch.tensor([[1.0, 0.8], [0.6, 1.0]], dtype=torch.float64)
    assert collaborators(overlap, 0, 10).tolist() == [[True, True], [False, True]]
    assert collaborators(overlap[:1, :1], 0, 10).tolist() == [[True]]


def test_after_beta_rounds_only_the_pairs_of_the_largest_overlap_collaborate():
    """E_t = O_max at t + 1 = β (exactly), above it after: critical parameters become local."""
    algo = prepare(_cfg(beta=3))
    cids = [0, 1, 2, 3]
    replies, masks = _replies(algo, cids, seed=1)
    weights = dict.fromkeys(cids, 1.0)
    *_, overlap = _by_hand(replies, masks, weights, 3, 3)
    top = max(overlap.values())
    params = [k for k, _ in algo.ctx.model.named_parameters()]
    for rnd, pairs in [(3, [p for p, o in overlap.items() if o == top]), (4, [])]:
        out = algo.aggregate(rnd, algo.init_server(), replies, weights)
        for i in cids:
            others = [j for (a, j) in pairs if a == i]
            expected = sum(replies[j][params[0]] for j in [i, *others]) / (1 + len(others))
            assert torch.allclose(out[f"{CUSTOM}{i}/{params[0]}"], expected, atol=1e-6)
    assert pairs == [] and len([p for p, o in overlap.items() if o == top]) >= 1


def test_the_next_model_takes_critical_entries_from_the_customized_model_and_the_rest_from_the_latest_global():
    """Eq. 5, with the client's own BatchNorm statistics for its personal model; a client without a mask has the
    global model; a client left out of a later round keeps its mask and customized model, mixed with the new global
    model."""
    algo = prepare(_cfg(sections=BN, beta=4))
    cids = [0, 1, 2]
    replies, masks = _replies(algo, cids)
    server = algo.aggregate(1, algo.init_server(), replies, dict.fromkeys(cids, 1.0))
    params = [k for k, _ in algo.ctx.model.named_parameters()]
    buffers = [k for k in algo.ctx.initial_params if k not in params]
    later, _ = _replies(algo, [2, 3], seed=5)
    server = algo.aggregate(2, server, later, {2: 1.0, 3: 2.0})
    payloads = algo.configure(3, server, [0, 4])
    x = algo.ctx.source.test.x[:16]
    for c in (0, 4):
        want = {k: server[k] for k in algo.ctx.initial_params}
        if c == 0:
            for k in params:
                want[k] = torch.where(masks[0][k], server[f"{CUSTOM}0/{k}"], server[k])
            assert not torch.equal(want[params[0]], server[params[0]])
        assert same_tensors(payloads[c], want)
        state = {"cid": torch.tensor(c), **({k: replies[0][k] for k in buffers} if c == 0 else {})}
        algo.ctx.model.load_state_dict({**want, **{k: state[k] for k in buffers if k in state}})
        algo.ctx.model.eval()
        with torch.no_grad():
            assert torch.equal(algo.personal_model(server, state).logits(x), algo.ctx.model(x))
    assert torch.equal(algo.generic_model(server).logits(x), algo.personal_model(server, {"cid": torch.tensor(4)})
                       .logits(x))  # fmt: skip
    others = tuple(f"{p}{c}/" for p in (MASK, CUSTOM) for c in (1, 2, 3))
    assert set(algo.server_view(server, [0])) == {k for k in server if not k.startswith(others)}


def test_the_client_starts_from_its_own_statistics_and_the_payload_s_parameters():
    algo = prepare(_cfg(sections=BN))
    payload = algo.configure(1, algo.init_server(), [0])[0]
    buffers = [k for k in payload if k not in dict(algo.ctx.model.named_parameters())]
    own = {k: payload[k] + 1 for k in buffers}
    plan = algo.sgd_plan(payload, {"cid": torch.tensor(0), **own}, algo.ctx.client_data(0))
    assert same_tensors(plan.start, {**payload, **own})
    plan = algo.sgd_plan(payload, {"cid": torch.tensor(0)}, algo.ctx.client_data(0))
    assert same_tensors(plan.start, payload)


def test_three_rounds_through_the_engine_are_the_rule_by_hand():
    """Every client every round: FedAvg's local SGD from θ_i, the masks of (start, trained), then Eqs. 3–5 with
    t + 1 = the round — the run's server state and P-FL models, recomputed by hand."""
    full = {"federation": {**TINY["federation"], "sample_fraction": 1.0}, "eval": {"every": 3, "finetune": []}}
    cfg = _cfg(sections={**full, "train": {**TINY["train"], "rounds": 3, "momentum": 0.0}}, tau=0.4, beta=4)
    run = pflbed.run(cfg, write=False, progress=False)
    algo, avg = prepare(cfg), prepare(_cfg("fedavg", {**full, "train": cfg.train.model_dump()}))
    cids = list(algo.ctx.federation.participated)
    weights = {c: float(algo.ctx.federation.num_train(c)) for c in cids}
    glob, model = dict(algo.ctx.initial_params), {c: dict(algo.ctx.initial_params) for c in cids}
    for rnd in (1, 2, 3):
        replies, masks = {}, {}
        for c in cids:
            replies[c], _ = update_client(avg, rnd, c, model[c], {})
            masks[c] = {k: _paper_mask(model[c][k], replies[c][k], 0.4) for k in replies[c]}
        glob, custom, collab, _ = _by_hand(replies, masks, weights, rnd, 4)
        model = {c: {k: torch.where(masks[c][k], custom[c][k], glob[k]).float() for k in glob} for c in cids}
        assert any(1 < len(v) < len(cids) for v in collab.values())
    assert all(torch.allclose(run.server[k].double(), glob[k], atol=1e-5) for k in glob)
    for c in cids:
        mine = algo.personal_model(run.server, run.executor.states[c]).params
        assert all(torch.allclose(mine[k], model[c][k], atol=1e-5) for k in glob)


# --- special cases -----------------------------------------------------------------------------------------------
def test_tau_zero_is_fedavg_bit_for_bit():
    """No critical parameter: every personalized model is the global model, which is FedAvg's."""
    cac = pflbed.run(_cfg(tau=0.0), write=False, progress=False)
    avg = pflbed.run(_cfg("fedavg"), write=False, progress=False)
    assert same_tensors({k: cac.server[k] for k in avg.server}, avg.server)
    assert {k: v for k, v in cac.summary["final"].items() if k != "diag"} == avg.summary["final"]


def test_client_level_dp_is_refused():
    with pytest.raises(ConfigError, match="pair by pair"):
        validate_config({**TINY, "algorithm": {"name": "fedcac"}, "privacy": {"clip": 0.5, "noise_multiplier": 1.0}})


def test_the_personal_model_carries_the_clients_own_batchnorm_statistics():
    algo = prepare(_cfg(sections=BN))
    server = algo.init_server()
    stats = {k: server[k] + 1 if server[k].is_floating_point() else server[k] + 3 for k in algo.buffers}
    assert stats
    params = algo.personal_model(server, {**algo.init_client(0), **stats}).params
    assert all(torch.equal(params[k], v) for k, v in stats.items())
    fresh = algo.personal_model(server, algo.init_client(0)).params  # before its first round: the global ones
    assert all(torch.equal(fresh[k], server[k]) for k in algo.buffers)
