from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed import memory, rng
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.fedrod import balanced_softmax_loss, personal_loss
from pflbed.algorithms.fedrod_hyper import HyperNetwork
from pflbed.algorithms.training import get_params, load_params
from pflbed.cli import main
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.evaluation.evaluate import last
from pflbed.models import build_model

from ..tiny import TINY
from .test_fedrod import _hand_decoupled

WITH_NEW = {  # label skew Dir(0.3), as in the slides' setups
    **TINY,
    "federation": {**TINY["federation"], "alpha": 0.3, "new_clients": 2},
    "eval": {**TINY["eval"], "new_clients": {"epochs": 1, "lrs": [0.05]}},
}


def _algo(name="fedrod_hyper", train=None, **options):
    return prepare(validate_config({**TINY, "train": {**TINY["train"], **(train or {})},
                                    "algorithm": {"name": name, **options}}))  # fmt: skip


def _random_hyper(num_classes, d, hidden, seed=0):
    torch.manual_seed(seed)
    hyper = HyperNetwork(num_classes, d, hidden)
    torch.nn.init.normal_(hyper.fc2.weight)  # the zero-initialised output layer, made non-trivial
    return hyper


def test_generated_head_has_the_head_shapes_and_depends_on_the_prior():
    hyper = HyperNetwork(3, 5, 4)
    w, b = hyper(torch.tensor([0.2, 0.3, 0.5]))
    assert w.shape == (3, 5) and b.shape == (3,)
    assert not w.any() and not b.any()  # zero output layer: every client starts at ŷ_P = ŷ_G
    hyper = _random_hyper(3, 5, 4)
    h1, h2 = hyper.head(torch.tensor([0.8, 0.1, 0.1])), hyper.head(torch.tensor([0.1, 0.1, 0.8]))
    assert h1["weight"].shape == (3, 5) and h1["bias"].shape == (3,)
    assert not torch.allclose(h1["weight"], h2["weight"])


def test_hypernetwork_is_two_fc_layers_with_a_relu():
    """H^P(a; ν) = fc2(ReLU(fc1(a))), its output split into the head's weight (first C·d entries, row-major C × d)
    and bias (last C) — note 1."""
    hyper = _random_hyper(3, 5, 4, seed=1)
    a = torch.tensor([0.7, 0.2, 0.1])
    h = hyper.fc1.weight @ a + hyper.fc1.bias
    assert (h < 0).any()  # the ReLU matters for this input
    out = hyper.fc2.weight @ h.clamp_min(0) + hyper.fc2.bias
    w, b = hyper(a)
    assert torch.allclose(w, out[:15].view(3, 5), atol=1e-6) and torch.allclose(b, out[15:], atol=1e-6)


@pytest.mark.parametrize("classes, d, hidden", [(3, 5, 4), (10, 84, 32)])
def test_hypernetwork_size_is_its_parameter_count(classes, d, hidden):
    """What the memory check counts (`HyperNetwork.size`) is what the module holds."""
    n = sum(p.numel() for p in HyperNetwork(classes, d, hidden).parameters())
    assert HyperNetwork.size(classes, d, hidden) == n


def test_a_hypernetwork_too_large_for_the_memory_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """Four float32 copies of ν cannot fit: one line naming algorithm.hidden, exit 2, no run directory. One byte
    more memory and it runs."""
    algo = _algo(hidden=5)
    need = 4 * 4 * sum(p.numel() for p in algo.hyper.parameters())  # ROUND_COPIES float32 copies
    sets = {"algorithm.name": "fedrod_hyper", "algorithm.hidden": 5, "dataset.name": "synthetic", "model.name": "mlp",
            "federation.clients": 4, "train.rounds": 1, "eval.finetune": "[]", "federation.train_per_client": 20}
    args = ["run", *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), "--no-progress"]
    monkeypatch.setattr(memory, "device_memory", lambda device: need - 1)
    assert main([*args, "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pflbed: error: algorithm.hidden: fedrod_hyper's hypernetwork would hold ")
    assert "\n" not in err
    assert not (tmp_path / "refused").exists()
    monkeypatch.setattr(memory, "device_memory", lambda device: need)
    assert main([*args, "--out", str(tmp_path / "fits")]) == 0


def test_hypernetwork_init_is_seeded_and_every_generated_head_starts_at_zero():
    """Note 3: ν's first layer is drawn from the (seed, INIT) stream of the hypernetwork, independent of anything
    else; the output layer is zero, so the initial server generates h_P = 0 and every ŷ_P is ŷ_G."""
    algo = _algo()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.derive_seed(algo.ctx.seed, rng.INIT, 1))
        ref = HyperNetwork(10, algo.head.in_features, 32)
    server = algo.init_server()
    for k, v in get_params(ref).items():
        assert torch.equal(server["hyper." + k], v), k
    assert server["hyper.fc1.weight"].abs().sum() > 0 and not server["hyper.fc2.weight"].any()
    x = algo.ctx.source.test.x[:50]
    c = algo.ctx.federation.participated[0]
    assert torch.equal(algo.personal_model(server, algo.init_client(c)).logits(x), algo.generic_model(server).logits(x))


@pytest.mark.parametrize(
    ("options", "train", "nu_lr"),
    [
        ({}, {}, 0.05),  # hyper_lr default: personal_lr / 2, personal_lr default: train.lr (0.1)
        ({"personal_lr": 0.3, "gamma": 0.5}, {"momentum": 0.5, "weight_decay": 0.01}, 0.15),
        ({"hyper_lr": 0.02, "personal_lr": 0.3}, {"local_epochs": 2}, 0.02),
    ],
)
def test_client_update_trains_nu_with_the_p_loss_through_the_generated_head(options, train, nu_lr):
    """Modified Eq. 9: ν*_m = SGD on the P-loss of h_G(z) + h_P(z; H(a_m; ν)), the head regenerated from ν at
    every step, with hyper_lr (default personal_lr / 2, note 4); f and h_G follow Eq. 8 on the same batches.
    Reference written by hand (H's forward and SGD)."""
    algo = _algo(train=train, hidden=8, **options)
    c = algo.ctx.federation.participated[2]
    data, t = algo.ctx.client_data(c), algo.ctx.cfg.train
    server = algo.init_server()
    server = {k: v + 0.01 * torch.randn_like(v) for k, v in server.items()}  # some ν̄ with non-zero output layer
    net = algo.ctx.new_model()
    load_params(net, {k: v for k, v in server.items() if not k.startswith("hyper.")})
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    nu = [server["hyper." + k].clone().requires_grad_() for k in names]
    n, d = 10, algo.head.in_features

    def generate(ps):
        out = ps[2] @ (ps[0] @ data.prior.float() + ps[1]).clamp_min(0) + ps[3]
        return out[: n * d].view(n, d), out[n * d :]

    _hand_decoupled(net, nu, data, t, gamma=options.get("gamma", 1.0), personal_lr=nu_lr, seed=4, generate=generate)
    cctx = ClientContext(1, c, torch.Generator().manual_seed(4))
    reply, _ = algo.client_update(server, algo.init_client(c), data, cctx)
    expected = {**get_params(net), **{"hyper." + k: v.detach() for k, v in zip(names, nu, strict=True)}}
    assert set(reply) == set(expected)
    for k, v in expected.items():
        assert torch.allclose(reply[k], v, atol=1e-5), k


def test_p_loss_trains_the_hypernetwork_not_the_body_or_generic_head():
    torch.manual_seed(0)
    net = build_model("mlp", (4,), 3)
    hyper = _random_hyper(3, 200, 8)
    x, y, a = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0]), torch.tensor([0.5, 0.3, 0.2])

    def head(z):
        w, b = hyper(a)
        return F.linear(z, w, b)

    z = net.features(x)
    g = net.classify(z)
    personal_loss(g, z, y, head).backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for p in net.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in hyper.parameters())
    hyper.zero_grad(set_to_none=True)
    balanced_softmax_loss(g, y, torch.tensor([5.0, 3.0, 2.0])).backward()
    assert all(p.grad is None for p in hyper.parameters())


def test_nu_is_uploaded_and_aggregated_and_the_generic_part_is_fedrods():
    algo = _algo()
    server = algo.init_server()
    model_keys = set(algo.ctx.model.state_dict())
    hyper_keys = {k for k in server if k.startswith("hyper.")}
    assert hyper_keys and set(server) == model_keys | hyper_keys
    linear = _algo("fedrod")
    replies = {}
    for i, c in enumerate(algo.ctx.federation.participated[:2]):
        state = algo.init_client(c)
        data = algo.ctx.client_data(c)
        assert set(state) == {"prior"} and torch.equal(state["prior"], data.prior)
        replies[c], new_state = algo.client_update(
            server, state, data, ClientContext(1, c, torch.Generator().manual_seed(i))
        )
        assert set(replies[c]) == set(server) and new_state is state  # nothing learned is kept on the client
        assert replies[c]["hyper.fc2.weight"].abs().sum() > 0  # ν moved (the P-loss trained it)
        # f and h_G follow exactly the linear variant's training (BSM only, same batches)
        ref, _ = linear.client_update(
            linear.init_server(), linear.init_client(c), data, ClientContext(1, c, torch.Generator().manual_seed(i))
        )
        for k in model_keys:
            assert torch.allclose(replies[c][k], ref[k], atol=1e-6), k
    a, b = replies
    out = algo.aggregate(1, server, replies, {a: 2, b: 1})
    assert set(out) == set(server)
    for k in out:
        assert torch.allclose(out[k], (2 * replies[a][k] + replies[b][k]) / 3, atol=1e-6), k


@pytest.fixture(scope="module")
def e2e():
    return pflbed.run({**WITH_NEW, "algorithm": {"name": "fedrod_hyper", "hidden": 16}}, write=False)


def test_fedrod_hyper_learns_end_to_end_in_strict_mode(e2e):
    """References: (1) FedRoD (linear) on the same config — the generic part (f, h_G) must be *identical*, since
    the P-loss never reaches it and aggregation is the same |D_m|-weighted mean; (2) for new clients, their
    zero-shot model H(a_new; ν̄), which adapting on their own data must beat (seed 0: 0.34 vs 0.55–0.59)."""
    f = e2e.summary["final"]
    assert f["gfl_acc"] > 0.3 and f["pfl_acc"] > 0.3  # 10 balanced classes: chance is 0.1
    linear = pflbed.run({**WITH_NEW, "algorithm": {"name": "fedrod"}}, write=False, progress=False)
    assert f["gfl_acc"] == linear.summary["final"]["gfl_acc"]
    assert all(torch.equal(linear.server[k], v) for k, v in linear.server.items() if not k.startswith("hyper."))
    nc = e2e.summary["new_clients"]
    assert nc["clients"] == 2 and nc["zero_shot"]["acc"] > 0.2
    for method in ("ft", "lp"):
        assert all(size["last"] > nc["zero_shot"]["acc"] + 0.08 for size in nc["methods"][method].values())
    assert e2e.server["hyper.fc1.weight"].shape == (16, 10)


def test_zero_shot_generates_the_head_from_the_new_clients_prior(e2e):
    algo = e2e.executor.algo
    c = algo.ctx.federation.new[0]
    data = algo.ctx.client_data(c)
    flipped = replace(data, prior=data.prior.flip(0))
    p1, p2 = algo.zero_shot(e2e.server, data), algo.zero_shot(e2e.server, flipped)
    assert not torch.allclose(p1.params["personal.weight"], p2.params["personal.weight"])
    x = algo.ctx.source.test.x[:200]
    assert not torch.equal(p1.logits(x), p2.logits(x))
    # participated clients: ŷ_G + H(a_m; ν̄) — the same generation from the client's stored prior
    m = algo.ctx.federation.participated[0]
    pm = algo.personal_model(e2e.server, e2e.executor.states[m])
    assert torch.equal(
        pm.params["personal.weight"], algo.zero_shot(e2e.server, algo.ctx.client_data(m)).params["personal.weight"]
    )


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_personalize_starts_from_the_generated_head(e2e, method):
    algo = e2e.executor.algo
    data = algo.ctx.client_data(algo.ctx.federation.new[0])
    start = algo.zero_shot(e2e.server, data).params
    p = last(algo.personalize(e2e.server, data, Budget(method, 1, 0.05, 8), torch.Generator()))
    changed = {k for k in start if not torch.equal(start[k], p.params[k])}
    assert {"personal.weight", "personal.bias"} <= changed
    assert all(k.startswith("personal.") for k in changed) == (method == "lp")
    assert not any(k.startswith("hyper.") for k in p.params)
    # with lr 0 the adapted model is exactly the start: H(a_new; ν̄) on θ̄, ψ̄ (not a zero head)
    p0 = last(algo.personalize(e2e.server, data, Budget(method, 1, 0.0, 8), torch.Generator()))
    assert set(p0.params) == set(start) and all(torch.equal(p0.params[k], v) for k, v in start.items())


def test_personalize_draws_batches_from_the_given_generator_only():
    """A new client's adaptation must depend on the generator the protocol derives from (seed, client, lr), not on
    torch's global RNG: the same generator gives the same model whatever the global state, another one differs."""
    algo = _algo()
    server = algo.init_server()
    data = algo.ctx.client_data(algo.ctx.federation.participated[0])
    budget = Budget("ft", 2, 0.1, 4)

    def adapt(seed: int, global_seed: int):
        torch.manual_seed(global_seed)
        return last(algo.personalize(server, data, budget, torch.Generator().manual_seed(seed))).params

    a, b, c = adapt(1, 0), adapt(1, 99), adapt(2, 0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_cached_body_features_are_keyed_by_the_server_state():
    """Personal models and lp-personalized predictors declare a shared body keyed by the server state: two server
    states evaluated with one cache must each keep their own body features (note 7, note 8)."""
    from .test_fedrod import _assert_cached_predictions_are_each_models_own, _two_servers

    algo = _algo()
    s1, s2 = _two_servers(algo)
    c = algo.ctx.federation.participated[0]
    data = algo.ctx.client_data(c)
    personal = [algo.personal_model(s, algo.init_client(c)) for s in (s1, s2)]
    lp = [last(algo.personalize(s, data, Budget("lp", 1, 0.1, 16), torch.Generator().manual_seed(0))) for s in (s1, s2)]
    _assert_cached_predictions_are_each_models_own(personal + lp, algo.ctx.source)


def test_hypernetwork_takes_a_class_distribution_of_any_float_dtype():
    """a_m may come as float64 (e.g. normalised label counts): H^P converts it to its own dtype, same head."""
    hyper = _random_hyper(3, 5, 4, seed=2)
    a = torch.tensor([0.6, 0.3, 0.1])
    w32, b32 = hyper(a)
    w64, b64 = hyper(a.double())
    assert w64.dtype == torch.float32 and torch.equal(w64, w32) and torch.equal(b64, b32)


def test_local_pfl_body_is_the_clients_own_body_with_the_generated_head(monkeypatch):
    """`pfl_body: local` (note 7): client m's P-FL predictor is θ*_m, ψ*_m it uploaded in its last participated
    round (not θ̄, ψ̄, not another client's, not an older round's) with h_P = H(a_m; ν̄) of the final server — the
    option changes the body only; a client never sampled gets θ̄, ψ̄ and H(a_m; ν̄). The state is a_m plus that
    body. References computed directly (H's forward by hand)."""
    from .test_fedrod import LOCAL_BODIES, additive_logits, last_rounds, run_recording_replies

    cfg = {**LOCAL_BODIES, "algorithm": {"name": "fedrod_hyper", "hidden": 8, "pfl_body": "local"}}
    res, replies = run_recording_replies(monkeypatch, cfg)
    algo, server = res.executor.algo, res.server
    last = last_rounds(replies, algo.ctx.federation, LOCAL_BODIES["train"]["rounds"])
    model_keys = set(algo.ctx.model.state_dict())
    assert server["hyper.fc2.weight"].abs().sum() > 0  # ν̄ generates non-zero heads
    x = algo.ctx.source.test.x[:300]
    n, d = algo.ctx.source.num_classes, algo.head.in_features
    trained = [c for c, r in last.items() if r is not None]
    for c, r in last.items():
        state = res.executor.state(c)
        a = state["prior"].float()
        h = (server["hyper.fc1.weight"] @ a + server["hyper.fc1.bias"]).clamp_min(0)
        out = server["hyper.fc2.weight"] @ h + server["hyper.fc2.bias"]
        w, b = out[: n * d].view(n, d), out[n * d :]
        got = algo.personal_model(server, state).logits(x)
        if r is None:
            assert set(state) == {"prior"}
            assert torch.allclose(got, additive_logits(algo, server, w, b, x), atol=1e-5)
            continue
        assert set(state) == {"prior"} | {"local." + k for k in model_keys}
        expected = additive_logits(algo, replies[(r, c)], w, b, x)
        assert torch.allclose(got, expected, atol=1e-5), c
        other = next(o for o in trained if o != c)
        wrong = [server, replies[(last[other], other)]] + [v for (rr, cc), v in replies.items() if cc == c and rr != r]
        for body in wrong:
            assert not torch.allclose(additive_logits(algo, body, w, b, x), expected, atol=1e-3), c


def test_local_bodies_are_scored_each_on_its_own_features_hyper():
    """As for the linear variant: one evaluation cache for all clients gives each client its own model's scores
    on the global test set (shared by all clients) with `pfl_body: local`."""
    from pflbed.evaluation.evaluate import Predictions, client_score, evaluate

    from .test_fedrod import LOCAL_BODIES

    cfg = {**LOCAL_BODIES, "eval": {**TINY["eval"], "pfl_test": "global"},
           "algorithm": {"name": "fedrod_hyper", "hidden": 8, "pfl_body": "local"}}  # fmt: skip
    res = pflbed.run(cfg, write=False, progress=False)
    algo, ctx = res.executor.algo, res.executor.algo.ctx
    _, per_client = evaluate(algo, res.server, res.executor.state)
    alone = {c: client_score(algo.personal_model(res.server, res.executor.state(c)), c, ctx,
                             Predictions(ctx.source, 1024), "test") for c in ctx.federation.participated}  # fmt: skip
    assert per_client == alone


def test_pfl_body_server_keeps_the_prior_alone_and_training_is_the_same():
    """Default `server`: the state is a_m alone, trained or not; the server is the same under both options (the
    replies are)."""
    cfg = {**TINY, "train": {**TINY["train"], "rounds": 2}}
    runs = {body: pflbed.run({**cfg, "algorithm": {"name": "fedrod_hyper", "hidden": 8, "pfl_body": body}},
                             write=False, progress=False) for body in ("server", "local")}  # fmt: skip
    assert all(set(s) == {"prior"} for s in runs["server"].executor.states.values())
    assert any(len(s) > 1 for s in runs["local"].executor.states.values())
    a, b = runs["server"].server, runs["local"].server
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert runs["server"].summary["final"]["gfl_acc"] == runs["local"].summary["final"]["gfl_acc"]
