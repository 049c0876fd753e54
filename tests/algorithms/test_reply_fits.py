"""`reply_fits(payload, reply)` of the algorithms whose replies are not plain new values of payload entries: every
honest reply of a few simulated rounds fits, and each tampering of one entry (wider, dropped, added, of another
dtype, of other values where the server reads them) is refused with a reason naming that entry. A site-local
deployment's server (`flower.reply_check.ReplyCheck`) takes this method in place of its rule for replies of payload
entries."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pflbed.algorithms.base import Algorithm, Tensors
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import update_client
from pflbed.flower.reply_check import ReplyCheck
from pflbed.models import MODELS, BlockNet

from ..tiny import TINY

ROUNDS = 3  # FedSelect: masks reach the replies in a client's 2nd round, the payloads (flat entries) in its 3rd


def _bn_net(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """A tiny model with a BatchNorm layer: float buffers and an integer batch counter in every model."""
    d = int(torch.tensor(input_shape).prod())
    return BlockNet([("body", nn.Sequential(nn.Flatten(), nn.Linear(d, 8), nn.BatchNorm1d(8), nn.ReLU())),
                     ("head", nn.Linear(8, num_classes))])  # fmt: skip


BASIS = {"name": "fedbasis", "K": 2, "alpha_epochs": 1, "basis_epochs": 1}  # with its warm start (FedAvg rounds)

# case → algorithm options (every case on the BatchNorm model, every participated client in every round)
CASES = {
    "scaffold": {"name": "scaffold"},
    "scaffold+option-I": {"name": "scaffold", "option": "I", "server_lr": 2.0},
    "fedpac": {"name": "fedpac", "body_epochs": 1},
    "fedfomo": {"name": "fedfomo", "M": 2},
    "fedfomo+deltas": {"name": "fedfomo", "M": 2, "affinity": "deltas", "candidates": "last_round"},
    "fedselect": {"name": "fedselect"},
    "fedselect+official": {"name": "fedselect", "preset": "official", "update_every": 1, "selection": "random"},
    "fedselect+alpha-0": {"name": "fedselect", "alpha": 0.0},
    "fedamp": {"name": "fedamp"},
    "fedamp+heur": {"name": "fedamp", "variant": "heur"},
    "fedbasis+warm-start": {**BASIS},
    "fedbasis": {**BASIS, "warmup_fraction": 0.0},
    "fedbasis+no-major": {**BASIS, "warmup_fraction": 0.0, "major": False, "coordinate_descent": False},
    "fedmtl": {"name": "fedmtl"},
    "pfedhn": {"name": "pfedhn", "local_steps": 2, "hidden": 16, "hidden_layers": 1},
    "pfedhn+epochs": {"name": "pfedhn", "local_steps": None, "hidden": 16, "hidden_layers": 1},
}


def _run(options: dict) -> tuple[Algorithm, list[tuple[int, Tensors, Tensors]]]:
    """The algorithm and (round, payload, honest reply) of every client of ROUNDS rounds, through the algorithm's
    own server rule (`aggregator`)."""
    with pytest.MonkeyPatch.context() as mp:  # FedBasis builds models of the config's name in init_server
        mp.setitem(MODELS, "bn_net", _bn_net)
        algo = prepare(validate_config({**TINY, "model": {"name": "bn_net"},
                                        "train": {**TINY["train"], "rounds": ROUNDS}, "algorithm": options}),
                       threads=1)  # fmt: skip
        cids = list(algo.ctx.federation.participated)
        weights = {c: float(algo.ctx.client_data(c).num_train) for c in cids}
        server, states, seen = algo.init_server(), {c: algo.init_client(c) for c in cids}, []
        for rnd in range(1, ROUNDS + 1):
            payloads = algo.configure(rnd, server, cids)
            agg = algo.aggregator(rnd, server, weights)
            for c in cids:
                reply, states[c] = update_client(algo, rnd, c, payloads[c], states[c])
                seen.append((rnd, payloads[c], reply))
                agg.add(c, reply)
            server = agg.result()
    return algo, seen


_RUNS: dict[str, tuple[Algorithm, list[tuple[int, Tensors, Tensors]]]] = {}


def run(case: str) -> tuple[Algorithm, list[tuple[int, Tensors, Tensors]]]:
    if case not in _RUNS:
        _RUNS[case] = _run(CASES[case])
    return _RUNS[case]


def last(case: str) -> tuple[Algorithm, Tensors, Tensors]:
    """The algorithm, and the last round's payload and honest reply whose reply has the most keys."""
    algo, seen = run(case)
    _, payload, reply = max((s for s in seen if s[0] == ROUNDS), key=lambda s: len(s[2]))
    return algo, payload, reply


def other_dtype(v: torch.Tensor) -> torch.dtype:
    return {torch.float32: torch.float64, torch.float64: torch.float32}.get(v.dtype, torch.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_every_honest_reply_fits(case):
    algo, seen = run(case)
    assert ReplyCheck(algo, 100.0).fits is not None  # the server takes the algorithm's own check
    assert len(seen) == ROUNDS * len(algo.ctx.federation.participated)
    assert [(rnd, algo.reply_fits(p, r)) for rnd, p, r in seen] == [(rnd, None) for rnd, _, _ in seen]


@pytest.mark.parametrize("case", list(CASES))
def test_each_tampered_entry_is_refused_naming_it(case):
    """Every entry of a reply in turn: wider ([2, *shape]), dropped, of another dtype (float32 ↔ float64, else
    float32) and, for float entries, int64; a key the algorithm does not reply (an arbitrary one, and each payload
    key an honest client leaves out) added."""
    algo, payload, reply = last(case)
    check = ReplyCheck(algo, 100.0)
    for k, v in reply.items():
        tampered = {"wide": {**reply, k: v.expand(2, *v.shape).clone()},
                    "dropped": {j: u for j, u in reply.items() if j != k},
                    "dtype": {**reply, k: v.to(other_dtype(v))}}  # fmt: skip
        if v.is_floating_point():
            tampered["int64"] = {**reply, k: v.long()}
        for how, bad in tampered.items():
            why = algo.reply_fits(payload, bad)
            # a dropped FedSelect mask: the reason may name its tensor instead, whose flat values no longer fit
            names = [k, k.removeprefix("mask/")] if how == "dropped" else [k]
            assert why is not None and any(f"'{n}'" in why for n in names), (k, how, why)
            assert check.fault(payload, bad) == why
    for k in ["extra", *sorted(set(payload) - set(reply))]:
        why = algo.reply_fits(payload, {**reply, k: payload.get(k, torch.zeros(3))})
        assert why == f"has key '{k}', which this algorithm's clients do not reply"


def test_a_reply_s_key_set_is_the_algorithm_s_not_the_payload_s():
    """Scaffold replies Δc under `dc/`, which the server never sent, and not c; FedMTL replies the float entries
    only; FedPAC its statistics besides the model, and not the prototypes it was sent."""
    for case, sent, replied in [("scaffold", "c/", "dc/"), ("fedpac", "protos", "count")]:
        _, payload, reply = last(case)
        assert any(k.startswith(sent) for k in payload) and not any(k.startswith(sent) for k in reply)
        assert any(k.startswith(replied) for k in reply) and not any(k.startswith(replied) for k in payload)
    _, payload, reply = last("fedmtl")
    ints = {k for k, v in payload.items() if not v.is_floating_point()}
    assert ints and set(reply) == set(payload) - ints


def test_fedpac_s_statistics_are_float64_whatever_the_model():
    algo, payload, reply = last("fedpac")
    c, d = payload["protos"].shape
    assert {k: (list(reply[k].shape), reply[k].dtype) for k in ("proto", "count", "h", "v", "n")} == {
        "proto": ([c, d], torch.float32), "count": ([c], torch.float32), "h": ([c, d], torch.float64),
        "v": ([], torch.float64), "n": ([], torch.float64)}  # fmt: skip
    assert algo.reply_fits(payload, {**reply, "h": reply["h"][:, :-1].clone()}) == \
        f"has 'h' of shape {[c, d - 1]}, expected {[c, d]}"  # fmt: skip


@pytest.mark.parametrize("case", ["fedfomo", "fedfomo+deltas"])
def test_fedfomo_s_ids_must_be_those_sent(case):
    """The server adds the weights into P at the replied ids' columns: another client's id (or one of no client)
    would move the credit; weights of another length would not fit the ids."""
    algo, payload, reply = last(case)
    ids = payload["fomo/ids"]
    assert len(ids) == 2 and torch.equal(reply["fomo/ids"], ids)
    others = [c for c in algo.ctx.federation.participated if c not in ids.tolist()]
    for bad in (torch.tensor([others[0], int(ids[1])]), torch.tensor([int(ids[1]), int(ids[0])]),
                torch.tensor([10**6, int(ids[1])])):  # fmt: skip
        assert algo.reply_fits(payload, {**reply, "fomo/ids": bad}) == \
            f"has 'fomo/ids' {bad.tolist()}, not the ids the server sent, {ids.tolist()}"  # fmt: skip
    short = {**reply, "fomo/ids": ids[:1].clone(), "fomo/w": reply["fomo/w"][:1].clone()}
    assert algo.reply_fits(payload, short) == "has 'fomo/ids' of shape [1], expected [2]"
    first = run(case)[1][0]
    assert first[0] == 1 and len(first[1]["fomo/ids"]) == 0 and algo.reply_fits(first[1], first[2]) is None


def _masked(case: str) -> tuple[Algorithm, Tensors, Tensors, str]:
    """A FedSelect payload in which the server holds a mask for the client (a flat entry) and its reply, and the
    key of that entry."""
    algo, seen = run(case)
    for _, payload, reply in reversed(seen):
        flat = [k for k in algo.eligible if tuple(payload[k].shape) != tuple(algo.shapes[k])]
        if flat:
            return algo, payload, reply, flat[0]
    raise AssertionError("no payload with a flat entry")


@pytest.mark.parametrize("case", ["fedselect", "fedselect+official"])
def test_fedselect_masks_and_flat_values_must_agree(case):
    algo, payload, reply, k = _masked(case)
    n, bits = algo.shapes[k].numel(), reply[f"mask/{k}"]
    held = n - payload[k].numel()  # personal entries of the mask the server holds
    personal = n - reply[k].numel()
    assert 0 < held <= personal < n and algo.reply_fits(payload, reply) is None

    def flip(i: int) -> torch.Tensor:  # bit i of the packed mask flipped
        out = bits.clone()
        out[i // 8] ^= 1 << (7 - i % 8)
        return out

    unpacked = ((bits.reshape(-1, 1) >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1).reshape(-1)[:n].bool()
    one_more = flip(int((~unpacked).nonzero()[0]))  # one more personal entry: one value too many
    assert algo.reply_fits(payload, {**reply, f"mask/{k}": one_more}) == \
        f"has '{k}' of shape {[n - personal]}, expected {[n - personal - 1]}"  # fmt: skip
    fewer = bits.clone()  # personal entries down to one: fewer than the server holds
    fewer.zero_()
    fewer[0] = 128
    why = algo.reply_fits(payload, {**reply, f"mask/{k}": fewer, k: torch.zeros(n - 1)})
    assert why == f"has 'mask/{k}' of 1 personal entries, fewer than the {held} the server holds for this client"
    assert algo.reply_fits(payload, {**reply, f"mask/{k}": torch.zeros_like(bits), k: torch.zeros(n)}) == \
        f"has 'mask/{k}' with no personal entry"  # fmt: skip
    no_mask = {j: v for j, v in reply.items() if j != f"mask/{k}"}
    assert algo.reply_fits(payload, {**no_mask, k: torch.zeros(algo.shapes[k])}) == \
        f"lacks 'mask/{k}', though the server holds a mask of '{k}' for this client"  # fmt: skip
    for dtype in (torch.bool, torch.int8, torch.int64):
        assert algo.reply_fits(payload, {**reply, f"mask/{k}": bits.to(dtype)}) == \
            f"has 'mask/{k}' of dtype {dtype}, expected torch.uint8"  # fmt: skip


def test_fedselect_padding_bits_of_a_mask_are_refused():
    """A packed mask's bits past the tensor's entries are zero in every honest reply (`pack_bits`)."""
    algo, payload, reply = last("fedselect")
    k = next(j for j in algo.eligible if f"mask/{j}" in reply and algo.shapes[j].numel() % 8)
    bits = reply[f"mask/{k}"].clone()
    bits[-1] |= 1  # the last bit: padding, since n is not a multiple of 8
    assert algo.reply_fits(payload, {**reply, f"mask/{k}": bits}) == f"has 'mask/{k}' with padding bits set"


def test_fedselect_a_mask_of_a_tensor_that_cannot_be_personal_is_refused():
    """The official preset personalizes the Linear weights only: a mask of a bias (with its values flat) would
    make the server average that bias as a masked entry."""
    algo, payload, reply = last("fedselect+official")
    bias = next(k for k in algo.keys if k.endswith(".bias") and k not in algo.eligible)
    n = algo.shapes[bias].numel()
    bits = torch.zeros((n + 7) // 8, dtype=torch.uint8)
    bits[0] = 128
    bad = {**reply, f"mask/{bias}": bits, bias: reply[bias].reshape(-1)[1:].clone()}
    assert algo.reply_fits(payload, bad) == f"has key 'mask/{bias}', which this algorithm's clients do not reply"


def test_fedselect_without_personalization_replies_full_tensors():
    """alpha = 0: no mask ever grows; every reply is the full model (FedAvg's), and a mask is refused."""
    algo, seen = run("fedselect+alpha-0")
    assert all(set(r) == set(algo.keys) for _, _, r in seen)
    _, payload, reply = last("fedselect+alpha-0")
    k = algo.eligible[0]
    n = algo.shapes[k].numel()
    bits = torch.zeros((n + 7) // 8, dtype=torch.uint8)
    bits[0] = 128
    assert algo.reply_fits(payload, {**reply, f"mask/{k}": bits, k: reply[k].reshape(-1)[1:].clone()}) == \
        f"has 'mask/{k}' of 1 personal entries, more than alpha and p let a client grow (0)"  # fmt: skip


@pytest.mark.parametrize("limit", ["stop", "cap"])
@pytest.mark.parametrize(("alpha", "p", "n"), [(0.3, 0.25, 10), (0.3, 0.25, 80), (0.8, 0.25, 80), (0.5, 1.0, 7),
                                               (1.0, 1.0, 8), (0.25, 0.25, 8), (0.05, 0.5, 3),
                                               (0.55, 0.1, 100)])  # 0.55·100 = 55.00000000000001  # fmt: skip
def test_fedselect_s_bound_on_personal_entries_is_the_largest_mask_grow_mask_reaches(alpha, p, n, limit):
    """`most_personal` against GradSelect itself: the largest count reached by growing a mask from every count
    (the growth only depends on the count, not on which entries)."""
    from types import SimpleNamespace

    from pflbed.algorithms.fedselect import FedSelect
    from pflbed.algorithms.masks import grow_mask

    reached = 0
    for before in range(n + 1):
        mask = torch.arange(n) < before
        grown = grow_mask(mask, torch.rand(n), rate=p, limit=alpha, cap=limit == "cap")
        reached = max(reached, int(grown.sum()) if before == 0 or grown.sum() > before else 0)
    algo = object.__new__(FedSelect)
    algo.opts = SimpleNamespace(alpha=alpha, p=p, limit=limit)
    assert algo.most_personal(n) == reached
