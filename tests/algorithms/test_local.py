import pytest
import torch

import pflbed
from pflbed import rng
from pflbed.algorithms.base import Budget, ClientContext, Predictor
from pflbed.algorithms.training import train_from
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError
from pflbed.evaluation.evaluate import Predictions, client_scores, last

from ..tiny import TINY


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
    # reference: the same clients' models had they never trained (seed 0: P-FL 0.38 vs 0.11)
    fed = algo.ctx.federation
    untrained, _ = client_scores({c: Predictor(algo.ctx.model, algo.ctx.initial_params) for c in fed.participated},
                                 algo.ctx, Predictions(algo.ctx.source, 1024))  # fmt: skip
    assert res.summary["final"]["pfl_acc"] > sum(untrained.values()) / len(untrained) + 0.15


def test_local_only_state_equals_plain_sgd_on_own_data():
    """Round 1: a sampled client's state is the configured SGD (`train_from`) from the initial model on its own
    data, with the round's client generator — the federated methods' schedule and nothing else."""
    cfg = {**TINY, "train": {**TINY["train"], "rounds": 1}}
    res = pflbed.run({**cfg, "algorithm": {"name": "local"}}, write=False)
    algo = res.executor.algo
    c = next(iter(res.executor.states))
    gen = torch.Generator().manual_seed(rng.derive_seed(0, rng.CLIENT, 1, c))
    state = train_from(algo.ctx.new_model(), algo.ctx.initial_params, algo.ctx.client_data(c), algo.ctx.cfg.train, gen)
    assert set(state) == set(res.executor.states[c])
    assert all(torch.equal(state[k], res.executor.states[c][k]) for k in state)


def test_local_client_continues_from_its_own_model_and_uploads_nothing():
    """Round r trains from the client's own model of its last sampled round (its state), never from the initial
    model again; the reply is empty and the server state never changes."""
    algo = prepare(validate_config({**TINY, "algorithm": {"name": "local"}}))
    c = algo.ctx.federation.participated[0]
    data, train = algo.ctx.client_data(c), algo.ctx.cfg.train
    state = algo.init_client(c)
    assert all(torch.equal(state[k], v) for k, v in algo.ctx.initial_params.items()) and set(state) == set(
        algo.ctx.initial_params
    )
    assert algo.configure(1, {}, [c]) == {c: {}}
    for rnd in (1, 2):
        before = dict(state)
        reply, state = algo.client_update({}, state, data, ClientContext(rnd, c, torch.Generator().manual_seed(rnd)))
        assert reply == {}
        expected = train_from(algo.ctx.new_model(), before, data, train, torch.Generator().manual_seed(rnd))
        assert all(torch.equal(state[k], expected[k]) for k in expected), rnd
    server = {}
    assert algo.aggregate(2, server, {c: {}}, {c: 1.0}) is server
    scored = algo.personal_model(server, state).params  # the client is scored with its own model
    assert set(scored) == set(state) and all(scored[k] is state[k] for k in state)


def test_new_client_trains_from_the_untrained_initial_model():
    """A new client has nothing to start from but the run's initial model (its own fresh init when heterogeneous):
    with lr 0 the adapted model is exactly that start."""
    algo = prepare(validate_config({**TINY, "algorithm": {"name": "local"}}))
    p = last(algo.personalize({}, algo.ctx.client_data(0), Budget("ft", 1, 0.0, 16), torch.Generator()))
    assert all(torch.equal(p.params[k], v) for k, v in algo.ctx.initial_params.items())
    archs = ["lenet5", "mlp"]
    hetero = prepare(validate_config({**HETERO_CFG, "algorithm": {"name": "local", "architectures": archs}}))
    for c in (0, 3):
        p = last(hetero.personalize({}, hetero.ctx.client_data(c), Budget("ft", 1, 0.0, 16), torch.Generator()))
        init = hetero.init_client(c)
        assert p.model is hetero.models[hetero.arch_of(c)]
        assert set(p.params) == set(init) - {"cid"} and all(torch.equal(p.params[k], init[k]) for k in p.params)
    # heterogeneous clients initialize independently, seeded by (run seed, client id): clients 0 and 1 share an
    # architecture but not their initial weights
    a, b = hetero.init_client(0), hetero.init_client(1)
    assert hetero.arch_of(0) == hetero.arch_of(1)
    assert not torch.equal(a["blocks.conv1.0.weight"], b["blocks.conv1.0.weight"])


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
    # reference: every client's own architecture at its own initialization, never trained (seed 0: 0.45 vs 0.15)
    fed = algo.ctx.federation
    untrained, _ = client_scores({c: algo.personal_model({}, algo.init_client(c)) for c in fed.participated},
                                 algo.ctx, Predictions(algo.ctx.source, 1024))  # fmt: skip
    assert res.summary["final"]["pfl_acc"] > sum(untrained.values()) / len(untrained) + 0.15
    assert res.summary["communication"]["up_bytes_per_round"] == 0
    nc = res.summary["new_clients"]
    assert nc["zero_shot"] is None and nc["methods"]["ft"]["S"]["last"] > 0.2  # 10 classes: chance 0.1
    new = algo.ctx.federation.new
    assert {algo.arch_of(c) for c in new} <= {"lenet5", "mlp"}
    pred = algo.personal_model(res.server, res.executor.states[algo.ctx.federation.participated[0]])
    assert pred.model is algo.models["lenet5"]


def test_unknown_architecture_is_a_config_error():
    with pytest.raises(ConfigError, match="architectures: unknown models"):
        pflbed.run({**HETERO_CFG, "algorithm": {"name": "local", "architectures": ["nope"]}}, write=False)


def test_new_client_training_draws_batches_from_the_given_generator_only():
    """A new client's from-scratch training depends on the generator the protocol derives for it, never on torch's
    global RNG: the same generator gives the same model whatever the global state, another one a different one."""
    algo = prepare(validate_config({**TINY, "algorithm": {"name": "local"}}))
    data = algo.ctx.client_data(0)

    def adapt(seed, global_seed):
        torch.manual_seed(global_seed)
        return last(algo.personalize({}, data, Budget("ft", 1, 0.1, 8), torch.Generator().manual_seed(seed))).params

    a, b, c = adapt(1, 0), adapt(1, 99), adapt(2, 0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
