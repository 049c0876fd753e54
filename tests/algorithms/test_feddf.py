"""FedDF (Lin et al., NeurIPS 2020): per-architecture FedAvg, then server ensemble distillation on public data."""

import math

import pytest
import torch

import pflbed
from pflbed import rng
from pflbed.algorithms import feddf
from pflbed.algorithms.training import get_params, load_params, train_from
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError

from ..tiny import TINY

FED = {**TINY["federation"], "clients": 4, "sample_fraction": 1.0, "public": 200}
HETERO = {"name": "feddf", "architectures": ["lenet5", "mlp"], "public_batch": 100, "server_steps": 20,
          "server_lr": 1e-3, "server_batch_size": 32}  # fmt: skip
CFG = {**TINY, "federation": FED, "algorithm": HETERO, "eval": {"every": 4, "finetune": []}}


def _param_bytes(params: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in params.values())


def test_fusion_is_the_size_weighted_mean_within_each_architecture():
    algo = prepare(validate_config(CFG))
    assert [algo.arch_of(c) for c in range(4)] == ["lenet5", "lenet5", "mlp", "mlp"]
    server = algo.init_server()
    values = {0: 1.0, 1: 4.0, 2: -2.0, 3: 6.0}
    replies = {}
    for c, v in values.items():
        g = algo.global_params(server, algo.arch_of(c))
        replies[c] = {k: torch.full_like(t, v) if t.is_floating_point() else t for k, t in g.items()}
    fused = algo.fuse(replies, {0: 10.0, 1: 30.0, 2: 1.0, 3: 3.0})
    # by hand: lenet5 (10·1 + 30·4) / 40 = 3.25; mlp (1·(−2) + 3·6) / 4 = 4.0 — never mixed across architectures
    assert set(fused) == {"lenet5", "mlp"}
    for a, expected in (("lenet5", 3.25), ("mlp", 4.0)):
        floats = [t for t in fused[a].values() if t.is_floating_point()]
        assert floats and all(torch.allclose(t, torch.full_like(t, expected)) for t in floats)
        assert set(fused[a]) == set(algo.global_params(server, a))


def test_teacher_is_the_uniform_mean_of_all_client_logits():
    algo = prepare(validate_config(CFG))
    server = algo.init_server()
    x = algo._public_x(1)
    replies, logits = {}, []
    for c in range(4):
        torch.manual_seed(c)
        model = algo.ctx.new_model(algo.arch_of(c))
        replies[c] = get_params(model)
        model.eval()
        with torch.no_grad():
            logits.append(model(x))
    teacher = algo.teacher_logits(x, replies)
    assert torch.allclose(teacher, torch.stack(logits).mean(0), atol=1e-5)
    assert algo.configure(1, server, [0, 2])[2] is algo.global_params(server, "mlp")


def test_distillation_moves_the_student_towards_the_ensemble():
    algo = prepare(validate_config(CFG))
    x = algo._public_x(1)
    teachers = {}
    for c in range(4):
        torch.manual_seed(10 + c)
        teachers[c] = get_params(algo.ctx.new_model(algo.arch_of(c)))
    teacher = algo.teacher_logits(x, teachers)
    student = algo.models["mlp"]
    load_params(student, algo.global_params(algo.init_server(), "mlp"))
    before = feddf.distill_kl(student, x, teacher, 1.0)
    feddf.ensemble_distill(student, x, teacher, steps=60, batch_size=32, lr=1e-2, temperature=1.0,
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    after = feddf.distill_kl(student, x, teacher, 1.0)
    assert after < 0.5 * before


def test_zero_server_steps_is_fedavg():
    fed = {**FED, "sample_fraction": 0.5}
    cfg = {**CFG, "federation": fed, "train": {**CFG["train"], "rounds": 2}, "eval": {"every": 2, "finetune": []}}
    a = pflbed.run({**cfg, "algorithm": {"name": "feddf", "homogeneous": True, "server_steps": 0}}, write=False)
    b = pflbed.run({**cfg, "algorithm": {"name": "fedavg"}}, write=False)
    fused = a.executor.algo.global_params(a.server, "mlp")
    assert set(fused) == set(b.server) and all(torch.equal(fused[k], b.server[k]) for k in b.server)
    assert a.summary["final"]["gfl_acc"] == b.summary["final"]["gfl_acc"]
    # heterogeneous: without distillation the aggregate is exactly the per-architecture FedAvg
    algo = prepare(validate_config({**CFG, "algorithm": {**HETERO, "server_steps": 0}}))
    server = algo.init_server()
    replies = {c: {k: v + c for k, v in algo.global_params(server, algo.arch_of(c)).items()} for c in range(4)}
    weights = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    out, fused = algo.aggregate(1, server, replies, weights), algo.fuse(replies, weights)
    for arch, params in fused.items():
        assert all(torch.equal(out[f"g/{arch}/{k}"], v) for k, v in params.items())


def _global(server: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    return {k[len(f"g/{arch}/") :]: v for k, v in server.items() if k.startswith(f"g/{arch}/")}


def _logits(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    load_params(model, params)
    model.eval()
    with torch.no_grad():
        return model(x)


def test_heterogeneous_end_to_end_strict_learns():
    """A strict 4-round run against a reference rebuilt by hand from a 3-round run of the same seed: every client
    trains from its architecture's global model g_3 with its (seed, round 4, id) stream; per architecture the
    replies are averaged with weights |D_n|; the teacher is the plain mean of all four clients' logits on ξ_4; each
    fused model then takes `server_steps` Adam steps towards it. The run's g_4 must equal that reference."""
    res = pflbed.run(CFG, write=False)
    algo = res.executor.algo
    f = res.summary["final"]
    assert f["pfl_acc"] > 0.3 and f["gfl_acc"] is None  # 10 classes: chance is 0.1
    sizes = {a: _param_bytes(algo.global_params(res.server, a)) for a in ("lenet5", "mlp")}
    comm = res.summary["communication"]
    assert comm["up_bytes_per_round"] == comm["down_bytes_per_round"] == 2 * sizes["lenet5"] + 2 * sizes["mlp"]
    diag = res.history[-1]["diag"]
    assert diag["distill_kl_end"] < diag["distill_kl_start"]
    # the personal model of every client is its architecture's global model
    for c in range(4):
        p = algo.personal_model(res.server, res.executor.state(c))
        assert p.model is algo.models[algo.arch_of(c)] and p.params is algo.global_params(res.server, algo.arch_of(c))
    # reference for round 4
    prev = pflbed.run({**CFG, "train": {**CFG["train"], "rounds": 3}}, write=False).server
    replies = {}
    for c in range(4):
        a = algo.arch_of(c)
        seed = rng.derive_seed(0, rng.CLIENT, 4, c)
        torch.manual_seed(seed)
        replies[c] = train_from(algo.models[a], _global(prev, a), algo.ctx.client_data(c), algo.ctx.cfg.train,
                                torch.Generator().manual_seed(seed))  # fmt: skip
    x = algo._public_x(4)
    teacher = sum(_logits(algo.models[algo.arch_of(c)], replies[c], x) for c in range(4)) / 4
    n = {c: algo.ctx.federation.num_train(c) for c in range(4)}
    for i, (a, group) in enumerate((("lenet5", [0, 1]), ("mlp", [2, 3]))):
        fused = {k: sum(n[c] * replies[c][k] for c in group) / sum(n[c] for c in group) for k in replies[group[0]]}
        model = algo.models[a]
        load_params(model, fused)
        feddf.ensemble_distill(model, x, teacher, steps=20, batch_size=32, lr=1e-3, temperature=1.0,
                               generator=rng.generator(0, feddf.STREAM, 1, 4, i))  # fmt: skip
        ref = get_params(model)
        # atol: Adam's per-coordinate normalization turns float rounding into ~1e-5; wrong rules move O(1e-3)
        assert all(torch.allclose(res.server[f"g/{a}/{k}"], v, atol=1e-4) for k, v in ref.items())
        assert any(not torch.allclose(fused[k], v, atol=1e-4) for k, v in ref.items())  # distillation moved it


def test_homogeneous_has_a_generic_model():
    cfg = {**CFG, "algorithm": {**HETERO, "architectures": ["mlp"]}, "train": {**CFG["train"], "rounds": 2},
           "eval": {"every": 2, "finetune": []}}  # fmt: skip
    res = pflbed.run(cfg, write=False)
    f = res.summary["final"]
    assert f["gfl_acc"] is not None and f["gfl_acc"] > 0.2


def _student(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 4)


@pytest.mark.parametrize(("schedule", "steps"), [("cosine", 5), ("constant", 7), ("cosine", 1)])
def test_server_distillation_is_adam_on_kl_of_tempered_softmaxes_with_the_schedule(schedule, steps):
    """Alg. 1's server step by hand: `steps` Adam steps (lr η; cosine: η_t = η·(1 + cos(πt/steps))/2) on
    KL(softmax(z̄/T) ‖ softmax(f(x)/T)) over reshuffled batches of the public samples (batch 4, 10 samples: 3
    batches a pass, so 5 and 7 steps cross into further passes; 1 step is one step). Returns the mean step loss."""
    g = torch.Generator().manual_seed(0)
    x, teacher = torch.randn(10, 3, generator=g), 3 * torch.randn(10, 4, generator=g)
    ref = _student(1)
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    rg = torch.Generator().manual_seed(5)
    batches = [b for _ in range(3) for b in torch.randperm(10, generator=rg).split(4)]
    t = torch.softmax(teacher / 2.0, dim=1)
    losses = []
    for step, b in enumerate(batches[:steps]):
        for group in opt.param_groups:
            group["lr"] = 0.05 * (1 + math.cos(math.pi * step / steps)) / 2 if schedule == "cosine" else 0.05
        loss = (t[b] * (t[b].log() - torch.log_softmax(ref(x[b]) / 2.0, dim=1))).sum(1).mean()
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model = _student(1)
    mean_loss = feddf.ensemble_distill(model, x, teacher, steps=steps, batch_size=4, lr=0.05, temperature=2.0,
                                       generator=torch.Generator().manual_seed(5), schedule=schedule)  # fmt: skip
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)
    assert mean_loss == pytest.approx(sum(losses) / steps, rel=1e-5)


def test_server_distillation_step_count_is_exact_for_a_single_sample_and_zero_means_none():
    """One public sample, batch 1: 4 steps are 4 Adam steps (4 passes of one batch); 0 steps leave the model as it
    is and report 0."""
    x, teacher = torch.tensor([[0.3, -0.7, 1.1]]), torch.tensor([[2.0, -1.0, 0.0, 0.5]])
    ref = _student(2)
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    t = torch.softmax(teacher, dim=1)
    for _ in range(4):
        loss = (t * (t.log() - torch.log_softmax(ref(x), dim=1))).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model = _student(2)
    feddf.ensemble_distill(model, x, teacher, steps=4, batch_size=1, lr=0.05, temperature=1.0,
                           generator=torch.Generator().manual_seed(0), schedule="constant")  # fmt: skip
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    untouched, before = _student(2), [p.detach().clone() for p in _student(2).parameters()]
    assert feddf.ensemble_distill(untouched, x, teacher, steps=0, batch_size=1, lr=0.05, temperature=1.0,
                                  generator=torch.Generator().manual_seed(0)) == 0.0  # fmt: skip
    assert all(torch.equal(p, q) for p, q in zip(untouched.parameters(), before, strict=True))


def test_distill_kl_is_the_tempered_kl_over_every_public_sample():
    """The diagnostic KL(softmax(z̄/T) ‖ softmax(f(x)/T)), Σ classes, mean over *all* samples — 1030 of them, more
    than one prediction chunk of 1024."""
    g = torch.Generator().manual_seed(1)
    x, teacher = torch.randn(1030, 3, generator=g), 3 * torch.randn(1030, 4, generator=g)
    model = _student(3)
    with torch.no_grad():
        z = model(x)
    t = torch.softmax(teacher / 2.0, dim=1)
    ref = (t * (t.log() - torch.log_softmax(z / 2.0, dim=1))).sum(1).mean()
    assert feddf.distill_kl(model, x, teacher, 2.0) == pytest.approx(float(ref), rel=1e-5)


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_aggregate_distils_every_fused_model_towards_all_clients_mean_logits(schedule):
    """Step 4: teacher = (1/|S_r|)·Σ_n f(w_n; ξ_r) over *all* replies (both architectures), each architecture's
    FedAvg model distilled with its own (seed, FedDF stream, round, architecture) batch order and the configured
    learning-rate schedule; the diagnostics are the mean KL before and after."""
    opts = {"server_steps": 3, "server_lr": 0.01, "temperature": 2.0, "server_schedule": schedule}
    algo = prepare(validate_config({**CFG, "algorithm": {**HETERO, **opts}}))
    server = algo.init_server()
    replies = {}
    for c in range(4):
        torch.manual_seed(20 + c)
        replies[c] = get_params(algo.ctx.new_model(algo.arch_of(c)))
    weights = {0: 10.0, 1: 30.0, 2: 1.0, 3: 3.0}
    out = algo.aggregate(2, server, replies, weights)
    x = algo._public_x(2)
    teacher = sum(_logits(algo.models[algo.arch_of(c)], replies[c], x) for c in range(4)) / 4
    fused = algo.fuse(replies, weights)
    before, after = [], []
    for i, a in enumerate(("lenet5", "mlp")):
        model = algo.models[a]
        load_params(model, fused[a])
        before.append(feddf.distill_kl(model, x, teacher, 2.0))
        feddf.ensemble_distill(model, x, teacher, steps=3, batch_size=32, lr=0.01, temperature=2.0,
                               generator=rng.generator(0, feddf.STREAM, 1, 2, i), schedule=schedule)  # fmt: skip
        after.append(feddf.distill_kl(model, x, teacher, 2.0))
        # Adam scales every coordinate's step to ~lr, so float rounding in near-zero gradients shows at ~1e-5;
        # a wrong rule moves parameters by O(lr) = 1e-2
        assert all(torch.allclose(out[f"g/{a}/{k}"], v, atol=1e-4) for k, v in get_params(model).items())
    assert float(out["kl_start"]) == pytest.approx(sum(before) / 2, rel=1e-5)
    # the same rounding reaches the final KL (seen: 1.6e-5 relative on one CPU); a wrong rule changes it by far more
    assert float(out["kl_end"]) == pytest.approx(sum(after) / 2, rel=1e-4)


def test_architecture_without_a_reply_keeps_its_global_model():
    """Only architectures with a received model are fused and distilled; the others stay as they were."""
    algo = prepare(validate_config({**CFG, "algorithm": {**HETERO, "server_steps": 2}}))
    server = algo.init_server()
    replies = {c: {k: v + 0.1 for k, v in algo.global_params(server, "mlp").items()} for c in (2, 3)}
    out = algo.aggregate(1, server, replies, {2: 1.0, 3: 1.0})
    lenet = algo.global_params(server, "lenet5")
    assert all(torch.equal(out[f"g/lenet5/{k}"], v) for k, v in lenet.items())
    assert any(not torch.allclose(out[f"g/mlp/{k}"], v) for k, v in replies[2].items())


def test_initial_models_and_documented_defaults():
    """model.name's architecture starts from the run's initial model, every other one from its own seeded random
    initialization (seed, init stream, FedDF stream, index in the architecture list); defaults: T = 1, 500 Adam
    steps at 1e-3, batch 256, cosine schedule."""
    algo = prepare(validate_config(CFG))
    server = algo.init_server()
    assert all(torch.equal(algo.global_params(server, "mlp")[k], v) for k, v in algo.ctx.initial_params.items())
    torch.manual_seed(rng.derive_seed(0, rng.INIT, feddf.STREAM, 0))
    lenet = get_params(algo.ctx.new_model("lenet5"))
    assert all(torch.equal(algo.global_params(server, "lenet5")[k], v) for k, v in lenet.items())
    # the stream index is the architecture's position: lenet5 second in the list seeds with index 1
    algo = prepare(validate_config({**CFG, "algorithm": {**HETERO, "architectures": ["mlp", "lenet5"]}}))
    torch.manual_seed(rng.derive_seed(0, rng.INIT, feddf.STREAM, 1))
    lenet = get_params(algo.ctx.new_model("lenet5"))
    assert all(torch.equal(algo.global_params(algo.init_server(), "lenet5")[k], v) for k, v in lenet.items())
    d = feddf.FedDFOptions()
    assert (d.temperature, d.server_steps, d.server_lr, d.server_batch_size, d.server_schedule, d.homogeneous) == (
        1.0, 500, 1e-3, 256, "cosine", False)  # fmt: skip


def test_public_data_is_needed_only_when_the_server_distils():
    """server_steps > 0 without public data is a configuration error; server_steps = 0 (per-architecture FedAvg)
    needs none, and its aggregate neither distils nor reports distillation KLs."""
    nopub = {**FED, "public": 0}
    with pytest.raises(ConfigError):
        prepare(validate_config({**CFG, "federation": nopub, "algorithm": {**HETERO, "server_steps": 1}}))
    algo = prepare(validate_config({**CFG, "federation": nopub, "algorithm": {**HETERO, "server_steps": 0}}))
    server = algo.init_server()
    replies = {c: {k: v + 0.1 * c for k, v in algo.global_params(server, algo.arch_of(c)).items()} for c in range(4)}
    out = algo.aggregate(1, server, replies, {c: 1.0 for c in range(4)})
    assert "kl_start" not in out and algo.diagnostics(1, out, algo.ctx.client_data) == {}


def test_a_single_server_step_distils():
    """server_steps = 1 is one Adam step towards the ensemble: the global model moves off the FedAvg model."""
    algo = prepare(validate_config({**CFG, "algorithm": {**HETERO, "server_steps": 1, "server_lr": 0.01}}))
    server = algo.init_server()
    replies = {}
    for c in range(4):
        torch.manual_seed(30 + c)
        replies[c] = get_params(algo.ctx.new_model(algo.arch_of(c)))
    weights = {c: 1.0 for c in range(4)}
    out, fused = algo.aggregate(1, server, replies, weights), algo.fuse(replies, weights)
    assert "kl_start" in out
    assert any(not torch.allclose(out[f"g/mlp/{k}"], v, atol=1e-3) for k, v in fused["mlp"].items())


def test_diagnostics_report_the_stored_kls_rounded_to_six_decimals():
    """distill_kl_start / distill_kl_end are the stored mean KLs, rounded to 6 decimals."""
    algo = prepare(validate_config(CFG))
    start, end = torch.tensor(0.123456789), torch.tensor(0.0987654321)
    d = algo.diagnostics(1, {"kl_start": start, "kl_end": end}, algo.ctx.client_data)
    assert d == {"distill_kl_start": round(float(start), 6), "distill_kl_end": round(float(end), 6)}


@pytest.mark.parametrize("cid", [1, 3])
def test_new_client_starts_from_and_fine_tunes_its_architectures_global_model(cid):
    """Zero-shot: the global model of the client's architecture; personalization: fine-tuning it (SGD at the
    budget's lr, batch, momentum, epochs) on the client's training data."""
    from pflbed.algorithms.base import Budget
    from pflbed.algorithms.training import local_sgd
    from pflbed.evaluation.evaluate import last

    algo = prepare(validate_config(CFG))
    g = torch.Generator().manual_seed(3)
    server = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
              for k, v in algo.init_server().items()}  # fmt: skip
    arch, data = algo.arch_of(cid), algo.ctx.client_data(cid)
    zs = algo.zero_shot(server, data)
    assert zs.model is algo.models[arch] and zs.params is algo.global_params(server, arch)
    p = last(algo.personalize(server, data, Budget("ft", 2, 0.05, 8, momentum=0.5), torch.Generator().manual_seed(4)))
    model = algo.models[arch]
    load_params(model, _global(server, arch))
    local_sgd(model, data, epochs=2, batch_size=8, lr=0.05, momentum=0.5, generator=torch.Generator().manual_seed(4))
    assert p.model is model and all(torch.allclose(p.params[k], v, atol=1e-6) for k, v in get_params(model).items())
