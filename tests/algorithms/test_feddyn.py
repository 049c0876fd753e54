"""FedDyn (Acar et al., ICLR 2021, Alg. 1): local SGD on L_k(θ) − ⟨g_k, θ⟩ + α/2‖θ − θ^{t−1}‖², then
g_k ← g_k − α(θ_k − θ^{t−1}); server h ← h − α(1/m)Σ(θ_k − θ^{t−1}), θ ← mean(θ_k) − h/α."""

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError

from ..tiny import TINY

A = 0.2


def _tree(momentum=0.0, weight_decay=0.0, **options):
    train = {**TINY["train"], "momentum": momentum, "weight_decay": weight_decay}
    return {**TINY, "train": train, "algorithm": {"name": "feddyn", "alpha": A, **options},
            "executor": {**TINY["executor"], "threads": 1}}  # fmt: skip


def _algo(momentum=0.0, weight_decay=0.0, **options):
    return prepare(validate_config(_tree(momentum, weight_decay, **options)))


def _noise(tensors, seed, scale=0.01):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g) for k, v in tensors.items()}


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.5, 0.01)])
def test_client_solves_the_dynamically_regularized_objective_and_updates_its_gradient(momentum, weight_decay):
    """The paper's plain SGD steps; `train.momentum` and `train.weight_decay` apply as in every local optimizer."""
    algo = _algo(momentum, weight_decay)
    model, t = algo.ctx.model, algo.ctx.cfg.train
    server, data = algo.init_server(), algo.ctx.client_data(0)
    theta0 = algo.model_part(server)
    g_k = _noise(algo.init_client(0), 1)
    reply, g_new = algo.client_update(theta0, g_k, data, ClientContext(1, 0, torch.Generator().manual_seed(3)))
    model.train()
    names = list(g_k)
    th = {k: theta0[k].clone() for k in names}
    buf: dict = {}
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(3)):
        load_params(model, th)
        params = dict(model.named_parameters())
        grads = torch.autograd.grad(F.cross_entropy(model(data.x[b]), data.y[b]), [params[k] for k in names])
        for k, g in zip(names, grads, strict=True):
            d = g - g_k[k] + A * (th[k] - theta0[k]) + weight_decay * th[k]
            buf[k] = momentum * buf[k] + d if k in buf else d
            th[k] = th[k] - t.lr * buf[k]
    assert all(torch.allclose(reply[k], th[k], atol=1e-6) for k in names)
    assert all(torch.allclose(g_new[k], g_k[k] - A * (reply[k] - theta0[k]), atol=1e-7) for k in names)


def test_server_updates_h_over_all_clients_and_corrects_the_uniform_mean():
    algo = _algo()
    server = algo.init_server()
    server = {**server, **{f"h/{k}": v for k, v in _noise(algo.init_client(0), 2).items()}}
    theta0 = algo.model_part(server)
    replies = {c: {k: v + _noise({k: v}, 10 + c, 0.1)[k] if v.is_floating_point() else v
                   for k, v in theta0.items()} for c in (1, 3)}  # fmt: skip
    agg = algo.aggregator(1, server, {1: 10.0, 3: 30.0})  # sizes do not weigh: Alg. 1 averages uniformly
    for c in (1, 3):
        agg.add(c, replies[c])
    out = agg.result()
    m = len(algo.ctx.federation.participated)
    for k in algo.params:
        mean = 0.5 * (replies[1][k] + replies[3][k])
        h = server[f"h/{k}"] - A / m * ((replies[1][k] - theta0[k]) + (replies[3][k] - theta0[k]))
        assert torch.allclose(out[f"h/{k}"], h, atol=1e-6)
        assert torch.allclose(out[k], mean - h / A, atol=1e-5)


def _aggregated(algo):
    """A server state with a nonzero h, and the round's two replies (uniform mean: the authors' scored model)."""
    server = algo.init_server()
    server.update({f"h/{k}": v for k, v in _noise(algo.init_client(0), 2).items()})
    theta0 = algo.model_part(server)
    replies = {c: {k: v + _noise({k: v}, 10 + c, 0.1)[k] if v.is_floating_point() else v
                   for k, v in theta0.items()} for c in (1, 3)}  # fmt: skip
    agg = algo.aggregator(1, server, {1: 10.0, 3: 30.0})
    for c in (1, 3):
        agg.add(c, replies[c])
    return agg.result(), {k: 0.5 * (replies[1][k] + replies[3][k]) for k in theta0}


@pytest.mark.parametrize("eval_model", ["cloud", "mean"])
def test_the_scored_model_is_the_cloud_model_or_the_mean_of_the_client_models(eval_model):
    """`cloud` (default): G-FL, P-FL, zero-shot and fine-tuning start from θ = mean − h/α, Alg. 1's model; `mean`:
    from the round's uniform mean of the replies, the authors' reported model. Either way the clients receive θ,
    and h and θ are the same."""
    cloud, mean_algo = _algo(), _algo(eval_model="mean")
    algo = mean_algo if eval_model == "mean" else cloud
    out, mean = _aggregated(algo)
    reference, _ = _aggregated(cloud)
    assert all(torch.equal(out[k], reference[k]) for k in reference)  # θ and h do not depend on the option
    scored = mean if eval_model == "mean" else algo.model_part(out)
    data = algo.ctx.client_data(2)
    algo.generic_model(algo.init_server())  # an earlier state scored first: no stale model for the new one
    for pred in (algo.generic_model(out), algo.personal_model(out, algo.init_client(2)), algo.zero_shot(out, data)):
        assert pred.params.keys() == scored.keys()
        assert all(torch.allclose(pred.params[k], scored[k], atol=1e-6) for k in scored)
    assert all(torch.equal(algo.configure(2, out, [2])[2][k], out[k]) for k in algo.model_keys)  # clients get θ
    assert not any(k.startswith("mean/") for k in reference)  # the default keeps no mean
    assert not all(torch.allclose(mean[k], reference[k], atol=1e-4) for k in algo.params)  # h ≠ 0: they differ


def test_the_mean_model_starts_as_the_initial_model_and_leaves_training_alone():
    """Before round 1 the scored mean is the initial model; a run scoring the mean trains exactly as one scoring
    the cloud model (same server θ and h, same client states), only the evaluated model differs."""
    algo = _algo(eval_model="mean")
    server = algo.init_server()
    assert all(torch.equal(algo.generic_model(server).params[k], v) for k, v in algo.ctx.initial_params.items())
    bn = prepare(validate_config({**_tree(eval_model="mean"), "model": {"name": "cnn_bn"}}))
    out, mean = _aggregated(bn)  # BatchNorm statistics: no h, no stored mean — θ's are the mean already
    scored = bn.generic_model(out).params
    assert scored.keys() == set(bn.model_keys) and set(bn.model_keys) > set(bn.params)
    assert all(torch.equal(scored[k], out[k]) and torch.allclose(out[k].double(), mean[k].double())
               for k in bn.model_keys if k not in bn.params)  # fmt: skip
    runs = {m: pflbed.run({**_tree(eval_model=m), "train": {**TINY["train"], "rounds": 2}}, write=False,
                          progress=False) for m in ("cloud", "mean")}  # fmt: skip
    cloud, mean = runs["cloud"], runs["mean"]
    assert all(torch.equal(mean.server[k], v) for k, v in cloud.server.items())
    assert set(mean.server) - set(cloud.server) == {f"mean/{k}" for k in algo.params}
    assert mean.summary["final"]["gfl_acc"] != cloud.summary["final"]["gfl_acc"]


def test_an_unknown_scored_model_is_a_config_error():
    with pytest.raises(ConfigError, match="algorithm.eval_model"):
        validate_config(_tree(eval_model="avg"))
