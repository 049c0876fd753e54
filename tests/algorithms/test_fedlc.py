"""FedLC (Zhang et al., ICML 2022): local SGD on the cross-entropy of the logits calibrated by the client's own class
counts, g_k = f_k − τ·n_k^(−1/4); FedAvg's aggregation; the global model predicts uncalibrated."""

import math

import pytest
import torch
import torch.nn.functional as F

from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.fedlc import CalibratedObjective, calibration
from pflbed.algorithms.fedrod import class_counts
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from ..tiny import TINY

SKEWED = {**TINY["federation"], "alpha": 0.1}  # most clients miss some classes


def _algo(**options):
    cfg = validate_config({**TINY, "federation": SKEWED, "algorithm": {"name": "fedlc", **options},
                           "train": {**TINY["train"], "local_epochs": 2, "momentum": 0.0},
                           "executor": {"threads": 1}})  # fmt: skip
    return prepare(cfg)


def _skewed_client(algo):
    """A client missing at least one class (so both the calibration and the removal act)."""
    for cid in algo.ctx.federation.participated:
        data = algo.ctx.client_data(cid)
        if (class_counts(data) == 0).any():
            return data
    raise AssertionError("no client misses a class")


def test_the_client_update_is_sgd_on_the_cross_entropy_of_the_calibrated_logits():
    """The reply equals SGD written out by hand on CE(f(x) − τ·n^(−1/4), y), n the client's own training counts."""
    tau = 0.7
    algo = _algo(tau=tau)
    server, data = algo.init_server(), _skewed_client(algo)
    reply, _ = algo.client_update(server, {}, data, ClientContext(1, 0, torch.Generator().manual_seed(5)))
    counts = torch.bincount(data.y[data.train], minlength=algo.ctx.federation.num_classes).double()
    shift = torch.where(counts > 0, tau * counts.clamp_min(1).pow(-0.25), torch.full_like(counts, math.inf)).float()
    model, t = algo.ctx.model, algo.ctx.cfg.train
    load_params(model, server)
    model.train()
    params = dict(model.named_parameters())
    w = {k: server[k].clone() for k in params}
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(5)):
        load_params(model, w)
        loss = F.cross_entropy(model(data.x[b]) - shift, data.y[b])
        grads = torch.autograd.grad(loss, list(params.values()))
        w = {k: w[k] - t.lr * g for (k, g), in zip(zip(params, grads, strict=True), strict=True)}
    assert all(torch.allclose(reply[k], w[k], atol=1e-6) for k in params)
    plain, _ = prepare(validate_config({**algo.ctx.cfg.model_dump(), "algorithm": {"name": "fedavg"}})).client_update(
        server, {}, data, ClientContext(1, 0, torch.Generator().manual_seed(5)))  # fmt: skip
    assert not all(torch.allclose(reply[k], plain[k]) for k in params)  # the calibration changed the update


def test_the_default_loss_is_the_paper_s_pairwise_margin_form():
    """CE of g equals log(1 + Σ_{y'≠y} exp(Δ_{y,y'} + f_{y'} − f_y)), Δ_{y,y'} = τ(n_y^(−1/4) − n_{y'}^(−1/4))."""
    torch.manual_seed(0)
    f, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 1, 0])
    n, tau = torch.tensor([5.0, 40.0, 2.0, 11.0]), 0.8
    c = tau * n.pow(-0.25)
    margin = [torch.log1p(sum(torch.exp(c[yi] - c[j] + f[i, j] - f[i, yi]) for j in range(4) if j != yi))
              for i, yi in enumerate(y.tolist())]  # fmt: skip
    ours = CalibratedObjective("all")
    model = _FixedLogits(f)
    assert torch.allclose(ours(model, {}, {"shift": c}, f, y, None), torch.stack(margin).mean(), atol=1e-6)


def test_the_printed_formula_leaves_the_true_class_out_of_the_denominator_and_is_unbounded():
    torch.manual_seed(1)
    f, y = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    c = torch.tensor([0.1, 0.4, 0.2])
    g = f - c
    want = torch.stack([torch.logsumexp(torch.cat([g[i, :k], g[i, k + 1 :]]), 0) - g[i, k]
                        for i, k in enumerate(y.tolist())]).mean()  # fmt: skip
    printed = CalibratedObjective("others")
    assert torch.allclose(printed(_FixedLogits(f), {}, {"shift": c}, f, y, None), want, atol=1e-6)
    big = f.clone()
    big[torch.arange(5), y] += 100.0
    assert printed(_FixedLogits(big), {}, {"shift": c}, big, y, None) < -90  # no lower bound
    assert CalibratedObjective("all")(_FixedLogits(big), {}, {"shift": c}, big, y, None) >= 0


def test_a_missing_class_is_removed_or_floored():
    counts = torch.tensor([16.0, 0.0, 1.0])
    assert torch.equal(calibration(counts, 2.0, "remove"), torch.tensor([1.0, math.inf, 2.0]))
    assert torch.allclose(calibration(counts, 2.0, "floor"), torch.tensor([1.0, 200.0, 2.0]))


def test_a_removed_class_gets_no_gradient_and_the_global_model_predicts_uncalibrated():
    algo = _algo(tau=1.0)
    server, data = algo.init_server(), _skewed_client(algo)
    reply, _ = algo.client_update(server, {}, data, ClientContext(1, 0, torch.Generator().manual_seed(2)))
    missing = (class_counts(data) == 0).nonzero().flatten()
    bias = [k for k in reply if k.endswith("bias")][-1]  # the classifier's
    assert torch.equal(reply[bias][missing], server[bias][missing])
    x = data.x[data.val[:8]] if data.val.numel() else data.x[data.train[:8]]
    load_params(algo.ctx.model, reply)
    algo.ctx.model.eval()
    with torch.no_grad():
        raw = algo.ctx.model(x)
    assert torch.allclose(algo.generic_model(reply).logits(x), raw)  # no calibration at prediction
    assert torch.allclose(algo.personal_model(reply, {}).logits(x), raw)


class _FixedLogits(torch.nn.Module):
    """A 'model' whose logits are its input: `CalibratedObjective` reads them through `model_forward`."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits


@pytest.fixture(autouse=True)
def _fixed_forward(monkeypatch):
    import pflbed.algorithms.fedlc as fedlc

    real = fedlc.model_forward
    monkeypatch.setattr(fedlc, "model_forward",
                        lambda model, params, x: x if isinstance(model, _FixedLogits) else real(model, params, x))
