"""FedProto (Tan et al., AAAI 2022): each client trains its own model on CE + λ·L_R, L_R the distance of its
embeddings to the global class prototypes (Eq. 8); it replies its local prototypes (Eq. 5) and class counts; the
server averages them per class (Eq. 6); a client predicts by the nearest global prototype. With `models`, clients
train different architectures of one embedding size, and the prototypes of all of them meet in Eq. 6."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.cli import main
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError
from pflbed.evaluation.evaluate import last
from pflbed.models import build_model

from ..tiny import TINY, same_tensors

TRAIN = {**TINY["train"], "rounds": 2, "lr": 0.05, "momentum": 0.5, "weight_decay": 0.01}


def _cfg(name="fedproto", **options):
    return validate_config({**TINY, "train": {**TINY["train"], "local_epochs": 2, "momentum": 0.0},
                            "algorithm": {"name": name, **options}, "executor": {"threads": 1}})  # fmt: skip


def _update(algo, payload, state, cid, seed=7):
    data = algo.ctx.client_data(cid)
    return algo.client_update(payload, state, data, ClientContext(1, cid, torch.Generator().manual_seed(seed)))


def _rich_client(algo):
    """The participated client holding the most classes."""
    fed = algo.ctx.federation
    return max(fed.participated, key=lambda c: (int((fed.clients[c].prior > 0).sum()), -c))


def _payload(algo, seed=0, masked=(7, 8, 9)):
    """Global prototypes of every class but `masked` (random, of the embeddings' scale)."""
    g = torch.Generator().manual_seed(seed)
    server = algo.init_server()
    protos = torch.rand(server["protos"].shape, generator=g)
    mask = torch.ones_like(server["proto_mask"])
    mask[list(masked)] = 0.0
    return {"protos": protos * mask.unsqueeze(1), "proto_mask": mask}


def _model_keys(algo):
    return list(algo.ctx.model.state_dict())


def _body(model, params, x):
    load_params(model, {k: v for k, v in params.items() if k != "cid"})
    return model.features(x).flatten(1)


def _by_hand(algo, payload, state, cid, lam, regularizer="per_sample", seed=7, model=None):
    """E epochs of SGD written out (on `model`, default the run's): (trained parameters, per epoch the (z, y) of its
    training forwards)."""
    model, t, data = model or algo.ctx.model, algo.ctx.cfg.train, algo.ctx.client_data(cid)
    protos, mask = payload["protos"], payload["proto_mask"]
    params = dict(model.named_parameters())
    w = {k: state[k].clone() for k in model.state_dict()}
    per_epoch = math.ceil(data.num_train / t.batch_size)
    seen = []
    for i, b in enumerate(index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(seed))):
        x, y = data.x[b], data.y[b]
        load_params(model, w)
        model.train()
        z = model.features(x).flatten(1)
        ce = F.cross_entropy(model.classify(z), y)
        if regularizer == "per_sample":  # the authors' code: MSELoss against a target whose rows are C̄^(y)
            target = z.detach().clone()
            for r, label in enumerate(y.tolist()):
                if mask[label] > 0:
                    target[r] = protos[label]
            reg = F.mse_loss(target, z)
        else:  # Σ_j over the batch's classes with a prototype of the MSE between its batch mean and C̄^(j)
            reg = sum(F.mse_loss(z[y == j].mean(0), protos[j]) for j in y.unique().tolist() if mask[j] > 0)
        loss = ce + lam * reg
        grads = torch.autograd.grad(loss, list(params.values()))
        w = {**w, **{k: w[k] - t.lr * g for k, g in zip(params, grads, strict=True)}}
        seen.append((i // per_epoch, z.detach(), y))
    return w, seen


def _class_means(z, y, num_classes):
    means, counts = torch.zeros(num_classes, z.shape[1]), torch.zeros(num_classes)
    for j in range(num_classes):
        if (y == j).any():
            means[j], counts[j] = z[y == j].double().mean(0).float(), float((y == j).sum())
    return means, counts


@pytest.mark.parametrize("regularizer", ["per_sample", "class_mean"])
def test_the_client_update_is_sgd_on_eq_8_and_replies_eq_5_of_the_trained_model(regularizer):
    lam = 0.8
    algo = prepare(_cfg(lam=lam, regularizer=regularizer))
    cid = _rich_client(algo)
    data = algo.ctx.client_data(cid)
    assert bool((data.prior[[7, 8, 9]] > 0).any())  # a class without a prototype is in the client's data
    payload, state = _payload(algo), algo.init_client(cid)
    reply, new = _update(algo, payload, state, cid)
    w, _ = _by_hand(algo, payload, state, cid, lam, regularizer)
    keys = [k for k, _ in algo.ctx.model.named_parameters()]
    assert all(torch.allclose(new[k], w[k], atol=1e-5) for k in keys)
    assert int(new["cid"]) == cid and set(new) == {"cid", *_model_keys(algo)}
    model = algo.ctx.model
    model.eval()
    with torch.no_grad():
        z = _body(model, new, data.x[data.train])
    means, counts = _class_means(z, data.y[data.train], algo.num_classes)
    assert set(reply) == {"proto", "count"}
    assert torch.allclose(reply["proto"], means, atol=1e-5) and torch.equal(reply["count"], counts)
    plain, _ = _update(algo, {**payload, "proto_mask": torch.zeros_like(payload["proto_mask"])}, state, cid)
    assert not torch.allclose(reply["proto"], plain["proto"])  # the regulariser acted


def test_the_first_round_and_lam_zero_are_local_training_bit_for_bit():
    """No global prototype yet (round 1), or λ = 0: the client trains on CE alone, from its own model."""
    algo, local = prepare(_cfg(lam=5.0)), prepare(_cfg("local"))
    cid = _rich_client(algo)
    _, state = _update(algo, algo.configure(1, algo.init_server(), [cid])[cid], algo.init_client(cid), cid)
    _, plain = _update(local, {}, local.init_client(cid), cid)
    assert same_tensors({k: state[k] for k in plain}, plain)
    zero = pflbed.run(_cfg(lam=0.0), write=False, progress=False)
    ref = pflbed.run(_cfg("local"), write=False, progress=False)
    assert zero.executor.states.keys() == ref.executor.states.keys()
    for c, s in ref.executor.states.items():
        assert same_tensors({k: zero.executor.states[c][k] for k in s}, s)


@pytest.mark.parametrize("weighting", ["samples", "clients"])
def test_the_server_averages_each_class_over_the_clients_holding_it_eq_6(weighting):
    algo = prepare(_cfg(weighting=weighting))
    g = torch.Generator().manual_seed(3)
    server = algo.init_server()
    c, d = server["protos"].shape
    previous = torch.rand(c, d, generator=g)
    server = {"protos": previous, "proto_mask": torch.zeros(c)}
    server["proto_mask"][[0, 9]] = 1.0  # class 9: held before, by none of this round's clients
    counts = {0: torch.tensor([3.0, 1, 0, 0, 5, 0, 0, 0, 0, 0]), 2: torch.tensor([1.0, 0, 4, 0, 5, 0, 0, 0, 0, 0]),
              5: torch.tensor([0.0, 7, 2, 0, 1, 0, 0, 0, 0, 0])}  # fmt: skip
    replies = {i: {"proto": torch.rand(c, d, generator=g) * (n > 0).unsqueeze(1), "count": n}
               for i, n in counts.items()}  # fmt: skip
    out = algo.aggregate(1, server, replies, {0: 100.0, 2: 1.0, 5: 1.0})  # the engine's weights: not used
    for j in range(c):
        holders = [i for i in counts if counts[i][j] > 0]
        if not holders:  # kept (class 9) or still without a prototype
            assert torch.equal(out["protos"][j], previous[j])
            assert out["proto_mask"][j] == server["proto_mask"][j]
            continue
        weight = {i: float(counts[i][j]) if weighting == "samples" else 1.0 for i in holders}
        want = sum(weight[i] * replies[i]["proto"][j].double() for i in holders) / sum(weight.values())
        assert torch.allclose(out["protos"][j].double(), want, atol=1e-6) and out["proto_mask"][j] == 1.0
    assert out["proto_mask"].tolist() == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_last_epoch_prototypes_are_the_last_epoch_s_training_embeddings():
    """`local_protos: last_epoch` (the authors' code): the mean of the embeddings the last epoch's training forwards
    gave (train mode, each batch before its step); the model trained exactly as by default."""
    algo, default = prepare(_cfg(local_protos="last_epoch")), prepare(_cfg())
    cid = _rich_client(algo)
    payload, state = _payload(algo), algo.init_client(cid)
    assert algo.sgd_plan(payload, state, algo.ctx.client_data(cid)) is None  # its clients train one by one
    reply, new = _update(algo, payload, state, cid)
    _, ref = _update(default, payload, state, cid)
    assert same_tensors(new, ref)
    _, seen = _by_hand(algo, payload, state, cid, 1.0)
    final = [(z, y) for e, z, y in seen if e == algo.ctx.cfg.train.local_epochs - 1]
    means, counts = _class_means(torch.cat([z for z, _ in final]), torch.cat([y for _, y in final]), algo.num_classes)
    assert torch.allclose(reply["proto"], means, atol=1e-5) and torch.equal(reply["count"], counts)


def _trained(alpha=1.0):
    cfg = validate_config({**_cfg().model_dump(), "federation": {**TINY["federation"], "alpha": alpha}})
    r = pflbed.run(cfg, write=False, progress=False)
    return r.executor.algo, r.server, r.executor.states


def test_a_client_predicts_the_nearest_global_prototype_in_its_own_embedding():
    algo, server, states = _trained()
    cid = _rich_client(algo)
    x = algo.ctx.source.test.x[:64]
    mask = server["proto_mask"].clone()
    mask[2] = 0.0  # a class without a prototype is never predicted
    server = {**server, "proto_mask": mask}
    pred = algo.personal_model(server, states[cid])
    model = algo.ctx.model
    model.eval()
    with torch.no_grad():
        z = _body(model, states[cid], x)
    dist = torch.stack([((z - server["protos"][j]) ** 2).sum(1) for j in range(algo.num_classes)], 1)
    dist[:, mask == 0] = math.inf
    logits = pred.logits(x)
    assert torch.equal(logits.argmax(1), dist.argmin(1))
    assert torch.allclose(logits[:, mask > 0], -dist[:, mask > 0], atol=1e-4)
    assert not (logits.argmax(1) == 2).any()


def test_the_readout_options_restrict_to_the_client_s_classes_or_use_its_head():
    algo, server, states = _trained(alpha=0.1)  # clients missing classes
    fed = algo.ctx.federation
    cid = min(fed.participated, key=lambda c: int((fed.clients[c].prior > 0).sum()))
    own = fed.clients[cid].prior > 0
    assert not bool(own.all())
    server = {**server, "proto_mask": torch.ones_like(server["proto_mask"])}
    x = algo.ctx.source.test.x[:200]
    everywhere = algo.personal_model(server, states[cid]).logits(x)
    algo.opts = algo.opts.model_copy(update={"predict": "own_prototypes"})
    restricted = algo.personal_model(server, states[cid]).logits(x)
    assert bool(own[restricted.argmax(1)].all()) and not bool(own[everywhere.argmax(1)].all())
    assert torch.equal(restricted[:, own], everywhere[:, own])
    algo.opts = algo.opts.model_copy(update={"predict": "head"})
    model = algo.ctx.model
    load_params(model, {k: states[cid][k] for k in _model_keys(algo)})
    model.eval()
    with torch.no_grad():
        assert torch.equal(algo.personal_model(server, states[cid]).logits(x), model(x))
    algo.opts = algo.opts.model_copy(update={"predict": "prototypes"})
    none = {**server, "proto_mask": torch.zeros_like(server["proto_mask"])}  # before any prototype: the head
    with torch.no_grad():
        assert torch.equal(algo.personal_model(none, states[cid]).logits(x), model(x))


def test_a_new_client_trains_the_initial_model_on_eq_8_towards_the_global_prototypes():
    lam = 0.5
    algo = prepare(_cfg(lam=lam))
    cid = _rich_client(algo)
    data, server = algo.ctx.client_data(cid), _payload(algo, seed=4)
    budget = Budget("ft", 2, 0.05, 16, momentum=0.5)  # the budget's momentum, its buffer kept across the epochs
    preds = list(algo.personalize(server, data, budget, torch.Generator().manual_seed(9)))
    assert len(preds) == 2
    model = algo.ctx.model
    params = dict(model.named_parameters())
    w = {k: v.clone() for k, v in algo.ctx.initial_params.items()}
    buf = {}
    gen = torch.Generator().manual_seed(9)
    for epoch in range(2):
        for b in index_batches(data.train, 16, 1, gen):
            x, y = data.x[b], data.y[b]
            load_params(model, w)
            model.train()
            z = model.features(x).flatten(1)
            target = torch.where((server["proto_mask"][y] > 0).unsqueeze(1), server["protos"][y], z.detach())
            loss = F.cross_entropy(model.classify(z), y) + lam * F.mse_loss(target, z)
            grads = torch.autograd.grad(loss, list(params.values()))
            buf = {k: 0.5 * buf[k] + g if k in buf else g for k, g in zip(params, grads, strict=True)}  # torch's SGD
            w = {**w, **{k: w[k] - 0.05 * buf[k] for k in params}}
        got = preds[epoch].params  # each epoch's own snapshot
        assert all(torch.allclose(got["net." + k], w[k], atol=1e-5) for k in params)
        assert torch.equal(got["protos"], server["protos"]) and torch.equal(got["allowed"], server["proto_mask"])
    probe = last(algo.personalize(server, data, Budget("lp", 1, 0.05, 16), torch.Generator().manual_seed(9)))
    head = set(model.state_keys(model.head_blocks()))
    assert all(torch.equal(probe.params["net." + k], v) for k, v in algo.ctx.initial_params.items() if k not in head)
    assert algo.zero_shot(server, data) is None and algo.generic_model(server) is None
    own = prepare(_cfg(lam=lam, predict="own_prototypes"))  # a new client's readout: its own classes only
    lacking = replace(data, prior=torch.where(torch.arange(len(data.prior)) == 2, 0.0, data.prior))
    allowed = last(own.personalize(server, lacking, budget, torch.Generator().manual_seed(9))).params["allowed"]
    assert torch.equal(allowed, server["proto_mask"] * (lacking.prior > 0)) and allowed[2] == 0 and allowed[0] == 1


def test_the_class_mean_regulariser_batched_is_each_client_s_own(together):
    """The engine's batched tests run the defaults; the other regulariser's per-client batch means must survive
    the batched step's padding and weights too (two rounds with momentum and weight decay, as those tests)."""
    runs = []
    for batch_clients in (False, True):
        cfg = validate_config({**_cfg(regularizer="class_mean").model_dump(), "train": TRAIN,
                               "executor": {"threads": 1, "batch_clients": batch_clients}})  # fmt: skip
        runs.append(pflbed.run(cfg, write=False, progress=False))
    loop, both = runs
    assert together and all(n > 1 for n in together)
    assert all(torch.allclose(loop.server[k], both.server[k], atol=1e-5) for k in loop.server)
    for c, s in loop.executor.states.items():
        assert all(torch.allclose(s[k].float(), both.executor.states[c][k].float(), atol=1e-5) for k in s)


def test_replies_are_checked_against_the_prototypes_sent():
    algo = prepare(_cfg())
    cid = _rich_client(algo)
    payload = _payload(algo)
    reply, _ = _update(algo, payload, algo.init_client(cid), cid)
    assert algo.reply_fits(payload, reply) is None
    lacking = {"proto": reply["proto"].clone(), "count": reply["count"].clone()}
    lacking["proto"][0], lacking["count"][0] = 0.0, 0.0
    assert algo.reply_fits(payload, lacking) is None  # a class the client does not hold: a count of 0
    c, d = payload["protos"].shape
    assert algo.reply_fits(payload, {**reply, "proto": reply["proto"][:, :-1]}) == \
        f"has 'proto' of shape {[c, d - 1]}, expected {[c, d]}"  # fmt: skip
    assert algo.reply_fits(payload, {**reply, "count": reply["count"].double()}) == \
        "has 'count' of dtype torch.float64, expected torch.float32"  # fmt: skip
    assert algo.reply_fits(payload, {"proto": reply["proto"]}) == "lacks 'count'"
    negative = reply["count"].clone()
    negative[0] = -1.0
    assert algo.reply_fits(payload, {**reply, "count": negative}) == "has 'count' with a negative entry"
    assert type(algo).dp_refused is not None and type(algo).client_entries is None


# --- heterogeneous clients (`models`) --------------------------------------------------------------------------------
HET = ["lenet5", "lenet5_bn"]  # one embedding size (84), the second with BatchNorm: other parameters and buffers
ARCH = ["lenet5"] * 3 + ["lenet5_bn"] * 3  # TINY's 6 clients in contiguous blocks, as feddf and ktpfl assign them


def _het_cfg(models=HET, batch_size=16, **options):
    """`_cfg` with client c on ARCH[c]. A BatchNorm step on a batch of a few samples is ill-conditioned (rounding
    grows by orders of magnitude): the by-hand comparison takes a batch size that leaves none on lenet5_bn."""
    cfg = _cfg(**options).model_dump()
    return validate_config({**cfg, "model": {"name": "lenet5"}, "train": {**cfg["train"], "batch_size": batch_size},
                            "algorithm": {"name": "fedproto", "models": models, **options}})  # fmt: skip


def _fresh(algo, arch, params):
    """A zoo model of `arch` built here (not the algorithm's), loaded with `params`, in eval mode."""
    model = build_model(arch, algo.ctx.source.input_shape, algo.num_classes)
    load_params(model, {k: v for k, v in params.items() if k != "cid"})
    return model.eval()


def test_heterogeneous_clients_train_their_own_architecture_and_eq_6_averages_all_of_them():
    """Client c trains ARCH[c] from its architecture's initial model (Eq. 8 by hand on that architecture), replies
    Eq. 5 in its own embedding space, and the server's C̄^(j) is the count-weighted mean over the replies of both
    architectures."""
    lam = 0.8
    algo = prepare(_het_cfg(lam=lam, batch_size=24))
    fed = algo.ctx.federation
    assert [algo.arch_of(c) for c in range(len(fed.clients))] == ARCH
    states = {c: algo.init_client(c) for c in fed.participated}
    for c, state in states.items():
        assert set(state) == {"cid", *build_model(ARCH[c], (1, 8, 8), 10).state_dict()}, c
    assert same_tensors({k: states[0][k] for k in algo.ctx.initial_params}, algo.ctx.initial_params)  # the run's
    other = [c for c in fed.participated if ARCH[c] == "lenet5_bn"]
    assert len(other) > 1 and all(same_tensors(states[c], {**states[other[0]], "cid": states[c]["cid"]})
                                  for c in other)  # fmt: skip
    payload = _payload(algo)
    replies = {}
    for c in fed.participated:
        data = algo.ctx.client_data(c)
        replies[c], new = _update(algo, payload, states[c], c)
        model = _fresh(algo, ARCH[c], states[c])
        w, _ = _by_hand(algo, payload, states[c], c, lam, model=model)
        assert all(torch.allclose(new[k], w[k], atol=1e-5) for k, _ in model.named_parameters()), c
        model = _fresh(algo, ARCH[c], new)
        with torch.no_grad():
            means, counts = _class_means(model.features(data.x[data.train]).flatten(1), data.y[data.train], 10)
        assert torch.allclose(replies[c]["proto"], means, atol=1e-5) and torch.equal(replies[c]["count"], counts)
    out = algo.aggregate(1, algo.init_server(), replies, dict.fromkeys(replies, 1.0))
    both = 0
    for j in range(algo.num_classes):
        holders = [c for c in replies if replies[c]["count"][j] > 0]
        both += len({ARCH[c] for c in holders}) == 2
        want = sum(replies[c]["count"][j].double() * replies[c]["proto"][j].double() for c in holders)
        assert torch.allclose(out["protos"][j].double(), want / sum(replies[c]["count"][j] for c in holders), atol=1e-6)
    assert both > 0  # classes whose prototype mixes both architectures


def test_a_heterogeneous_client_predicts_and_a_new_one_trains_in_its_own_architecture():
    """The nearest global prototype in the client's own embedding (one client of each architecture); a new client
    (`personalize`, here on the data of an id in lenet5_bn's block) starts from lenet5_bn's initial model."""
    r = pflbed.run(_het_cfg(), write=False, progress=False)
    algo, server, states = r.executor.algo, r.server, r.executor.states
    x = algo.ctx.source.test.x[:64]
    for c in (0, 5):  # one of each architecture
        model = _fresh(algo, ARCH[c], states[c])
        with torch.no_grad():
            z = model.features(x).flatten(1)
        dist = torch.stack([((z - server["protos"][j]) ** 2).sum(1) for j in range(algo.num_classes)], 1)
        assert torch.allclose(algo.personal_model(server, states[c]).logits(x), -dist, atol=1e-4)
    data = algo.ctx.client_data(5)
    probe = last(algo.personalize(server, data, Budget("lp", 1, 0.05, 16), torch.Generator().manual_seed(9)))
    start = algo.init_client(5)
    body = [k for k, _ in build_model("lenet5_bn", (1, 8, 8), 10).named_parameters() if "classifier" not in k]
    assert set(probe.params) == {"protos", "allowed", *("net." + k for k in start if k != "cid")}
    assert all(torch.equal(probe.params["net." + k], start[k]) for k in body)


def test_one_listed_model_is_the_default_run_bit_for_bit():
    one = pflbed.run(validate_config({**_cfg().model_dump(), "algorithm": {"name": "fedproto", "models": ["mlp"]}}),
                     write=False, progress=False)  # fmt: skip
    ref = pflbed.run(_cfg(), write=False, progress=False)
    assert same_tensors(one.server, ref.server) and one.executor.states.keys() == ref.executor.states.keys()
    assert all(same_tensors(one.executor.states[c], s) for c, s in ref.executor.states.items())


def test_architectures_of_other_embedding_sizes_or_unknown_names_are_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^algorithm\.models: .* need one size; .*\(lenet5 84, mlp 200\)$"):
        prepare(_het_cfg(["lenet5", "mlp"]))
    with pytest.raises(ConfigError, match=r"^algorithm\.models: .*unknown models \['lenet6'\]"):
        _het_cfg(["lenet5", "lenet6"])
    fast = ["--set", "dataset.name=synthetic", "--set", "federation.clients=4", "--set", "train.rounds=1",
            "--set", "algorithm.name=fedproto", "--no-progress"]  # fmt: skip
    for models, expected in (("[mlp,lenet5]", "(mlp 200, lenet5 84)"), ("[mlp,nope]", "unknown models")):
        out = tmp_path / "run"
        assert main(["run", *fast, "--set", f"algorithm.models={models}", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("pflbed: error: algorithm.models:") and expected in err, err
        assert not out.exists()


def test_heterogeneous_clients_batched_train_the_run_s_model_together_and_the_others_one_by_one(together):
    """Batch size 24 (see `_het_cfg`): the batched lenet5 clients' rounding reaches the lenet5_bn clients through
    the next round's prototypes."""
    runs = []
    for batch_clients in (False, True):
        cfg = validate_config({**_het_cfg().model_dump(), "train": {**TRAIN, "batch_size": 24},
                               "federation": {**TINY["federation"], "sample_fraction": 1.0},
                               "executor": {"threads": 1, "batch_clients": batch_clients}})  # fmt: skip
        runs.append(pflbed.run(cfg, write=False, progress=False))
    loop, both = runs
    assert together == [3, 3]  # per round the three lenet5 clients; the lenet5_bn ones through the loop
    assert all(torch.allclose(loop.server[k], both.server[k], atol=1e-5) for k in loop.server)
    for c, s in loop.executor.states.items():
        assert all(torch.allclose(s[k].float(), both.executor.states[c][k].float(), atol=1e-5) for k in s)


def test_diagnostics_count_the_classes_with_a_global_prototype():
    algo = prepare(_cfg())
    assert algo.diagnostics(1, _payload(algo), lambda c: {}) == {"proto_classes": 7}  # every class but 7, 8, 9
    assert algo.diagnostics(1, algo.init_server(), lambda c: {}) == {"proto_classes": 0}
