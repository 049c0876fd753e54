"""pFedHN (Shamsian et al., ICML 2021): the rules of `algorithms/pfedhn.py`, each against an expectation built
independently of the implementation — the hypernetwork's forward written out from the server's tensors, the
server's gradients from autograd of a surrogate through that forward, the optimizers by hand or torch's own SGD.

Rules: θ_i = h(v_i; φ) is an MLP of ReLU layers with one linear head per target tensor, seeded from its own
streams; the payload is h at the client's own embedding; the client runs K mini-batch SGD steps and replies
Δθ_i = θ̃_i − θ_i; the server's gradient of φ and v_i is (∂θ_i/∂(φ, v_i))ᵀ(θ_i − θ̃_i), the gradient of
½‖h(v_i; φ) − θ̃_i‖², so a step moves h(v_i; φ) toward θ̃_i (with one full-batch plain SGD step it is η times the
chain-rule gradient of the client's loss); a round's replies are combined by one step of φ on their mean and one
step of each replying v_i on its own gradient (or one step per reply in client order); only replying clients'
embeddings move; the SGD momentum lives in the server state; a new client learns only its embedding (φ
untouched, bit for bit), then optionally ft / lp from h(v).
"""

import io

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import pflbed
from pflbed import memory, rng
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.pfedhn import EMB, STREAM, HyperNetwork, PFedHNOptions
from pflbed.algorithms.training import finetune_epochs
from pflbed.cli import main
from pflbed.config import validate_config
from pflbed.engine import wire
from pflbed.engine.build import prepare
from pflbed.engine.driver import Driver
from pflbed.engine.executor import LoopExecutor
from pflbed.evaluation.evaluate import last
from pflbed.results.checkpoint import load_checkpoint, save_checkpoint

from ..tiny import TINY, same_tensors

WITH_NEW = {
    **TINY,
    "federation": {**TINY["federation"], "alpha": 0.3, "new_clients": 2},
    "eval": {**TINY["eval"], "new_clients": {"epochs": 2, "lrs": [0.05], "methods": ["ft"]}},
}


def _algo(train=None, federation=None, model=None, dataset=None, **options):
    tree = {**TINY, "train": {**TINY["train"], **(train or {})}, "algorithm": {"name": "pfedhn", "hidden": 8,
            **options}}  # fmt: skip
    if federation:
        tree["federation"] = {**TINY["federation"], **federation}
    if model:
        tree["model"] = {"name": model}
    if dataset:
        tree["dataset"] = {"name": dataset}
    return prepare(validate_config(tree))


def _moved(algo, seed=0, scale=0.05):
    """A server state away from the initial one (random φ and embeddings), so nothing is at a special point."""
    g = torch.Generator().manual_seed(seed)
    server = algo.init_server()
    return {k: v + scale * torch.randn(v.shape, generator=g) if not k.startswith("mom.") else v
            for k, v in server.items()}  # fmt: skip


def _hand_theta(algo, phi, v):
    """h(v; φ) written out: ReLU(W x + b) per hidden layer, then head_k(x) reshaped, one head per target tensor."""
    x = v
    for i in range(algo.opts.hidden_layers):
        x = torch.relu(phi[f"trunk.{2 * i}.weight"] @ x + phi[f"trunk.{2 * i}.bias"])
    out = {}
    for k, p in algo.ctx.model.named_parameters():
        head = k.replace(".", "_")
        out[k] = (phi[f"heads.{head}.weight"] @ x + phi[f"heads.{head}.bias"]).reshape(p.shape)
    return out


def _phi(server):
    return {k[3:]: v for k, v in server.items() if k.startswith("hn.")}


def _random_delta(algo, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: 0.01 * torch.randn(p.shape, generator=g) for k, p in algo.ctx.model.named_parameters()}


def _row(algo, c):
    return sorted(algo.ctx.federation.participated).index(c)


# --- the hypernetwork ----------------------------------------------------------------------------------------------
def test_defaults_are_the_papers_settings():
    """The authors' code defaults (module docstring, notes 3, 4, 6): SGD α 0.01, momentum 0.9, weight decay 1e-3,
    embeddings at α, three hidden layers of 100, K = 50, d = ⌊1 + n/4⌋; a round's replies combined by their mean
    (note 2: sequential steps on one round's stale deltas diverge)."""
    o = PFedHNOptions()
    assert (o.hn_lr, o.hn_momentum, o.hn_weight_decay, o.embed_lr) == (0.01, 0.9, 1e-3, None)
    assert (o.hidden, o.hidden_layers, o.local_steps, o.embed_dim) == (100, 3, 50, None)
    assert (o.combine, o.new_client, o.new_embedding_init) == ("mean", "embedding", "mean")
    for clients, d in ((6, 2), (20, 6), (50, 13)):
        assert _algo(federation={"clients": clients}).embed_dim == d
    assert _algo(embed_dim=5).embed_dim == 5


@pytest.mark.parametrize("layers", [1, 3])
def test_hypernetwork_is_relu_layers_then_one_linear_head_per_target_tensor(layers):
    algo = _algo(hidden_layers=layers)
    server = _moved(algo)
    params = dict(algo.ctx.model.named_parameters())
    heads = {k for k in server if k.startswith("hn.heads.") and k.endswith(".weight")}
    assert len(heads) == len(params)
    assert {k for k in server if k.startswith("hn.trunk.") and k.endswith(".weight")} == {
        f"hn.trunk.{2 * i}.weight" for i in range(layers)
    }
    for c in algo.ctx.federation.participated:
        v = server["emb"][_row(algo, c)]
        got, want = algo.generate(server, v), _hand_theta(algo, _phi(server), v)
        assert set(got) == set(params)
        for k in params:
            assert got[k].shape == params[k].shape and torch.allclose(got[k], want[k], atol=1e-6), k
    count = sum(v.numel() for k, v in server.items() if k.startswith("hn."))
    assert algo.diagnostics(1, server, algo.init_client)["hypernet_params"] == count == algo.num_hyper_params()
    shapes = {k: p.shape for k, p in params.items()}
    assert HyperNetwork.size(shapes, algo.embed_dim, algo.opts.hidden, layers) == count  # what its refusal counts


def test_a_hypernetwork_too_large_for_the_memory_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """Four copies of φ cannot fit: one line naming the options that size it, exit 2, no run directory (the server
    state is built before the directory is written). One copy less than the memory holds runs."""
    algo = _algo(hidden=7, hidden_layers=2, embed_dim=3)
    need = 4 * 4 * algo.num_hyper_params()  # ROUND_COPIES float32 copies
    sets = {"algorithm.name": "pfedhn", "algorithm.hidden": 7, "algorithm.hidden_layers": 2, "algorithm.embed_dim": 3,
            "algorithm.local_steps": 1, "dataset.name": "synthetic", "model.name": "mlp", "federation.clients": 4,
            "train.rounds": 1, "eval.finetune": "[]", "federation.train_per_client": 20}  # fmt: skip
    args = ["run", *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), "--no-progress"]
    monkeypatch.setattr(memory, "device_memory", lambda device: need - 1)
    assert main([*args, "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pflbed: error: algorithm.hidden, algorithm.hidden_layers and algorithm.embed_dim: pfedhn's "
                          f"hypernetwork would hold {algo.num_hyper_params():,} parameters") and "\n" not in err
    assert not (tmp_path / "refused").exists()
    monkeypatch.setattr(memory, "device_memory", lambda device: need)
    assert main([*args, "--out", str(tmp_path / "fits")]) == 0


def test_initialization_is_drawn_from_pfedhns_own_streams():
    """Note 5: φ from torch's default Linear init under (seed, STREAM, 0), embeddings N(0, 1) from (seed, STREAM,
    1), momentum zero; the same config gives the same state, another seed another one."""
    algo = _algo()
    server = algo.init_server()
    shapes = {k: p.shape for k, p in algo.ctx.model.named_parameters()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.derive_seed(algo.ctx.seed, STREAM, 0))
        ref = HyperNetwork(shapes, algo.embed_dim, 8, 3)
    for k, v in ref.state_dict().items():
        assert torch.equal(server["hn." + k], v), k
    emb = torch.randn(6, algo.embed_dim, generator=rng.generator(algo.ctx.seed, STREAM, 1))
    assert torch.equal(server["emb"], emb)
    assert all(not v.any() for k, v in server.items() if k.startswith("mom."))
    assert {k[4:] for k in server if k.startswith("mom.")} == {k for k in server if not k.startswith("mom.")}
    assert same_tensors(_algo().init_server(), server)
    other = prepare(validate_config({**TINY, "seed": 1, "algorithm": {"name": "pfedhn", "hidden": 8}}))
    assert not torch.equal(other.init_server()["emb"], server["emb"])


def test_start_at_the_initial_model_generates_it_for_every_embedding_then_learns():
    """Note 5's extension: heads' weights 0 and biases θ⁰, so every client's payload is the run's initial model
    (e.g. a pretrained body); the trunk is the paper's init from the same stream; after two rounds of replies the
    generated models have moved, and apart for different clients (weights, trunk and embeddings all learn)."""
    algo, paper = _algo(start="initial_model"), _algo()
    server, paper_server = algo.init_server(), paper.init_server()
    theta0 = {k: p.detach() for k, p in algo.ctx.model.named_parameters()}
    cids = algo.ctx.federation.participated[:3]
    for payload in algo.configure(1, server, cids).values():
        assert same_tensors(payload, {k: algo.ctx.initial_params[k] for k in payload})
        assert same_tensors(payload, theta0)
    assert all(torch.equal(server[k], paper_server[k]) for k in server if k.startswith("hn.trunk."))
    assert torch.equal(server["emb"], paper_server["emb"])
    for rnd in (1, 2):
        replies = {c: _random_delta(algo, 10 * rnd + c) for c in cids}
        server = algo.aggregate(rnd, server, replies, dict.fromkeys(cids, 1.0))
    a, b = (algo.generate(server, server["emb"][_row(algo, c)]) for c in cids[:2])
    assert not same_tensors(a, theta0) and not same_tensors(a, b)
    assert not torch.equal(server["hn.trunk.0.weight"], paper_server["hn.trunk.0.weight"])


def test_payload_is_the_generated_model_of_each_clients_own_embedding():
    algo = _algo()
    server = _moved(algo)
    cids = [5, 0, 3]
    payloads = algo.configure(1, server, cids)
    assert sorted(payloads) == sorted(cids)
    for c in cids:
        want = _hand_theta(algo, _phi(server), server["emb"][_row(algo, c)])
        assert set(payloads[c]) == set(want)
        assert all(torch.allclose(payloads[c][k], want[k], atol=1e-6) for k in want)
    assert not torch.allclose(payloads[0]["blocks.classifier.weight"], payloads[3]["blocks.classifier.weight"])
    swapped = dict(server)
    swapped["emb"] = server["emb"][torch.tensor([3, 1, 2, 0, 4, 5])]  # clients 0 and 3 swap embeddings
    again = algo.configure(1, swapped, [0, 3])
    assert same_tensors(again[0], payloads[3]) and same_tensors(again[3], payloads[0])


# --- the client ----------------------------------------------------------------------------------------------------
def _hand_local_sgd(model, theta, data, steps, lr, momentum, wd, bs, seed):
    """K steps of SGD by hand: batches from one permutation per epoch of the client's indices (the generator's
    draws), d = g + wd·p, buf = μ·buf + d (buf = d at the first step), p ← p − lr·buf."""
    g = torch.Generator().manual_seed(seed)
    params = {k: v.clone().requires_grad_() for k, v in theta.items()}
    bufs: dict = {}
    batches: list = []
    while len(batches) < steps:
        perm = data.train[torch.randperm(data.num_train, generator=g)]
        batches += list(perm.split(bs))
    model.train()
    for b in batches[:steps]:
        loss = F.cross_entropy(functional_call(model, params, (data.x[b],)), data.y[b])
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for (k, p), gk in zip(params.items(), grads, strict=True):
                d = gk + wd * p
                bufs[k] = d if k not in bufs or not momentum else momentum * bufs[k] + d
                p -= lr * bufs[k]
    return {k: v.detach() for k, v in params.items()}


@pytest.mark.parametrize(
    ("steps", "train"), [(7, {}), (5, {"momentum": 0.9, "weight_decay": 0.01, "lr": 0.05, "batch_size": 100})]
)
def test_local_update_is_k_sgd_steps_and_the_reply_is_the_delta(steps, train):
    """K steps across epoch boundaries (more steps than one epoch's batches, a partial last batch), `train.*`
    optimizer; the reply is θ̃ − θ under the parameter names, and the state keeps only the client id (no buffers
    in the MLP)."""
    algo = _algo(train={"batch_size": 128, **train}, local_steps=steps)
    t = algo.ctx.cfg.train
    c = algo.ctx.federation.participated[1]
    data = algo.ctx.client_data(c)
    assert -(-data.num_train // t.batch_size) < steps and data.num_train % t.batch_size
    payload = algo.configure(1, _moved(algo), [c])[c]
    cctx = ClientContext(1, c, torch.Generator().manual_seed(9))
    reply, state = algo.client_update(payload, algo.init_client(c), data, cctx)
    want = _hand_local_sgd(algo.ctx.model, payload, data, steps, t.lr, t.momentum, t.weight_decay, t.batch_size, 9)
    assert set(reply) == set(payload) and set(state) == {"cid"} and int(state["cid"]) == c
    for k in want:
        assert torch.allclose(reply[k], want[k] - payload[k], atol=1e-6), k
        assert reply[k].abs().max() > 0, k


@pytest.mark.parametrize("train", [{}, {"momentum": 0.5, "weight_decay": 0.01, "lr": 0.05}])
def test_local_update_in_epoch_mode_runs_train_local_epochs(train):
    """⌈n/B⌉ batches per epoch, `train.local_epochs` epochs, with the `train.*` optimizer."""
    algo = _algo(train={"local_epochs": 2, **train}, local_steps=None)
    t = algo.ctx.cfg.train
    c = algo.ctx.federation.participated[0]
    data = algo.ctx.client_data(c)
    payload = algo.configure(1, _moved(algo), [c])[c]
    reply, _ = algo.client_update(
        payload, algo.init_client(c), data, ClientContext(1, c, torch.Generator().manual_seed(2))
    )
    steps = 2 * -(-data.num_train // 16)  # two epochs of ⌈n/B⌉ batches
    want = _hand_local_sgd(algo.ctx.model, payload, data, steps, t.lr, t.momentum, t.weight_decay, 16, 2)
    assert all(torch.allclose(reply[k], want[k] - payload[k], atol=1e-6) for k in want)


def test_batchnorm_statistics_stay_with_the_client():
    """Note 7: buffers are not generated — the client trains with its own statistics, keeps them in its state,
    never uploads them, and its personal model uses them."""
    algo = _algo(model="cnn_bn", dataset="digits", local_steps=3)
    c = algo.ctx.federation.participated[0]
    state = algo.init_client(c)
    bufs = {k for k in state if k.startswith("buf.")}
    assert bufs and all(torch.equal(state[k], algo.ctx.initial_params[k[4:]]) for k in bufs)
    server = algo.init_server()
    payload = algo.configure(1, server, [c])[c]
    assert set(payload) == {k for k, _ in algo.ctx.model.named_parameters()}
    reply, new = algo.client_update(payload, state, algo.ctx.client_data(c), ClientContext(1, c, torch.Generator()))
    assert set(reply) == set(payload)
    assert any(not torch.equal(new[k], state[k]) for k in bufs)  # running statistics moved
    p = algo.personal_model(server, new)
    assert all(torch.equal(p.params[k[4:]], new[k]) for k in bufs)


# --- the server ----------------------------------------------------------------------------------------------------
def _surrogate_step(algo, server, c, delta, lr_phi, lr_v):
    """Expected plain-SGD step from autograd of ½‖h(v; φ) − θ̃‖², θ̃ = h(v; φ) + Δθ at the given state."""
    phi = {k: v.clone().requires_grad_() for k, v in _phi(server).items()}
    v = server["emb"][_row(algo, c)].clone().requires_grad_()
    with torch.no_grad():
        target = {k: t + delta[k] for k, t in _hand_theta(algo, phi, v).items()}
    theta = _hand_theta(algo, phi, v)
    loss = 0.5 * sum(((theta[k] - target[k]) ** 2).sum() for k in theta)
    grads = torch.autograd.grad(loss, [*phi.values(), v])
    new_phi = {k: p.detach() - lr_phi * g for (k, p), g in zip(phi.items(), grads[:-1], strict=True)}
    return new_phi, v.detach() - lr_v * grads[-1], target


def test_server_gradient_is_autograd_of_the_distance_to_the_trained_model_for_phi_and_v():
    """Algorithm 1 lines 10–11 with the sign that descends: φ and v_i move along −(∂θ/∂·)ᵀ(θ − θ̃), so the generated
    model comes closer to the client's θ̃ (checked directly too)."""
    algo = _algo(hn_momentum=0.0, hn_weight_decay=0.0, hn_lr=0.3, embed_lr=0.7)
    server = _moved(algo)
    c = algo.ctx.federation.participated[2]
    delta = _random_delta(algo, 1)
    out = algo.aggregate(1, server, {c: delta}, {c: 1.0})
    want_phi, want_v, target = _surrogate_step(algo, server, c, delta, 0.3, 0.7)
    for k, v in want_phi.items():
        assert torch.allclose(out["hn." + k], v, atol=1e-6), k
    assert torch.allclose(out["emb"][_row(algo, c)], want_v, atol=1e-6)
    assert not torch.allclose(out["emb"][_row(algo, c)], server["emb"][_row(algo, c)], atol=1e-4)

    def distance(s):
        theta = _hand_theta(algo, _phi(s), s["emb"][_row(algo, c)])
        return sum(((theta[k] - target[k]) ** 2).sum() for k in theta)

    small = _algo(hn_momentum=0.0, hn_weight_decay=0.0, hn_lr=1e-4, embed_lr=1e-3)  # no overshoot: pure direction
    assert distance(small.aggregate(1, server, {c: delta}, {c: 1.0})) < distance(server) - 1e-3


def test_one_full_batch_plain_sgd_step_gives_eta_times_the_chain_rule_gradient():
    """K = 1, one batch of all the client's data, no momentum: Δθ = −η∇_θ L, so the server's step is
    φ − α·η·∇_φ L(h(v; φ)) and v − β·η·∇_v L(h(v; φ)) — the exact gradient of the client's loss through h."""
    eta, alpha, beta = 0.5, 0.2, 0.4
    algo = _algo(train={"batch_size": 100_000, "lr": eta}, local_steps=1, hn_lr=alpha, embed_lr=beta, hn_momentum=0.0,
                 hn_weight_decay=0.0)  # fmt: skip
    server = _moved(algo)
    c = algo.ctx.federation.participated[3]
    data = algo.ctx.client_data(c)
    payload = algo.configure(1, server, [c])[c]
    reply, _ = algo.client_update(payload, algo.init_client(c), data, ClientContext(1, c, torch.Generator()))
    out = algo.aggregate(1, server, {c: reply}, {c: 1.0})

    phi = {k: v.clone().requires_grad_() for k, v in _phi(server).items()}
    v = server["emb"][_row(algo, c)].clone().requires_grad_()
    algo.ctx.model.train()
    x, y = data.x[data.train], data.y[data.train]
    loss = F.cross_entropy(functional_call(algo.ctx.model, _hand_theta(algo, phi, v), (x,)), y)
    grads = torch.autograd.grad(loss, [*phi.values(), v])
    got = [out["hn." + k] - server["hn." + k] for k in phi] + [out["emb"][_row(algo, c)] - v.detach()]
    want = [-alpha * eta * g for g in grads[:-1]] + [-beta * eta * grads[-1]]
    for g, w in zip(got, want, strict=True):
        assert (g - w).norm() <= 1e-3 * w.norm() + 1e-7  # Δθ is a float32 difference: relative rounding
    assert want[-1].norm() > 0 and want[0].norm() > 0


@pytest.mark.parametrize("combine", ["sequential", "mean"])
def test_only_the_replying_clients_embeddings_and_momentum_rows_change(combine):
    algo = _algo(combine=combine)
    server = _moved(algo)
    replying = algo.ctx.federation.participated[1:3]
    out = algo.aggregate(1, server, {c: _random_delta(algo, c) for c in replying}, {c: 1.0 for c in replying})
    assert set(out) == set(server)
    for c in algo.ctx.federation.participated:
        r = _row(algo, c)
        moved = not torch.equal(out["emb"][r], server["emb"][r])
        mom_moved = not torch.equal(out["mom.emb"][r], server["mom.emb"][r])
        assert moved == mom_moved == (c in replying), c
    assert all(not torch.equal(out[k], server[k]) for k in server if k.startswith("hn."))


def _torch_sgd_reference(algo, server, rounds, lr_phi, lr_v, momentum, wd, mean=False):
    """torch.optim.SGD on φ and the embeddings as separate parameters (a parameter without a gradient is not
    stepped: neither moved nor its momentum), over the linear surrogate −⟨h(v_c; φ), Δθ_c⟩ whose gradient is
    −(∂θ/∂·)ᵀΔθ_c at the current point: per round, one step per reply in client order, or one step with φ's
    gradient the mean over the replies and each v_c's its own (v_c detached from the mean, φ from v_c's term)."""
    phi = {k: torch.nn.Parameter(v.clone()) for k, v in _phi(server).items()}
    emb = {c: torch.nn.Parameter(server["emb"][_row(algo, c)].clone()) for c in algo.ctx.federation.participated}
    opt = torch.optim.SGD([{"params": list(phi.values())}, {"params": list(emb.values()), "lr": lr_v}], lr=lr_phi,
                          momentum=momentum, weight_decay=wd)  # fmt: skip

    def surrogate(c, delta):
        theta = _hand_theta(algo, phi, emb[c])
        return -sum((theta[k] * delta[k]).sum() for k in theta)

    for replies in rounds:
        if mean:
            opt.zero_grad(set_to_none=True)
            for c, d in sorted(replies.items()):
                own = emb[c]
                emb[c] = own.detach()
                (surrogate(c, d) / len(replies)).backward()  # φ: the mean
                emb[c], frozen = own, dict(phi)
                phi.update({k: p.detach() for k, p in phi.items()})
                surrogate(c, d).backward()  # v_c: its own gradient
                phi.update(frozen)
            opt.step()
        else:
            for c in sorted(replies):
                opt.zero_grad(set_to_none=True)
                surrogate(c, replies[c]).backward()
                opt.step()
    return {k: p.detach() for k, p in phi.items()}, {c: p.detach() for c, p in emb.items()}


def _assert_matches(algo, out, ref, atol=1e-6):
    phi, emb = ref
    for k, v in phi.items():
        assert torch.allclose(out["hn." + k], v, atol=atol), k
    for c, v in emb.items():
        assert torch.allclose(out["emb"][_row(algo, c)], v, atol=atol), c


@pytest.mark.parametrize("combine", ["sequential", "mean"])
def test_replies_combine_as_steps_of_the_hypernetwork_sgd_in_client_order(combine):
    """Note 2. Sequential: one Algorithm 1 step per reply in increasing client id, each at the φ the previous one
    left; mean: one step of φ on the mean gradient, one step of each replying v_i on its own. SGD with momentum
    0.9, weight decay, embeddings at embed_lr. The replies are handed over in reverse order: the result must not
    depend on it."""
    opts = dict(hn_lr=0.05, embed_lr=0.3, hn_momentum=0.9, hn_weight_decay=0.01)
    algo = _algo(combine=combine, **opts)
    server = _moved(algo)
    cids = [4, 1, 0]
    replies = {c: _random_delta(algo, 10 + c) for c in cids}
    out = algo.aggregate(1, server, replies, {c: 1.0 for c in cids})
    ref = _torch_sgd_reference(algo, server, [replies], 0.05, 0.3, 0.9, 0.01, mean=combine == "mean")
    _assert_matches(algo, out, ref)


def test_momentum_is_server_state_and_carries_across_rounds_and_algorithm_objects():
    """Note 3: the SGD momentum of φ and of each embedding lives in the server state (`mom.*`): round 2 run by a
    fresh algorithm object on a server state that went through bytes equals torch's SGD continued over both
    rounds — and differs from a restart without momentum."""
    opts = dict(hn_lr=0.05, embed_lr=0.2, hn_momentum=0.9, hn_weight_decay=0.0)
    algo = _algo(**opts)
    server = _moved(algo)
    rounds = [
        {0: _random_delta(algo, 1), 2: _random_delta(algo, 2)},
        {2: _random_delta(algo, 3), 5: _random_delta(algo, 4)},
    ]
    s1 = algo.aggregate(1, server, rounds[0], {})
    fresh = _algo(**opts)
    s2 = fresh.aggregate(2, wire.roundtrip(s1), rounds[1], {})
    _assert_matches(algo, s2, _torch_sgd_reference(algo, server, rounds, 0.05, 0.2, 0.9, 0.0, mean=True))
    no_momentum = {k: (torch.zeros_like(v) if k.startswith("mom.") else v) for k, v in s1.items()}
    restarted = fresh.aggregate(2, no_momentum, rounds[1], {})
    assert not torch.allclose(restarted["hn.trunk.0.weight"], s2["hn.trunk.0.weight"], atol=1e-6)


def test_a_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """Rounds 1–2, a checkpoint written and read back (server and client states), rounds 3–4 by a new algorithm
    object and executor: the same final server state, bit for bit, as four rounds straight."""
    torch.set_num_threads(1)
    cfg = validate_config({**TINY, "algorithm": {"name": "pfedhn", "hidden": 8, "local_steps": 5}})

    def rounds(algo, executor, server, first, stop):
        for r in Driver(algo, executor).rounds(server, first):
            server = r.server
            if r.rnd == stop:
                break
        return server

    algo = prepare(cfg)
    straight = rounds(algo, LoopExecutor(algo), algo.init_server(), 1, 4)
    first = prepare(cfg)
    ex1 = LoopExecutor(first)
    mid = rounds(first, ex1, first.init_server(), 1, 2)
    save_checkpoint(tmp_path, 2, mid, ex1.states, [], {})
    saved = load_checkpoint(tmp_path)
    second = prepare(cfg)
    ex2 = LoopExecutor(second)
    ex2.states = saved["clients"]
    resumed = rounds(second, ex2, saved["server"], 3, 4)
    assert same_tensors(resumed, straight)
    assert not same_tensors(mid, straight)


# --- evaluation and new clients ------------------------------------------------------------------------------------
def test_personal_model_is_the_generated_model_of_the_clients_current_embedding_and_there_is_no_generic_model():
    algo = _algo()
    server = algo.aggregate(1, _moved(algo), {0: _random_delta(algo, 0)}, {0: 1.0})
    assert algo.generic_model(server) is None
    for c in algo.ctx.federation.participated:  # client 0 moved; the others keep their initial embeddings
        want = _hand_theta(algo, _phi(server), server["emb"][_row(algo, c)])
        p = algo.personal_model(server, algo.init_client(c))
        assert all(torch.allclose(p.params[k], want[k], atol=1e-6) for k in want)


def _new_client_algo(**options):
    return _algo(federation={"new_clients": 2}, **options)


def _hand_embedding_phase(algo, server, data, epochs, lr, momentum, bs, seed, v0):
    """SGD on v alone (φ fixed) on the client's cross-entropy of h(v; φ), one permutation per epoch: v per epoch."""
    g = torch.Generator().manual_seed(seed)
    phi = _phi(server)
    v = v0.clone().requires_grad_()
    buf, out = None, []
    algo.ctx.model.train()
    for _ in range(epochs):
        for b in data.train[torch.randperm(data.num_train, generator=g)].split(bs):
            logits = functional_call(algo.ctx.model, _hand_theta(algo, phi, v), (data.x[b],))
            (gv,) = torch.autograd.grad(F.cross_entropy(logits, data.y[b]), [v])
            with torch.no_grad():
                buf = gv if buf is None else momentum * buf + gv
                v -= lr * buf
        out.append(v.detach().clone())
    return out


@pytest.mark.parametrize("init", ["mean", "random"])
def test_a_new_client_learns_only_its_embedding_with_the_hypernetwork_frozen(init):
    """§5.3: from the start embedding (mean of the participated ones, or a fresh draw), SGD on v only; φ and every
    other server tensor are untouched bit for bit; each epoch's model is h(v_e; φ); ft and lp are the same
    procedure here; zero-shot is h(v_0; φ)."""
    algo = _new_client_algo(new_embedding_init=init)
    server = _moved(algo)
    before = {k: v.clone() for k, v in server.items()}
    c = algo.ctx.federation.new[0]
    data = algo.ctx.client_data(c)
    fresh = rng.generator(algo.ctx.seed, STREAM, 2, c)
    v0 = server["emb"].mean(0) if init == "mean" else torch.randn(algo.embed_dim, generator=fresh)
    zero = algo.zero_shot(server, data).params
    assert all(torch.allclose(zero[k], t, atol=1e-6) for k, t in _hand_theta(algo, _phi(server), v0).items())
    budget = Budget("ft", 3, 0.5, 8, momentum=0.5)
    models = list(algo.personalize(server, data, budget, torch.Generator().manual_seed(7)))
    assert same_tensors(server, before)
    vs = _hand_embedding_phase(algo, server, data, 3, 0.5, 0.5, 8, 7, v0)
    assert len(models) == 3
    for p, v in zip(models, vs, strict=True):
        want = _hand_theta(algo, _phi(server), v)
        assert set(p.params) == set(want) and all(torch.allclose(p.params[k], want[k], atol=1e-5) for k in want)
    assert not torch.allclose(vs[-1], v0, atol=1e-3)
    lp = list(algo.personalize(server, data, Budget("lp", 3, 0.5, 8, momentum=0.5), torch.Generator().manual_seed(7)))
    assert all(same_tensors(a.params, b.params) for a, b in zip(lp, models, strict=True))


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_embedding_then_tune_fine_tunes_from_the_learned_embeddings_model(method):
    """`embedding+tune` (pFedHN+FT / +LP): the embedding phase (`new_embed_epochs`, not reported), then
    `finetune_epochs` with `budget.method` from h(v*; φ) — lp moves only the head — one model per tuning epoch.
    `new_embed_epochs` (3) counts the embedding phase of `embedding+tune` only: plain `embedding` ignores it."""
    algo = _new_client_algo(new_client="embedding+tune", new_embed_epochs=3, new_embed_lr=0.5)
    plain = _new_client_algo(new_embed_lr=0.5, new_embed_epochs=1)
    server = _moved(algo)
    before = {k: v.clone() for k, v in server.items()}
    data = algo.ctx.client_data(algo.ctx.federation.new[1])
    budget = Budget(method, 2, 0.05, 8)
    models = list(algo.personalize(server, data, budget, torch.Generator().manual_seed(3)))
    assert same_tensors(server, before) and len(models) == 2
    g = torch.Generator().manual_seed(3)
    start = last(plain.personalize(server, data, Budget(method, 3, 0.05, 8), g)).params
    ref = [p.params for p in finetune_epochs(plain.ctx.model, dict(start), data, budget, g)]
    assert all(same_tensors(a.params, b) for a, b in zip(models, ref, strict=True))
    changed = {k for k in start if not torch.equal(models[-1].params[k], start[k])}
    assert changed == ({"blocks.classifier.weight", "blocks.classifier.bias"} if method == "lp" else set(start))
    zero = algo.zero_shot(server, data).params
    assert any(not torch.equal(zero[k], start[k]) for k in zero)  # the embedding phase ran


def test_local_update_and_personalization_draw_randomness_from_the_given_generator_only():
    algo = _new_client_algo(local_steps=4)
    server = _moved(algo)
    c, n = algo.ctx.federation.participated[0], algo.ctx.federation.new[0]

    def both(seed, global_seed):
        torch.manual_seed(global_seed)
        payload = algo.configure(1, server, [c])[c]
        cctx = ClientContext(1, c, torch.Generator().manual_seed(seed))
        reply, _ = algo.client_update(payload, algo.init_client(c), algo.ctx.client_data(c), cctx)
        new = algo.ctx.client_data(n)
        p = last(algo.personalize(server, new, Budget("ft", 2, 0.3, 4), torch.Generator().manual_seed(seed)))
        return {**reply, **{"new." + k: v for k, v in p.params.items()}}

    a, b, other = both(1, 0), both(1, 99), both(2, 0)
    assert same_tensors(a, b) and not same_tensors(a, other)


# --- end to end ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def e2e():
    torch.set_num_threads(1)
    algorithm = {"name": "pfedhn", "hidden": 16, "local_steps": 10, "hn_lr": 0.05}
    train = {**WITH_NEW["train"], "rounds": 8}
    ev = {**WITH_NEW["eval"], "finetune": ["ft", "lp"]}  # asked for, never run: no generic model
    return pflbed.run({**WITH_NEW, "train": train, "eval": ev, "algorithm": algorithm}, write=False, progress=False)


def test_pfedhn_learns_end_to_end_in_strict_mode_and_reports_new_clients(e2e):
    """The generated personal models beat the initial hypernetwork's (P-FL), G-FL is absent (and with it the
    participated clients' `eval.finetune` rows), and the new-client protocol reports zero-shot and per-size
    figures."""
    f = e2e.summary["final"]
    assert f["gfl_acc"] is None and f["pfl_acc"] > 0.3  # 10 classes: chance 0.1
    assert "ft" not in f and "lp" not in f
    algo = e2e.executor.algo
    src, fed = algo.ctx.source.train, algo.ctx.federation

    def mean_acc(server):  # each participated client's generated model on its own test split
        accs = []
        for c in fed.participated:
            idx = fed.clients[c].test
            logits = algo.personal_model(server, e2e.executor.state(c)).logits(src.x[idx])
            accs.append((logits.argmax(1) == src.y[idx]).float().mean())
        return float(sum(accs) / len(accs))

    assert mean_acc(e2e.server) > mean_acc(algo.init_server()) + 0.1
    assert f["diag"]["hypernet_params"] == algo.num_hyper_params() and f["diag"]["embed_dim"] == 2
    nc = e2e.summary["new_clients"]
    assert nc["clients"] == 2 and nc["zero_shot"]["acc"] > 0.1
    assert set(nc["methods"]["ft"]) == {"S", "M"}
    buf = io.BytesIO()
    torch.save(e2e.server, buf)  # the whole server state is plain tensors
    assert all(isinstance(v, torch.Tensor) for v in e2e.server.values())


def test_diagnostics_report_the_mean_distance_of_the_embeddings_to_their_mean():
    algo = _algo()
    server = algo.init_server()
    server[EMB] = torch.zeros_like(server[EMB])
    server[EMB][:, 0] = 1.0
    server[EMB][0, 0], server[EMB][1, 0] = 4.5, -2.5  # column means (1, 0, …): distances 3.5, 3.5, 0, …
    d = algo.diagnostics(1, server, lambda c: {})
    n = len(server[EMB])
    assert n == 6 and d["emb_spread"] == round(7.0 / 6, 6) and d["embed_dim"] == server[EMB].shape[1] > 1
