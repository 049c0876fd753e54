"""`executor.precision: bf16`: client training under autocast, the server's rules and the rounds' scoring in float32.

Runs on the CPU (autocast's bfloat16 works there too), so CI checks where the precision applies; what it buys in
speed is a GPU figure (benchmarks/gpu.py).
"""

import pytest
import torch
from torch import nn

from pflbed.algorithms import ALGORITHMS, fedas
from pflbed.algorithms.fedala import FedALA
from pflbed.algorithms.fedamp import FedAMP
from pflbed.config import validate_config
from pflbed.errors import ConfigError
from pflbed.results.experiment import run

from ..tiny import TINY


def _cfg(name="fedavg", precision="bf16", **executor):
    return validate_config({**TINY, "algorithm": {"name": name}, "train": {**TINY["train"], "rounds": 2},
                            "executor": {"threads": 1, "precision": precision, **executor}})  # fmt: skip


def _record_linear_dtypes(monkeypatch):
    """The dtype of every nn.Linear output, and whether autocast was on, in call order."""
    seen = []
    real = nn.Linear.forward

    def forward(self, x):
        out = real(self, x)
        seen.append((out.dtype, torch.is_autocast_enabled("cpu")))
        return out

    monkeypatch.setattr(nn.Linear, "forward", forward)
    return seen


@pytest.mark.parametrize("batch_clients", [False, True])
def test_bf16_trains_clients_in_bfloat16_and_keeps_everything_exchanged_in_float32(batch_clients, monkeypatch):
    from pflbed.engine import driver

    seen = _record_linear_dtypes(monkeypatch)
    in_eval = []
    real_eval = driver.Driver.evaluate

    def evaluate(self, *a, **kw):
        start = len(seen)
        out = real_eval(self, *a, **kw)
        in_eval.extend(seen[start:])
        return out

    monkeypatch.setattr(driver.Driver, "evaluate", evaluate)
    r = run(_cfg(batch_clients=batch_clients), write=False, progress=False)
    assert any(dt == torch.bfloat16 and on for dt, on in seen), "no forward ran in bfloat16"
    assert in_eval and all(dt == torch.float32 and not on for dt, on in in_eval)  # the rounds' scoring: float32
    assert all(v.dtype == torch.float32 for v in r.server.values() if v.is_floating_point())
    states = [v for s in r.executor.states.values() for v in s.values() if v.is_floating_point()]
    assert all(v.dtype == torch.float32 for v in states)


def test_fp32_runs_no_forward_in_bfloat16(monkeypatch):
    seen = _record_linear_dtypes(monkeypatch)
    run(_cfg(precision="fp32"), write=False, progress=False)
    assert seen and all(dt == torch.float32 and not on for dt, on in seen)


def test_the_server_rule_runs_outside_autocast(monkeypatch):
    """FedAMP's server forms its personalized models from a similarity matrix (matrix products): under autocast
    they would be rounded to bfloat16 every round. The rule must see autocast off, the client updates on."""
    flags = {"aggregate": [], "client": []}
    real_agg, real_update = FedAMP.aggregate, FedAMP.client_update

    def aggregate(self, *a, **kw):
        flags["aggregate"].append(torch.is_autocast_enabled("cpu"))
        return real_agg(self, *a, **kw)

    def client_update(self, *a, **kw):
        flags["client"].append(torch.is_autocast_enabled("cpu"))
        return real_update(self, *a, **kw)

    monkeypatch.setattr(FedAMP, "aggregate", aggregate)
    monkeypatch.setattr(FedAMP, "client_update", client_update)
    run(_cfg("fedamp"), write=False, progress=False)
    assert flags["client"] and all(flags["client"])
    assert flags["aggregate"] and not any(flags["aggregate"])


@pytest.mark.parametrize("batch_clients", [False, True])
def test_a_plans_finish_runs_under_autocast_batched_as_in_the_loop(batch_clients, together, monkeypatch):
    """A plan's `finish` is part of the client's update: FedAS's Fisher trace (like SCAFFOLD's option-I gradient
    and KT-pFL's soft predictions) runs its forwards there, under autocast in the loop, and so batched. Red with the
    batched executor calling `finish` outside `precision`."""
    flags, real = [], fedas.fisher_trace

    def fisher_trace(*a, **kw):
        flags.append(torch.is_autocast_enabled("cpu"))
        return real(*a, **kw)

    monkeypatch.setattr(fedas, "fisher_trace", fisher_trace)
    run(_cfg("fedas", batch_clients=batch_clients), write=False, progress=False)
    assert bool(together) == batch_clients  # the batched path ran where asked
    assert flags and all(flags)


@pytest.mark.parametrize("batch_clients", [False, True])
def test_a_plans_building_runs_under_autocast_batched_as_in_the_loop(batch_clients, together, monkeypatch):
    """Building a plan is part of the client's update too: FedALA learns its aggregation weights there (forwards
    of the model from the second round on), under autocast in the loop, and so batched. Red with the batched
    executor building the round's plans outside `precision`."""
    flags, real = [], FedALA.learn_weights

    def learn_weights(self, *a, **kw):
        flags.append(torch.is_autocast_enabled("cpu"))
        return real(self, *a, **kw)

    monkeypatch.setattr(FedALA, "learn_weights", learn_weights)
    run(_cfg("fedala", batch_clients=batch_clients), write=False, progress=False)
    assert bool(together) == batch_clients
    assert flags and all(flags)


def test_bf16_changes_results_and_fp32_is_the_default():
    assert validate_config({}).executor.precision == "fp32"
    a = run(_cfg(precision="fp32"), write=False, progress=False)
    b = run(_cfg(precision="bf16"), write=False, progress=False)
    assert any(not torch.equal(a.server[k], b.server[k]) for k in a.server)


def test_an_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^executor\.precision"):
        validate_config({"executor": {"precision": "fp16"}})


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_runs_in_bf16(name):
    """Each algorithm's own computations meet autocast's bfloat16 outputs (kNN-Per's datastore distances failed
    on a scatter of mixed dtypes before they were computed in float32)."""
    from .test_device import EVAL, FED, LIGHT

    options = {k: v for k, v in LIGHT.items() if k in ALGORITHMS[name].Config.model_fields}
    options.update({"K": 2} if name == "fedbasis" else {})  # two rounds: one warm-up round of 2 clients
    options.update({"hidden": 16, "hidden_layers": 1, "local_steps": 2} if name == "pfedhn" else {})  # default: 25 s
    executor = {"threads": 1, "precision": "bf16"}
    # the new-client protocol (ft and lp) on a one-epoch budget: its code paths, not the default 240 epochs
    cfg = validate_config({**TINY, "federation": FED, "eval": EVAL, "algorithm": {"name": name, **options},
                           "train": {**TINY["train"], "rounds": 2}, "executor": executor})  # fmt: skip
    r = run(cfg, write=False, progress=False)
    assert all(v.dtype != torch.bfloat16 for v in r.server.values())
