"""FedDF (Lin et al., NeurIPS 2020): per-architecture FedAvg, then server ensemble distillation on public data."""

import torch

import pflbed
from pflbed.algorithms import feddf
from pflbed.algorithms.training import get_params, load_params
from pflbed.config import validate_config
from pflbed.engine.loop import prepare

from .tiny import TINY

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


def test_heterogeneous_end_to_end_strict_learns():
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


def test_homogeneous_has_a_generic_model():
    cfg = {**CFG, "algorithm": {**HETERO, "architectures": ["mlp"]}, "train": {**CFG["train"], "rounds": 2},
           "eval": {"every": 2, "finetune": []}}  # fmt: skip
    res = pflbed.run(cfg, write=False)
    f = res.summary["final"]
    assert f["gfl_acc"] is not None and f["gfl_acc"] > 0.2
