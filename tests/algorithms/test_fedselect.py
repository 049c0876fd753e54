import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed import rng
from pflbed.algorithms import fedselect
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.fedselect import FedSelect, FedSelectOptions
from pflbed.algorithms.local import LocalOnly
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_plan
from pflbed.algorithms.masks import (
    any_each,
    eligible_keys,
    fill,
    grow_mask,
    iou,
    iou_matrix,
    masked_mean,
    pack_bits,
    personal_fraction,
    take,
    unpack_bits,
)
from pflbed.algorithms.training import get_params, index_batches, load_params, local_sgd
from pflbed.config import validate_config
from pflbed.engine import wire
from pflbed.engine.build import prepare
from pflbed.engine.executor import LoopExecutor
from pflbed.errors import ConfigError
from pflbed.evaluation.evaluate import last
from pflbed.federation import sample_clients

from ..tiny import TINY

FULL = {**TINY["federation"], "sample_fraction": 1.0}


def drive(options: dict, rounds: int, **sections):
    """Run the round loop by hand (strict executor) and keep every round's payloads, replies, server and states."""
    cfg = validate_config({**TINY, **sections, "algorithm": {"name": "fedselect", **options}})
    algo = prepare(cfg)
    ex = LoopExecutor(algo, strict=True)
    fed = algo.ctx.federation
    server, history = algo.init_server(), []
    for rnd in range(1, rounds + 1):
        cids = sample_clients(cfg.seed, rnd, fed.participated, cfg.federation.sample_fraction)
        payloads = algo.configure(rnd, server, cids)
        replies = ex.run(rnd, payloads)
        server = algo.aggregate(rnd, server, replies, {c: fed.num_train(c) for c in cids})
        history.append({"payloads": payloads, "replies": replies, "server": server, "states": dict(ex.states)})
    return algo, history


def masks_of(algo: FedSelect, state: dict) -> dict[str, torch.Tensor]:
    return {k: algo._mask(state, f"mask/{k}", k) for k in algo.eligible}


# --- mask utilities ----------------------------------------------------------------------------------------------
def test_wire_packing_matches_numpy_and_round_trips():
    g = torch.Generator().manual_seed(0)
    for shape in [(1,), (7,), (8,), (3, 5), (2, 3, 4)]:
        m = torch.rand(shape, generator=g) > 0.5
        bits = pack_bits(m)
        assert bits.dtype == torch.uint8 and bits.numel() == math.ceil(m.numel() / 8)
        assert np.array_equal(bits.numpy(), np.packbits(m.numpy().reshape(-1)))
        assert torch.equal(unpack_bits(bits, m.shape), m)
        x = torch.randn(shape, generator=g)
        flat = take(x, ~m)
        assert flat.numel() == int((~m).sum())
        assert flat.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # a copy: the wire's own
        assert torch.equal(fill(~m, flat, torch.zeros(shape)) * (~m), x * (~m))
        assert torch.equal(fill(m, take(x, m), flat), x)  # own values + flat shared values = the whole tensor
    with pytest.raises(ValueError):
        fill(m, take(x, m)[:-1], flat)


def test_mask_flags_are_read_at_once_and_wire_constants_made_once_per_device():
    """`any_each` answers for every mask in one read of the device; the constants `pack_bits` and `unpack_bits` use
    are made once per device, not per call (each a copy to, or a kernel on, a GPU)."""
    masks = [torch.zeros(3, dtype=torch.bool), torch.tensor([False, True]), torch.ones(1, dtype=torch.bool)]
    assert any_each(masks) == [False, True, True] and any_each([]) == []
    from pflbed.algorithms import masks as module

    for constant in (module._BIT_WEIGHTS, module._SHIFTS):
        first = module._on(constant, torch.device("cpu"))
        assert module._on(constant, torch.device("cpu")) is first and torch.equal(first, constant)
        elsewhere = module._on(constant, torch.device("meta"))  # another device: a copy there, made once
        assert elsewhere.device.type == "meta" and module._on(constant, torch.device("meta")) is elsewhere
    assert module._SHIFTS.tolist() == [7, 6, 5, 4, 3, 2, 1, 0] and module._BIT_WEIGHTS.tolist() == [
        128, 64, 32, 16, 8, 4, 2, 1]  # fmt: skip


@pytest.mark.parametrize("update_every", [1, 2])
def test_a_client_s_finish_reads_whether_its_masks_hold_personal_entries_in_one_go(update_every, monkeypatch):
    """Whether each eligible tensor's mask has a personal entry, before and after its growth, is read from the device
    once for all tensors (`any_each`), never tensor by tensor as a Python bool (each a wait on a GPU): a round of
    100 clients of a ResNet-18 asked it 18,600 times. The reply and state are those of the hand reference tests."""
    algo, hist = drive({"update_every": update_every}, rounds=2, federation=FULL)
    c = 0
    state, payload = hist[-1]["states"][c], algo.configure(3, hist[-1]["server"], [c])[c]
    plan = algo.round_plan(payload, state, algo.ctx.client_data(c), ClientContext(3, c, torch.Generator()))
    trained = {k: v + 0.01 for k, v in plan.start.items()}
    reads = []
    real = fedselect.any_each
    monkeypatch.setattr(fedselect, "any_each", lambda ms: reads.append(len(ms)) or real(ms))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: pytest.fail("a tensor read as a Python bool"))
    reply, new_state = plan.finish(trained)
    n = len(algo.eligible)
    assert reads == ([n, n] if (int(state["rounds"]) + 1) % update_every == 0 else [n])
    assert any(k.startswith("mask/") for k in reply) and any(k.startswith("held/") for k in new_state)


def test_count_masked_aggregation_hand_computed():
    """Entry 0 is personal for all 3 clients, entry 1 shared by c0 only, entry 2 by c0 and c1, entry 3 by all."""
    old = torch.tensor([9.0, 9.0, 9.0, 9.0])
    values = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0, 7.0, 8.0]), torch.tensor([10.0, 20, 30, 40])]
    personal = [torch.tensor([1, 0, 0, 0]).bool(), torch.tensor([1, 1, 0, 0]).bool(), torch.tensor([1, 1, 1, 0]).bool()]
    expected = torch.tensor([9.0, 2.0, (3 + 7) / 2, (4 + 8 + 40) / 3])
    assert torch.allclose(masked_mean(old, values, [~p for p in personal]), expected)

    # The same through the algorithm's wire format: flat global entries + packed masks, 0-share entry kept.
    algo, _ = drive({"eligible": "all"}, 0)
    k = "blocks.classifier.bias"  # 10 entries; the first 4 as above, the rest shared by all
    server = algo.init_server()
    server[k] = torch.cat([old, torch.zeros(6)])
    replies = {}
    for c, (v, p) in enumerate(zip(values, personal, strict=True)):
        full_v, full_p = torch.cat([v, torch.full((6,), float(c))]), torch.cat([p, torch.zeros(6, dtype=torch.bool)])
        replies[c] = {kk: torch.full_like(server[kk], float(c)) for kk in algo.keys}  # unmasked tensors: 0, 1, 2
        replies[c][k], replies[c][f"mask/{k}"] = take(full_v, ~full_p), pack_bits(full_p)
    sizes = {0: 10, 1: 100, 2: 1000}  # |D_m|: ignored, the mean is uniform over clients (Alg. 1)
    out = algo.aggregate(1, server, {c: wire.roundtrip(r) for c, r in replies.items()}, sizes)
    assert torch.allclose(out[k], torch.cat([expected, torch.full((6,), 1.0)]))
    assert all(torch.allclose(out[kk], torch.ones_like(out[kk])) for kk in algo.keys if kk != k)
    assert torch.equal(out[f"mask/2/{k}"], pack_bits(torch.cat([personal[2], torch.zeros(6, dtype=torch.bool)])))


def test_grow_mask_selects_largest_smallest_random_and_stops_at_alpha():
    delta = torch.tensor([0.9, 0.1, 0.5, 0.7, 0.3, 0.2, 0.8, 0.4])
    none = torch.zeros(8, dtype=torch.bool)
    big = grow_mask(none, delta, rate=0.25, limit=1.0)
    assert big.nonzero().squeeze(1).tolist() == [0, 6]
    assert grow_mask(none, delta, rate=0.25, limit=1.0, selection="smallest").nonzero().squeeze(1).tolist() == [1, 5]
    rand = grow_mask(none, delta, rate=0.5, limit=1.0, selection="random", generator=torch.Generator().manual_seed(1))
    assert int(rand.sum()) == 4
    again = grow_mask(big, delta, rate=0.5, limit=1.0)  # only still-global entries compete: 0 and 6 are taken
    assert big.logical_and(again).equal(big) and again.nonzero().squeeze(1).tolist() == [0, 2, 3, 6, 7]
    assert torch.equal(grow_mask(again, delta, rate=0.5, limit=0.6), again)  # 5/8 ≥ 0.6: stopped
    assert int(grow_mask(big, delta, rate=1.0, limit=0.5).sum()) == 8  # stop: tested before growing (overshoot)
    assert int(grow_mask(big, delta, rate=1.0, limit=0.5, cap=True).sum()) == 4  # cap: never above ⌊α·n⌋
    assert not grow_mask(none, delta, rate=1.0, limit=0.0).any()  # α = 0: never personalize


def test_iou_matrix_hand_computed():
    a, b, c = torch.tensor([1, 1, 0, 0]).bool(), torch.tensor([0, 1, 1, 0]).bool(), torch.zeros(4, dtype=torch.bool)
    m = iou_matrix([a, b, c])
    assert m[0, 0] == 1 and m[0, 1] == pytest.approx(1 / 3) and m[1, 0] == m[0, 1]
    assert m[0, 2] == 0 and math.isnan(m[2, 2])


# --- options -----------------------------------------------------------------------------------------------------
def test_presets_and_option_validation():
    paper = FedSelectOptions()
    assert (paper.p, paper.alpha, paper.update_every, paper.eligible, paper.delta_from) == (
        0.25, 0.3, 1, "all", "round_start",
    )  # fmt: skip
    off = FedSelectOptions(preset="official", alpha=0.5)
    assert (off.p, off.alpha, off.update_every, off.eligible, off.delta_from) == (
        0.25, 0.5, 3, "weights", "last_update",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="algorithm.bogus"):
        validate_config({**TINY, "algorithm": {"name": "fedselect", "bogus": 1}})
    with pytest.raises(ConfigError, match="algorithm.layers"):
        prepare(validate_config({**TINY, "algorithm": {"name": "fedselect", "layers": "nope"}}))
    algo, _ = drive({"eligible": "weights"}, 0)
    model = algo.ctx.model
    assert eligible_keys(model, "weights") == ["blocks.fc1.1.weight", "blocks.fc2.0.weight", "blocks.classifier.weight"]
    assert eligible_keys(model, "all", "classifier") == ["blocks.classifier.weight", "blocks.classifier.bias"]


# --- LocalAlt ----------------------------------------------------------------------------------------------------
def test_frozen_entries_never_move_in_either_phase_even_with_momentum_and_weight_decay():
    """LocalAlt's plan (personal pass, global pass, twice): each pass moves exactly its side's entries — a pass
    that followed the other side's (momentum 0.9 and weight decay live in the second epoch) included. Each prefix
    of the plan is run from the same start and generator, so prefix i+1 differs from prefix i by one pass."""
    train = {**TINY["train"], "local_epochs": 2, "momentum": 0.9, "weight_decay": 0.1, "lr": 0.1}
    algo, _ = drive({"eligible": "all"}, 0, train=train)
    model, data = algo.ctx.model, algo.ctx.client_data(0)
    g = torch.Generator().manual_seed(0)
    mask = {
        "blocks.fc1.1.weight": torch.rand(model.blocks.fc1[1].weight.shape, generator=g) < 0.3,  # mixed tensor
        "blocks.classifier.bias": torch.ones(10, dtype=torch.bool),  # wholly personal
    }  # every other tensor wholly global
    state = {f"mask/{k}": pack_bits(m) for k, m in mask.items()}
    plan = algo.round_plan(algo.configure(1, algo.init_server(), [0])[0], state, data, ClientContext(1, 0, gen(1)))
    assert [ph.optimizer for ph in plan.phases] == ["personal", "global"] * 2

    def after(n):
        short = LocalSGDPlan(plan.start, plan.phases[:n], lambda t: (t, {}), consts=plan.consts)
        return run_plan(model, short, data, algo.ctx.cfg.train, gen(1))[0]

    mask_of = {k: mask.get(k, torch.zeros(p.shape, dtype=torch.bool)) for k, p in model.named_parameters()}
    before = after(0)
    for n, ph in enumerate(plan.phases, 1):
        now = after(n)
        for k in mask_of:
            trainable = mask_of[k] if ph.optimizer == "personal" else ~mask_of[k]
            assert torch.equal(now[k][~trainable], before[k][~trainable]), (n, k)
            assert not trainable.any() or not torch.equal(now[k][trainable], before[k][trainable]), (n, k)
        before = now
    assert all(p.requires_grad for p in model.parameters())  # the shared model object is left trainable


# --- equivalences ------------------------------------------------------------------------------------------------
def test_alpha_zero_is_fedavg_with_uniform_weights():
    """Equal-size clients (so FedAvg's |D_m| weights are uniform): identical server after 2 rounds, bit for bit."""
    sections = {
        "federation": {**TINY["federation"], "partition": "iid", "train_per_client": 40},
        "train": {**TINY["train"], "rounds": 2, "momentum": 0.5, "weight_decay": 1e-3, "local_epochs": 2},
        "eval": {"every": 2, "finetune": []},
    }
    fa = pflbed.run({**TINY, **sections, "algorithm": {"name": "fedavg"}}, write=False)
    fs = pflbed.run({**TINY, **sections, "algorithm": {"name": "fedselect", "alpha": 0.0, "p": 0.5}}, write=False)
    fed = fa.executor.algo.ctx.federation
    assert len({fed.num_train(c) for c in fed.participated}) == 1
    assert set(fs.server) == set(fa.server)  # no client mask stored: nobody personalized
    for k, v in fa.server.items():
        assert torch.equal(fs.server[k], v), k
    assert fs.history[-1]["up_bytes_per_round"] == fa.history[-1]["up_bytes_per_round"]
    assert fs.history[-1]["down_bytes_per_round"] == fa.history[-1]["down_bytes_per_round"]


def test_all_personal_masks_are_local_only_training_from_then_on():
    """p = 1, α = 1: after round 1 (FedAvg) every entry is personal; rounds 2–3 are exactly local-only training
    from the round-1 aggregate (the newly personal entries start from it, as Alg. 1 broadcasts before the new
    mask applies), and the server no longer changes."""
    train = {**TINY["train"], "momentum": 0.9}
    algo, hist = drive({"p": 1.0, "alpha": 1.0, "eligible": "all"}, 3, federation=FULL, train=train)
    after1 = algo._globals(hist[0]["server"])
    assert all(torch.equal(algo._globals(hist[-1]["server"])[k], v) for k, v in after1.items())
    assert all(r[k].numel() == 0 for r in hist[-1]["replies"].values() for k in algo.keys)  # nothing shared
    local = LocalOnly(replace(algo.ctx, options=LocalOnly.Config()))
    for c in algo.ctx.federation.participated:
        state = dict(after1)
        for rnd in (2, 3):
            gen = torch.Generator().manual_seed(rng.derive_seed(algo.ctx.seed, rng.CLIENT, rnd, c))
            _, state = local.client_update({}, state, algo.ctx.client_data(c), ClientContext(rnd, c, gen))
        mine = algo.personal_model(hist[-1]["server"], hist[-1]["states"][c]).params
        for k in algo.keys:
            assert torch.equal(mine[k], state[k]), (c, k)
    # a round with no global entry has no global pass: no backward for nothing, no batch drawn for it
    c, server = algo.ctx.federation.participated[0], hist[-1]["server"]
    plan = algo.round_plan(algo.configure(4, server, [c])[c], hist[-1]["states"][c], algo.ctx.client_data(c),
                           ClientContext(4, c, torch.Generator().manual_seed(0)))  # fmt: skip
    assert [ph.optimizer for ph in plan.phases] == ["personal"]


# --- masks over rounds -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", ["stop", "cap"])
def test_masks_only_grow_and_respect_the_limit(limit):
    p, alpha = 0.3, 0.5
    opts = {"p": p, "alpha": alpha, "eligible": "weights", "limit": limit}
    algo, hist = drive(opts, 5, federation=FULL)
    prev = {c: masks_of(algo, {}) for c in algo.ctx.federation.participated}
    for h in hist:
        for c, state in h["states"].items():
            now = masks_of(algo, state)
            for k, m in now.items():
                assert torch.equal(prev[c][k] & m, prev[c][k]), (c, k)  # mask_t ⊆ mask_t+1
                n, before, after = m.numel(), int(prev[c][k].sum()), int(m.sum())
                if after > before:
                    assert before < alpha * n  # grows only below the limit
                bound = alpha if limit == "cap" else alpha + p * (1 - alpha) + 1 / n  # stop: one step may overshoot
                assert after / n <= bound + 1e-9
            prev[c] = now
        for k in algo.keys:  # biases are never personal under eligible="weights"
            if k not in algo.eligible:
                assert all(f"mask/{k}" not in r for r in h["replies"].values())
    final = [int(m.sum()) / m.numel() for s in hist[-1]["states"].values() for m in masks_of(algo, s).values()]
    assert min(final) >= alpha - 1e-3  # 5 updates at p = 0.3 reach α everywhere (cap: ⌊α·n⌋ entries)
    k = algo.eligible[0]
    first = masks_of(algo, hist[0]["states"][0])[k]
    assert int(first.sum()) == math.floor(p * first.numel() + 0.5)  # the first update takes p of the entries


def test_single_layer_ablation_and_official_schedule():
    algo, hist = drive({"preset": "official", "layers": "classifier", "p": 0.5}, 4, federation=FULL)
    assert algo.eligible == ["blocks.classifier.weight"]
    for rnd, h in enumerate(hist, start=1):  # update_every = 3 counts the client's rounds: first update after round 3
        s = h["states"][0]
        assert {k for k in s if k.startswith("mask/")} == ({"mask/blocks.classifier.weight"} if rnd >= 3 else set())
        assert ("ref/blocks.classifier.weight" in s) == (rnd >= 3)  # Δ reference taken at the mask update
        sent = [[x for x in r if x.startswith("mask/")] for r in h["replies"].values()]
        assert all(x == (["mask/blocks.classifier.weight"] if rnd >= 4 else []) for x in sent)


# --- wire accounting and end to end ------------------------------------------------------------------------------
def test_bytes_shrink_as_masks_grow_and_match_the_wire_format():
    algo, hist = drive({"p": 0.5, "alpha": 1.0, "eligible": "all"}, 4, federation=FULL)
    up = [sum(wire.num_bytes(r) for r in h["replies"].values()) for h in hist]
    down = [sum(wire.num_bytes(p) for p in h["payloads"].values()) for h in hist]
    assert up[0] == down[0] == sum(v.numel() * v.element_size() for v in algo.ctx.initial_params.values()) * 6
    assert all(a > b for a, b in zip(up, up[1:], strict=False))
    # down: the server learns a client's mask from its next reply, and the entries that just became personal start
    # from the fresh global value, so round 2 still sends everything
    assert down[1] == down[0] and all(a > b for a, b in zip(down[1:], down[2:], strict=False))
    prev_states = hist[-2]["states"]
    for c, r in hist[-1]["replies"].items():  # up: global entries (fp32) + one bit per entry of masked tensors
        mask = masks_of(algo, prev_states[c])
        expect = sum(4 * int((~m).sum()) + math.ceil(m.numel() / 8) for m in mask.values())
        assert wire.num_bytes(r) == expect


def test_end_to_end_beats_fedavg_under_label_skew_writes_iou_artifacts_and_diagnostics(tmp_path):
    """Label skew (2 classes per client): FedSelect's personal models (Alg. 1's θ_k^{t+1}) must beat FedAvg's global
    model on the clients' own test data by a wide margin on this fixed seed (about 0.52 against 0.19); a run whose
    personal entries were not kept, or whose evaluation used the global values, lands at FedAvg's level."""
    fed = {**TINY["federation"], "partition": "classes", "new_clients": 1}
    cfg = {**TINY, "algorithm": {"name": "fedselect"}, "federation": fed}
    cfg["eval"] = {**TINY["eval"], "new_clients": {"epochs": 1, "lrs": [0.05], "fractions": [1.0]}}
    res = pflbed.run(cfg, out=tmp_path / "run")
    fedavg = pflbed.run({**cfg, "algorithm": {"name": "fedavg"}}, write=False, progress=False).summary["final"]
    final = res.summary["final"]
    assert final["gfl_acc"] is None
    assert final["pfl_acc"] > fedavg["pfl_acc"] + 0.2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("personal_fraction" in rec["diag"] for rec in lines)
    frac = lines[-1]["diag"]["personal_fraction"]
    assert set(frac) == {"fc1", "fc2", "classifier", "all", "eligible"} and 0 < frac["all"] < 1
    clients = lines[-1]["diag"]["personal_fraction_clients"]  # per client and layer; their mean is the summary
    assert set(clients) == {str(c) for c in res.executor.algo.ctx.federation.participated}
    for b, v in frac.items():
        assert sum(f[b] for f in clients.values()) / len(clients) == pytest.approx(v, abs=1e-5)
    png, csv_ = (tmp_path / "run" / res.summary["artifacts"][k] for k in ("mask_iou_png", "mask_iou_csv"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = csv_.read_text().splitlines()
    algo = res.executor.algo
    participated = algo.ctx.federation.participated
    assert len(rows) == 1 + len(participated) and rows[0].startswith("client,majority_class")
    # Fig. 4: clients sorted by majority class; cell (i, j) = IoU of the two clients' final classifier masks
    table = [r.split(",") for r in rows[1:]]
    order, majority = [int(r[0]) for r in table], [int(r[1]) for r in table]
    assert majority == sorted(majority) and sorted(order) == sorted(participated)
    keys = algo.iou_keys()
    masks = [torch.cat([algo._mask(res.executor.state(c), f"mask/{k}", k).reshape(-1) for k in keys]) for c in order]
    got = torch.tensor([[float(v) for v in r[2:]] for r in table], dtype=torch.float64)
    assert torch.allclose(got, iou_matrix(masks), atol=1e-6, equal_nan=True)
    assert res.summary["new_clients"] is not None


def test_new_client_starts_all_global_and_lp_changes_only_the_head():
    algo, hist = drive({}, 2)
    server, data = hist[-1]["server"], algo.ctx.client_data(0)
    zero = algo.zero_shot(server, data).params
    assert all(torch.equal(zero[k], server[k]) for k in algo.keys) and set(zero) == set(algo.keys)
    p = last(algo.personalize(server, data, Budget("lp", 1, 0.1, 8), torch.Generator().manual_seed(0)))
    head = set(algo.ctx.model.state_keys(algo.ctx.model.head_blocks()))
    assert {k for k in algo.keys if not torch.equal(p.params[k], server[k])} == head
    assert algo.generic_model(server) is None


# --- rules checked against hand-written references ---------------------------------------------------------------
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_local_alt(model, data, personal, *, epochs, lr, momentum, weight_decay, batch_size, generator):
    """Alg. 2 written out independently of `MaskedPhase`: per epoch, one shuffled pass that moves only the personal
    entries, then one that moves only the global entries. Each step is torch's SGD rule (d = ∇ + wd·θ,
    buf = μ·buf + d, θ ← θ − lr·buf) applied to the side's entries only; each side keeps its own momentum buffer
    across the round's epochs. A side with nothing to train makes no pass and draws no batch."""
    params = dict(model.named_parameters())
    own = {k: personal.get(k, torch.zeros(p.shape, dtype=torch.bool)) for k, p in params.items()}
    sides = [own, {k: ~m for k, m in own.items()}]  # personal pass FIRST, then the global pass
    buffers: list[dict[str, torch.Tensor]] = [{}, {}]
    model.train()
    for _ in range(epochs):
        for side, buf in zip(sides, buffers, strict=True):
            if not any(m.any() for m in side.values()):
                continue
            for b in index_batches(data.train, batch_size, 1, generator):
                loss = F.cross_entropy(model(data.x[b]), data.y[b])
                grads = torch.autograd.grad(loss, list(params.values()))
                with torch.no_grad():
                    for (k, p), g in zip(params.items(), grads, strict=True):
                        d = g + weight_decay * p
                        buf[k] = d.clone() if k not in buf else momentum * buf[k] + d
                        p[side[k]] -= lr * buf[k][side[k]]
    return get_params(model)


def top_new_entries(mask: torch.Tensor, delta: torch.Tensor, p: float, alpha: float, largest: bool = True):
    """Alg. 3 for one tensor, by hand: unless the personal fraction has reached α, add the ⌊p·n_global + ½⌋
    still-global entries with the largest (or smallest) |Δ|."""
    n_global = int((~mask).sum())
    if int(mask.sum()) >= alpha * mask.numel():
        return mask.clone()
    score = delta.abs().reshape(-1) * (1 if largest else -1)
    score = score.masked_fill(mask.reshape(-1), float("-inf"))
    new = mask.clone().reshape(-1)
    new[score.topk(math.floor(p * n_global + 0.5)).indices] = True
    return new.reshape(mask.shape)


def trained_from(algo: FedSelect, reply: dict, new_state: dict) -> dict[str, torch.Tensor]:
    """The client's locally trained model, rebuilt from what it uploaded (global entries) and kept (personal ones)."""
    out = {}
    for k in algo.keys:
        held = f"held/{k}"
        out[k] = fill(algo._mask(new_state, held, k), new_state[f"v/{k}"], reply[k]) if held in new_state else reply[k]
    return out


@pytest.mark.parametrize("eligible", ["all", "weights"])
def test_client_round_composition_localalt_order_reply_and_gradselect_match_hand_reference(eligible):
    """One client round of Alg. 1 against references written out by hand, on a client whose masks exercise every
    case: a tensor partly personal with entries that just became personal (start from the fresh global value), one
    at its α limit (must not grow), one wholly personal (trained only in the personal pass), one wholly global.

    Protects: the payload holds exactly the client's global entries; the start model is server values on entries
    global in the last training + own values on entries held personal; LocalAlt runs the personal pass BEFORE the
    global pass, alternating per epoch, each side with its own optimizer kept across epochs (momentum 0.5 and weight
    decay make any leak or restart visible); the reply holds exactly the entries global during this training plus
    their packed mask; the client keeps its personal entries; GradSelect grows the mask by the top p of
    |θ_trained − θ_round_start| among still-global entries, and only below α; the grown mask is stored for the next
    round (the training mask is what the server learns). With `eligible: weights` the classifier's bias is not
    eligible: always global, it trains in the global pass only."""
    train = {**TINY["train"], "local_epochs": 2, "momentum": 0.5, "weight_decay": 0.01}
    p, alpha = 0.25, 0.3
    algo, _ = drive({"p": p, "alpha": alpha, "eligible": eligible}, 0, train=train)
    model, init = algo.ctx.model, algo.ctx.initial_params
    c = algo.ctx.federation.participated[0]
    data = algo.ctx.client_data(c)
    g = gen(11)
    rand = {k: torch.rand(v.shape, generator=g) for k, v in init.items()}
    w1, wc, bc = "blocks.fc1.1.weight", "blocks.classifier.weight", "blocks.classifier.bias"
    mask = {w1: rand[w1] < 0.1, wc: rand[wc] < 0.4, bc: torch.ones(10, dtype=torch.bool)}
    held = {w1: rand[w1] < 0.05, wc: mask[wc], bc: mask[bc]}  # fc1: half its personal entries are new this round
    if eligible == "weights":
        del mask[bc], held[bc]
    assert sorted(mask) == sorted(k for k in algo.eligible if k in (w1, wc, bc))
    assert int(mask[wc].sum()) >= alpha * mask[wc].numel()
    server = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in init.items()}  # start ≠ initial model
    own = {k: init[k][m] + 1.0 for k, m in held.items()}  # the client's personal values from its last training
    for k, m in held.items():
        server[f"mask/{c}/{k}"] = pack_bits(m)  # what the server learned from the client's last reply
    state = {"rounds": torch.tensor(4)}
    for k in mask:
        state[f"mask/{k}"], state[f"held/{k}"], state[f"v/{k}"] = pack_bits(mask[k]), pack_bits(held[k]), own[k]

    payload = wire.roundtrip(algo.configure(5, server, [c])[c])
    for k in algo.keys:  # broadcast only into the client's global entries
        assert torch.equal(payload[k], take(server[k], ~held[k]) if k in held else server[k]), k
    reply, new_state = algo.client_update(payload, state, data, ClientContext(5, c, gen(5)))

    start = {k: server[k].clone() for k in algo.keys}
    for k, m in held.items():
        start[k][m] = own[k]
    load_params(model, start)
    t = algo.ctx.cfg.train
    ref = reference_local_alt(model, data, mask, epochs=2, lr=t.lr, momentum=0.5, weight_decay=0.01,
                              batch_size=t.batch_size, generator=gen(5))  # fmt: skip

    assert set(reply) == set(algo.keys) | {f"mask/{k}" for k in mask}
    for k in algo.keys:
        if k in mask:
            assert torch.equal(reply[f"mask/{k}"], pack_bits(mask[k])), k
            assert torch.allclose(reply[k], take(ref[k], ~mask[k]), atol=1e-5), k  # global entries only
            assert torch.allclose(new_state[f"v/{k}"], take(ref[k], mask[k]), atol=1e-5), k  # personal: kept
            assert torch.equal(new_state[f"held/{k}"], pack_bits(mask[k])), k
        else:
            assert torch.allclose(reply[k], ref[k], atol=1e-5), k
    assert int(new_state["rounds"]) == 5
    trained = trained_from(algo, reply, new_state)
    for k in algo.eligible:
        expect = top_new_entries(mask.get(k, torch.zeros(init[k].shape, dtype=torch.bool)), trained[k] - start[k], p,
                                 alpha)  # fmt: skip
        assert torch.equal(algo._mask(new_state, f"mask/{k}", k), expect), k
    assert torch.equal(algo._mask(new_state, f"mask/{wc}", wc), mask[wc])  # at the α limit: no growth
    assert int(algo._mask(new_state, f"mask/{w1}", w1).sum()) > int(mask[w1].sum())


def test_official_delta_is_measured_from_the_last_mask_update_on_the_clients_own_round_count(monkeypatch):
    """Official preset (update_every = 3, delta_from = last_update, weights only): one client taking part in global
    rounds 2, 3, 5, 6, 7, 9 updates its mask after its own 3rd and 6th rounds — not after global rounds divisible by
    3 — with Δ measured first from the initial model, then from the model trained at its previous update (not the
    round's start, not the round before). Only the Linear weights are ranked."""
    calls: list[tuple[int, str, torch.Tensor]] = []
    real = fedselect.grow_mask
    i = 0

    def spy(mask, delta, **kw):
        calls.append((i, delta.clone()))
        return real(mask, delta, **kw)

    monkeypatch.setattr(fedselect, "grow_mask", spy)
    algo, _ = drive({"preset": "official"}, 0)
    assert algo.eligible == ["blocks.fc1.1.weight", "blocks.fc2.0.weight", "blocks.classifier.weight"]
    c = algo.ctx.federation.participated[0]
    data, server, state = algo.ctx.client_data(c), algo.init_server(), {}
    trained_at = {}
    for i, rnd in enumerate([2, 3, 5, 6, 7, 9], start=1):
        payload = algo.configure(rnd, server, [c])[c]
        reply, state = algo.client_update(payload, state, data, ClientContext(rnd, c, gen(rnd)))
        trained_at[i] = trained_from(algo, reply, state)
        server = algo.aggregate(rnd, server, {c: reply}, {c: 1.0})
    assert [n for n, _ in calls] == [3] * 3 + [6] * 3  # one call per eligible tensor, at the client's 3rd and 6th
    for (n, delta), k in zip(calls, algo.eligible * 2, strict=True):
        ref = algo.ctx.initial_params[k] if n == 3 else trained_at[3][k]
        assert torch.equal(delta, trained_at[n][k] - ref), (n, k)


@pytest.mark.parametrize("selection", ["smallest", "random"])
def test_selection_ablations_reach_the_mask_update(selection):
    """Table 3's ablations are wired through `client_update`: "smallest" personalizes the least-changed entries;
    "random" draws a mask of the same size from the client's round generator where its training left it (the
    same generator: the same mask; another: another; and not the largest-|Δ| one)."""
    p = 0.25
    algo, _ = drive({"p": p, "alpha": 1.0, "eligible": "weights", "selection": selection}, 0)
    c = algo.ctx.federation.participated[0]
    data, server = algo.ctx.client_data(c), algo.init_server()
    payload = algo.configure(1, server, [c])[c]
    reply, state = algo.client_update(payload, {}, data, ClientContext(1, c, gen(1)))
    for k in algo.eligible:
        none = torch.zeros(server[k].shape, dtype=torch.bool)
        got = algo._mask(state, f"mask/{k}", k)
        assert int(got.sum()) == math.floor(p * got.numel() + 0.5), k
        largest = top_new_entries(none, reply[k] - server[k], p, 1.0)
        if selection == "smallest":
            assert torch.equal(got, top_new_entries(none, reply[k] - server[k], p, 1.0, largest=False)), k
        else:
            assert not torch.equal(got, largest), k
    if selection == "random":
        _, again = algo.client_update(payload, {}, data, ClientContext(1, c, gen(1)))
        assert all(torch.equal(again[f"mask/{k}"], state[f"mask/{k}"]) for k in algo.eligible)
        _, other = algo.client_update(payload, {}, data, ClientContext(1, c, gen(2)))
        assert not all(torch.equal(other[f"mask/{k}"], state[f"mask/{k}"]) for k in algo.eligible)
        g = gen(1)  # the draws follow the training's: the generator trained through, then GradSelect's in key order
        plan = algo.round_plan(payload, {}, data, ClientContext(1, c, g))
        run_plan(algo.ctx.model, replace(plan, finish=lambda t: (t, {})), data, algo.ctx.cfg.train, g)
        for k in algo.eligible:
            none = torch.zeros(server[k].shape, dtype=torch.bool)
            want = grow_mask(none, reply[k] - server[k], rate=p, limit=1.0, selection="random", generator=g)
            assert torch.equal(algo._mask(state, f"mask/{k}", k), want), k


def test_grow_mask_rounding_and_limit_boundary():
    """⌊p·n_global + ½⌋ new entries counted among the still-GLOBAL entries (not all n), and growth stops as soon as
    the personal fraction EQUALS α (Alg. 3: grow while sparsity < α)."""
    delta = torch.arange(1.0, 11.0)  # 10 entries, |Δ| increasing
    none = torch.zeros(10, dtype=torch.bool)
    assert grow_mask(none, delta, rate=0.25, limit=1.0).nonzero().squeeze(1).tolist() == [7, 8, 9]  # 2.5 → 3
    assert int(grow_mask(none, delta, rate=0.24, limit=1.0).sum()) == 2  # 2.4 → 2
    two = grow_mask(none, delta, rate=0.2, limit=1.0)
    assert two.nonzero().squeeze(1).tolist() == [8, 9]
    grown = grow_mask(two, delta, rate=0.5, limit=1.0)
    assert grown.nonzero().squeeze(1).tolist() == [4, 5, 6, 7, 8, 9]  # ½ of the 8 global entries, not of all 10
    assert torch.equal(grow_mask(two, delta, rate=0.5, limit=0.2), two)  # 2/10 = α: stopped
    assert int(grow_mask(two, delta, rate=0.5, limit=0.21).sum()) == 6  # just below α: grows
    signed = torch.tensor([-9.0, 1, 2, 3, 4, 5, 6, 7, 8, 0.5])
    assert grow_mask(none, signed, rate=0.1, limit=1.0).nonzero().squeeze(1).tolist() == [0]  # |Δ|, not Δ
    a = grow_mask(none, delta, rate=0.5, limit=1.0, selection="random", generator=gen(3))
    b = grow_mask(none, delta, rate=0.5, limit=1.0, selection="random", generator=gen(3))
    assert torch.equal(a, b) and int(a.sum()) == 5  # drawn from the given generator
    r = grow_mask(two, delta, rate=1.0, limit=1.0, selection="random", generator=gen(4))
    assert bool(r.all())  # random picks among global entries only: all 8 remaining, none twice


def test_server_keeps_each_clients_last_mask_and_broadcasts_only_its_global_entries():
    """The server's per-client masks (Alg. 1's m_k, needed to broadcast into ¬m_k): replaced by a replying client's
    new mask, dropped when its reply has none, kept for clients not sampled this round; `configure` then sends each
    client the server's values at exactly its global entries."""
    algo, _ = drive({"eligible": "weights"}, 0)
    k = "blocks.classifier.weight"
    server = algo.init_server()
    g = gen(2)
    m = {c: torch.rand(server[k].shape, generator=g) < 0.3 for c in range(3)}
    for c in range(3):
        server[f"mask/{c}/{k}"] = pack_bits(m[c])
    replies = {}
    for c in (1, 2):
        replies[c] = {kk: torch.full_like(server[kk], float(c)) for kk in algo.keys}
    new2 = m[2] | (torch.rand(server[k].shape, generator=g) < 0.2)
    replies[2][k], replies[2][f"mask/{k}"] = take(replies[2][k], ~new2), pack_bits(new2)  # client 1: no mask now
    out = algo.aggregate(3, server, replies, {1: 1.0, 2: 1.0})
    assert torch.equal(out[f"mask/0/{k}"], pack_bits(m[0])) and f"mask/1/{k}" not in out
    assert torch.equal(out[f"mask/2/{k}"], pack_bits(new2))
    expect = torch.where(new2, 1.0, 1.5)  # entry personal for client 2: client 1's value alone
    assert torch.equal(out[k], expect)
    pay = algo.configure(4, out, [0, 1, 2])
    assert torch.equal(pay[0][k], take(out[k], ~m[0])) and torch.equal(pay[2][k], take(out[k], ~new2))
    assert torch.equal(pay[1][k], out[k])


def test_personal_fraction_diagnostics_hand_computed():
    """diag.personal_fraction: per client, personal entries of its CURRENT mask (the one its next round trains with)
    over each block's parameter count, over all parameters, and over the eligible entries; then the mean over the
    participated clients (clients without a mask count as 0)."""
    algo, _ = drive({"eligible": "weights"}, 0)
    w1, wc = "blocks.fc1.1.weight", "blocks.classifier.weight"
    m1, mc = torch.zeros(200, 64, dtype=torch.bool), torch.zeros(10, 200, dtype=torch.bool)
    m1[:20], mc[:, :50] = True, True  # 1280 and 500 personal entries
    cids = algo.ctx.federation.participated
    states = {cids[0]: {f"mask/{w1}": pack_bits(m1), f"mask/{wc}": pack_bits(mc), f"held/{wc}": pack_bits(mc[:1])}}
    diag = algo.diagnostics(1, algo.init_server(), lambda c: states.get(c, {}))
    size = {"fc1": 64 * 200 + 200, "fc2": 200 * 200 + 200, "classifier": 200 * 10 + 10}
    one = {"fc1": 1280 / size["fc1"], "fc2": 0.0, "classifier": 500 / size["classifier"],
           "all": 1780 / sum(size.values()), "eligible": 1780 / (64 * 200 + 200 * 200 + 200 * 10)}  # fmt: skip
    assert diag["personal_fraction_clients"][str(cids[0])] == pytest.approx(one, abs=1e-6)
    assert diag["personal_fraction_clients"][str(cids[1])] == dict.fromkeys(one, 0.0)
    assert diag["personal_fraction"] == pytest.approx({b: v / len(cids) for b, v in one.items()}, abs=1e-6)


def test_iou_keys_are_the_classifiers_eligible_tensors():
    """Fig. 4's IoU is over the classifier layer: the head's eligible tensors, or the topmost block with any under a
    single-layer ablation that excludes the head."""
    assert drive({"eligible": "all"}, 0)[0].iou_keys() == ["blocks.classifier.weight", "blocks.classifier.bias"]
    assert drive({"eligible": "weights"}, 0)[0].iou_keys() == ["blocks.classifier.weight"]
    assert drive({"eligible": "weights", "layers": "fc1"}, 0)[0].iou_keys() == ["blocks.fc1.1.weight"]


# --- rules the mutation run found unguarded ----------------------------------------------------------------------
def test_iou_matrix_edge_cases_hand_computed():
    """Fig. 4's IoU as a float64 matrix: no client gives a 0×0 matrix; a pair whose union is ONE entry is a proper
    IoU (0 or 1, not NaN and not halved); NaN only where both masks are empty."""
    empty = iou_matrix([])
    assert empty.shape == (0, 0) and empty.dtype == torch.float64
    a, z = torch.tensor([0, 1, 0]).bool(), torch.zeros(3, dtype=torch.bool)
    m = iou_matrix([a, z])
    assert m.dtype == torch.float64
    assert m[0, 0].item() == 1.0 and m[0, 1].item() == 0.0 and m[1, 0].item() == 0.0 and math.isnan(m[1, 1])


def test_unpack_bits_rejects_a_packed_mask_that_does_not_fit():
    """A packed mask must be uint8 AND exactly ⌈n/8⌉ bytes; either mismatch is a ValueError (never a silently
    truncated or re-typed mask)."""
    ok = pack_bits(torch.ones(10, dtype=torch.bool))  # 2 bytes
    with pytest.raises(ValueError, match="does not fit"):
        unpack_bits(torch.cat([ok, ok]), (10,))  # right dtype, too many bytes
    with pytest.raises(ValueError, match="does not fit"):
        unpack_bits(ok[:1], (10,))  # right dtype, too few bytes
    with pytest.raises(ValueError, match="does not fit"):
        unpack_bits(ok.to(torch.int16), (10,))  # right size, wrong dtype


def test_fill_keeps_the_values_dtype():
    """`fill` places the flat values bit for bit: the result has the values' dtype, also when `outside` is flat."""
    where = torch.tensor([True, False, True, False])
    inside = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    outside = torch.tensor([0.1, 0.7], dtype=torch.float64)
    out = fill(where, inside, outside)
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.tensor([1 / 3, 0.1, 2 / 3, 0.7], dtype=torch.float64))


def test_grow_mask_single_entry_empty_step_limit_edge_and_random_draw():
    """Alg. 3 edge cases. A one-entry tensor grows like any other (⌊1·1 + ½⌋ = 1 new entry). A step of ⌊p·n + ½⌋ = 0
    entries returns the mask in its own shape and draws nothing from the generator. The α test is "fraction ≥ α"
    with a 1e-9 float tolerance, inclusive: a fraction exactly at the tolerance edge counts as reached. "random" is a
    fresh draw from the given generator — not the largest-|Δ| nor the smallest-|Δ| entries, and seed-dependent."""
    one = torch.zeros(1, dtype=torch.bool)
    assert grow_mask(one, torch.tensor([0.5]), rate=1.0, limit=1.0).tolist() == [True]
    assert not grow_mask(one, torch.tensor([0.5]), rate=1.0, limit=1e-9).any()  # 0 ≥ 1e-9·1 − 1e-9: reached

    none = torch.zeros(2, 5, dtype=torch.bool)
    delta = torch.arange(10.0).reshape(2, 5)
    g = gen(0)
    same = grow_mask(none, delta, rate=0.04, limit=1.0, selection="random", generator=g)  # ⌊0.4 + ½⌋ = 0
    assert same.shape == (2, 5) and not same.any()
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=gen(0)))  # nothing drawn

    flat = torch.zeros(40, dtype=torch.bool)
    d = torch.arange(40.0)
    largest = grow_mask(flat, d, rate=0.25, limit=1.0)
    smallest = grow_mask(flat, d, rate=0.25, limit=1.0, selection="smallest")
    draws = [grow_mask(flat, d, rate=0.25, limit=1.0, selection="random", generator=gen(s)) for s in (1, 2)]
    for r in draws:
        assert int(r.sum()) == 10 and not torch.equal(r, largest) and not torch.equal(r, smallest)
    assert not torch.equal(draws[0], draws[1])


def test_a_keyed_phase_runs_no_backward_into_parameters_it_does_not_train():
    """A phase restricted to some parameters (`Phase.keys`, FedSelect's personal side) freezes the others for its
    duration: their `.grad` stays None, and the shared model is left trainable."""
    algo, _ = drive({}, 0)
    model, data = algo.ctx.model, algo.ctx.client_data(0)
    model.zero_grad(set_to_none=True)
    head_bias = "blocks.classifier.bias"
    phase = Phase(tuple(model.block_names()), 1, 0.1, keys=(head_bias,), optimizer="personal")
    plan = LocalSGDPlan(get_params(model), (phase,), lambda t: (t, {}))
    run_plan(model, plan, data, algo.ctx.cfg.train, gen(3))
    assert all(p.grad is None for k, p in model.named_parameters() if k != head_bias)
    assert model.blocks.classifier.bias.grad is not None
    assert all(p.requires_grad for p in model.parameters())


def test_diagnostics_fraction_over_blocks_with_several_tensors_rounded_to_six_digits():
    """diag.personal_fraction with every parameter eligible: a block's count sums ALL its tensors (weight + bias),
    and the reported numbers are the fractions rounded to 6 decimals (per client, then the mean over clients)."""
    algo, _ = drive({"eligible": "all"}, 0)
    wc, bc = "blocks.classifier.weight", "blocks.classifier.bias"
    mw, mb = torch.zeros(10, 200, dtype=torch.bool), torch.zeros(10, dtype=torch.bool)
    mw[0, :5], mb[:2] = True, True  # 5 + 2 personal entries
    cids = algo.ctx.federation.participated
    states = {cids[0]: {f"mask/{wc}": pack_bits(mw), f"mask/{bc}": pack_bits(mb)}}
    diag = algo.diagnostics(1, algo.init_server(), lambda c: states.get(c, {}))
    total = sum(v.numel() for v in algo.ctx.initial_params.values())
    one = {"fc1": 0.0, "fc2": 0.0, "classifier": 7 / 2010, "all": 7 / total, "eligible": 7 / total}
    assert diag["personal_fraction_clients"][str(cids[0])] == {b: round(v, 6) for b, v in one.items()}
    assert diag["personal_fraction"] == {b: round(v / len(cids), 6) for b, v in one.items()}


def test_diagnostics_on_a_one_entry_model_with_one_client():
    """The fractions divide by the true sizes even when a block, the model, the eligible set and the participated
    clients are each of size ONE (the max(·, 1) guards only stop a division by zero): a one-entry model whose only
    entry is personal for its only client reports 1.0 everywhere."""
    algo = FedSelect.__new__(FedSelect)  # only the fields `diagnostics` reads: one block "a", one 1-entry tensor
    algo.ctx = SimpleNamespace(federation=SimpleNamespace(participated=[7]))
    algo.param_keys, algo.eligible = ["a.w"], ["a.w"]
    algo.shapes, algo.block_of = {"a.w": torch.Size([1])}, {"a.w": "a"}
    state = {"mask/a.w": pack_bits(torch.ones(1, dtype=torch.bool))}
    diag = algo.diagnostics(1, {}, lambda c: state)
    assert diag == {"personal_fraction": {"a": 1.0, "all": 1.0, "eligible": 1.0},
                    "personal_fraction_clients": {"7": {"a": 1.0, "all": 1.0, "eligible": 1.0}}}  # fmt: skip


def test_new_client_ft_is_plain_sgd_from_the_global_values_with_the_given_generator():
    """A new client's `ft` personalization: SGD on every parameter from the server's global values, batches drawn
    from the generator it is given (reproducible), checked against plain SGD with the same batches."""
    algo, _ = drive({}, 0)
    model, init = algo.ctx.model, algo.ctx.initial_params
    server = {k: v + 0.05 * torch.randn(v.shape, generator=gen(9)) for k, v in init.items()}
    server["mask/0/blocks.classifier.bias"] = pack_bits(torch.ones(10, dtype=torch.bool))  # not a parameter
    data = algo.ctx.client_data(algo.ctx.federation.participated[0])
    got = last(algo.personalize(server, data, Budget("ft", 2, 0.1, 8, momentum=0.5), gen(0))).params
    load_params(model, algo._globals(server))
    local_sgd(model, data, epochs=2, batch_size=8, lr=0.1, momentum=0.5, generator=gen(0))
    ref = get_params(model)
    assert set(got) == set(algo.keys) and all(torch.allclose(got[k], ref[k], atol=1e-6) for k in ref)


def test_mask_iou_csv_is_the_hand_computed_iou_of_the_final_classifier_masks(tmp_path):
    """Fig. 4's CSV, written by `artifacts` into a folder that does not exist yet (nor does its parent) and again
    into the same folder (a rerun overwrites): rows and columns are the participated clients sorted by (majority
    class, id); the majority column is the argmax of the client's class prior; cell (i, j) is the IoU of the two
    clients' CURRENT classifier masks (weight and bias together), written with 6 decimals. Nested masks (client of
    rank r holds the first 10·r classifier-weight entries) give IoU = min(r_i, r_j) / max(r_i, r_j); a client with
    no mask gives 0 against a masked one and an empty cell value (nan) against itself."""
    algo, _ = drive({"eligible": "all"}, 0)
    fed = algo.ctx.federation
    wc, bc = "blocks.classifier.weight", "blocks.classifier.bias"
    rank = {c: r for r, c in enumerate(sorted(fed.participated))}  # 0 = no mask at all
    states = {}
    for c, r in rank.items():
        m = torch.zeros(10 * 200, dtype=torch.bool)
        m[: 10 * r] = True
        no_bias = pack_bits(torch.zeros(10, dtype=torch.bool))
        states[c] = {f"mask/{wc}": pack_bits(m), f"mask/{bc}": no_bias} if r else {}
        states[c][f"held/{wc}"] = pack_bits(torch.ones(2000, dtype=torch.bool))  # last training's mask: not plotted
    out_dir = tmp_path / "run" / "plots"
    for _ in range(2):
        files = algo.artifacts(algo.init_server(), lambda c: states[c], out_dir)
    assert files == {"mask_iou_png": "fedselect_mask_iou.png", "mask_iou_csv": "fedselect_mask_iou.csv"}
    assert (out_dir / "fedselect_mask_iou.png").read_bytes()[:4] == b"\x89PNG"
    rows = [line.split(",") for line in (out_dir / "fedselect_mask_iou.csv").read_text().splitlines()]
    majority = {c: int(fed.clients[c].prior.argmax()) for c in fed.participated}
    order = sorted(fed.participated, key=lambda c: (majority[c], c))
    assert rows[0] == ["client", "majority_class", *[f"c{c}" for c in order]]
    assert [int(r[0]) for r in rows[1:]] == order and [int(r[1]) for r in rows[1:]] == [majority[c] for c in order]
    for row, ci in zip(rows[1:], order, strict=True):
        for cell, cj in zip(row[2:], order, strict=True):
            a, b = rank[ci], rank[cj]
            expect = float("nan") if max(a, b) == 0 else min(a, b) / max(a, b)
            assert cell == f"{expect:.6f}", (ci, cj)


def test_pairwise_iou_and_personal_fraction_hand_computed():
    """masks.iou (|a ∧ b| / |a ∨ b|, NaN when both masks are empty) agrees with iou_matrix entry by entry, including
    a union of ONE entry; masks.personal_fraction is the share of personal entries (a one-entry mask: 0 or 1)."""
    a, b = torch.tensor([1, 1, 0, 0]).bool(), torch.tensor([0, 1, 1, 0]).bool()
    single, z = torch.tensor([0, 0, 0, 1]).bool(), torch.zeros(4, dtype=torch.bool)
    assert iou(a, b) == pytest.approx(1 / 3) and iou(a, a) == 1.0 and iou(a, z) == 0.0
    assert iou(single, z) == 0.0 and iou(single, single) == 1.0 and math.isnan(iou(z, z))
    ms = [a, b, single, z]
    mat = iou_matrix(ms)
    for i, x in enumerate(ms):
        for j, y in enumerate(ms):
            assert (math.isnan(iou(x, y)) and math.isnan(mat[i, j])) or iou(x, y) == pytest.approx(mat[i, j].item())
    assert personal_fraction(torch.tensor([[1, 0, 0], [0, 0, 0]]).bool()) == pytest.approx(1 / 6)
    assert personal_fraction(torch.ones(1, dtype=torch.bool)) == 1.0
    assert personal_fraction(torch.zeros(0, dtype=torch.bool)) == 0.0
