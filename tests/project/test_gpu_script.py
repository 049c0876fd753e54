"""`benchmarks/gpu.py` writes to a new directory of its own unless told otherwise: a trial run on a CPU
(`--device cpu --quick`, as docs/guide/gpu.md shows it) must not overwrite the committed GPU results."""

import importlib.util
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _gpu_script():
    spec = importlib.util.spec_from_file_location("gpu_script", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_out_is_a_fresh_directory_never_the_committed_results(tmp_path, monkeypatch):
    gpu = _gpu_script()
    monkeypatch.chdir(tmp_path)
    a = gpu.parse_args(["--device", "cpu", "--quick"])
    assert a.out.resolve().parent == tmp_path / "runs" and a.out.name.startswith("gpu-")
    assert a.out.is_dir() and not list(a.out.iterdir())  # new and empty
    b = gpu.parse_args(["--device", "cpu", "--quick"])
    assert b.out != a.out  # a second call within the same second: a directory of its own
    assert gpu.parse_args(["--out", "benchmarks/results"]).out == Path("benchmarks/results")  # only when asked


def _result(gpu: str, speed: list[dict], quick: bool = False) -> dict:
    return {"gpu": gpu, "quick": quick, "args": {"models": ["cnn", "resnet18"]},
            "centralized": {"cnn": {32: 20000.0}, "resnet18": {32: 4000.0}}, "speed": speed}  # fmt: skip


def _case(alg: str, model: str, executor: str, s_per_round: float, cent: float, shape: str = "paper") -> dict:
    sps = 50000 / s_per_round
    return {"shape": shape, "algorithm": alg, "model": model, "executor": executor, "s_per_round": s_per_round,
            "samples_per_round": 50000, "samples_per_s": sps, "of_centralized": sps / cent}  # fmt: skip


def test_the_goals_are_judged_on_each_algorithms_best_default_round_against_its_own_threshold(tmp_path):
    """ResNet-18: FedAvg and FedRoD need 0.8 of the centralized rate, FedSelect and FedBasis 0.5, from the best of
    loop / batched / procs at the defaults (bf16, TF32 matrix products or nondeterministic kernels do not count,
    nor another shape);
    FedAvg's CNN round: 0.25 s on an H100, elsewhere the multiple of the centralized rate that 0.25 s is there."""
    gpu = _gpu_script()
    ref = tmp_path / "h100.json"
    ref.write_text('{"centralized": {"cnn": {"32": 25000.0}}}')  # 0.25 s there = 200,000 samples/s = 8 × 25,000
    speed = [_case("fedavg", "resnet18", "loop", 20.0, 4000), _case("fedavg", "resnet18", "batched", 15.0, 4000),
             _case("fedavg", "resnet18", "batched-bf16", 5.0, 4000),  # 2.5: not at the defaults
             _case("fedrod", "resnet18", "procs", 16.0, 4000),  # 0.78
             _case("fedrod", "resnet18", "batched", 10.0, 4000, shape="paper64"),  # another shape
             _case("fedselect", "resnet18", "batched", 25.0, 4000),  # exactly 0.5
             _case("fedbasis", "resnet18", "procs", 26.0, 4000),  # 0.48
             _case("fedavg", "cnn", "batched", 0.30, 20000), _case("fedavg", "cnn", "loop", 3.0, 20000),
             _case("fedavg", "cnn", "batched-fast", 0.2, 20000), _case("fedavg", "cnn", "batched-bf16", 0.2, 20000),
             _case("fedavg", "cnn", "batched-graphs-tf32", 0.2, 20000),  # a change of precision: does not count
             _case("fedavg", "cnn", "batched-graphs", 0.32, 20000)]  # compiled counts: it only rounds  # fmt: skip
    got = {g["goal"].split(" round")[0].split(" s/")[0]: g for g in gpu.goals(_result("NVIDIA H200", speed), ref)}
    assert [got[k]["met"] for k in ("fedavg resnet18", "fedrod resnet18", "fedselect resnet18",
                                    "fedbasis resnet18")] == [True, False, True, False]  # fmt: skip
    assert got["fedavg resnet18"]["measured"] == 0.833 and got["fedavg resnet18"]["via"] == "batched"
    assert got["fedrod resnet18"]["measured"] == 0.781 and got["fedrod resnet18"]["via"] == "procs"
    cnn = got["fedavg cnn"]  # 0.30 s here: 166,667 samples/s = 8.33 × 20,000 ≥ 8
    assert cnn["met"] is True and cnn["measured"] == 8.333 and cnn["target"] == ">= 8.00" and cnn["via"] == "batched"
    compiled = speed + [_case("fedavg", "cnn", "batched-compile", 0.25, 20000)]
    assert gpu.goals(_result("NVIDIA H200", compiled), ref)[-1]["via"] == "batched-compile"
    nhwc = compiled + [_case("fedavg", "cnn", "batched-graphs-nhwc", 0.2, 20000)]  # a setting of the library's
    assert gpu.goals(_result("NVIDIA H200", nhwc), ref)[-1]["via"] == "batched-graphs-nhwc"
    for ex in ("batched-tuned", "batched-graphs-tuned", "batched-graphs-nhwc-tuned"):  # executor.autotune: one too
        tuned = compiled + [_case("fedavg", "cnn", ex, 0.2, 20000)]
        assert gpu.goals(_result("NVIDIA H200", tuned), ref)[-1]["via"] == ex
    tuned = speed + [_case("fedbasis", "resnet18", "batched-tuned", 25.0, 4000)]
    assert gpu.goals(_result("NVIDIA H200", tuned), ref)[3]["met"] is True
    slow = [m for m in speed if m["model"] != "cnn"] + [_case("fedavg", "cnn", "batched", 0.42, 20000)]
    assert gpu.goals(_result("NVIDIA H200", slow), ref)[-1]["met"] is False  # 5.95 × < 8 ×
    h100 = gpu.goals(_result("NVIDIA H100 80GB HBM3", speed), ref)[-1]
    assert (h100["measured"], h100["target"], h100["met"]) == (0.3, "<= 0.25", False)  # seconds, on an H100
    fast = [m for m in speed if m["model"] != "cnn"] + [_case("fedavg", "cnn", "batched", 0.25, 20000)]
    assert gpu.goals(_result("NVIDIA H100 80GB HBM3", fast), ref)[-1]["met"] is True
    assert [g["met"] for g in gpu.goals(_result("NVIDIA H200", [], quick=False), ref)] == [None] * 5  # unmeasured
    assert {g["met"] for g in gpu.goals(_result("NVIDIA H200", speed, quick=True), ref)} == {None}  # tiny runs


def test_a_full_run_measures_the_goals_first_and_every_case_once():
    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--out", "unused"])
    todo = gpu.cases(a)
    assert todo[:12] == gpu.goal_cases(a) == [("paper", "fedavg", "cnn", "batched")] + [
        ("paper", alg, "resnet18", "batched") for alg in ("fedavg", "fedrod", "fedselect", "fedbasis")] + [
        ("paper", "fedavg", "cnn", e) for e in ("batched-compile", "batched-graphs", "batched-graphs-nhwc",
                                                "batched-graphs-nhwc-tuned", "batched-graphs-tuned",
                                                "batched-tuned")] + [("paper", "fedbasis", "resnet18", "batched-tuned")]
    assert todo[12:13] == [("paper", "fedavg", "cnn", "batched-nhwc")]
    assert todo[13:17] == [("paper64", alg, "resnet18_imagenet", "batched")
                          for alg in ("fedavg", "fedrod", "fedselect", "fedbasis")]  # fmt: skip
    assert todo[17] == ("paper", "fedavg", "cnn", "batched-graphs-tf32")
    assert gpu.EXECUTORS["batched-graphs-tf32"] == gpu.EXECUTORS["batched-graphs"] | {"tf32": True}
    assert len(todo) == len(set(todo)) and ("paper", "fedavg", "cnn", "loop") in todo


@pytest.fixture
def kernels():
    """The process's kernel flags (cuDNN's and torch's deterministic mode) all off, matrix products not in TF32, and
    put back after the test whatever it left: a probe's or case's flags must not reach the tests after it."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    was = matmul.allow_tf32
    with cudnn.flags(enabled=cudnn.enabled, benchmark=False, deterministic=False, allow_tf32=cudnn.allow_tf32):
        torch.use_deterministic_algorithms(False)
        matmul.allow_tf32 = False
        try:
            yield lambda: (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                           torch.are_deterministic_algorithms_enabled())  # fmt: skip
        finally:
            torch.use_deterministic_algorithms(False)
            matmul.allow_tf32 = was


def test_a_tuned_case_runs_autotuned_and_leaves_the_kernel_flags_as_it_found_them(tmp_path, monkeypatch, kernels):
    """`-tuned` cases are `executor.autotune` (which a GPU run's `prepare` makes `cudnn.benchmark`, as it sets the
    deterministic flags, cuDNN's and torch's: set here as a GPU's `prepare` would, on the CPU); after a case, or a
    probe (a profiled `-tuned` round), the flags are as before it, so the next case runs as configured."""
    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    a.rounds = 2
    seen = []
    real_prepare, real_round = gpu.prepare, gpu.Driver.train_round

    def as_on_a_gpu(cfg):
        gpu.gpu_kernels(torch.device("cuda"), cfg.executor.deterministic, cfg.executor.autotune, cfg.executor.tf32)
        return real_prepare(cfg)

    def spy(self, *args, **kwargs):
        seen.append(torch.backends.cudnn.benchmark)
        return real_round(self, *args, **kwargs)

    monkeypatch.setattr(gpu, "prepare", as_on_a_gpu)
    monkeypatch.setattr(gpu.Driver, "train_round", spy)
    tuned = gpu.config("fedavg", "cnn", gpu.EXECUTORS["batched-tuned"], a, "paper")
    assert tuned.executor.autotune and tuned.executor.batch_clients and tuned.executor.deterministic
    assert gpu.time_rounds(tuned, None)["rounds_timed"] == 1 and seen == [True, True]
    assert kernels() == (False, False, False)
    gpu.time_rounds(gpu.config("fedavg", "cnn", gpu.EXECUTORS["batched"], a, "paper"), None)
    assert seen[2:] == [False, False]
    a.profile, a.profile_executor, a.skip = ("fedavg", "cnn"), "batched-tuned", ["outside", "step", "combine"]
    result: dict = {"skipped": []}
    monkeypatch.setattr(gpu, "write", lambda *args: None)
    gpu.probes(a, result, torch.device("cpu"), time.perf_counter())
    assert "error" not in result["profile"] and seen[-1] is True
    assert kernels() == (False, False, False)


def test_the_step_and_layer_probes_run_deterministic_kernels_as_a_round_does(tmp_path, monkeypatch, kernels):
    """A round runs deterministic kernels by default (`executor.deterministic`), so the probes that explain its
    time do too, whatever the measurement before them left (the process's defaults on a fresh GPU are not); the
    `tuned` step and layers are autotuned as well, the others not; the flags are put back after. The layer probe's
    `wgrad_bmm` form is the library's product form."""
    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    seen: dict[str, set] = {"cross_entropy": set(), "conv2d": set(), "linear": set()}
    real = gpu.F

    class Spy:
        def __getattr__(self, name):
            if name not in seen:
                return getattr(real, name)

            def call(*args, **kwargs):
                seen[name].add((*kernels(), torch.backends.cuda.matmul.allow_tf32))
                return getattr(real, name)(*args, **kwargs)

            return call

    monkeypatch.setattr(gpu, "F", Spy())
    products = []  # the `wgrad_bmm` form: the library's (`conv_weight_grad.product_conv`), on conv1 and conv2
    product = gpu.conv_weight_grad.weight_grad
    monkeypatch.setattr(gpu.conv_weight_grad, "weight_grad", lambda *a: products.append(a[2]) or product(*a))
    out = gpu.step_probe(a, torch.device("cpu"))
    assert {tuple(s) for s in products} == {(32, 3, 5, 5), (64, 32, 5, 5)}
    assert out["batched_step_tuned_ms"] > 0 and set(out["layers_ms"]["conv2"]) == {"vmap", "bmm", "dense", "tuned",
                                                                                  "nhwc", "wgrad_bmm"}
    assert set(out["layers_ms"]["fc1"]) == {"vmap", "bmm", "dense", "tf32"}
    assert seen == {"cross_entropy": {(False, True, True, False), (True, True, True, False)},
                    "conv2d": {(False, True, True, False), (True, True, True, False)},
                    "linear": {(False, True, True, False), (False, True, True, True)}}  # fmt: skip
    assert kernels() == (False, False, False) and not torch.backends.cuda.matmul.allow_tf32


def test_no_round_starts_that_would_end_past_the_deadline(tmp_path, monkeypatch):
    """The first round always runs (it is the estimate); a later one starts only if the round before says it ends
    before the deadline. A case cut short keeps its rounds and says so, with no per-round figure from the warm-up."""
    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    a.rounds = 3
    cfg = gpu.config("fedavg", "cnn", gpu.EXECUTORS["loop"], a, "paper")
    whole = gpu.time_rounds(cfg, None)
    assert whole["rounds_timed"] == 2 and "incomplete" not in whole and whole["s_per_round"] > 0
    cut = gpu.time_rounds(cfg, None, deadline=0.0)
    assert cut["rounds_timed"] == 0 and "s_per_round" not in cut and "samples_per_s" not in cut
    assert cut["incomplete"] == "1 of 3 rounds: the next would pass --deadline-s" and cut["warmup_s"] > 0
    clock = iter(range(100))  # a clock that ticks once per reading: every round takes exactly 1
    monkeypatch.setattr(gpu, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    # round 1 reads 0 and 1; before round 2 the clock reads 2: 2 + 1 (the last round) passes 2.5, 2 alone would not
    assert gpu.time_rounds(cfg, None, deadline=2.5)["incomplete"].startswith("1 of 3")
    assert "incomplete: 1 of 3 rounds" in gpu.line(cut | {"shape": "paper", "algorithm": "fedavg", "model": "cnn",
                                                          "executor": "loop"})  # fmt: skip


def test_each_batched_computation_is_recorded_and_fedbasis_s_timed_round_is_its_own(tmp_path):
    """`batched_calls`: the clients of every batched computation in order (a round split in parts shows each part,
    as one halved after running out of memory would). FedBasis's case has no FedAvg warm start, so the round timed
    after the warm-up is FedBasis's second, not its first."""
    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    split = gpu.time_rounds(gpu.config("fedavg", "cnn", gpu.EXECUTORS["batched"] | {"batch_max_clients": 3}, a,
                                       "paper"), None)  # fmt: skip
    assert split["batched_calls"] == [3, 1] * 3 and split["batched_clients"] == 3  # 3 rounds of 4 clients
    fedbasis = gpu.config("fedbasis", "cnn", gpu.EXECUTORS["batched"], a, "paper")
    assert fedbasis.algorithm.warmup_fraction == 0.0 and fedbasis.train.rounds == 3
    assert gpu.time_rounds(fedbasis, None)["batched_calls"] == [4, 4, 4]


def test_each_rounds_allocator_cache_flushes_are_recorded_and_listed(tmp_path, monkeypatch):
    """`cache_flushes`: per round, how often the GPU's allocator flushed its cache to allocate (counted around the
    round, not the case); a case with any is listed under the table with its batched computations."""
    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    flushes = [0]
    real = gpu.batched.train_together

    def train(*args, **kw):
        flushes[0] += len(args[1]) > 1  # a flush during each batched computation of several clients
        return real(*args, **kw)

    monkeypatch.setattr(gpu.batched, "cache_flushes", lambda device: flushes[0])
    monkeypatch.setattr(gpu.batched, "train_together", train)
    m = gpu.time_rounds(gpu.config("fedavg", "cnn", gpu.EXECUTORS["batched"] | {"batch_max_clients": 3}, a,
                                   "paper"), None)  # fmt: skip
    assert m["cache_flushes"] == [1, 1, 1] and flushes == [3]  # a round's 3 clients and its 1 (`batched_calls`)
    m |= {"shape": "paper", "algorithm": "fedavg", "model": "cnn", "executor": "batched", "of_centralized": 0.5}
    quiet = m | {"executor": "loop", "cache_flushes": [0, 0, 0]}
    gpu.write({"device": "cpu", "gpu": None, "torch": "x", "cpu_count": 2, "quick": True, "args": vars(a),
               "speed": [m, quiet]}, tmp_path)  # fmt: skip
    text = (tmp_path / "gpu.txt").read_text()
    assert "paper fedavg cnn batched: [1, 1, 1] a round; batched computations of [3, 1, 3, 1, 3, 1] clients" in text
    assert "cnn loop: [0" not in text


def test_the_convolutions_autotune_computed_as_products_are_recorded_and_listed(tmp_path, monkeypatch):
    """`conv_products`: which convolutions a case's eager batched steps computed with their weight gradient as a
    product (`conv_weight_grad.chosen`, asked only under `executor.autotune` on a GPU: here asked by hand), listed
    under the table; a case that never asked has none, and the choosing is the library's again after the case."""
    from pflbed.engine import conv_weight_grad

    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    real, choose = gpu.batched.train_together, conv_weight_grad.chosen
    monkeypatch.setattr(conv_weight_grad, "_CHOICES", {})

    def train(model, plans, datas, *args, **kw):
        conv_weight_grad.chosen(model, datas[0].x[:1], len(plans), 32, lambda key: key[4] == 64)  # (conv2's)
        return real(model, plans, datas, *args, **kw)

    monkeypatch.setattr(gpu.batched, "train_together", train)
    m = gpu.time_rounds(gpu.config("fedavg", "cnn", gpu.EXECUTORS["batched"], a, "paper"), None)
    assert m["conv_products"] == ["blocks.conv2.0"] and conv_weight_grad.chosen is choose
    monkeypatch.setattr(gpu.batched, "train_together", real)
    plain = gpu.time_rounds(gpu.config("fedavg", "cnn", gpu.EXECUTORS["batched"], a, "paper"), None)
    assert "conv_products" not in plain
    m |= {"shape": "paper", "algorithm": "fedavg", "model": "cnn", "executor": "batched-tuned", "of_centralized": 1}
    gpu.write({"device": "cpu", "gpu": None, "torch": "x", "cpu_count": 2, "quick": True, "args": vars(a),
               "speed": [m, plain | {**{k: m[k] for k in ("shape", "algorithm", "model")}, "executor": "batched",
                                     "of_centralized": 1}]}, tmp_path)  # fmt: skip
    text = (tmp_path / "gpu.txt").read_text()
    assert "as a product (conv_weight_grad):\npaper fedavg cnn batched-tuned: blocks.conv2.0\n" in text


def test_the_layer_probes_matrix_product_form_is_each_clients_own_convolution():
    """The compile probe times a convolution as unfold + bmm beside the vmapped one: the same function, or its
    timing compares nothing."""
    import torch
    import torch.nn.functional as F

    gpu = _gpu_script()
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 4, 2, 5, 5, generator=g), torch.randn(3, 6, 2, 7, 9, generator=g)
    want = torch.stack([F.conv2d(x[i], w[i], padding=2) for i in range(3)])
    torch.testing.assert_close(gpu.conv_as_bmm(w, x), want, rtol=1e-5, atol=1e-5)


def test_the_combine_probes_forms_are_fedbasis_combination_and_its_gradients(tmp_path, monkeypatch):
    """The combine probe times other forms of FedBasis's θ(α, V) beside `basis.combine`, the bases shared by the
    clients: each must give the same θ and the same gradient with respect to α (`max_gap`, relative), or its time
    compares nothing; a form that slips (the major basis dropped, α's rows swapped, α detached) shows a gap. The V
    step's θ must give P the gradient S·G and a none: one that drops S shows a gap. The figures reach gpu.txt."""
    import torch

    from pflbed.algorithms import basis

    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path), "--models", "cnn", "mlp"])
    forms = gpu.combine_forms

    def with_wrong_ones(keys, group_of, k):  # what the gaps are for: each form's slip of the sum
        out = forms(keys, group_of, k)
        right = out["mul-add"]
        out["no-major"] = lambda v, alpha, m: right(v, alpha, {key: 0 * t for key, t in m.items()})
        out["one-group"] = lambda v, alpha, m: right(v, alpha.flip(0), m)
        out["alpha-detached"] = lambda v, alpha, m: right(v, alpha.detach(), m)  # θ right, no gradient to α
        return out

    monkeypatch.setattr(gpu, "combine_forms", with_wrong_ones)
    got = gpu.combine_probe(a, torch.device("cpu"))
    assert got["clients"] == 4 and got["K"] == 4 and got["params"] > 0
    assert set(got["alpha"]) == {"combine", "mul-add", "bcast", "no-major", "one-group", "alpha-detached"}
    for form in ("combine", "mul-add", "bcast"):
        r = got["alpha"][form]
        assert r["ms"] > 0 and r["max_gap"] < 1e-4, form  # float32 sums in another order
    assert got["alpha"]["no-major"]["max_gap"] > 0.1 and got["alpha"]["one-group"]["max_gap"] > 0.1
    assert got["alpha"]["alpha-detached"]["max_gap"] == 1.0
    step = got["v_step"]["v_step_theta"]
    assert step["ms"] > 0 and step["max_gap"] < 1e-5 and got["pass_ms"] > 0
    unscaled = basis.coefficients
    monkeypatch.setattr(basis, "coefficients", lambda alpha, major: unscaled(alpha, major) * 0.5)  # S off by 4
    assert gpu.combine_probe(a, torch.device("cpu"))["v_step"]["v_step_theta"]["max_gap"] > 0.1
    gpu.write({"device": "cpu", "gpu": None, "torch": "x", "quick": True, "cpu_count": 2, "tests": None, "speed": [],
               "skipped": [], "args": vars(a) | {"out": str(tmp_path)}, "combine": got}, tmp_path)
    text = (tmp_path / "gpu.txt").read_text()
    assert "combine probe: FedBasis's θ" in text and "  ψ step, with respect to α: combine " in text
    assert "  V step, with respect to P and a: v_step_theta " in text


def test_the_outside_probe_times_the_round_whole_then_without_its_gradients_and_puts_the_step_back(tmp_path,
                                                                                                  monkeypatch):
    """The outside probe times FedAvg's batched round as it runs, then with the executor's step replaced: a step
    that computes no gradient (zeros: the round's parameters never move) — and puts the step back after, also when
    the second timing fails. Its figures reach gpu.txt."""
    from pflbed.engine import batched

    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    real, timed, seen = batched.compiled, gpu.time_rounds, []

    def time_rounds(cfg, pool, *rest):
        seen.append(batched.compiled is real)
        if not seen[-1]:  # the replaced step: zeros of each trained tensor, the statistics as they were
            p, b = {"w": torch.ones(2, 3)}, {"s": torch.ones(1)}
            step = batched.compiled(None, "off", None)
            grads, moved = step(p, {}, b, {}, {}, {}, None, None, None, [], [])
            assert torch.equal(grads["w"], torch.zeros(2, 3)) and moved == b and moved is not b
        return timed(cfg, pool, *rest)

    monkeypatch.setattr(gpu, "time_rounds", time_rounds)
    got = gpu.outside_probe(a, torch.device("cpu"))
    assert seen == [True, False] and batched.compiled is real
    assert got["clients"] == 4 and got["round_s"] > 0 and got["outside_s"] > 0
    gpu.write({"device": "cpu", "gpu": None, "torch": "x", "quick": True, "cpu_count": 2, "tests": None, "speed": [],
               "skipped": [], "args": vars(a) | {"out": str(tmp_path)}, "outside": got}, tmp_path)
    assert "outside probe: FedAvg's cnn round batched, 4 clients: " in (tmp_path / "gpu.txt").read_text()

    def failing(cfg, pool, *rest):
        if batched.compiled is not real:
            raise RuntimeError("out of time")
        return timed(cfg, pool, *rest)

    monkeypatch.setattr(gpu, "time_rounds", failing)
    with pytest.raises(RuntimeError, match="out of time"):
        gpu.outside_probe(a, torch.device("cpu"))
    assert batched.compiled is real


def test_a_failing_probe_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    """A probe that fails (out of memory on a small GPU, say) is a result in gpu.txt, not the end of the call: the
    cases after the probes still run."""
    import time

    import torch

    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path), "--skip", "profile", "outside",
                        "combine"])  # fmt: skip

    def broken(*args):
        raise torch.OutOfMemoryError("CUDA out of memory.\nTried to allocate")

    monkeypatch.setattr(gpu, "step_probe", broken)
    result = {"device": "cpu", "gpu": None, "torch": "", "quick": True, "cpu_count": 2, "tests": None, "speed": [],
              "skipped": [], "args": vars(a) | {"out": str(tmp_path)}}  # fmt: skip
    gpu.probes(a, result, torch.device("cpu"), time.perf_counter())
    assert result["step"] == {"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate"}
    assert "profile" not in result  # skipped as asked
    assert "step: ERROR OutOfMemoryError: CUDA out of memory. Tried to allocate" in (tmp_path / "gpu.txt").read_text()


def test_the_profiled_round_is_fedavgs_cnn_or_the_seed_method_and_model_asked_for(tmp_path, monkeypatch):
    """`--profile ALG/MODEL`: the round profiled (FedAvg's, of the first of `--models`, by default), named in
    `profile.txt` and in the result; anything but a seed method and a model of the run is refused by the parser."""
    gpu = _gpu_script()
    assert gpu.parse_args(["--out", "unused"]).profile == ("fedavg", "cnn")
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path), "--models", "cnn", "mlp", "--profile",
                        "fedbasis/mlp"])
    built = []
    real = gpu.config

    def spy(algorithm, model, *args, **kw):
        cfg = real(algorithm, model, *args, **kw)
        built.append((algorithm, model, cfg.federation.clients, cfg.executor.compile, cfg.model.channels_last))
        return cfg

    monkeypatch.setattr(gpu, "config", spy)
    got = gpu.profile_round(a, tmp_path)
    assert built == [("fedbasis", "mlp", 4, "off", False)]  # the quick paper shape's clients
    assert got["case"] == "fedbasis mlp batched" and got["clients"] == 4 and got["seconds"] > 0
    assert (tmp_path / "profile.txt").read_text().startswith(
        "one batched fedbasis round, mlp, paper shape, 4 clients, cpu (")
    a.profile, a.profile_executor = ("fedavg", "cnn"), "batched-nhwc"  # `--profile-executor`: its settings
    assert gpu.profile_round(a, tmp_path)["case"] == "fedavg cnn batched-nhwc"
    assert built[1] == ("fedavg", "cnn", 4, "off", True)
    for ex in ("batched-graphs", "batched-graphs-nhwc-tuned"):
        assert gpu.parse_args(["--out", "x", "--profile-executor", ex]).profile_executor == ex
    for bad in (["--profile", "fedprox/cnn"], ["--profile", "fedbasis/vgg11"], ["--profile", "fedbasis/cnn/x"],
                ["--profile-clients", "0"], ["--profile-executor", "loop"], ["--profile-executor", "batched-fast"]):
        with pytest.raises(SystemExit) as e:
            gpu.parse_args(["--out", "unused", *bad])
        assert e.value.code == 2


def test_the_profiled_round_can_take_fewer_clients_than_the_shape(tmp_path, monkeypatch):
    """`--profile-clients N`: the profiled round's federation has N clients (a round that fills the memory at the
    shape's 100 is profiled without the allocator's pressure), said in `profile.txt`, the result and gpu.txt."""
    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path), "--models", "cnn", "mlp", "--profile",
                        "fedavg/mlp", "--profile-clients", "2"])
    built = []
    real = gpu.config

    def spy(algorithm, model, *args, **kw):
        cfg = real(algorithm, model, *args, **kw)
        built.append(cfg.federation.clients)
        return cfg

    monkeypatch.setattr(gpu, "config", spy)
    got = gpu.profile_round(a, tmp_path)
    assert built == [2] and got["clients"] == 2
    assert ", paper shape, 2 clients, cpu (" in (tmp_path / "profile.txt").read_text()
    gpu.write({"device": "cpu", "gpu": None, "torch": "x", "quick": True, "cpu_count": 2, "tests": None, "speed": [],
               "skipped": [], "args": vars(a) | {"out": str(tmp_path)}, "profile": got}, tmp_path)
    assert "profiled fedavg mlp batched round, 2 clients: " in (tmp_path / "gpu.txt").read_text()


def test_each_case_starts_from_an_emptied_gpu_cache(tmp_path, monkeypatch):
    """Each case's rounds start with the blocks earlier cases left released (`fresh`), before its peak memory is
    reset: held, they would count in its memory in use and make it flush the cache."""
    gpu = _gpu_script()
    a = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    emptied, seen = [], []
    monkeypatch.setattr(gpu.torch.cuda, "empty_cache", lambda: emptied.append(True))
    gpu.fresh(gpu.torch.device("cuda", 0))
    gpu.fresh(gpu.torch.device("cpu"))
    assert emptied == [True]  # on a GPU only
    monkeypatch.setattr(gpu, "fresh", seen.append)
    gpu.time_rounds(gpu.config("fedavg", "cnn", gpu.EXECUTORS["batched"], a, "paper"), None)
    assert seen == [gpu.torch.device("cpu")]


def test_the_centralized_limit_is_the_fastest_layout_and_way_of_choosing_kernels(monkeypatch, kernels):
    """The most one device trains: the best of NHWC off and on, cuDNN's heuristics and its autotuner (each measured
    under its own flags, put back after) — a round may run any of them (`-nhwc`, `-tuned`), so none is measured
    against a limit it could beat; all with the GPU's default kernels (not deterministic, faster), whatever the
    measurement before it left."""
    gpu = _gpu_script()
    seen = []

    def rate(model, batch, device, steps, size, channels_last):
        assert not torch.backends.cudnn.deterministic and not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32  # PyTorch's defaults
        seen.append((channels_last, torch.backends.cudnn.benchmark))
        return {(False, False): 1.0, (False, True): 3.0, (True, False): 2.0, (True, True): 1.5}[seen[-1]]

    monkeypatch.setattr(gpu, "_centralized", rate)
    gpu.gpu_kernels(torch.device("cuda"), True, False, False)  # as a case before it may leave them (`prepare`)
    assert gpu.centralized("cnn", 32, torch.device("cpu"), 1) == 3.0
    assert sorted(seen) == [(False, False), (False, True), (True, False), (True, True)]
    assert kernels() == (False, True, True) and not torch.backends.cudnn.allow_tf32
    assert [e for e in gpu.EXECUTORS if gpu.channels_last(e)] == ["batched-nhwc", "batched-graphs-nhwc",
                                                                   "batched-graphs-nhwc-tuned"]  # fmt: skip
    assert [e for e in gpu.EXECUTORS if gpu.EXECUTORS[e].get("autotune")] == [
        "batched-tuned", "batched-graphs-tuned", "batched-graphs-nhwc-tuned"]


def test_a_call_in_two_parts_measures_the_goals_in_the_first_and_everything_else_in_the_second(tmp_path):
    """`--part goals`: the goals' cases alone, no tests, no probes (a short first call whose figures come back even
    if the machine fails during the second); `--part rest`: the tests, the probes and every other case; together
    what one whole call measures, each once, in its order. `--skip` and `--cases` hold in each part."""
    gpu = _gpu_script()

    def parts(*extra):
        return gpu.parts(gpu.parse_args(["--device", "cuda", "--out", str(tmp_path), *extra]))

    a = gpu.parse_args(["--device", "cuda", "--out", str(tmp_path)])
    goal, every = gpu.goal_cases(a), gpu.cases(a)
    rest = [c for c in every if c not in goal]
    assert every[: len(goal)] == goal and len(rest) > 20
    assert parts() == (True, goal, True, rest)
    assert parts("--part", "goals") == (False, goal, False, [])
    assert parts("--part", "rest") == (True, [], True, rest)
    assert parts("--skip", "tests", "speed") == (False, [], True, [])
    assert parts("--part", "rest", "--skip", "tests") == (False, [], True, rest)
    one = "paper/fedavg/cnn/loop"
    assert parts("--part", "goals", "--cases", one) == (False, [("paper", "fedavg", "cnn", "loop")], False, [])
    assert parts("--part", "rest", "--cases", one) == (True, [], True, [])


def test_cublas_is_configured_for_reproducible_runs_before_the_first_measurement_uses_it(tmp_path, monkeypatch):
    """cuBLAS reads its workspace configuration when the process first uses it, so `gpu.py` sets it (as a run's
    `prepare` would) before the centralized limit, the first measurement: set by the first case's `prepare` only,
    every deterministic case would run with cuBLAS's default, nondeterministic configuration."""
    gpu = _gpu_script()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # so that the test's end puts back what was there before
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    seen = []

    def centralized(*args):
        seen.append(gpu.os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return 1.0

    monkeypatch.setattr(gpu, "centralized", centralized)
    monkeypatch.setattr(gpu, "speed_cases", lambda *args: None)
    monkeypatch.setattr(gpu.sys, "argv", ["gpu.py", "--device", "cpu", "--quick", "--part", "goals",
                                          "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(SystemExit) as done:
        gpu.main()
    assert done.value.code == 0 and seen and set(seen) == {":4096:8"}
