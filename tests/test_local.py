import pytest
import torch

import pflbed
from pflbed.errors import ConfigError

from .tiny import TINY


def test_local_only_shares_nothing_and_trains_only_sampled_clients():
    res = pflbed.run({**TINY, "algorithm": {"name": "local"}}, write=False)
    algo, states = res.executor.algo, res.executor.states
    assert res.server == {}
    assert res.summary["final"]["gfl_acc"] is None and "ft" not in res.summary["final"]
    comm = res.summary["communication"]
    assert comm["up_bytes_per_round"] == comm["down_bytes_per_round"] == 0
    from pflbed.federation import sample_clients

    trained = {c for r in range(1, 5) for c in sample_clients(0, r, algo.ctx.federation.participated, 0.5)}
    for c in algo.ctx.federation.participated:
        moved = any(not torch.equal(states[c][k], algo.ctx.initial_params[k]) for k in states[c])
        assert moved == (c in trained)


def test_local_only_state_equals_plain_sgd_on_own_data():
    cfg = {**TINY, "train": {**TINY["train"], "rounds": 1}}
    res = pflbed.run({**cfg, "algorithm": {"name": "local"}}, write=False)
    algo = res.executor.algo
    c = next(iter(res.executor.states))
    from pflbed.algorithms.base import ClientContext
    from pflbed.engine import rng

    gen = torch.Generator().manual_seed(rng.derive_seed(0, rng.CLIENT, 1, c))
    _, state = algo.client_update({}, dict(algo.ctx.initial_params), algo.ctx.client_data(c), ClientContext(1, c, gen))
    assert all(torch.equal(state[k], res.executor.states[c][k]) for k in state)


HETERO_FED = {**TINY["federation"], "clients": 4, "sample_fraction": 1.0, "public": 200}
HETERO_CFG = {**TINY, "federation": HETERO_FED, "train": {**TINY["train"], "rounds": 1}}


def test_heterogeneous_local_is_ktpfl_without_the_transfer():
    """Same config: same architecture per client, same initial weights, and after round 1 (before any target has
    reached a KT-pFL client) the same weights — the control isolates what the knowledge transfer adds."""
    archs = ["lenet5", "mlp"]
    local = pflbed.run({**HETERO_CFG, "algorithm": {"name": "local", "architectures": archs}}, write=False)
    kt = pflbed.run({**HETERO_CFG, "algorithm": {"name": "ktpfl", "architectures": archs, "public_batch": 50}},
                    write=False)  # fmt: skip
    la, ka = local.executor.algo, kt.executor.algo
    assert [la.arch_of(c) for c in range(4)] == [ka.arch_of(c) for c in range(4)] == ["lenet5", "lenet5", "mlp", "mlp"]
    for c in range(4):
        init = la.init_client(c)
        assert all(torch.equal(init[k], ka.init_client(c)["w/" + k]) for k in init if k != "cid")
        trained, kt_state = local.executor.states[c], kt.executor.states[c]
        assert set(trained) - {"cid"} == {k[2:] for k in kt_state if k.startswith("w/")}
        assert all(torch.equal(trained[k], kt_state["w/" + k]) for k in trained if k != "cid")
        assert any(not torch.equal(trained[k], init[k]) for k in init if k != "cid")


def test_heterogeneous_local_end_to_end_with_new_clients_trained_from_scratch():
    fed = {**HETERO_FED, "clients": 6, "new_clients": 2}
    cfg = {**TINY, "federation": fed, "algorithm": {"name": "local", "architectures": ["lenet5", "mlp"]},
           "eval": {**TINY["eval"], "new_clients": {"methods": ["ft"], "fractions": [1.0], "epochs": 2, "lrs": [0.1]}}}
    res = pflbed.run(cfg, write=False)
    algo = res.executor.algo
    assert res.summary["final"]["pfl_acc"] > 0.3 and res.summary["communication"]["up_bytes_per_round"] == 0
    nc = res.summary["new_clients"]
    assert nc["zero_shot"] is None and nc["methods"]["ft"]["S"]["last"] > 0.2  # 10 classes: chance 0.1
    new = algo.ctx.federation.new
    assert {algo.arch_of(c) for c in new} <= {"lenet5", "mlp"}
    pred = algo.personal_model(res.server, res.executor.states[algo.ctx.federation.participated[0]])
    assert pred.model is algo.models["lenet5"]


def test_unknown_architecture_is_a_config_error():
    with pytest.raises(ConfigError, match="architectures: unknown models"):
        pflbed.run({**HETERO_CFG, "algorithm": {"name": "local", "architectures": ["nope"]}}, write=False)
