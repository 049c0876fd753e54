"""`benchmarks/executor_probe.py`: its draws are the same in every run, a stopped probe goes on where it stopped,
and each comparison reports a planted difference (a wrong batched rule, a worker's different result, a resume
from a wrong checkpoint) as a disagreement with exit code 1."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import hypothesis
import pytest
import torch
from hypothesis.internal.conjecture import providers

from pflbed.engine import batched
from pflbed.results import experiment
from tests import seeded_examples
from tests.engine import test_batched

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("executor_probe", ROOT / "benchmarks" / "executor_probe.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_draws_are_the_same_in_every_run_and_a_probe_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """At one draw, then at three: only draws 1 and 2 are added; a fresh probe of draw 1 draws the same config (the
    comparison itself stubbed: what is drawn and skipped is the probe's, whatever it compares)."""
    compared = []
    monkeypatch.setattr(probe, "compare", lambda what, cfg, *a: compared.append(cfg) or {"result": "equal"})
    first, again = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert probe.main(["batched", "--draws", "1", "--out", str(first)]) == 0
    assert probe.main(["batched", "--draws", "3", "--out", str(first)]) == 0
    assert [r["draw"] for r in _lines(first)] == [0, 1, 2] and len(compared) == 3
    assert probe.main(["batched", "--start", "1", "--draws", "1", "--out", str(again)]) == 0
    (one,) = _lines(again)
    assert one["draw"] == 1 and one["config"] == _lines(first)[1]["config"] == compared[1]
    assert len({json.dumps(c, sort_keys=True) for c in compared}) == 3  # three different draws


def test_every_algorithm_is_drawn_and_the_first_one_takes_only_its_share():
    """Draws 0 to 199 draw each of the algorithms, APFL (the first, which the example after hypothesis's simplest
    never takes) included, its draws of other features all different; a draw not given to it is hypothesis's own,
    as before APFL had its share."""
    drawn = [probe.draw(i) for i in range(400)]
    names = [a for a, _, _ in drawn[:200]]
    assert set(names) == set(probe.ALGORITHMS)
    assert 0 < names.count(probe.FIRST) <= 200 // len(probe.ALGORITHMS) * 2
    # chosen by the draw's index, not by a drawn value hypothesis favours (as a feature seed of 0): their other
    # features as varied as any draw's
    firsts = [features for a, _, features in drawn if a == probe.FIRST]
    assert len(set(firsts)) == len(firsts) >= 4
    for i in range(40):
        if names[i] != probe.FIRST:
            assert drawn[i] == probe._last_example(probe.DRAWS, i)


def test_a_draw_is_the_same_whatever_was_imported_before_it(tmp_path, monkeypatch):
    """Hypothesis draws now and then from the literals of the project's imported modules: a Flower probe imports
    more of them than a batched one, and a code change edits them. Draws 0 to 11 (draws 5 and 6 took such a
    literal), before and after importing a module of 500 fresh literals and drawing from hypothesis with them
    (which caches the literals it may take), are the same."""
    before = [probe.draw(i) for i in range(12)]
    (tmp_path / "many_literals.py").write_text("".join(f"X{k} = {7919 * k + 13}\n" for k in range(500)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "many_literals", raising=False)
    importlib.import_module("many_literals")

    @hypothesis.settings(max_examples=50, database=None, deadline=None)
    @hypothesis.given(probe.DRAWS)
    def elsewhere(drawn):
        pass

    monkeypatch.setattr(providers, "_get_local_constants", seeded_examples.HYPOTHESIS_POOL)  # (the suite's off)
    try:
        for i in range(12):
            elsewhere()
            assert probe.draw(i) == before[i], i
    finally:
        providers.CONSTANTS_CACHE.cache.clear()  # what `elsewhere` left there: the literals of this test's module


def test_a_wrong_batched_rule_is_reported_as_a_rule_not_as_rounding(tmp_path, monkeypatch):
    """Batched training planted wrong (every trained tensor moved by 1e-3): the run is off the loop's beyond its
    sensitivity, and round 1's float64 plans, batched vs alone, differ: `RULE`, exit 1; in float32 the batched
    training is the one far from the float64 plans."""
    torch.set_num_threads(1)
    real = batched.train_together

    def wrong(*a, **kw):
        return [{k: v + 1e-3 if v.is_floating_point() else v for k, v in t.items()} for t in real(*a, **kw)]

    monkeypatch.setattr(batched, "train_together", wrong)
    monkeypatch.setattr(test_batched, "train_together", wrong)
    out = tmp_path / "p.jsonl"
    assert probe.main(["batched", "--start", "4", "--draws", "1", "--out", str(out)]) == 1
    (r,) = _lines(out)
    assert r["result"] == "RULE" and r["float64"] > 1e-4 and r["distance"] > 100 * r["sensitivity"]
    # in float32 too, the batched training is the one off the float64 plans, the loop's is not; and the loop's is
    # float32 indeed: its rounding shows (a float32 path run in float64 would be 0 here)
    assert r["batched_f32"] > 1e-4 > 1e-5 > r["loop_f32"] > 1e-9


def test_a_wrong_compiled_rule_is_reported_as_a_rule_and_the_compiler_is_put_back(tmp_path, monkeypatch):
    """The compiled step planted wrong (every output moved by 1e-3; the eager step left alone): the run is off the
    eager batched run beyond its sensitivity, and round 1's plans in float64, compiled vs eager, differ: `RULE`,
    exit 1. The probe compiled on `aot_eager`, and `torch.compile` is torch's own again after it."""
    torch.set_num_threads(1)
    real, real_compile, backends = batched.compiled, torch.compile, []

    def wrong(step, mode, model, *kept):
        fast = real(step, mode, model, *kept)
        if mode == "off":
            return fast
        backends.append(torch.compile)
        moved = lambda t: t + 1e-3 if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        return lambda *a: torch.utils._pytree.tree_map(moved, fast(*a))

    monkeypatch.setattr(batched, "compiled", wrong)
    out = tmp_path / "p.jsonl"
    assert probe.main(["compiled", "--start", "4", "--draws", "1", "--out", str(out)]) == 1
    (r,) = _lines(out)
    assert r["result"] == "RULE" and r["float64"] > 1e-4 and r["distance"] > 100 * r["sensitivity"]
    assert backends and all(c is not real_compile for c in backends) and torch.compile is real_compile


def test_the_compiled_judge_trains_in_float64():
    """Draw 1 (Per-FedAvg on LeNet-5 with BatchNorm): round 1's plans, compiled vs eager, differ by about 1e-7 in
    float32 (AOT autograd's decompositions round differently); the judge's float64 training leaves no such gap."""
    torch.set_num_threads(1)
    cfg = probe.config(*probe.draw(1))
    assert (cfg["algorithm"]["name"], cfg["model"]["name"]) == ("perfedavg", "lenet5_bn")
    with probe.on_aot_eager():
        assert probe._compiled_parity(cfg)["float64"] <= 1e-12


@pytest.mark.parametrize(("what", "base"), [("batched", "loop"), ("compiled", "batched")])
def test_a_close_comparison_is_against_its_base_run_and_that_run_s_sensitivity(what, base, monkeypatch):
    """Batched clients against the loop, the compiled step against the eager batched one: both runs compared and the
    sensitivity (the learning rate moved) taken from the base executor's run."""
    ran = []
    state = SimpleNamespace(server={"w": torch.zeros(2)}, executor=SimpleNamespace(states={}))
    monkeypatch.setattr(probe, "_run", lambda cfg, executor, **kw: ran.append(executor) or state)
    assert probe.compare(what, probe.config("fedavg", {}, 2), "loop", None, None)["result"] == "equal"
    assert ran == [base, what, base]


def test_a_worker_result_that_differs_in_one_entry_is_a_mismatch(monkeypatch):
    """The bit-for-bit comparison (procs, Flower): one client state's entry moved by one float32 step in the other
    executor's run."""
    torch.set_num_threads(1)
    cfg = probe.config("fedavg", {}, 2)  # features 2: the MLP
    cfg["algorithm"] = {"name": "fedper"}
    real = probe._run

    def other(cfg, executor, **kw):
        res = real(cfg, "loop", **kw)
        if executor != "loop":
            state = next(iter(res.executor.states.values()))
            k = next(k for k, v in state.items() if v.is_floating_point())
            state[k] = torch.nextafter(state[k], torch.full_like(state[k], float("inf")))
        return res

    monkeypatch.setattr(probe, "_run", other)
    assert probe.compare("procs", cfg, "loop", None, None)["result"] == "MISMATCH"
    monkeypatch.setattr(probe, "_run", lambda cfg, executor, **kw: real(cfg, "loop", **kw))
    assert probe.compare("procs", cfg, "loop", None, None)["result"] == "equal"


@pytest.mark.parametrize("planted", [False, True])
def test_a_resume_from_a_wrong_checkpoint_is_a_mismatch(planted, monkeypatch):
    """Stopped after round 2's checkpoint and resumed: equal to the uninterrupted run, and a mismatch where the
    checkpoint's server state is loaded moved by 1e-3."""
    torch.set_num_threads(1)
    cfg = probe.config("fedavg", {}, 2)  # features 2: the MLP
    real = experiment.load_checkpoint

    def moved(*a, **kw):
        blob = real(*a, **kw)
        if blob is not None:
            blob["server"] = {k: v + 1e-3 if v.is_floating_point() else v for k, v in blob["server"].items()}
        return blob

    if planted:
        monkeypatch.setattr(experiment, "load_checkpoint", moved)
    assert probe.compare("resume", cfg, "loop", None, None)["result"] == ("MISMATCH" if planted else "equal")


@pytest.mark.xdist_group("flower-simulation")  # one Ray runtime at a time, beside the Flower parity tests
@pytest.mark.parametrize("what", [["procs"], ["flower"], ["batched"], ["resume", "--executor", "batched"],
                                  ["compiled"]])  # fmt: skip
def test_each_probe_runs_as_the_contributing_guide_shows_it(what, tmp_path):
    """Each comparison's command at one draw (FedAMP on the MLP, a cheap one): it runs and the executors agree."""
    torch.set_num_threads(1)
    out = tmp_path / "p.jsonl"
    assert probe.main([*what, "--start", "4", "--draws", "1", "--out", str(out)]) == 0
    (r,) = _lines(out)
    assert r["draw"] == 4 and r["config"]["model"]["name"] == "mlp" and r["result"] in ("equal", "rounding")
