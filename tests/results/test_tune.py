"""`pflbed tune` (issue 39): search spaces declared where the options live, studies on validation only, equal
budgets, resumable and shared studies."""

from __future__ import annotations

import pytest

from pflbed.algorithms import ALGORITHMS
from pflbed.config import TrainConfig
from pflbed.errors import ConfigError, PflbedError
from pflbed.search import Choice, IntSearch, Search, check_declared, declared, parse_space, sources


def test_declared_search_names_are_options_of_their_model():
    for name, cls in ALGORITHMS.items():
        check_declared(cls.Config, f"algorithms.{name}")
        for key, space in declared(cls.Config).items():  # every declared value validates as the option
            for v in ([space.low, space.high] if not isinstance(space, Choice) else list(space.options)):
                cls.Config.model_validate({key: v})
    check_declared(TrainConfig, "train")
    assert set(declared(TrainConfig)) == {"lr", "local_epochs", "momentum"}
    wanted = {"fedprox": {"mu"}, "ditto": {"lam"}, "fedselect": {"alpha", "p"}, "fedbasis": {"K", "tau"},
              "pfedhn": {"hn_lr"}}  # fmt: skip
    for name, keys in wanted.items():
        assert keys <= set(declared(ALGORITHMS[name].Config)), name
    assert declared(ALGORITHMS["fedprox"].Config)["mu"].log


def test_every_algorithm_declares_a_search_space_of_its_own_holding_its_defaults():
    """Every algorithm with options declares `search` on its own options class (an empty one says, in its source,
    why nothing is tuned): `pflbed tune` refuses one that inherits or lacks it. A numeric default (the paper's value,
    where the option has one) lies in its range, so a search can return the paper's setting."""
    for name, cls in ALGORITHMS.items():
        options = cls.Config
        if not options.model_fields:
            continue
        assert "search" in vars(options), f"{name}: no search space of its own"
        for key, space in declared(options).items():
            default = options.model_fields[key].default
            if isinstance(space, Search | IntSearch) and isinstance(default, int | float):
                assert space.low <= default <= space.high, (name, key, default, space)
    tuned = {n for n, c in ALGORITHMS.items() if declared(c.Config)}
    assert len(tuned) >= 25 and {"pfedme", "perfedavg", "apfl", "fedamp", "feddyn", "fedfomo", "fedmtl", "fedpac",
                                 "fedrep", "knnper", "l2gd", "scaffold", "fedrod_hyper", "ktpfl"} <= tuned  # fmt: skip


def test_an_option_whose_none_stands_for_another_key_says_which():
    """An option documented as "None: train.lr" (or train.local_epochs) declares it (`same_as`): the tuner's first
    trial fills it in from that key, so the trial is the default configuration. An option documented so but not
    declared would be drawn there instead, and its study could choose a "default" that is not one."""
    import re

    pattern = re.compile(r"(?:None:|default:?)\s*`?(train\.[a-z_]+)`?")
    declared_ = 0
    for name, cls in ALGORITHMS.items():
        for key, field in cls.Config.model_fields.items():
            said = pattern.search(field.description or "") if field.default is None else None
            if said:
                assert sources(cls.Config).get(key) == said.group(1), (name, key)
                declared_ += 1
    assert declared_ >= 12 and sources(ALGORITHMS["fedrep"].Config) == {"head_lr": "train.lr", "body_lr": "train.lr"}


def test_a_declaration_naming_no_option_is_caught():
    from typing import ClassVar

    from pydantic import BaseModel

    class Opts(BaseModel):
        search: ClassVar[dict] = {"nu": Search(0.1, 1.0)}
        mu: float = 0.1

    with pytest.raises(ConfigError, match="'nu' is not an option"):
        check_declared(Opts, "x")


def test_parse_space_forms_and_errors():
    assert parse_space({"low": 1e-3, "high": 1, "log": True}, "w") == Search(1e-3, 1.0, True)
    assert parse_space({"low": 1, "high": 4, "int": True}, "w") == IntSearch(1, 4)
    assert parse_space({"low": 1, "high": 8, "int": True, "log": True}, "w") == IntSearch(1, 8, True)  # every key
    assert parse_space({"low": 0.5, "high": 0.5}, "w") == Search(0.5, 0.5)  # one value: a range Optuna takes
    assert parse_space([1, "a"], "w") == Choice([1, "a"])
    assert parse_space([None, True, 0.5, 2, "x"], "w") == Choice((None, True, 0.5, 2, "x"))  # each kind Optuna keeps
    assert parse_space({"low": 1, "high": 2, "log": False, "int": False}, "w") == Search(1.0, 2.0)
    forms = "give {low: L, high: H[, log: true][, int: true]} or {choices: [...]}"
    for bad, message in (({"low": 0, "high": 1, "log": True}, "a log range needs low > 0, got 0.0"),
                         ({"low": 2, "high": 1}, "low 2.0 must not exceed high 1.0"),
                         ({"low": True, "high": 2}, "low and high must be numbers"),  # YAML's yes is no bound
                         ({"low": 1, "high": 2.5, "int": True}, "an integer range needs integer low and high"),
                         ({"low": 0, "high": 4, "int": True, "log": True}, "a log range needs low > 0, got 0"),
                         ({"choices": []}, "a choice needs at least one option"),
                         ({"choices": "0.1"}, "choices must be a list of options, got str '0.1'"),  # 0, . and 1
                         ({"choices": {"a": 1}}, "choices must be a list of options, got dict {'a': 1}"),
                         ({"choices": [1, [2, 3]]}, "an option must be a number, a string, a boolean or null, got "
                                                    "list [2, 3]"),  # fmt: skip
                         ({"low": 1, "high": 2, "log": "no"}, "log and int must be true or false"),  # bool("no")
                         ({"low": 1, "high": 2, "int": 1}, "log and int must be true or false"),
                         ({"lo": 1}, f"unknown keys ['lo']; {forms}"), (3, forms)):
        with pytest.raises(ConfigError) as e:
            parse_space(bad, "w")
        assert str(e.value) == f"w: {message}", bad


def test_a_space_hands_its_bounds_and_scale_to_the_sampler_and_says_them():
    """What the trial is asked for is the space's: an integer range drawn log-uniform is drawn so (not uniform)."""

    class Trial:
        def __getattr__(self, method):
            return lambda *args, **kwargs: (method, args, kwargs)

    spaces = (Search(1e-3, 1.0, True), Search(0.0, 0.9), IntSearch(1, 64, True), IntSearch(1, 5),
              Choice([1, "a", None]))
    assert [s.suggest(Trial(), "k") for s in spaces] == [
        ("suggest_float", ("k", 1e-3, 1.0), {"log": True}), ("suggest_float", ("k", 0.0, 0.9), {"log": False}),
        ("suggest_int", ("k", 1, 64), {"log": True}), ("suggest_int", ("k", 1, 5), {"log": False}),
        ("suggest_categorical", ("k", [1, "a", None]), {})]
    assert [s.text() for s in spaces] == ["log-uniform [0.001, 1]", "uniform [0, 0.9]", "int log [1, 64]", "int [1, 5]",
                                          "one of 1, 'a', None"]


def test_algorithms_name_shows_the_search_space(capsys):
    from pflbed.cli import main

    assert main(["algorithms", "fedbasis"]) == 0
    out = capsys.readouterr().out
    tau = next(line for line in out.splitlines() if line.startswith("│ tau "))
    assert [c.strip() for c in tau.split("│")[1:-1]][5] == "log-uniform [0.02, 1]"
    assert "train.lr: log-uniform [0.001, 0.3]" in out
    assert main(["algorithms", "l2gd"]) == 0  # the shared keys its training never reads: not in its search
    out = " ".join(capsys.readouterr().out.split())
    assert ("search space (pflbed tune): train.lr: log-uniform [0.001, 0.3] (left out: train.local_epochs, "
            "train.momentum, train.weight_decay, never read by its training with its default options)") in out


class _FakeTuner:
    """`pflbed tune`'s view of a Tuner: methods A, B and C, those in `short` still short of their budget."""

    calls: list = []
    short: tuple[str, ...] = ()
    stop = False

    def __init__(self, suite, out, storage) -> None:
        from types import SimpleNamespace

        self.calls.append(("tuner", suite, out, storage))
        self.out = Path(out or "tune-dir")
        self.methods = [SimpleNamespace(name=name) for name in "ABC"]
        self.storage_path = "study.db"

    def run_trials(self, max_trials, worker, log) -> None:
        self.calls.append(("trials", max_trials, worker, log is not None))
        if self.stop:
            raise KeyboardInterrupt

    def finished(self, method) -> bool:
        return method.name not in self.short

    def bench(self):
        from types import SimpleNamespace

        return SimpleNamespace(run=lambda log, jobs: self.calls.append(("re-runs", jobs, log is not None))), None

    def write_tables(self):
        self.calls.append(("tables",))
        return Path("t.md"), Path("t.json")


@pytest.fixture
def fake_tuner(tmp_path, monkeypatch):
    """The command alone: a stand-in suite loader, Optuna check and Tuner, run in tmp_path (the table's files)."""
    import pflbed.results.tune as tune

    monkeypatch.chdir(tmp_path)
    Path("t.md").write_text("| the table |\n")
    monkeypatch.setattr(_FakeTuner, "calls", [])
    monkeypatch.setattr(tune, "load_tune_suite", lambda config, overrides: ("suite", config, tuple(overrides)))
    monkeypatch.setattr(tune, "optuna_module", lambda: _FakeTuner.calls.append(("optuna",)))
    monkeypatch.setattr(tune, "Tuner", _FakeTuner)
    return _FakeTuner


def test_tune_runs_the_trials_then_the_re_runs_once_every_study_is_done_then_prints_the_table(fake_tuner, capsys):
    from pflbed.cli import main

    assert main(["tune", "-c", "s.yaml", "--set", "a=1", "--out", "o", "--storage", "sqlite:///x.db",
                 "--max-trials", "3", "--jobs", "2"]) == 0  # fmt: skip
    assert fake_tuner.calls == [("optuna",), ("tuner", ("suite", "s.yaml", ("a=1",)), Path("o"), "sqlite:///x.db"),
                                ("trials", 3, False, True), ("re-runs", 2, True), ("tables",)]  # fmt: skip
    assert capsys.readouterr().out == "| the table |\n\ntables: t.md, t.json; study: study.db\n"


def test_tune_with_a_study_short_of_its_budget_writes_the_table_without_re_runs_and_names_the_study(
        fake_tuner, monkeypatch, capsys):  # fmt: skip
    from pflbed.cli import main

    monkeypatch.setattr(fake_tuner, "short", ("A", "C"))
    assert main(["tune", "-c", "s.yaml"]) == 0
    assert [c[0] for c in fake_tuner.calls] == ["optuna", "tuner", "trials", "tables"]
    assert fake_tuner.calls[1][2:] == (None, None) and fake_tuner.calls[2] == ("trials", None, False, True)
    assert capsys.readouterr().out.splitlines()[-1] == ("tables: t.md, t.json; study: study.db — studies still short "
                                                         "of their budget: A, C (re-run to continue)")  # fmt: skip


def test_a_tune_worker_runs_trials_only_and_table_only_writes_the_table_only(fake_tuner, capsys):
    from pflbed.cli import main

    assert main(["tune", "-c", "s.yaml", "--worker"]) == 0
    assert fake_tuner.calls[2:] == [("trials", None, True, True)] and capsys.readouterr().out == ""
    fake_tuner.calls.clear()
    assert main(["tune", "-c", "s.yaml", "--table-only"]) == 2  # no study yet: no table of nothing, no study made
    assert capsys.readouterr().err == ("pflbed: error: --table-only: tune-dir holds no study of this suite; run it "
                                       "first (without --table-only)\n")  # fmt: skip
    assert main(["tune", "-c", "s.yaml", "--table-only", "--storage", "sqlite:///x.db"]) == 0  # a storage elsewhere
    capsys.readouterr()
    fake_tuner.calls.clear()
    Path("tune-dir").mkdir()
    Path("tune-dir", "study.db").write_bytes(b"")
    assert main(["tune", "-c", "s.yaml", "--table-only"]) == 0  # every study done, still no re-runs
    assert fake_tuner.calls[2:] == [("tables",)]
    assert capsys.readouterr().out.endswith("tables: t.md, t.json; study: study.db\n")
    fake_tuner.calls.clear()
    assert main(["tune", "-c", "s.yaml", "--worker", "--table-only"]) == 2
    assert capsys.readouterr().err == ("pflbed: error: --worker runs trials only; --table-only writes the table: "
                                       "give one\n")  # fmt: skip
    assert [c[0] for c in fake_tuner.calls] == ["optuna", "tuner"]  # nothing ran


@pytest.mark.parametrize("worker", [False, True])
def test_an_interrupted_tune_names_the_command_that_continues_it_with_the_options_given(fake_tuner, monkeypatch,
                                                                                        capsys, worker):
    from pflbed.cli import main

    monkeypatch.setattr(fake_tuner, "stop", True)
    given = ["-c", "my suite.yaml", "--set", "a=1", "--set", "b=[x, y]", "--out", "o", "--storage", "sqlite:///x.db",
             "--max-trials", "3", "--jobs", "2", *(["--worker"] if worker else [])]  # fmt: skip
    assert main(["tune", *given]) == 130
    assert capsys.readouterr().err == (
        "pflbed: interrupted; finished trials and re-runs are kept: continue with: pflbed tune -c 'my suite.yaml' "
        f"--set a=1 --set 'b=[x, y]' --out o --storage sqlite:///x.db{' --worker' if worker else ''} --max-trials 3 "
        "--jobs 2\n")  # every option given, as typed
    assert fake_tuner.calls[-1][0] == "trials"
    assert main(["tune", "-c", "s.yaml", "--jobs", "1"]) == 130  # the defaults, not repeated
    assert capsys.readouterr().err.endswith("continue with: pflbed tune -c s.yaml\n")


# --- studies -------------------------------------------------------------------------------------------------------
optuna = pytest.importorskip("optuna")

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from pflbed.cli import main  # noqa: E402
from pflbed.results.tune import (  # noqa: E402
    TuneMethod,
    Tuner,
    TuneSuite,
    _Surplus,
    _trial_seconds,
    apply_overrides,
    load_tune_suite,
    shown_storage,
)
from pflbed.results.tune.tables import _pct, _short  # noqa: E402

from ..doc_commands import page_command  # noqa: E402
from .test_tune_protocol import _seconds, _timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = {"dataset": {"name": "digits"}, "model": {"name": "mlp"}, "federation": {"clients": 3},
        "train": {"rounds": 2, "checkpoint_every": 0}, "eval": {"every": 1, "finetune": []},
        "executor": {"threads": 1}}  # fmt: skip


def suite(tmp_path, trials=2, methods=None, **tune):
    return {"name": "t", "out": str(tmp_path / "out"), "base": BASE, "seeds": [0],
            "tune": {"trials": trials, "budget": 1000, "pruner": "none", **tune},
            "methods": methods or {"FedAvg": {"set": {"algorithm.name": "fedavg"}}}}  # fmt: skip


def write(tmp_path, tree) -> str:
    f = tmp_path / "suite.yaml"
    f.write_text(yaml.safe_dump(tree))
    return str(f)


def finished(tuner, method):
    study = tuner.study(method)
    return study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))


def test_a_two_method_study_finishes_and_writes_the_table(tmp_path, capsys):
    methods = {"FedAvg": {"set": {"algorithm.name": "fedavg"}},
               "FedProx": {"set": {"algorithm.name": "fedprox"}, "space": {"train.momentum": None}}}  # fmt: skip
    f = write(tmp_path, suite(tmp_path, 2, methods))
    assert main(["tune", "-c", f]) == 0
    out = tmp_path / "out"
    table = json.loads((out / "table.json").read_text())
    rows = {r["method"]: r for r in table["methods"]}
    assert set(rows) == {"FedAvg", "FedProx"}
    assert table["storage"] == "study.db"  # the default, in the tune directory: no path of this machine
    tuner = Tuner(load_tune_suite(f))
    for r in rows.values():
        assert r["trials_cap"] == 2 and r["complete"] + r["pruned"] == 2
        assert r["default"]["P-FL"] is not None and r["tuned"]["P-FL"] is not None  # default vs tuned
        assert r["seeds"] == {"default": 1, "tuned": 1, "of": 1}
        assert (out / r["plots"]["history"]).exists()
        # compute: the trials' running times (Optuna's), and the re-runs' wall times (2 runs, one seed each)
        study = tuner.study(next(m for m in tuner.methods if m.name == r["method"]))
        spans = [(t.datetime_complete - t.datetime_start).total_seconds() for t in study.get_trials()]
        assert r["seconds"]["search"] == pytest.approx(sum(spans)) and len(spans) == 2
        walls = [json.loads(p.read_text())["timing"]["wall_s"] for p in (out / "final").rglob("summary.json")
                 if f"/{r['method']}" in str(p)]  # fmt: skip
        assert len(walls) == 2 and r["seconds"]["reruns"] == pytest.approx(sum(walls))
    assert "algorithm.mu" in rows["FedProx"]["chosen"] and "train.momentum" not in rows["FedProx"]["chosen"]
    md = (out / "table.md").read_text()
    assert "| FedProx | 2 (" in md and "P-FL default | P-FL tuned" in md and "plots/FedAvg-history.png" in md
    page = (out / "report.html").read_text()  # self-contained: the plots embedded
    assert page.count("data:image/png;base64,") == sum(len(r["plots"]) for r in rows.values()) >= 2
    # every trial is an ordinary run directory: pflbed report reads it
    trial = next((out / "trials" / "FedAvg").iterdir())
    assert main(["report", str(trial), "-o", str(tmp_path / "r.md")]) == 0


def test_trials_are_scored_on_validation_never_on_test(tmp_path, monkeypatch):
    """Validation made the mirror image of test (val = 1 − test): the objective and every pruner report must be the
    validation figure at the round selected on validation; a study scored on a test figure fails here."""
    import pflbed.engine.driver as driver

    real = driver.evaluate

    def mirrored(*args, **kwargs):
        scores, per_client = real(*args, **kwargs)
        return {**scores, "pfl_val": 1 - scores["pfl_acc"], "gfl_val": 1 - scores["gfl_acc"]}, per_client

    monkeypatch.setattr(driver, "evaluate", mirrored)
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2, pruner="median")))
    tuner.run_trials(log=lambda *_: None)
    trials = finished(tuner, tuner.methods[0])
    assert len(trials) == 2
    for t in trials:
        history = [json.loads(line) for line in (tuner.out / t.user_attrs["run_dir"] / "metrics.jsonl").open()]
        val = max(h["pfl_val"] for h in history)
        assert t.value == pytest.approx(val)
        assert all(t.value != pytest.approx(h["pfl_acc"]) for h in history)
        running = [max(h["pfl_val"] for h in history[: k + 1]) for k in range(len(history))]
        assert [t.intermediate_values[h["round"]] for h in history] == pytest.approx(running)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # trials made by hand (study.ask)
def test_a_restarted_study_continues_without_repeating_trials(tmp_path):
    f = write(tmp_path, suite(tmp_path, 3))
    assert main(["tune", "-c", f, "--max-trials", "1"]) == 0
    tuner = Tuner(load_tune_suite(f))
    (first,) = finished(tuner, tuner.methods[0])
    stamp = (tuner.out / first.user_attrs["run_dir"] / "summary.json").stat().st_mtime_ns
    # a process killed mid-trial: its trial stays RUNNING, owned by a process that no longer exists
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    study = tuner.study(tuner.methods[0])
    killed = study.ask({"train.lr": optuna.distributions.FloatDistribution(1e-3, 0.3, log=True)})
    killed.set_user_attr("host", __import__("socket").gethostname())
    killed.set_user_attr("pid", dead.pid)
    assert main(["tune", "-c", f]) == 0
    trials = study.get_trials()
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(done) == 3 and [t.number for t in trials if t.state == TrialState.FAIL] == [killed.number]
    retry = next(t for t in done if t.user_attrs.get("retry_of") == killed.number)  # its parameters, queued again
    assert retry.params["train.lr"] == killed.params["train.lr"]
    assert (tuner.out / first.user_attrs["run_dir"] / "summary.json").stat().st_mtime_ns == stamp  # not re-run
    assert len(list((tuner.out / "trials" / "FedAvg").iterdir())) == 3  # the killed trial never got a run dir


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # a trial made by hand (study.ask)
def test_a_trial_says_when_it_starts_and_how_its_rounds_go_and_a_worker_why_it_stops(tmp_path):
    """A trial is minutes long: it says it started (k of the budget) and prints each evaluation round's objective;
    a worker that finds a method's budget spent, or the rest running elsewhere, says so instead of exiting
    silently."""
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2)))
    lines: list[str] = []
    passes: list[int] = []  # the running trial's recorded compute as each round's line is printed

    def log(line: str) -> None:
        lines.append(line)
        if ": round " in line:
            (running,) = tuner.study(tuner.methods[0]).get_trials(states=(TrialState.RUNNING,))
            passes.append(running.user_attrs["passes"])

    took = _timed(tuner.run_trials, log=log)
    starts = [line for line in lines if ": started, " in line]
    assert [line.split(": started, ")[1] for line in starts] == \
        ["trial 1; 0.00 of 1000 base runs spent", "trial 2; 1.00 of 1000 base runs spent"]  # fmt: skip
    first, second = tuner.study(tuner.methods[0]).get_trials()
    head = starts[0].split(": started")[0]  # the trial's values by their names without the section
    assert head.startswith("FedAvg trial 0 (") and head.endswith(")")
    assert head.removeprefix("FedAvg trial 0 (")[:-1].split(", ") == \
        [f"{k.split('.', 1)[1]}={_short(v)}" for k, v in first.params.items()]  # fmt: skip
    rounds = [line for line in lines if "trial 1: round " in line]
    assert [line.split("round ")[1].split(",")[0] for line in rounds] == ["1/2", "2/2"]  # eval.every 1, 2 rounds
    assert all("pfl_val" in line for line in rounds)
    history = [json.loads(line) for line in (tuner.out / second.user_attrs["run_dir"] / "metrics.jsonl").open()]
    assert [line.split("pfl_val ")[1].split(",")[0] for line in rounds] == [_pct(h["pfl_val"]) for h in history]
    assert [line.split(", ")[-1] for line in lines if "trial 0: round " in line] == \
        ["0.50 base runs", "1.00 base runs"]  # fmt: skip
    assert _seconds(lines[-1], f"{starts[1].split(': started')[0]}: pfl_val {_pct(second.value)}") <= took
    unit = tuner.unit()  # each round's compute is recorded as it ends, for other processes' budget checks
    total = second.user_attrs["passes"]  # its local epochs are drawn: a multiple of the base run's
    assert passes == [unit / 2, unit, total / 2, total] and total % unit == 0
    lines.clear()
    assert tuner.run_trials(worker=True, log=lines.append) == 0
    assert len(lines) == 1 and lines[0].startswith("FedAvg: its budget is spent (") and "2 trials finished" in lines[0]
    tuner.study(tuner.methods[0]).ask()  # a trial running elsewhere, the budget one more
    wide = Tuner(TuneSuite.model_validate(suite(tmp_path, 3)))
    lines.clear()
    assert wide.run_trials(worker=True, log=lines.append) == 0
    assert len(lines) == 1 and lines[0].startswith("FedAvg: nothing left to start (")
    assert lines[0].endswith("base runs spent, 1 trial running elsewhere)")
    tuner.study(tuner.methods[0]).ask()  # two running elsewhere, the cap one more again
    wider = Tuner(TuneSuite.model_validate(suite(tmp_path, 4)))
    lines.clear()
    assert wider.run_trials(worker=True, log=lines.append) == 0
    assert len(lines) == 1 and lines[0].endswith("base runs spent, 2 trials running elsewhere)")


def test_the_table_marks_a_study_short_of_its_budget_and_says_what_its_std_is(tmp_path):
    """A study that has not spent its budget is marked short in the table (its row is not yet an equal-budget
    comparison); the intro says that ± is the population standard deviation over the seeds."""
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, None, budget=4)))

    def row(name, complete, pruned, spent):
        return {"method": name, "budget": 4, "complete": complete, "pruned": pruned, "best_value": 0.5,
                "objective": "pfl_val", "best_trial": 0, "chosen": {}, "default": {"P-FL": (80.0, 1.0)},
                "tuned": {"P-FL": (81.0, 0.5)}, "seeds": {"default": 1, "tuned": 1, "of": 1},
                "seconds": {"search": 60.0, "reruns": 60.0}, "finished": spent >= 4,
                "compute": {"base_runs": spent, "unit_sample_passes": 100.0}}  # fmt: skip

    _, cells = tuner.table([row("Full", 3, 1, 4.1), row("Short", 2, 0, 2.0)])
    assert cells[0][1:3] == ["4 (3 / 1)", "4.10 of 4"] and cells[1][1:3] == ["2 (2 / 0)", "2.00 of 4, **short**"]
    assert "population standard deviation" in tuner._intro([row("Full", 3, 1, 4.1)])


def test_a_ctrl_c_leaves_its_trial_running_for_the_next_command_to_queue_again(tmp_path, monkeypatch, caplog):
    """Ctrl-C in a trial: no Optuna traceback, the trial is left RUNNING (Optuna's optimize would record it FAIL
    at once, so `recover` never saw it), and the next command, finding its process gone, queues its parameters again
    and runs them."""
    import pflbed.results.experiment

    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2)))
    real = pflbed.results.experiment.run
    monkeypatch.setattr(pflbed.results.experiment, "run", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        tuner.run_trials(log=lambda *_: None)
    study = tuner.study(tuner.methods[0])
    (left,) = study.get_trials()
    assert left.state == TrialState.RUNNING
    assert not [r for r in caplog.records if r.name.startswith("optuna") and "failed" in r.getMessage()]
    study._storage.set_trial_user_attr(left._trial_id, "pid", 2**22 + 12345)  # its process is gone
    monkeypatch.setattr(pflbed.results.experiment, "run", real)
    again = Tuner(TuneSuite.model_validate(suite(tmp_path, 2)))
    logs: list[str] = []
    assert again.run_trials(log=logs.append) == 2
    assert logs[0] == "FedAvg: re-queued the trials a stopped process left running"
    trials = again.study(again.methods[0]).get_trials()
    retried = [t for t in trials if t.user_attrs.get("retry_of") == left.number]
    assert trials[0].state == TrialState.FAIL and len(retried) == 1 and retried[0].params == left.params


def test_two_workers_share_one_sqlite_study(tmp_path):
    f = write(tmp_path, suite(tmp_path, 4))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "pflbed", "tune", "-c", f, "--worker"]
    procs = [subprocess.Popen(cmd + ["--max-trials", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
    began = tmp_path / "out" / "trials"
    for _ in range(1200):  # the second starts once the first has begun a trial: on a loaded machine it could
        if any(began.glob("*/*")) or procs[0].poll() is not None:  # otherwise take the whole budget first
            break
        time.sleep(0.1)
    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stdout.read().decode()
    tuner = Tuner(load_tune_suite(f))
    trials = tuner.study(tuner.methods[0]).get_trials()
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(done) == 4  # the budget, not one trial more
    assert {t.user_attrs["pid"] for t in done} == {p.pid for p in procs}  # both ran trials of the one study
    assert not (tuner.out / "table.md").exists()  # workers only run trials


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # trials made by hand (study.ask)
@pytest.mark.filterwarnings("error:The value None could not be cast")  # told failed, not told None
def test_a_trial_begun_after_the_budget_is_taken_is_surplus(tmp_path):
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2)))
    study = tuner.study(tuner.methods[0])
    for _ in range(2):  # two trials running elsewhere take the budget
        study.ask()
    late = study.ask()
    with pytest.raises(_Surplus):
        tuner._objective(tuner.methods[0], late, lambda *_: None)
    assert not tuner._one_trial(study, tuner.methods[0], lambda *_: None)  # asked, found surplus, told: not counted
    trials = study.get_trials()
    assert trials[-1].state == TrialState.FAIL and trials[-1].user_attrs["surplus"] and len(trials) == 4
    assert tuner.run_trials(worker=True) == 0 and not (tuner.out / "trials").exists()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # a trial made by hand (study.ask)
def test_a_trial_begun_when_the_others_spent_the_budget_to_the_pass_is_surplus(tmp_path):
    tuner = Tuner(TuneSuite.model_validate({**suite(tmp_path, 2), "tune": {"budget": 1, "pruner": "none"}}))
    study = tuner.study(tuner.methods[0])
    study.add_trial(optuna.trial.create_trial(value=0.5, user_attrs={"passes": int(tuner.unit())}))
    with pytest.raises(_Surplus):
        tuner._objective(tuner.methods[0], study.ask(), lambda *_: None)


@pytest.mark.filterwarnings("error:The value None could not be cast")  # told failed, not told None
def test_a_trial_that_raises_is_failed_and_its_error_goes_on(tmp_path, monkeypatch):
    """An error inside a trial that is not the run's (not a divergence, a refusal or a prune): the trial is recorded
    failed, not counted, and the error reaches the command (one line there), not swallowed."""
    import pflbed.results.experiment

    monkeypatch.setattr(pflbed.results.experiment, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2)))
    with pytest.raises(OSError, match="disk full"):
        tuner.run_trials(log=lambda *_: None)
    (trial,) = tuner.study(tuner.methods[0]).get_trials()
    assert trial.state == TrialState.FAIL and tuner.counts(tuner.study(tuner.methods[0])) == (0, 0)


def test_a_running_trial_keeps_its_own_heartbeat(tmp_path, monkeypatch):
    """While a trial runs, its heartbeat is recorded (a machine that dies mid-trial is then found by the heartbeat's
    grace period, `fail_stale_trials`), and the heartbeat stops with the trial."""
    beats = []
    real = optuna.storages.RDBStorage.record_heartbeat
    monkeypatch.setattr(optuna.storages.RDBStorage, "record_heartbeat",
                        lambda self, trial_id: (beats.append(trial_id), real(self, trial_id))[1])  # fmt: skip
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 1)))
    assert tuner.run_trials(log=lambda *_: None) == 1
    (trial,) = tuner.study(tuner.methods[0]).get_trials()
    assert beats and set(beats) == {trial._trial_id}
    assert not [t for t in threading.enumerate() if t.name == "pflbed-tune-heartbeat"]


def test_equal_budgets_are_enforced(tmp_path, capsys):
    methods = {"FedAvg": {"set": {"algorithm.name": "fedavg"}},
               "FedProx": {"set": {"algorithm.name": "fedprox"}, "trials": 3}}  # fmt: skip
    assert main(["tune", "-c", write(tmp_path, suite(tmp_path, 2, methods))]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("pflbed: error: methods.FedProx.trials: 3 against tune.trials 2: every method gets the same budget "
                   "(say tune.unequal_budgets: true to allow it)")  # fmt: skip
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2, methods, unequal_budgets=True)))
    assert [m.trials for m in tuner.methods] == [2, 3]
    methods["FedProx"] = {"set": {"algorithm.name": "fedprox"}, "budget": 5}
    assert main(["tune", "-c", write(tmp_path, suite(tmp_path, 2, methods))]) == 2
    assert "methods.FedProx.budget: 5.0 against tune.budget 1000.0" in capsys.readouterr().err


@pytest.mark.parametrize(("change", "message"), [
    ({"tune": {"budget": 2, "objective": "selected.pfl_acc"}}, "tune.objective: not a validation figure"),
    ({"tune": {"budget": 2, "objective": "pfl_acc"}}, "suite.yaml: tune.objective: not a validation figure; give one "
     "of pfl_val, gfl_val, new_val or a summary field ending in _val (never a test figure) (got 'pfl_acc')"),
    ({"methods": {"P": {"set": {"algorithm.name": "fedprox"}, "objective": "selected.gfl_acc"}}},
     "suite.yaml: methods.P.objective: not a validation figure"),
    ({"tune": {"trials": 0, "budget": 1}}, "tune.trials: "),
    ({"tune": {"trials": 2}}, "tune.budget: "),
    ({"seeds": [0, 100], "tune": {"budget": 1, "seed": 100}}, "tune.seed: 100 is one of the reported seeds"),
    ({"tune": {"budget": 1, "warmup": 1}}, "tune.warmup: "),
    ({"seeds": [0, 1, 0]}, "suite.yaml: seeds: each seed once: a repeated seed reruns the same run and counts it "
     "twice in mean ± std (got [0, 1, 0])"),
    ({"seeds": [0, -1]}, "suite.yaml: seeds.1: Input should be greater than or equal to 0 (got -1)"),
    ({"methods": {"P": {"set": {"algorithm.name": "fedprox"}, "space": {"algorithm.nu": {"low": 1, "high": 2}}}}},
     "methods.P.space.algorithm.nu: "),
    ({"methods": {"P": {"set": {"algorithm.name": "fedprox"}, "space": {"algorithm.mu": {"low": -1, "high": 1}}}}},
     "methods.P.space.algorithm.mu: -1.0 does not validate (methods.P: algorithm.mu: Input should be greater than "
     "or equal to 0 (got -1.0))"),
    ({"methods": {"P": {"set": {"algorithm.name": "fedprox", "train.lr": -1}}}},
     "pflbed: error: methods.P: train.lr: Input should be greater than 0 (got -1)"),
    ({"methods": {"P": {"space": {"train.lr": {"lo": 1}}}}}, "methods.P.space.train.lr: unknown keys"),
    ({"tune": {"trials": 2, "budget": 1, "space": {"train.lr": {"lo": 1}}}},
     "pflbed: error: tune.space.train.lr: unknown keys"),
    ({"methods": {"P": {"space": {"train.lr.x": [1, 2]}}}},  # a key below a number: its bound, not a traceback
     "pflbed: error: methods.P.space.train.lr.x: 1 does not validate (methods.P: train.lr: "),
    ({"methods": {"F": {"set": {"algorithm.name": "fedavg", "executor.name": "flower"}}}},
     "pflbed: error: methods.F: executor.name: flower trains on the sites, where `pflbed tune` cannot count a "
     "trial's compute; tune with loop, procs or threads"),
])  # fmt: skip
def test_bad_suites_fail_in_one_line_naming_the_field(tmp_path, capsys, change, message):
    assert main(["tune", "-c", write(tmp_path, {**suite(tmp_path), **change})]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_a_suite_without_tune_or_no_mapping_at_all_is_named_as_such(tmp_path, capsys):
    """A bench suite given to `pflbed tune` is told where it belongs; a file that is no mapping is told so, with or
    without `--set` (an override does not turn it into an empty suite whose first missing field is reported)."""
    tree = suite(tmp_path)
    del tree["tune"]
    f = write(tmp_path, tree)
    assert main(["tune", "-c", f]) == 2
    assert capsys.readouterr().err.strip() == (f"pflbed: error: {f}: tune: missing (trials per method, …); `pflbed "
                                               "bench` runs suites without one")  # fmt: skip
    (tmp_path / "suite.yaml").write_text("[1, 2]\n")
    for extra in ([], ["--set", "tune.trials=2"]):
        assert main(["tune", "-c", f, *extra]) == 2
        assert capsys.readouterr().err.strip() == (f"pflbed: error: {f}: config: Input should be a valid dictionary "
                                                   "or instance of TuneSuite")  # fmt: skip
    assert TuneMethod.model_validate({"objective": None}).objective is None  # null: the suite's objective


def test_a_set_naming_a_method_the_suite_lacks_lists_the_methods_it_has(tmp_path, capsys):
    two = suite(tmp_path, methods={"FedAvg": {"set": {"algorithm.name": "fedavg"}},
                                   "FedProx": {"set": {"algorithm.name": "fedprox"}}})
    none = suite(tmp_path)
    del none["methods"]
    for tree, item, shown in ((two, "methods=[FedAvg, Ditto]", "'Ditto' in the suite (FedAvg, FedProx)"),
                              (none, "methods=[A]", "'A' in the suite (it has none)"),
                              (none, "methods.A.set.train.lr=0.1", "'A' in the suite (it has none)")):
        assert main(["tune", "-c", write(tmp_path, tree), "--set", item]) == 2
        assert capsys.readouterr().err.strip() == f"pflbed: error: --set {item.split('=')[0]}: no method {shown}"


def test_without_optuna_tune_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)
    assert main(["tune", "-c", write(tmp_path, suite(tmp_path))]) == 2
    assert capsys.readouterr().err.strip() == "pflbed: error: pflbed tune needs Optuna: pip install 'pflbed[tune]'"


def test_importing_optuna_silences_its_experimental_warnings_only(recwarn):
    """Optuna's experimental-API warnings would interleave with a study's lines; every other warning (a method
    tuned on train.* alone, a deprecation) must still reach the user."""
    from pflbed.results.tune import optuna_module

    module = optuna_module()
    warnings.warn("theirs", module.exceptions.ExperimentalWarning, stacklevel=1)
    warnings.warn("ours", UserWarning, stacklevel=1)
    assert [str(w.message) for w in recwarn] == ["ours"]


def test_a_method_whose_algorithm_declares_no_search_space_is_refused_or_warned_about(tmp_path, monkeypatch):
    """An algorithm with options of its own but no `search` declaration of its own (here Ditto's declaration
    removed: its λ and personal steps would silently go untuned beside a method whose knobs are tuned) is refused,
    naming the method and each of its options; `tune.undeclared: warn` tunes it on train.* alone and says so."""
    from pflbed.algorithms.ditto import DittoOptions

    monkeypatch.delattr(DittoOptions, "search")
    methods = {"Ditto": {"set": {"algorithm.name": "ditto"}}}
    why = ("methods.Ditto: algorithm 'ditto' declares no search space for its own options (lam, personal_epochs, "
           "personal_lr): a comparison would tune the others' knobs and not its own; {}, or set tune.undeclared: warn")
    with pytest.raises(ConfigError) as refused:
        Tuner(TuneSuite.model_validate(suite(tmp_path, 2, methods)))
    assert str(refused.value) == why.format("declare `search` on its options (pflbed.search)")
    with pytest.warns(UserWarning) as warned:
        tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2, methods, undeclared="warn")))
    assert [str(w.message) for w in warned] == [
        why.format("tuning its train.* alone. Declare `search` on its options (pflbed.search)")]
    assert all(k.startswith("train.") for k in tuner.methods[0].space)


def test_a_diverged_trial_counts_as_pruned_toward_the_budget(tmp_path):
    methods = {"FedAvg": {"set": {"algorithm.name": "fedavg"}, "space": {"train.lr": {"choices": [1.0e30]}}}}
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2, methods)))
    lines: list[str] = []
    assert tuner.run_trials(max_trials=3, log=lines.append) == 2  # the budget, then stop
    trials = tuner.study(tuner.methods[0]).get_trials()
    assert [t.state for t in trials] == [TrialState.PRUNED] * 2
    assert [t.user_attrs["diverged"] for t in trials] == [1, 1]
    assert all(t.user_attrs["passes"] > 0 for t in trials)  # the compute up to the divergence counts
    ends = [line.split("): ", 1)[1] for line in lines if ": started, " not in line]
    assert ends == ["diverged in round 1: counted as pruned"] * 2


def test_a_trial_whose_values_the_algorithm_refuses_together_counts_as_pruned(tmp_path):
    """Each bound of a space validates alone; a combination an algorithm refuses (L2GD: θ = lr·λ·(1 − p)/p must be
    ≤ 1) is counted as pruned with the reason, not the end of the study."""
    space = {"train.lr": None, "algorithm.lam": {"low": 5.0, "high": 10.0}, "algorithm.p": {"low": 0.1, "high": 0.2}}
    methods = {"L2GD": {"set": {"algorithm.name": "l2gd", "train.lr": 0.3}, "space": space}}
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2, methods)))
    lines: list[str] = []
    assert tuner.run_trials(max_trials=3, log=lines.append) == 2
    trials = tuner.study(tuner.methods[0]).get_trials()
    assert [t.state for t in trials] == [TrialState.PRUNED] * 2
    assert all("algorithm.lam" in t.user_attrs["refused"] for t in trials)
    ends = [line.split("): ", 1)[1] for line in lines if ": started, " not in line]
    assert ends == [f"refused ({t.user_attrs['refused']}): counted as pruned" for t in trials]


def test_the_tuned_configuration_is_the_trial_with_the_highest_validation_figure(tmp_path):
    """The study maximizes its objective (a validation figure): its best trial — what Optuna's sampler and pruner
    steer by — is the highest one, and so is the trial whose configuration is re-run as the tuned one (red with the
    study's direction planted as "minimize")."""
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 3)))
    method = tuner.methods[0]
    study = tuner.study(method)
    lr = optuna.distributions.FloatDistribution(1e-3, 0.3, log=True)
    for value, figure in ((0.01, 0.4), (0.1, 0.8), (0.003, 0.6)):
        study.add_trial(optuna.trial.create_trial(params={"train.lr": value}, distributions={"train.lr": lr},
                                                  value=figure))  # fmt: skip
    assert study.best_trial.value == 0.8 and study.best_trial.params == {"train.lr": 0.1}
    assert tuner.best(method).number == study.best_trial.number
    bench, rows = tuner.bench()
    assert bench.suite.tables["tuned"].methods[rows["FedAvg"]].set["train.lr"] == 0.1
    study.add_trial(optuna.trial.create_trial(params={"train.lr": 0.2}, distributions={"train.lr": lr}, value=0.8))
    assert tuner.best(method).params == {"train.lr": 0.1}  # a tie: the earlier trial


def test_the_re_runs_are_each_methods_set_then_with_the_chosen_values_and_report_its_columns(tmp_path):
    """The bench's default cell runs the method's own `set` (its algorithm, its fixed options), the tuned cell that
    with the chosen trial's values over it; both report the method's columns over the suite's (here a method
    without a global model drops G-FL, the suite's columns have a column of its own)."""
    methods = {"P": {"set": {"algorithm.name": "fedprox", "algorithm.mu": 0.1}, "report": {"G-FL": None}}}
    columns = {"P-FL": "selected.pfl_acc", "G-FL": "selected.gfl_acc", "final P-FL": "final.pfl_acc"}
    tuner = Tuner(TuneSuite.model_validate({**suite(tmp_path, 3, methods), "report": columns}))
    lr = optuna.distributions.FloatDistribution(1e-3, 0.3, log=True)
    tuner.study(tuner.methods[0]).add_trial(optuna.trial.create_trial(params={"train.lr": 0.1},
                                                                      distributions={"train.lr": lr}, value=0.8))
    bench, rows = tuner.bench()
    default, tuned = bench.suite.tables["default"].methods["P"], bench.suite.tables["tuned"].methods[rows["P"]]
    assert default.set == {"algorithm.name": "fedprox", "algorithm.mu": 0.1}
    assert tuned.set == {"algorithm.name": "fedprox", "algorithm.mu": 0.1, "train.lr": 0.1}
    assert default.report == tuned.report == {**columns, "G-FL": None}
    assert bench.suite.tables["default"].report == bench.suite.tables["tuned"].report == columns
    assert (bench.suite.base, bench.suite.seeds, bench.suite.out) == (BASE, [0], str(tuner.out / "final"))


def test_a_study_without_a_complete_trial_has_no_tuned_configuration(tmp_path):
    """Only pruned (or failed) trials: nothing was scored to the end, so nothing is chosen, and the table re-runs the
    default alone."""
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, 2)))
    method = tuner.methods[0]
    study = tuner.study(method)
    lr = optuna.distributions.FloatDistribution(1e-3, 0.3, log=True)
    study.add_trial(optuna.trial.create_trial(params={"train.lr": 0.1}, distributions={"train.lr": lr},
                                              state=TrialState.PRUNED, intermediate_values={1: 0.9}))  # fmt: skip
    assert tuner.best(method) is None
    bench, rows = tuner.bench()
    assert rows == {} and "tuned" not in bench.suite.tables
    (row,) = tuner.rows()  # its table row: no best trial, nothing chosen, no tuned figure nor seed
    assert {k: row[k] for k in ("best_trial", "best_value", "best_truncated", "chosen", "chosen_is_default")} == {
        "best_trial": None, "best_value": None, "best_truncated": None, "chosen": {}, "chosen_is_default": False}
    assert row["tuned"] == {"P-FL": None, "G-FL": None} and row["seeds"] == {"default": 0, "tuned": 0, "of": 1}
    assert (row["complete"], row["pruned"]) == (0, 1)  # and the queued default, not yet taken:
    assert row["default_trial"] == {"number": 0, "state": "WAITING", "value": None}


def test_objective_values_are_validation_figures():
    from pflbed.results.tune import objective_value

    history = [{"round": 1, "pfl_val": 0.5, "pfl_acc": 0.9, "gfl_val": 0.7, "gfl_acc": 0.1},
               {"round": 2, "pfl_val": 0.6, "pfl_acc": 0.2, "gfl_val": 0.65, "gfl_acc": 0.3},
               {"round": 3, "pfl_val": 0.55, "pfl_acc": 0.2, "gfl_val": 0.7, "gfl_acc": 0.3}]  # fmt: skip
    per_lr = {"0.01": {"best_val": 0.4, "best": 0.99}, "0.1": {"best_val": 0.8, "best": 0.01}}
    nc = {"methods": {"ft": {"S": {"lr_best": 0.1, "per_lr": per_lr}, "L": {"lr_best": 0.01, "per_lr": per_lr}}}}
    summary = {"new_clients": nc, "final": {"ft": {"pfl_val": 0.45, "pfl_acc": 0.95}}}
    assert objective_value(summary, history, "pfl_val") == 0.6
    assert objective_value(summary, history, "gfl_val") == 0.7  # selected on G-FL val itself, not on P-FL val
    assert objective_value(summary, history, "new_val") == pytest.approx((0.8 + 0.4) / 2)
    assert objective_value(summary, history, "final.ft.pfl_val") == 0.45
    assert objective_value({"new_clients": None}, history, "new_val") is None
    assert objective_value({"new_clients": {"methods": {}}}, history, "new_val") is None
    assert objective_value(summary, [{"round": 1, "pfl_val": 0.5}], "gfl_val") is None  # a figure it never had
    assert objective_value(summary, [{"round": 1, "gfl_val": float("nan")}], "gfl_val") is None
    assert objective_value({"final": {"ft": {"pfl_val": float("nan")}}}, history, "final.ft.pfl_val") is None
    assert objective_value(summary, history, "final.lp.pfl_val") is None


def test_a_killed_tune_process_is_continued_by_the_next(tmp_path):
    """A real kill (SIGKILL mid-trial): the next `pflbed tune` fails the dead trial, runs its parameters again and
    stops at the budget."""
    import signal

    tree = suite(tmp_path, 1)
    tree["base"] = {**BASE, "train": {**BASE["train"], "rounds": 30}, "eval": {"every": 10, "finetune": []}}
    f = write(tmp_path, tree)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "pflbed", "tune", "-c", f, "--worker"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    metrics = tmp_path / "out" / "trials" / "FedAvg" / "trial0000" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:  # round 10
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tuner = Tuner(load_tune_suite(f))
    study = tuner.study(tuner.methods[0])
    (killed,) = study.get_trials()
    assert killed.state == TrialState.RUNNING and killed.user_attrs["pid"] == proc.pid
    assert main(["tune", "-c", f, "--worker"]) == 0
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert trials[1].params == killed.params and trials[1].user_attrs["retry_of"] == 0
    # the compute counts the trial that ran to its end, not the killed one (failed only at this resume)
    done = trials[1].datetime_complete - trials[1].datetime_start
    assert _trial_seconds(study) == done.total_seconds()


TUNE_SUITES = sorted(p for p in (ROOT / "benchmarks" / "suites").glob("*.yaml")
                     if "tune" in yaml.safe_load(p.read_text()))  # fmt: skip


@pytest.mark.parametrize("path", TUNE_SUITES, ids=[p.stem for p in TUNE_SUITES])
def test_the_committed_tune_suites_validate(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    tuner = Tuner(load_tune_suite(path))
    assert len({m.budget for m in tuner.methods}) == 1 and all(m.space for m in tuner.methods)
    for m in tuner.methods:  # FedBasis's FedAvg warm-up trains train.local_epochs: searched, not dropped as unused
        if m.config(tuner.seed, {}).algorithm.name == "fedbasis":
            assert "train.local_epochs" in m.space, m.name


def test_a_restarted_study_draws_new_parameters_not_the_first_process_s_again(tmp_path):
    """Each `pflbed tune` process builds its sampler anew: seeded like the first one, it would draw the first
    process's parameters again and spend the budget on a repeat. Two processes (two Tuners) of one study, one trial
    each: their parameters differ."""
    tree = suite(tmp_path, 2)
    first = Tuner(TuneSuite.model_validate(tree))
    assert first.run_trials(max_trials=1, log=lambda *_: None) == 1
    second = Tuner(TuneSuite.model_validate(tree))  # a restart: a fresh sampler on the same study
    assert second.run_trials(max_trials=1, log=lambda *_: None) == 1
    a, b = finished(second, second.methods[0])
    assert a.params != b.params


def test_a_storage_url_is_shown_without_its_password():
    """table.json and error lines name the storage; a database password must not travel with them."""
    assert shown_storage("postgresql://user:s3cret@db-host:5432/pflbed") == "postgresql://user:***@db-host:5432/pflbed"
    assert shown_storage("mysql+pymysql://u:p:q@h/d") == "mysql+pymysql://u:***@h/d"
    for kept in ("postgresql://user@db-host/pflbed", "sqlite:////data/study.db"):
        assert shown_storage(kept) == kept


def test_the_study_is_named_in_messages_by_its_file_or_by_its_url_without_a_password(tmp_path):
    spec = TuneSuite.model_validate(suite(tmp_path, 1))
    local = Tuner(spec, out=tmp_path / "t")
    assert (local.storage_path, local.storage_shown) == (str(tmp_path / "t" / "study.db"), "study.db")
    assert local.storage_url == f"sqlite:///{(tmp_path / 't' / 'study.db').resolve()}"
    shared = Tuner(spec, out=tmp_path / "t", storage="postgresql://user:s3cret@db-host/pflbed")
    assert shared.storage_path == shared.storage_shown == "postgresql://user:***@db-host/pflbed"
    assert shared.storage_url == "postgresql://user:s3cret@db-host/pflbed"


def test_opening_a_new_database_that_another_worker_is_creating_waits_and_retries(tmp_path, monkeypatch):
    """Workers starting on one new database create its tables at once and the losers' inserts fail (IntegrityError,
    or SQLite's OperationalError "database is locked"): each waits a little longer and tries again, up to six times,
    then gives up in one line naming the storage without its password; any other error gives up at once."""
    import pflbed.results.tune.studies as studies

    def failing(name, times):
        calls = []

        def open_(url, **kwargs):
            calls.append(url)
            if len(calls) <= times:
                raise type(name, (Exception,), {})("tables exist")
            return "opened"

        return calls, open_

    waits = []
    monkeypatch.setattr(studies.time, "sleep", waits.append)
    url = "postgresql://u:pw@h/db"
    for name, times, tries, slept in (("IntegrityError", 2, 3, [0.5, 1.0]), ("OperationalError", 5, 6, None)):
        calls, open_ = failing(name, times)
        monkeypatch.setattr(optuna.storages, "RDBStorage", open_)
        waits.clear()
        assert Tuner(TuneSuite.model_validate(suite(tmp_path, 2)), storage=url).storage() == "opened"
        assert len(calls) == tries and waits == (slept or [0.5, 1.0, 1.5, 2.0, 2.5]), name
    for name, times, tries in (("OperationalError", 6, 6), ("ValueError", 1, 1)):
        calls, open_ = failing(name, times)
        monkeypatch.setattr(optuna.storages, "RDBStorage", open_)
        with pytest.raises(PflbedError) as e:
            Tuner(TuneSuite.model_validate(suite(tmp_path, 2)), storage=url).storage()
        assert str(e.value) == f"--storage postgresql://u:***@h/db: {name}: tables exist" and len(calls) == tries


@pytest.mark.filterwarnings("ignore:RetryFailedTrialCallback has been deprecated:FutureWarning")
def test_a_database_is_opened_with_heartbeats_a_retry_and_on_sqlite_a_lock_wait(tmp_path, monkeypatch):
    """Every database storage (a server's, with its driver named or not, and SQLite) gets heartbeats, so a trial
    whose process died elsewhere is failed and its values run again once; SQLite alone gets the driver's lock wait
    (other servers' drivers take no `timeout`). An Optuna without the heartbeat retry (before 4.9) retries failed
    trials instead."""
    opened = []

    class Opened:
        def __init__(self, url, **kwargs):
            opened.append((url, kwargs))

    monkeypatch.setattr(optuna.storages, "RDBStorage", Opened)
    urls = ["mysql+pymysql://u:pw@h/db", "postgresql://u@h/db", None]
    for url in urls:
        assert isinstance(Tuner(TuneSuite.model_validate(suite(tmp_path, 2)), storage=url).storage(), Opened)
    assert [u for u, _ in opened] == [*urls[:2], f"sqlite:///{(tmp_path / 'out' / 'study.db').resolve()}"]
    for (url, kwargs), wait in zip(opened, ({}, {}, {"connect_args": {"timeout": 60}}), strict=True):
        retry = kwargs.pop("heartbeat_stale_trial_callback")
        assert isinstance(retry, optuna.storages.RetryHeartbeatStaleTrialCallback) and retry._max_retry == 1
        assert kwargs == {"engine_kwargs": wait, "heartbeat_interval": 30, "grace_period": 120}, url
    monkeypatch.delattr(optuna.storages, "RetryHeartbeatStaleTrialCallback")
    Tuner(TuneSuite.model_validate(suite(tmp_path, 2)), storage=urls[0]).storage()
    retry = opened[-1][1]["failed_trial_callback"]
    assert isinstance(retry, optuna.storages.RetryFailedTrialCallback) and retry._max_retry == 1
    assert "heartbeat_stale_trial_callback" not in opened[-1][1]


@pytest.mark.parametrize("url", ["postgresql://user:s3cret@127.0.0.1:1/none", "redis://user:s3cret@127.0.0.1:1/0"])
def test_a_storage_that_cannot_be_opened_is_one_line_without_its_password(tmp_path, capsys, url):
    """A server that does not answer, or a storage Optuna does not open (left to it, not run in memory)."""
    f = write(tmp_path, suite(tmp_path))
    assert main(["tune", "-c", f, "--storage", url]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pflbed: error: --storage {url.replace(':s3cret@', ':***@')}: "), err
    assert "s3cret" not in err and "\n" not in err, err
    assert not (tmp_path / "out" / "trials").exists()


def test_a_study_file_that_is_no_database_is_one_line_naming_it(tmp_path, capsys):
    """The default `study.db` overwritten (or a --storage URL naming a file that is no database): one line naming
    the file, without SQLAlchemy's statement and link (three lines before), and not blaming --storage when none
    was given."""
    f = write(tmp_path, suite(tmp_path))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "study.db").write_bytes(bytes(range(256)) * 12)
    assert main(["tune", "-c", f, "--table-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pflbed: error: {tmp_path / 'out' / 'study.db'}: DatabaseError: ") and "\n" not in err, err
    url = f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    assert main(["tune", "-c", f, "--storage", url, "--table-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pflbed: error: --storage {url}: DatabaseError: ") and "\n" not in err, err


# --- --set, --out, the default directory, the plots (issue 49) ----------------------------------------------------
def test_set_overrides_the_suite_by_its_own_dotted_keys(tmp_path):
    methods = {"FedAvg": {"set": {"algorithm.name": "fedavg"}},
               "FedProx": {"set": {"algorithm.name": "fedprox"}, "space": {"algorithm.mu": {"low": 0.01, "high": 0.1}}},
               "Ditto": {"set": {"algorithm.name": "ditto"}}}  # fmt: skip
    f = write(tmp_path, suite(tmp_path, 8, methods))
    s = load_tune_suite(f, ["tune.trials=2", "seeds=[3, 4]", "base.train.rounds=1", "base.federation.alpha=0.5",
                            "methods.FedProx.set.train.lr=0.2", "methods.FedProx.space.algorithm.mu=null",
                            "tune.space.train.momentum=null", "methods.Ditto=null", "report.P-FL=final.pfl_acc"])
    assert s.tune.trials == 2 and s.seeds == [3, 4] and s.tune.space == {"train.momentum": None}
    assert s.base["train"] == {"rounds": 1, "checkpoint_every": 0} and s.base["federation"]["alpha"] == 0.5
    assert s.methods["FedProx"].set == {"algorithm.name": "fedprox", "train.lr": 0.2}
    assert s.methods["FedProx"].space == {"algorithm.mu": None} and list(s.methods) == ["FedAvg", "FedProx"]
    assert s.report == {"P-FL": "final.pfl_acc", "G-FL": "selected.gfl_acc"}  # the other column kept
    assert list(load_tune_suite(f, ["methods=[Ditto, FedAvg]"]).methods) == ["Ditto", "FedAvg"]
    s = load_tune_suite(f, ["tune.space={train.lr: null}", "tune.space.train.momentum={low: 0.0, high: 0.9}",
                            "methods.FedAvg.objective=gfl_val", "methods.FedProx.set={algorithm.name: fedprox, "
                            "train.lr: 0.3}", "methods.Ditto={set: {algorithm.name: ditto}, objective: gfl_val}",
                            "report={X: final.pfl_acc}", "report.acc.mean=final.pfl_acc"])  # whole sections, a
    # method's own (not flat) key, a column whose name has a dot
    assert s.tune.space == {"train.lr": None, "train.momentum": {"low": 0.0, "high": 0.9}}
    assert s.methods["FedAvg"].objective == "gfl_val" and s.methods["FedAvg"].set == {"algorithm.name": "fedavg"}
    assert s.methods["FedProx"].set == {"algorithm.name": "fedprox", "train.lr": 0.3}
    assert s.methods["FedProx"].space == {"algorithm.mu": {"low": 0.01, "high": 0.1}}
    assert s.methods["Ditto"].objective == "gfl_val" and s.report == {"X": "final.pfl_acc", "acc.mean": "final.pfl_acc"}
    assert list(load_tune_suite(f, ["methods={FedAvg: {set: {algorithm.name: fedavg}}}"]).methods) == ["FedAvg"]
    assert load_tune_suite(f).tune.trials == 8  # the file itself is untouched
    f = write(tmp_path, suite(tmp_path, 8, {"FedAvg": None}))  # a method left empty in the file, filled by --set
    assert load_tune_suite(f, ["methods.FedAvg.set.algorithm.name=fedavg"]).methods["FedAvg"].set == {
        "algorithm.name": "fedavg"}


def test_apply_overrides_returns_a_new_tree_and_creates_the_sections_it_sets():
    tree = {"tune": {"trials": 2}, "methods": {"A": {"set": {"train.lr": 0.1}}}}
    new, keys = apply_overrides(tree, ["tune.trials=3", "methods.A.set.train.lr=0.2"])
    assert new == {"tune": {"trials": 3}, "methods": {"A": {"set": {"train.lr": 0.2}}}} and keys == [
        "tune.trials", "methods.A.set.train.lr"]
    assert tree == {"tune": {"trials": 2}, "methods": {"A": {"set": {"train.lr": 0.1}}}}  # the caller's, untouched
    assert apply_overrides({}, ["tune.space.train.lr=null"])[0] == {"tune": {"space": {"train.lr": None}}}


def test_a_set_below_a_value_that_is_no_section_is_one_line_naming_it(tmp_path, capsys):
    f = write(tmp_path, suite(tmp_path))
    for items, message in ((["methods.FedAvg.set=5", "methods.FedAvg.set.train.lr=0.1"],
                            "methods.FedAvg.set.train.lr: set is not a section"),
                           (["methods.FedAvg.set=5", "methods.FedAvg.set.seed=1"],
                            "methods.FedAvg.set.seed: set is not a section"),
                           (["tune=5", "tune.space.train.lr=null"], "tune.space.train.lr: not a section"),
                           (["report=5", "report.X=final.pfl_acc"], "report.X: report is not a section"),
                           (["methods.FedAvg=5", "methods.FedAvg.objective=gfl_val"],
                            "methods.FedAvg.objective: not a section"),
                           (["methods.FedAvg.objective=gfl_val", "methods.FedAvg.objective.x=1"],
                            "methods.FedAvg.objective.x: objective is not a section")):
        assert main(["tune", "-c", f, *(a for item in items for a in ("--set", item))]) == 2
        assert capsys.readouterr().err.strip() == f"pflbed: error: --set {message}", items


@pytest.mark.parametrize(("item", "message"), [
    ("tune.trails=2", "--set tune.trails: unknown key; did you mean tune.trials?"),
    ("methods.FedAvg.budgt=1", "--set methods.FedAvg.budgt: unknown key; did you mean methods.FedAvg.budget?"),
    ("methods.FedAvg.prune_on=pfl_vall", "--set methods.FedAvg.prune_on: Input should be 'pfl_val' or 'gfl_val' "
                                         "(got 'pfl_vall'); did you mean pfl_val?"),
    ("tune.trials=0", "--set tune.trials: Input should be greater than or equal to 1 (got 0)"),
    ("tune={budget: 0}", "--set tune.budget: Input should be greater than 0 (got 0)"),  # the error below the key set
    ("tune.foo.bar=1", "--set tune.foo: unknown key"),  # the error above the key set
    ("train.rounds=2", "--set train.rounds: not a key of a tune suite (name, base, seeds, tune, methods, report, "
                       "out); a run config key goes under base (--set base.train.rounds=…) or a method's set (--set "
                       "methods.NAME.set.train.rounds=…)"),
    ("base.train.roundz=2", "--set base.train.roundz: unknown key; did you mean base.train.rounds?"),
    ("base.train={roundz: 2}", "--set base.train.roundz: unknown key; did you mean base.train.rounds?"),
    ("methods.FedAvgg.set.train.lr=0.1", "--set methods.FedAvgg.set.train.lr: no method 'FedAvgg' in the suite "
                                         "(FedAvg)"),
    ("methods=[FedAvg, Ditto]", "--set methods: no method 'Ditto' in the suite (FedAvg)"),
    ("seeds.first=1", "--set seeds.first: seeds is not a section"),
    ("tune.trials", "--set 'tune.trials': expected key=value"),
])  # fmt: skip
def test_a_bad_set_key_is_one_line_naming_it(tmp_path, capsys, item, message):
    assert main(["tune", "-c", write(tmp_path, suite(tmp_path)), "--set", item]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"pflbed: error: {message}", err
    assert not (tmp_path / "out").exists()


def test_the_tune_directory_defaults_to_runs_tune_not_the_repository(tmp_path, monkeypatch):
    tree = {k: v for k, v in suite(tmp_path).items() if k != "out"}
    monkeypatch.chdir(tmp_path)
    assert Tuner(TuneSuite.model_validate(tree)).out == Path("runs") / "tune" / "t"
    assert Tuner(TuneSuite.model_validate(tree), out=tmp_path / "x").out == tmp_path / "x"  # --out
    assert Tuner(TuneSuite.model_validate(suite(tmp_path)), out=tmp_path / "x").out == tmp_path / "x"  # over out:
    monkeypatch.chdir(ROOT)  # run from the repository: still nothing under benchmarks/results
    assert not Tuner(TuneSuite.model_validate(tree)).out.resolve().is_relative_to(ROOT / "benchmarks")


def test_set_and_out_on_the_command_line_and_the_same_command_continues(tmp_path, capsys):
    f = write(tmp_path, suite(tmp_path, 5))
    d = tmp_path / "elsewhere"
    cmd = ["tune", "-c", f, "--set", "tune.trials=2", "--set", "base.train.rounds=1", "--out", str(d)]
    assert main([*cmd, "--max-trials", "1"]) == 0
    assert not (tmp_path / "out").exists()  # --out wins over the suite's out
    tuner = Tuner(load_tune_suite(f, ["tune.trials=2", "base.train.rounds=1"]), out=d)
    assert len(finished(tuner, tuner.methods[0])) == 1
    run = next((d / "trials" / "FedAvg").iterdir())
    assert json.loads((run / "summary.json").read_text())["rounds"] == 1  # the --set reached the trials
    capsys.readouterr()
    assert main(cmd) == 0  # the same command again: the second trial, then the re-runs and the table
    assert len(finished(tuner, tuner.methods[0])) == 2
    assert json.loads((d / "table.json").read_text())["methods"][0]["trials_cap"] == 2
    assert capsys.readouterr().out.rstrip().endswith(f"study: {d / 'study.db'}")  # the study's path, not "study.db"


def test_a_study_refuses_a_suite_whose_trials_would_differ(tmp_path, capsys):
    """Trials of two setups in one study (a shrunk trial run, then the full suite in the same directory) would
    mix, and the re-runs of the first would be reused: refused in one line naming the key. The budget may grow."""
    f = write(tmp_path, suite(tmp_path, 2))
    first = Tuner(load_tune_suite(f))
    first.study(first.methods[0])  # the study exists and records its setup
    again = Tuner(load_tune_suite(f, ["tune.trials=3", "tune.budget=2000"]))
    again.study(again.methods[0])  # a larger budget: the same study
    assert main(["tune", "-c", f, "--set", "seeds=[0, 1]"]) == 2  # other reported seeds: other trial data
    assert "trial data excludes the tests of seeds: [0, 1], but the FedAvg study" in capsys.readouterr().err
    assert main(["tune", "-c", f, "--set", "base.train.rounds=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("pflbed: error: base.train.rounds: 3, but the FedAvg study in "), err
    assert "ran its trials with 2; give another --out" in err
    assert main(["tune", "-c", f, "--set", "methods.FedAvg.set.train.lr=0.1"]) == 2
    assert "methods.FedAvg.set.train.lr: 0.1, but" in capsys.readouterr().err
    for key, value, name, shown in (("tune.objective", "gfl_val", "objective", '"gfl_val"'),
                                    ("tune.seed", "101", "trial seed", "101"),
                                    ("tune.first", "sampled", "first trial", '"sampled"')):  # fmt: skip
        assert main(["tune", "-c", f, "--set", f"{key}={value}"]) == 2  # other trials: another figure chose them, ...
        assert capsys.readouterr().err.startswith(f"pflbed: error: {name}: {shown}, but the FedAvg study in ")
    proxy = tmp_path / "proxy"
    proxy.mkdir()
    g = write(proxy, suite(proxy, 2, objective="final.ft.pfl_val"))
    proxied = Tuner(load_tune_suite(g))
    proxied.study(proxied.methods[0])
    assert main(["tune", "-c", g, "--set", "tune.prune_on=gfl_val"]) == 2  # the pruner read another curve
    assert capsys.readouterr().err.startswith('pflbed: error: pruned on: "gfl_val", but the FedAvg study in ')


def test_a_train_key_no_trial_reads_is_not_searched_and_one_a_personalization_reads_is(tmp_path):
    """A method whose training never reads a shared `train.*` key (`Algorithm.unread_train`: APFL's plain steps
    read no momentum) searches without it: a dimension its trials would learn nothing about, and a "chosen value"
    meaning nothing. Its trials personalizing (`eval.finetune`, or new clients under a `new_val` objective) read
    `train.momentum` through the budget, which is searched again; so is a key that some value of the searched
    options reads (pFedHN's `local_steps: null` runs `train.local_epochs` epochs). A method's own space naming a key
    it never reads is refused in one line."""
    from pflbed.results.tune.tables import _space

    every = ["train.lr", "train.local_epochs", "train.momentum"]
    methods = {"FedAvg": {"set": {"algorithm.name": "fedavg"}},
               "APFL": {"set": {"algorithm.name": "apfl"}},
               "APFL+FT": {"set": {"algorithm.name": "apfl", "eval.finetune": ["ft"]}},
               "APFL-new": {"set": {"algorithm.name": "apfl", "federation.new_clients": 1,
                                    "eval.new_clients.methods": ["ft"]}, "objective": "new_val"},
               "APFL-newless": {"set": {"algorithm.name": "apfl", "federation.new_clients": 1,
                                        "eval.new_clients.methods": ["ft"]}},  # trials skip new clients
               "L2GD": {"set": {"algorithm.name": "l2gd"}},
               "pFedHN": {"set": {"algorithm.name": "pfedhn"}},
               "pFedHN-K": {"set": {"algorithm.name": "pfedhn"},
                            "space": {"algorithm.local_steps": {"choices": [None, 5]}}}}  # fmt: skip
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path, methods=methods)))
    shared = {m.name: [k for k in m.space if k.startswith("train.")] for m in tuner.methods}
    unread = {m.name: m.unread for m in tuner.methods}
    assert shared == {"FedAvg": every, "APFL": ["train.lr", "train.local_epochs"], "APFL+FT": every,
                      "APFL-new": every, "APFL-newless": ["train.lr", "train.local_epochs"], "L2GD": ["train.lr"],
                      "pFedHN": ["train.lr", "train.momentum"], "pFedHN-K": every}  # fmt: skip
    assert unread == {"FedAvg": [], "APFL": ["train.momentum"], "APFL+FT": [], "APFL-new": [],
                      "APFL-newless": ["train.momentum"], "L2GD": ["train.local_epochs", "train.momentum"],
                      "pFedHN": ["train.local_epochs"], "pFedHN-K": []}  # fmt: skip
    apfl = next(m for m in tuner.methods if m.name == "APFL")
    assert "space.train.momentum" not in apfl.setup() and "train.momentum" not in apfl.default
    assert _space({"space": {"train.lr": "log-uniform [0.001, 0.3]"}, "unread": apfl.unread}, "`") == \
        "`train.lr` log-uniform [0.001, 0.3]; not searched, never read by its trials: `train.momentum`"
    assert _space({"space": {}}) == "none"  # a table from before: no `unread`
    refused = {"APFL": {"set": {"algorithm.name": "apfl"}, "space": {"train.weight_decay": {"low": 0, "high": 0.1}}}}
    with pytest.raises(ConfigError, match=r"^methods\.APFL\.space\.train\.weight_decay: algorithm 'apfl' never "
                                          r"reads train\.weight_decay in these trials; leave it out$"):  # fmt: skip
        Tuner(TuneSuite.model_validate(suite(tmp_path, methods=refused)))
    kept = {"APFL": {"set": {"algorithm.name": "apfl"}, "space": {"train.momentum": None}}}  # dropped by the suite
    assert Tuner(TuneSuite.model_validate(suite(tmp_path, methods=kept))).methods[0].unread == []


def test_a_study_recorded_before_tune_first_existed_drew_its_first_trial(tmp_path):
    """A study whose recorded setup has no `first trial` (it predates the key) drew its first trial like the rest:
    it continues under `tune.first: sampled` and is refused under `default`, naming the key."""
    f = write(tmp_path, suite(tmp_path, 2, first="sampled"))
    old = Tuner(load_tune_suite(f))
    study = old.study(old.methods[0])
    study.set_user_attr("setup", {k: v for k, v in study.user_attrs["setup"].items() if k != "first trial"})
    same = Tuner(load_tune_suite(f))
    same.study(same.methods[0])
    other = Tuner(load_tune_suite(f, ["tune.first=default"]))
    with pytest.raises(ConfigError, match=r'^first trial: "default", but the FedAvg study in .* ran its trials with '
                                          r'"sampled"; '):  # fmt: skip
        other.study(other.methods[0])


def test_a_key_set_on_one_side_only_differs_even_when_null_and_a_shared_database_asks_for_a_new_name(tmp_path):
    """A key one setup holds and the other does not is a difference even where its value is null (shown as
    `"unset"` on the side without it); on a database other than `--out`'s own the refusal asks for another suite
    name, as another `--out` would share the database."""
    plain = suite(tmp_path, 2)
    null = {**plain, "base": {**BASE, "federation": {**BASE["federation"], "sampling": None}}}
    db = f"sqlite:///{tmp_path / 'shared.db'}"
    for held, now, shown in ((null, plain, ('"unset"', "null")), (plain, null, ("null", '"unset"'))):
        for storage, advice in ((None, "give another --out"), (db, "give another suite name (--set name=…)")):
            first = Tuner(TuneSuite.model_validate(held), storage=storage)
            first.study(first.methods[0])
            again = Tuner(TuneSuite.model_validate(now), storage=storage)
            refusal = (rf"^base\.federation\.sampling: {shown[0]}, but the FedAvg study in .* ran its trials with "
                       rf"{shown[1]}; {re.escape(advice)} ")  # fmt: skip
            with pytest.raises(ConfigError, match=refusal):
                again.study(again.methods[0])
            (tmp_path / "out" / "study.db").unlink(missing_ok=True)
            (tmp_path / "shared.db").unlink(missing_ok=True)


def _fake_trials(tuner, n):
    """`n` complete trials made by hand (no runs): what the plots read."""
    from optuna.distributions import FloatDistribution
    from optuna.trial import create_trial

    study = tuner.study(tuner.methods[0])
    dists = {"train.lr": FloatDistribution(1e-3, 0.3, log=True), "train.momentum": FloatDistribution(0, 0.9)}
    for i in range(n):
        study.add_trial(create_trial(params={"train.lr": 0.001 * (i + 1), "train.momentum": 0.05 * i},
                                     distributions=dists, value=0.5 + 0.01 * i))  # fmt: skip


@pytest.mark.parametrize(("n", "importance"), [(2, False), (10, True)])
def test_plots_are_titled_by_method_in_percent_and_importances_need_enough_trials(tmp_path, monkeypatch, n,
                                                                                 importance):
    from matplotlib.figure import Figure

    drawn = {}
    real = Figure.savefig

    def record(fig, path, **kw):
        ax = fig.axes[0]
        drawn[Path(path).stem] = (ax.get_title(), ax.get_title(loc="left"), ax.get_ylabel(),
                                  ax.yaxis.get_major_formatter()(0.5, 0))
        return real(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", record)
    tuner = Tuner(TuneSuite.model_validate(suite(tmp_path)))
    _fake_trials(tuner, n)
    stale = tuner.out / "plots" / "FedAvg-importance.png"  # drawn from other trials by an earlier call
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"an earlier drawing")
    tuner.draw()
    assert stale.exists() is importance and (not importance or stale.read_bytes() != b"an earlier drawing")
    assert drawn["FedAvg-history"] == ("FedAvg: optimization history", "", "pfl_val (%)", "50")
    if importance:
        assert drawn["FedAvg-importance"][:2] == ("FedAvg: parameter importances", "")
        assert "FedAvg" not in tuner.absent
    else:
        assert "FedAvg-importance" not in drawn
        why = tuner.absent["FedAvg"]["importance"]
        assert why == "2 complete trials; importances need at least 10 to mean anything"
        assert f"Parameter importances: not drawn ({why})." in tuner.markdown(tuner.rows())


def test_the_tuning_guide_s_small_study_runs_as_written(tmp_path, monkeypatch):
    """docs/guide/tuning.md's `--set`/`--out` example, as the page shows it, from a working directory of its own
    (the suite file named from the repository): it finishes, and its output is where `--out` says."""
    argv = page_command("docs/guide/tuning.md", "--out runs/tune/digits-small")
    assert argv[:2] == ["tune", "-c"]
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    assert (tmp_path / "runs" / "tune" / "digits-small" / "table.md").is_file()


def test_a_tune_suite_s_name_is_one_directory_s_name(tmp_path):
    """`runs/tune/<name>`: a name `../x` put the study and its runs outside it."""
    with pytest.raises(ConfigError) as e:
        load_tune_suite(write(tmp_path, {**suite(tmp_path), "name": "../x"}))
    assert str(e.value).endswith("name: must be one directory's name (no /, \\ or NUL, not . or ..); give out to "
                                 "choose where the results go (got '../x')")  # fmt: skip
