"""Per-FedAvg (Fallah et al., NeurIPS 2020, Alg. 1): each local step takes the gradient at the *adapted* model
w̃ = w − α∇f(w; D) on a fresh batch D' (FO), times (I − α∇²f(w; D'')) for HF; a client's model is the meta-model
after α-steps on its own data."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from pflbed import rng
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.perfedavg import PERSONAL_STREAM, PerFedAvg
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.results.experiment import run

from ..tiny import TINY, figures, same_tensors

ALPHA = 0.03
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func


def _algo(variant, **tree):
    cfg = validate_config({**TINY, "algorithm": {"name": "perfedavg", "variant": variant, "alpha": ALPHA},
                           "executor": {"threads": 1}, **tree})  # fmt: skip
    return prepare(cfg)


def _loss(model, params, buffers, x, y):
    return F.cross_entropy(functional_call(model, {**buffers, **params}, (x,)), y)


def _reference(algo, server, data, seed, variant):
    """Algorithm 1's local loop, written with torch.func (a separate path from the implementation's)."""
    model, t = algo.ctx.model, algo.ctx.cfg.train
    model.train()
    names = [k for k, _ in model.named_parameters()]
    buffers = {k: v.clone() for k, v in server.items() if k not in names}
    w = {k: server[k].clone() for k in names}
    batches = index_batches(data.train, t.batch_size, 10**9, torch.Generator().manual_seed(seed))
    grad = torch.func.grad(lambda p, x, y: _loss(model, p, buffers, x, y))
    for _ in range(t.local_epochs * math.ceil(data.num_train / t.batch_size)):
        d, d2 = next(batches), next(batches)
        g = grad(w, data.x[d], data.y[d])
        adapted = {k: w[k] - ALPHA * g[k] for k in names}
        outer = grad(adapted, data.x[d2], data.y[d2])
        if variant == "hf":
            d3 = next(batches)
            _, hv = torch.func.jvp(lambda p, d3=d3: grad(p, data.x[d3], data.y[d3]), (w,), (outer,))
            outer = {k: outer[k] - ALPHA * hv[k] for k in names}
        w = {k: w[k] - t.lr * outer[k] for k in names}
    return w


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_local_steps_take_the_gradient_at_the_adapted_model(variant):
    """FO: ∇f(w̃; D'); HF: the same times (I − α∇²f(w; D'')) — each equal to the torch.func reference."""
    algo = _algo(variant)
    server, data = algo.init_server(), algo.ctx.client_data(0)
    cctx = ClientContext(1, 0, torch.Generator().manual_seed(2))
    reply, _ = algo.client_update(server, algo.init_client(0), data, cctx)
    ref = _reference(algo, server, data, 2, variant)
    assert all(torch.allclose(reply[k], ref[k], atol=1e-5) for k in ref)
    if variant == "hf":
        fo = _reference(algo, server, data, 2, "fo")
        assert not all(torch.allclose(ref[k], fo[k], atol=1e-5) for k in ref)  # the correction matters here


def test_a_clients_model_is_one_alpha_step_on_its_data_from_the_meta_model():
    algo = _algo("fo")
    server = algo.init_server()
    data = algo.ctx.client_data(3)
    pred = algo.personal_model(server, algo.init_client(3))
    model = algo.ctx.model
    names = [k for k, _ in model.named_parameters()]
    buffers = {k: v for k, v in server.items() if k not in names}
    w = {k: server[k] for k in names}
    g = torch.func.grad(lambda p: _loss(model, p, buffers, data.x[data.train], data.y[data.train]))(w)
    assert all(torch.allclose(pred.params[k], w[k] - ALPHA * g[k], atol=1e-6) for k in names)


@pytest.mark.parametrize("model", ["alexnet_small_x025", "lenet5_bn"])
def test_procs_equals_loop_bit_for_bit_on_models_with_dropout_and_batchnorm(model, pool, monkeypatch):
    """The personal model's α-step runs in train mode: dropout draws masks (alexnet_small_x025), BatchNorm
    normalizes with the client's batch statistics and moves its running ones (lenet5_bn). In `loop` torch's global
    RNG holds whatever the last client update left, in `procs` the parent's never moves: only masks drawn from the
    step's own (seed, client) stream give both executors the same personal models — compared here parameter for
    parameter, every one the evaluations scored (the accuracies of this tiny run hardly move with a mask)."""
    torch.set_num_threads(1)
    scored = []
    real = PerFedAvg.adapted
    monkeypatch.setattr(PerFedAvg, "adapted", lambda self, s, d: scored.append(real(self, s, d)) or scored[-1])
    tree = {**TINY, "model": {"name": model}, "train": {**TINY["train"], "rounds": 2},
            "algorithm": {"name": "perfedavg"}, "eval": {**TINY["eval"], "every": 1}}  # fmt: skip
    loop = run(validate_config({**tree, "executor": {"strict": True, "threads": 1}}), write=False, progress=False)
    in_loop, scored[:] = list(scored), []
    procs_cfg = {**tree, "executor": {"name": "procs", "workers": 2, "strict": True, "threads": 1}}
    procs = run(validate_config(procs_cfg), write=False, progress=False, pool=pool)
    assert figures(procs.summary) == figures(loop.summary)
    assert same_tensors(procs.server, loop.server)
    assert len(scored) == len(in_loop) == 2 * len(loop.executor.algo.ctx.federation.participated)
    assert all(same_tensors(a, b) for a, b in zip(scored, in_loop, strict=True))


def _one_step_by_hand(algo, server, data, seed=None):
    """One full-batch α-step in train mode on a copy of the model, torch's global RNG seeded with `seed` first."""
    model = copy.deepcopy(algo.ctx.model)
    load_params(model, server)
    model.train()
    if seed is not None:
        torch.manual_seed(seed)
    named = dict(model.named_parameters())
    loss = F.cross_entropy(model(data.x[data.train]), data.y[data.train])
    grads = dict(zip(named, torch.autograd.grad(loss, list(named.values())), strict=True))
    with torch.no_grad():
        for k, p in named.items():
            p.sub_(ALPHA * grads[k])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_personal_step_draws_its_dropout_masks_from_seed_and_client_alone():
    """alexnet_small_x025 has dropout: the α-step's masks come from torch's global RNG seeded from (seed, stream,
    client id) — the same personal model under any state of the global RNG, which is left as it was — and the
    step is a train-mode one (masks drawn), not an eval-mode one."""
    algo = _algo("fo", model={"name": "alexnet_small_x025"})
    server, state, data = algo.init_server(), algo.init_client(2), algo.ctx.client_data(2)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    first = algo.personal_model(server, state).params
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(2)
    assert same_tensors(algo.personal_model(server, state).params, first)
    by_hand = _one_step_by_hand(algo, server, data, rng.derive_seed(algo.ctx.seed, PERSONAL_STREAM, 2))
    assert all(torch.allclose(first[k], by_hand[k], atol=1e-6) for k in by_hand)
    other = _one_step_by_hand(algo, server, data, rng.derive_seed(algo.ctx.seed, PERSONAL_STREAM, 3))
    assert not all(torch.allclose(first[k], other[k], atol=1e-6) for k in other)  # the masks matter here


def test_the_personal_step_normalizes_with_the_clients_batch_and_moves_the_running_statistics():
    """lenet5_bn: train mode — the gradient through batch statistics of the client's training split, the running
    statistics one momentum step (0.1) toward them, the batch counted; the server state is not touched."""
    algo = _algo("fo", model={"name": "lenet5_bn"})
    server, data = algo.init_server(), algo.ctx.client_data(1)
    kept = {k: v.clone() for k, v in server.items()}
    got = algo.personal_model(server, algo.init_client(1)).params
    by_hand = _one_step_by_hand(algo, server, data)
    assert all(torch.allclose(got[k], by_hand[k], atol=1e-6) for k in by_hand)
    counters = [k for k in got if k.endswith("num_batches_tracked")]
    assert counters and all(int(got[k]) == int(server[k]) + 1 for k in counters)
    running = [k for k in got if k.endswith("running_mean")]
    assert running and all(not torch.allclose(got[k], server[k]) for k in running)
    assert same_tensors(server, kept)
