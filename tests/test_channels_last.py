"""`model.channels_last`: conv weights stored NHWC, every model and every algorithm still runs, same numbers."""

import pytest
import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.config import validate_config
from pflbed.engine.loop import prepare, run
from pflbed.models import MODELS, build_model

from .tiny import TINY

CL = torch.channels_last
LIGHT = {"architectures": ["lenet5", "mlp"], "server_steps": 3}


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


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_runs_channels_last_and_agrees_with_nchw(name):
    """The run's models (the shared one and per-architecture ones) are NHWC, and a tiny run on a conv model gives
    the NCHW run's figures up to rounding."""
    fields = ALGORITHMS[name].Config.model_fields
    options = {k: v for k, v in LIGHT.items() if k in fields}
    summaries = {}
    for layout in (False, True):
        model = {"name": "lenet5", "channels_last": layout}
        cfg = validate_config({**TINY, "dataset": {"name": "digits"}, "model": model,
                               "federation": {**TINY["federation"], "public": 64, "sample_fraction": 1.0},
                               "train": {**TINY["train"], "rounds": 2},
                               "algorithm": {"name": name, **options}, "executor": {"threads": 1}})  # fmt: skip
        if layout:
            ctx = prepare(cfg).ctx
            assert all(w.is_contiguous(memory_format=CL) for w in _conv_weights(ctx.model.state_dict()))
            assert all(w.is_contiguous(memory_format=CL) for w in _conv_weights(ctx.new_model("lenet5").state_dict()))
        summaries[layout] = run(cfg, write=False, progress=False).summary["final"]
    assert summaries[True]["pfl_acc"] == pytest.approx(summaries[False]["pfl_acc"], abs=0.05)
