"""The algorithm contract, exercised by toy algorithms through the real engine."""

import pytest
import torch

import pflbed
from pflbed.algorithms import ALGORITHMS, register
from pflbed.algorithms.base import Algorithm, Predictor

from ..tiny import TINY as TINY_BASE

TINY = {**TINY_BASE, "train": {**TINY_BASE["train"], "rounds": 3}, "eval": {"every": 1, "finetune": []}}


class CountingAlgo(Algorithm):
    """Server state is a counter; each client replies with its id and counts its own visits in its state."""

    name = "toy-counting"

    def init_server(self):
        return {"total": torch.zeros(())}

    def init_client(self, cid):
        return {"visits": torch.zeros((), dtype=torch.int64)}

    def configure(self, rnd, server, cids):
        return {c: {"rnd": torch.tensor(rnd), "total": server["total"]} for c in cids}

    def client_update(self, payload, state, data, cctx):
        assert int(payload["rnd"]) == cctx.rnd
        noise = torch.rand((), generator=cctx.generator)
        return {"cid": torch.tensor(float(data.cid)), "noise": noise}, {"visits": state["visits"] + 1}

    def aggregate(self, rnd, server, replies, weights):
        self.seen = getattr(self, "seen", []) + [(rnd, sorted(replies), dict(weights))]
        self.noise = {c: float(r["noise"]) for c, r in replies.items()}
        return {"total": server["total"] + sum(r["cid"] for r in replies.values())}

    def personal_model(self, server, state):
        return Predictor(self.ctx.model, self.ctx.initial_params)

    def diagnostics(self, rnd, server, state_of):
        return {
            "total": float(server["total"]),
            "visits0": int(state_of(self.ctx.federation.participated[0])["visits"]),
        }

    def artifacts(self, server, state_of, out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "total.txt").write_text(str(float(server["total"])))
        return {"total": "total.txt"}


class LeakyAlgo(CountingAlgo):
    """Returns a Python object in its reply: must fail in strict mode."""

    name = "toy-leaky"

    def client_update(self, payload, state, data, cctx):
        return {"obj": object()}, state


@pytest.fixture(autouse=True)
def _registered():
    for cls in (CountingAlgo, LeakyAlgo):
        register(cls)
    yield
    for cls in (CountingAlgo, LeakyAlgo):
        ALGORITHMS.pop(cls.name, None)


def test_engine_drives_the_contract():
    from pflbed.federation import sample_clients

    res = pflbed.run({**TINY, "algorithm": {"name": "toy-counting"}}, write=False)
    algo = res.executor.algo
    fed = algo.ctx.federation
    expected = [(r, sample_clients(0, r, fed.participated, 0.5)) for r in (1, 2, 3)]
    assert [(r, c) for r, c, _ in algo.seen] == expected
    for _, cids, weights in algo.seen:  # aggregation weights are |D_m|
        assert weights == {c: fed.num_train(c) for c in cids}
    assert float(res.server["total"]) == sum(sum(c) for _, c in expected)
    visits = {c: int(s["visits"]) for c, s in res.executor.states.items()}
    for c in fed.participated:
        assert visits.get(c, 0) == sum(c in cids for _, cids in expected)
    assert len(res.history) == 3 and res.summary["final"]["gfl_acc"] is None


def test_client_randomness_depends_only_on_seed_round_client():
    a = pflbed.run({**TINY, "algorithm": {"name": "toy-counting"}}, write=False).executor.algo.noise
    b = pflbed.run(
        {**TINY, "algorithm": {"name": "toy-counting"}, "executor": {"strict": False}}, write=False
    ).executor.algo.noise
    assert a == b


def test_strict_mode_rejects_what_cannot_cross_the_wire():
    with pytest.raises(TypeError, match=r"^a payload, reply or client state must be a dict\[str, Tensor\]$"):
        pflbed.run({**TINY, "algorithm": {"name": "toy-leaky"}}, write=False)


def test_diagnostics_are_logged_and_artifacts_written(tmp_path):
    import json

    res = pflbed.run({**TINY, "algorithm": {"name": "toy-counting"}}, out=tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["diag"]["total"] for x in lines] == [h["diag"]["total"] for h in res.history]
    assert lines[-1]["diag"]["total"] == float(res.server["total"])
    assert res.summary["artifacts"] == {"total": "plots/total.txt"}
    assert (tmp_path / "run" / "plots" / "total.txt").read_text() == str(float(res.server["total"]))


# --- the registry's discovery (`pflbed.algorithms._discover`) ------------------------------------------------------
# shared pieces, no algorithm
HELPER_MODULES = {"base", "common", "training", "partial", "basis", "basis_plots", "distill", "masks",
                  "local_sgd", "server_extras", "reply_shapes", "sgd"}


def _rediscover(monkeypatch, shared=None, extra_dir=None):
    """Run the registry's discovery again into an empty registry (restored afterwards) and return what it found."""
    import sys

    import pflbed.algorithms as registry

    monkeypatch.setattr(registry, "ALGORITHMS", {})
    if shared is not None:
        monkeypatch.setattr(registry, "_SHARED", shared)
    if extra_dir is not None:
        monkeypatch.setattr(registry, "__path__", [*registry.__path__, str(extra_dir)])
        for p in extra_dir.glob("*.py"):
            monkeypatch.delitem(sys.modules, f"pflbed.algorithms.{p.stem}", raising=False)
    try:
        registry._discover()
    finally:
        if extra_dir is not None:  # the temporary modules must not outlive the test
            for p in extra_dir.glob("*.py"):
                sys.modules.pop(f"pflbed.algorithms.{p.stem}", None)
    return registry.ALGORITHMS


def test_registry_discovers_exactly_the_algorithm_modules(monkeypatch):
    """Adding an algorithm is adding one file: every module of the package except the shared helpers registers its
    one `Algorithm` subclass, under its `name` (= the module's name), as the class defined in that module — not a
    class it imports (fedrod_hyper imports FedRoD) and not the helper modules."""
    from pathlib import Path

    import pflbed.algorithms as registry

    found = _rediscover(monkeypatch)
    files = {p.stem for p in Path(registry.__file__).parent.glob("*.py")} - {"__init__"}
    assert set(found) == files - HELPER_MODULES and len(found) == 41
    for name, cls in found.items():
        assert issubclass(cls, Algorithm) and cls.name == name and cls.__module__ == f"pflbed.algorithms.{name}"
    assert found["fedrod_hyper"] is not found["fedrod"]


def test_registry_skips_shared_and_private_modules(monkeypatch, tmp_path):
    """Modules named in `_SHARED` and modules starting with `_` are never imported as algorithms; a subclass that
    does not set its own `name` is not registered (it would shadow its parent's entry)."""
    (tmp_path / "_private_algo.py").write_text(
        "from pflbed.algorithms.fedavg import FedAvg\n\nclass Hidden(FedAvg):\n    name = 'toy-private'\n"
    )
    (tmp_path / "zz_toy_algo.py").write_text(
        "from pflbed.algorithms.fedavg import FedAvg\n\n"
        "class Visible(FedAvg):\n    name = 'toy-visible'\n\nclass Unnamed(FedAvg):\n    pass\n"
    )
    found = _rediscover(monkeypatch, extra_dir=tmp_path)
    assert "toy-visible" in found and found["toy-visible"].__module__ == "pflbed.algorithms.zz_toy_algo"
    assert "toy-private" not in found
    assert found["fedavg"].__module__ == "pflbed.algorithms.fedavg"  # not the unnamed subclass
    import pflbed.algorithms as registry

    found = _rediscover(monkeypatch, shared={*registry._SHARED, "fedavg"})
    assert "fedavg" not in found and "fedbn" in found


def test_unknown_algorithm_is_a_config_error_listing_the_known_names():
    """get_algorithm: a registered name gives its class; an unknown one is a ConfigError naming the config key and
    every known algorithm, sorted, so the user sees the valid choices."""
    import pflbed.algorithms as registry
    from pflbed.errors import ConfigError

    assert registry.get_algorithm("fedavg") is ALGORITHMS["fedavg"]
    with pytest.raises(ConfigError) as err:
        registry.get_algorithm("nope")
    known = sorted(ALGORITHMS)
    assert "fedavg" in known and "toy-counting" in known  # toy algorithms registered by the fixture count too
    assert str(err.value) == f"algorithm.name: unknown algorithm 'nope'; known: {', '.join(known)}"


BN_ROUND_OPTIONS = {
    "fedbasis": {"K": 2},  # one warm-up round trains 3 clients
    "pfedme": {"beta": 0.5},  # β = 1 returns the mean itself, skipping the mixing rule
    "scaffold": {"server_lr": 2.0},  # η_g = 1 skips the extrapolation
}


@pytest.mark.parametrize("name", sorted(n for n in ALGORITHMS if not n.startswith("toy-")))
def test_every_algorithm_keeps_each_entrys_type_through_a_round_on_a_batchnorm_model(name):
    """BatchNorm's counters are integers: a server rule or a client update that treats every entry as a parameter
    (averaging, extrapolating or mixing it) turns them into floats, or fails on them. One round of each
    algorithm on `cnn_bn`: every server and client-state entry keeps its initial dtype and shape."""
    from ..tiny import parity_config

    cfg = parity_config(name, {"threads": 1}, evaluation={"every": 100}, rounds=1).model_dump(mode="json")
    cfg["model"] = {"name": "cnn_bn"}
    cfg["algorithm"].update(BN_ROUND_OPTIONS.get(name, {}))
    r = pflbed.run(cfg, write=False, progress=False)
    algo = r.executor.algo

    def kinds(tensors):
        return {k: (v.dtype, v.shape) for k, v in tensors.items()}

    before = kinds(algo.init_server())
    after = kinds(r.server)
    assert {k: after[k] for k in before if k in after} == {k: before[k] for k in after if k in before}
    for c, state in r.executor.states.items():
        first = kinds(algo.init_client(c))
        assert {k: v for k, v in kinds(state).items() if k in first} == {k: first[k] for k in state if k in first}
