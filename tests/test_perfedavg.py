"""Per-FedAvg (Fallah et al., NeurIPS 2020, Alg. 1): each local step takes the gradient at the *adapted* model
w̃ = w − α∇f(w; D) on a fresh batch D' (FO), times (I − α∇²f(w; D'')) for HF; a client's model is the meta-model
after α-steps on its own data."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches
from pflbed.config import validate_config
from pflbed.engine.loop import prepare

from .tiny import TINY

ALPHA = 0.03
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func


def _algo(variant):
    cfg = validate_config({**TINY, "algorithm": {"name": "perfedavg", "variant": variant, "alpha": ALPHA},
                           "executor": {"threads": 1}})  # fmt: skip
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
