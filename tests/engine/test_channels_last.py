"""`model.channels_last`: conv weights stored NHWC, every model and every algorithm still runs, same numbers."""

import pytest
import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.models import MODELS, build_model
from pflbed.results.experiment import run

from ..tiny import TINY

CL = torch.channels_last
LIGHT = {"architectures": ["lenet5", "mlp"], "server_steps": 3}


def _max_gap(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _conv_weights(params):
    return [v for v in params.values() if v.dim() == 4]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_builds_channels_last_with_the_same_initial_weights(name):
    torch.manual_seed(3)
    plain = build_model(name, (1, 8, 8), 10)
    torch.manual_seed(3)
    nhwc = build_model(name, (1, 8, 8), 10, channels_last=True)
    a, b = plain.state_dict(), nhwc.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same numbers, only the layout differs
    assert all(w.is_contiguous(memory_format=CL) for w in _conv_weights(b))
    x = torch.randn(3, 1, 8, 8)
    plain.eval(), nhwc.eval()
    assert torch.allclose(plain(x), nhwc(x), atol=1e-5)


def test_the_runs_models_are_channels_last_and_a_run_agrees_with_nchw():
    """The shared model and models built per architecture (KT-pFL: `Context.new_model`) are NHWC; a tiny FedAvg
    run gives the NCHW run's figures up to rounding. """
    tree = {**TINY, "dataset": {"name": "digits"}, "federation": {**TINY["federation"], "public": 64},
            "executor": {"threads": 1}}  # fmt: skip
    ktpfl = prepare(validate_config({**tree, "model": {"name": "mlp", "channels_last": True},
                                     "algorithm": {"name": "ktpfl", "architectures": ["mlp", "lenet5"]}}))  # fmt: skip
    assert all(w.is_contiguous(memory_format=CL) for w in _conv_weights(ktpfl.models["lenet5"].state_dict()))
    finals = {}
    for layout in (False, True):
        cfg = validate_config({**tree, "model": {"name": "lenet5", "channels_last": layout},
                               "algorithm": {"name": "fedavg"}})  # fmt: skip
        if layout:
            assert all(w.is_contiguous(memory_format=CL) for w in _conv_weights(prepare(cfg).ctx.model.state_dict()))
        finals[layout] = run(cfg, write=False, progress=False).summary["final"]
    assert finals[True]["pfl_acc"] == pytest.approx(finals[False]["pfl_acc"], abs=0.02)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_runs_channels_last(name):
    """No algorithm assumes contiguous NCHW parameters (a `.view` on a conv weight would raise here)."""
    options = {k: v for k, v in LIGHT.items() if k in ALGORITHMS[name].Config.model_fields}
    cfg = validate_config({**TINY, "dataset": {"name": "digits"}, "model": {"name": "lenet5", "channels_last": True},
                           "federation": {**TINY["federation"], "public": 64, "sample_fraction": 1.0},
                           "train": {**TINY["train"], "rounds": 1}, "eval": {"every": 1, "finetune": ["lp"]},
                           "algorithm": {"name": name, **options}, "executor": {"threads": 1}})  # fmt: skip
    assert 0.0 <= run(cfg, write=False, progress=False).summary["final"]["pfl_acc"] <= 1.0


def test_batched_clients_keep_each_clients_weights_channels_last():
    """`model.channels_last` holds for a round's clients batched together (`engine.batched`): each client's
    convolution weights stay NHWC through its steps and come back so — what `benchmarks/gpu.py`'s `-nhwc` cases
    measure — and the round equals the NCHW round's up to rounding."""
    from dataclasses import replace

    from pflbed.algorithms.base import ClientContext
    from pflbed.engine.batched import train_together
    from pflbed.engine.executor import client_generator

    torch.set_num_threads(1)
    trained = {}
    for layout, own in ((False, False), (True, False), (True, True)):  # `own`: each client its own start tensors
        cfg = validate_config({**TINY, "dataset": {"name": "digits"},
                               "model": {"name": "lenet5", "channels_last": layout},
                               "algorithm": {"name": "fedavg"}, "executor": {"threads": 1}})  # fmt: skip
        algo = prepare(cfg)
        ctx, cids = algo.ctx, sorted(algo.ctx.federation.participated)[:3]
        payloads = algo.configure(1, algo.init_server(), cids)
        plans = [algo.round_plan(payloads[c], algo.init_client(c), ctx.client_data(c),
                                 ClientContext(1, c, client_generator(cfg.seed, 1, c))) for c in cids]  # fmt: skip
        plans = [replace(p, start={k: v.clone() for k, v in p.start.items()}) for p in plans] if own else plans
        trained[layout, own] = train_together(ctx.model, plans, [ctx.client_data(c) for c in cids], cfg.train,
                                         [client_generator(cfg.seed, 1, c) for c in cids])  # fmt: skip
    for nchw, nhwc, own in zip(trained[False, False], trained[True, False], trained[True, True], strict=True):
        assert _conv_weights(nhwc) and all(w.is_contiguous(memory_format=CL) for w in _conv_weights(nhwc))
        assert all(w.is_contiguous(memory_format=CL) for w in _conv_weights(own)) and _max_gap(own, nhwc) == 0
        assert not any(w.is_contiguous(memory_format=CL) for w in _conv_weights(nchw) if w.shape[1] > 1)  # (one
        # input channel: both layouts at once)
        assert all(torch.allclose(nchw[k], nhwc[k], atol=1e-5) for k in nchw)
