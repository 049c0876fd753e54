"""`pflbed tune`'s fairness rules (issue 51): equal training compute, a pruner that waits and sees every method's
curve, trial data without the reported test samples, and trial owners told apart across containers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from optuna.distributions import FloatDistribution  # noqa: E402
from optuna.trial import TrialState, create_trial  # noqa: E402

from pflbed.config import validate_config  # noqa: E402
from pflbed.data import load_source  # noqa: E402
from pflbed.errors import PflbedError  # noqa: E402
from pflbed.federation import build_federation  # noqa: E402
from pflbed.results.tune import Tuner, TuneSuite, _dead, _process, load_tune_suite  # noqa: E402
from pflbed.results.tune.tables import _pct  # noqa: E402
from pflbed.results.tune.trials import first_to_finish  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = {"dataset": {"name": "digits"}, "model": {"name": "mlp"}, "federation": {"clients": 3},
        "train": {"rounds": 2, "checkpoint_every": 0}, "eval": {"every": 1, "finetune": []},
        "executor": {"threads": 1}}  # fmt: skip
QUIET = {"log": lambda *_: None}
FEDAVG = {"A": {"set": {"algorithm.name": "fedavg"}}}  # one method, its default config


def _tuner(tmp_path, methods, base=BASE, **tune) -> Tuner:
    return Tuner(TuneSuite.model_validate({"name": "t", "out": str(tmp_path / "out"), "base": base, "seeds": [0],
                                           "tune": {"pruner": "none", **tune}, "methods": methods}))  # fmt: skip


def _rounds(n: int) -> dict:
    """The base config with `n` rounds."""
    return {**BASE, "train": {**BASE["train"], "rounds": n}}


def _timed(f, **kwargs) -> float:
    """Seconds `f(**kwargs)` took: a bound on any duration a line it logged can state."""
    t0 = time.perf_counter()
    f(**kwargs)
    return time.perf_counter() - t0


def _seconds(line: str, text: str) -> int:
    """The N of a log line that reads `text (N s)`."""
    m = re.fullmatch(re.escape(text) + r" \((\d+) s\)", line)
    assert m, (line, text)
    return int(m[1])


def _done(tuner, m):
    return tuner.study(m).get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))


def test_every_method_spends_the_same_compute_so_a_costlier_method_runs_fewer_trials(tmp_path):
    """Two FedAvgs, one training 3 local epochs: with a budget of 3 base runs the 1-epoch method runs three trials,
    the 3-epoch one a single trial, and both spend 3 base runs. Equal trials (the old rule) would give the 3-epoch
    method three times the compute."""
    fixed = {"train.local_epochs": None, "train.lr": None, "train.momentum": None, "algorithm.mu": None}
    methods = {f"E{e}": {"set": {"algorithm.name": "fedprox", "train.local_epochs": e}, "space": fixed}
               for e in (1, 3)}  # fmt: skip
    methods["E1"]["space"] = {**fixed, "train.lr": {"low": 0.01, "high": 0.1}}  # something to sample
    methods["E3"]["space"] = dict(methods["E1"]["space"])
    tuner = _tuner(tmp_path, methods, budget=3)
    tuner.run_trials(**QUIET)
    unit = tuner.unit()
    spent = {m.name: tuner.spent(tuner.study(m)) / unit for m in tuner.methods}
    assert spent == {"E1": 3.0, "E3": 3.0}
    assert [len(_done(tuner, m)) for m in tuner.methods] == [3, 1]
    assert all(tuner.finished(m) for m in tuner.methods)
    for m in tuner.methods:  # each trial that ends exactly on the budget runs to its last round, uncut, unstopped
        assert all(t.state == TrialState.COMPLETE and {"cut", "truncated"}.isdisjoint(t.user_attrs)
                   for t in _done(tuner, m))  # fmt: skip


def test_the_budgets_unit_is_what_fedavg_trains_in_a_run_of_the_base_config_with_its_client_sampling(tmp_path):
    """The unit (a base run) counts the clients each round samples: here Poisson sampling, as privacy uses, whose
    rounds train other clients (and other numbers of them) than the fixed draw's."""
    def tuner(sampling: str) -> Tuner:
        base = {**BASE, "federation": {"clients": 8, "sample_fraction": 0.5, "sampling": sampling},
                "train": {**BASE["train"], "rounds": 3}}  # fmt: skip
        fixed = {"train.lr": None, "train.local_epochs": None, "train.momentum": None}
        return Tuner(TuneSuite.model_validate({"name": "t", "out": str(tmp_path / sampling), "base": base,
                                               "seeds": [0], "tune": {"pruner": "none", "budget": 10, "trials": 1},
                                               "methods": {"A": {"set": {"algorithm.name": "fedavg"},
                                                                 "space": fixed}}}))  # fmt: skip

    poisson = tuner("poisson")
    poisson.run_trials(**QUIET)
    (trial,) = _done(poisson, poisson.methods[0])
    assert trial.user_attrs["passes"] == poisson.unit() != tuner("fixed").unit()


def test_the_trial_that_spends_the_budget_is_cut_at_that_evaluation(tmp_path):
    """A budget of 1.5 base runs: the second trial is cut after its first round (pruned, `cut`), leaving the study
    within one evaluation interval of the budget instead of a whole trial over it."""
    methods = {"F": {"set": {"algorithm.name": "fedprox"},
                     "space": {"train.local_epochs": None, "train.momentum": None, "algorithm.mu": None}}}
    tuner = _tuner(tmp_path, methods, budget=1.5)
    lines: list[str] = []
    tuner.run_trials(log=lines.append)
    first, second = _done(tuner, tuner.methods[0])
    assert first.state == TrialState.COMPLETE and second.state == TrialState.PRUNED
    assert any(line.startswith(f"F trial {second.number} (") and ": cut: the budget is spent at round 1, best pfl_val "
               in line for line in lines)  # fmt: skip
    assert second.user_attrs["cut"] == 1
    assert tuner.spent(tuner.study(tuner.methods[0])) == 1.5 * tuner.unit()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # trials made by hand (study.ask)
def test_the_budget_spent_is_the_finished_and_running_trials_compute(tmp_path):
    """The study's spent compute sums the sample passes of its complete, pruned and running trials (a running one's
    so far), and of no failed or waiting one: a failed trial's parameters are queued again, or it took none of the
    budget (surplus, a repeat); a trial just taken has trained nothing yet. `but` leaves one trial out."""
    tuner = _tuner(tmp_path, FEDAVG, budget=100, first="sampled")
    study = tuner.study(tuner.methods[0])
    for state, passes in ((TrialState.COMPLETE, 1), (TrialState.PRUNED, 10), (TrialState.FAIL, 1000)):
        study.add_trial(create_trial(state=state, value=0.5 if state == TrialState.COMPLETE else None,
                                     user_attrs={"passes": passes}))  # fmt: skip
    running = study.ask()
    study.enqueue_trial({}, user_attrs={"passes": 10000})
    assert tuner.spent(study) == 11  # the running trial has no passes yet: 0
    study._storage.set_trial_user_attr(running._trial_id, "passes", 100)
    assert tuner.spent(study) == 111 and tuner.spent(study, but=running.number) == 11
    assert tuner.spent(study, but=1) == 101
    assert tuner.counts(study) == (2, 1)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # trials made by hand (study.ask)
def test_a_study_is_finished_once_nothing_runs_and_its_budget_or_its_cap_is_reached(tmp_path):
    """Finished = no trial running, and the budget spent or (with a cap) the cap's trials finished."""
    tuner = _tuner(tmp_path / "budget", FEDAVG, budget=2, first="sampled")
    method, unit = tuner.methods[0], int(tuner.unit())
    study = tuner.study(method)
    study.add_trial(create_trial(value=0.5, user_attrs={"passes": unit}))
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={"passes": unit - 1}))
    assert not tuner.finished(method, study)  # one sample pass short of 2 base runs
    running = study.ask()
    study._storage.set_trial_user_attr(running._trial_id, "passes", 1)
    assert not tuner.finished(method, study)  # spent, but a trial still runs
    study.tell(running, 0.5)
    assert tuner.finished(method, study)
    capped = _tuner(tmp_path / "cap", FEDAVG, budget=100, trials=2,
                    first="sampled")  # fmt: skip
    method = capped.methods[0]
    study = capped.study(method)
    study.add_trial(create_trial(value=0.5, user_attrs={"passes": 1}))
    assert not capped.finished(method, study)
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={"passes": 1}))
    assert capped.finished(method, study)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # trials made by hand (study.ask)
def test_the_trial_stopped_rather_than_cut_is_the_oldest_running_one_while_none_is_complete(tmp_path):
    """Where the budget is spent, the oldest running trial of a study with no complete trial is stopped and scored
    (so that the study has one to choose); any other is cut. Older trials that ended otherwise (pruned, failed)
    do not count."""
    tuner = _tuner(tmp_path, FEDAVG, budget=100, first="sampled")
    study = tuner.study(tuner.methods[0])
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={"passes": 1}))
    study.add_trial(create_trial(state=TrialState.FAIL))
    older, younger = study.ask(), study.ask()
    assert first_to_finish(study, older.number) and not first_to_finish(study, younger.number)
    study.tell(older, 0.5)
    assert not first_to_finish(study, younger.number)  # the study has a complete trial


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # a trial made by hand (study.ask)
def test_the_pruner_waits_for_its_warm_up_before_judging(tmp_path):
    """Median pruner, 8 rounds, warm-up a quarter: a trial far below the others is not judged at round 1 (the old
    pruner cut most trials at their first evaluation), and is at round 2, once two trials have finished."""
    tuner = _tuner(tmp_path, FEDAVG, base=_rounds(8), budget=10, pruner="median", warmup=0.25)
    study = tuner.study(tuner.methods[0])
    dist = {"train.lr": FloatDistribution(1e-3, 0.3, log=True)}
    for i in range(2):
        study.add_trial(create_trial(params={"train.lr": 0.01 * (i + 1)}, distributions=dist, value=0.9,
                                     intermediate_values={1: 0.9, 2: 0.9, 3: 0.9}))  # fmt: skip
    trial = study.ask(dist)
    trial.report(0.1, 1)
    assert not trial.should_prune()
    trial.report(0.1, 2)
    assert trial.should_prune()


def test_the_sampler_is_the_suites_tpe_lying_for_running_trials_or_random(tmp_path):
    """`tune.sampler`: TPE by default, with the constant liar (a trial another worker is running counts as drawn
    where it stands, so workers started together do not crowd one region; Optuna keeps the flag private), or
    random."""
    tpe = _tuner(tmp_path / "tpe", FEDAVG, budget=1)
    sampler = tpe.study(tpe.methods[0]).sampler
    assert type(sampler) is optuna.samplers.TPESampler and sampler._constant_liar is True
    rand = _tuner(tmp_path / "random", FEDAVG, budget=1, sampler="random")
    assert type(rand.study(rand.methods[0]).sampler) is optuna.samplers.RandomSampler


def test_the_pruner_is_the_suites_each_from_the_warm_up_round(tmp_path):
    """`tune.pruner`: hyperband's rungs run from the warm-up round (a quarter of 8 rounds: round 2; a tenth: round 1,
    the earliest) to the last round; `none` prunes nothing (the median pruner's warm-up is judged by its trials
    above). Optuna keeps the bounds private."""
    pruners = {}
    for name, warmup in (("hyperband", 0.25), ("hyperband", 0.1), ("none", 0.25)):
        tuner = _tuner(tmp_path / f"{name}{warmup}", FEDAVG, base=_rounds(8), budget=1, pruner=name, warmup=warmup)
        pruners[name, warmup] = tuner.study(tuner.methods[0]).pruner
    for warmup, first in ((0.25, 2), (0.1, 1)):
        hyperband = pruners["hyperband", warmup]
        assert type(hyperband) is optuna.pruners.HyperbandPruner
        assert (hyperband._min_resource, hyperband._max_resource) == (first, 8)
    assert type(pruners["none", 0.25]) is optuna.pruners.NopPruner


def test_a_pruned_trial_says_at_which_round_and_its_best_figure_so_far(tmp_path, monkeypatch):
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    tuner = _tuner(tmp_path, FEDAVG, budget=10, trials=1)
    lines: list[str] = []
    took = _timed(tuner.run_trials, log=lines.append)
    (trial,) = _done(tuner, tuner.methods[0])
    assert trial.state == TrialState.PRUNED and list(trial.intermediate_values) == [1]
    head = lines[0].split(": started")[0]
    assert _seconds(lines[-1], f"{head}: pruned at round 1, best pfl_val {_pct(trial.intermediate_values[1])}") <= took


def test_a_new_study_on_an_old_out_runs_its_trials_over_the_old_trial_directories_silently(tmp_path, capsys):
    """The study database decides which trials ran, not the directories left in `--out`: a study begun anew there
    (its database deleted) runs its trial 0 again in `trial0000`, replacing the old run instead of being refused
    as a finished run. A trial's run prints nothing itself (no progress bar between the search's own lines)."""
    for _ in range(2):
        tuner = _tuner(tmp_path, FEDAVG, budget=1, trials=1)
        tuner.run_trials(**QUIET)
        (trial,) = _done(tuner, tuner.methods[0])
        assert trial.state == TrialState.COMPLETE and trial.user_attrs["run_dir"] == "trials/A/trial0000"
        (tuner.out / "study.db").unlink()
    assert capsys.readouterr().out == ""


@pytest.mark.filterwarnings("error:The value None could not be cast")  # a trial scored on nothing
def test_a_method_whose_run_does_not_report_its_objective_stops_and_names_it(tmp_path):
    """Local training has no global model: its runs report no G-FL figure, so a study of it on `gfl_val` is
    refused in one line naming the method, not scored on nothing or ended by a TypeError, also where the budget is
    smaller than one run (the study's first trial is not stopped while it has no figure to be scored on)."""
    tuner = _tuner(tmp_path, {"L": {"set": {"algorithm.name": "local"}, "objective": "gfl_val"}}, budget=0.5,
                   trials=1)  # fmt: skip
    with pytest.raises(PflbedError, match=r"^methods\.L: the run has no gfl_val \(objective: pick a validation "
                       r"figure the method reports\)$"):  # fmt: skip
        tuner.run_trials(**QUIET)


def test_a_method_whose_objective_is_a_summary_field_is_pruned_on_a_proxy_curve(tmp_path):
    """FedAvg+FT's objective (the fine-tuned models' validation P-FL) exists only at the end: its trials report the
    global model's validation P-FL at every evaluation, so the pruner can judge it as it judges the others."""
    methods = {"FedAvg+FT": {"set": {"algorithm.name": "fedavg", "eval.finetune": ["ft"]},
                             "objective": "final.ft.pfl_val", "space": {"train.local_epochs": None}}}
    tuner = _tuner(tmp_path, methods, budget=10, trials=1)
    tuner.run_trials(**QUIET)
    (trial,) = _done(tuner, tuner.methods[0])
    assert sorted(trial.intermediate_values) == [1, 2] and tuner.methods[0].curve == "pfl_val"
    assert trial.value is not None and trial.value != trial.intermediate_values[2]  # the objective: fine-tuned


def test_the_default_trial_seed_is_never_a_reported_seed(tmp_path):
    methods = FEDAVG
    for seeds, seed in (([0, 1, 2], 100), ([100, 7], 101)):
        suite = TuneSuite.model_validate({"name": "t", "base": BASE, "seeds": seeds, "tune": {"budget": 1},
                                          "methods": methods})  # fmt: skip
        assert Tuner(suite, out=tmp_path).seed == seed


def _overlap(tuner: Tuner) -> int:
    """Samples some trial trains or validates on that a reported seed's run tests on, over every method."""
    bad = 0
    for m in tuner.methods:
        trial = m.config(tuner.seed, {})
        source = load_source(trial.dataset)
        seen = set(build_federation(source, trial.federation, trial.seed).seen_indices().tolist())
        for s in tuner.suite.seeds:
            cfg = m.config(s, {}, trial=False)
            bad += len(seen & set(build_federation(source, cfg.federation, s).test_indices().tolist()))
    return bad


@pytest.mark.parametrize("name", ["tune_digits", "tune_fmnist", "leaderboard_fmnist"])
def test_no_trial_of_a_committed_suite_trains_or_validates_on_a_reported_test_sample(name, monkeypatch):
    path = ROOT / "benchmarks" / "suites" / f"{name}.yaml"
    suite = load_tune_suite(path)
    if suite.base.get("dataset", {}).get("name") == "fmnist" and not Path("/usr/share/datasets/fashion-mnist").is_dir():
        pytest.skip("dataset-fashion-mnist not installed")
    tuner = Tuner(suite, out=Path("/nonexistent"))
    tuner.methods = tuner.methods[:1]  # every method shares the base's federation settings (checked below)
    assert all(m.config(0, {}).federation == tuner.methods[0].config(0, {}).federation
               for m in Tuner(suite, out=Path("/nonexistent")).methods)  # fmt: skip
    assert _overlap(tuner) == 0
    monkeypatch.setattr(type(tuner.methods[0]), "config",
                        lambda self, seed, params, trial=True: validate_config(
                            {**tuner.suite.base, "seed": seed}))  # the old trials: no exclusion  # fmt: skip
    assert _overlap(tuner) > 0


def test_a_trial_owner_is_dead_only_where_this_process_can_tell(monkeypatch):
    """Same host and pid namespace, pid gone: dead. Another pid namespace (a container sharing the host name): never
    judged here, even if its pid is free here (host and pid alone would fail a live trial). A pid now held by a
    process started later: dead. A process's record holds its namespace and start time where /proc says them, and
    a process without a /proc entry any more is its host and pid alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = _process()
    assert _process(gone.pid) == {"host": here["host"], "pid": gone.pid}
    if Path("/proc/self/ns/pid").exists():
        assert set(here) == {"host", "pid", "pidns", "started"} and here["pidns"].startswith("pid:[")
    assert _dead({**here, "pid": gone.pid, "started": None})
    assert not _dead({**here, "pid": gone.pid, "pidns": "pid:[1]"})
    assert not _dead(here)  # this very process
    if "started" in here:
        assert _dead({**here, "started": here["started"] - 1})  # this pid, but an earlier process's
    assert not _dead({**here, "host": here["host"] + "-other", "pid": gone.pid})
    assert os.getpid() == here["pid"]
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # another live process: its own namespace and start time are read, not this process's
        read, readlink = [], os.readlink
        monkeypatch.setattr(os, "readlink", lambda path: read.append(path) or readlink(path))
        owner = _process(alive.pid)
        assert read == [f"/proc/{alive.pid}/ns/pid"]
        assert not _dead(owner)
        if "started" in owner:
            assert _dead({**owner, "started": owner["started"] - 1})
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="Linux's /proc")
def test_a_process_start_time_is_read_after_its_name_whatever_the_name_holds():
    """/proc/<pid>/stat puts the process name, in parentheses, before the start time; a name may hold spaces and
    parentheses itself (a process may rename itself so), and its start time must not move when it does (a moved
    one would call a live trial's owner another process, and fail its trial)."""
    rename = ("import sys\nsys.stdin.readline()\ntry:\n    open('/proc/self/comm', 'w').write('w) 1 2 (x')\n"
              "    print('renamed', flush=True)\nexcept OSError:\n    print('refused', flush=True)\n"
              "sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", rename], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = _process(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        if child.stdout.readline().strip() != "renamed":
            pytest.skip("this kernel refuses a process's renaming itself")
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "w) 1 2 (x"
        assert _process(child.pid) == before and "started" in before and not _dead(before)
    finally:
        child.kill()
        child.wait()


def test_a_trial_owner_this_process_may_not_signal_is_alive(monkeypatch):
    """Another user's process (signalling it is refused): alive, its trial left alone."""

    def refused(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("pflbed.results.tune.studies.os.kill", refused)
    assert not _dead({**_process(), "pid": 1})


def test_a_search_the_algorithm_refuses_throughout_stops_in_one_line(tmp_path, monkeypatch):
    """A refused trial trains nothing, so it spends none of a compute budget: a space the algorithm refuses every
    time (L2GD: θ = lr·λ·(1 − p)/p > 1 everywhere here) would loop for ever; after a run of refusals it stops,
    naming the method and its space."""
    import pflbed.results.tune.trials as trials
    from pflbed.errors import PflbedError

    monkeypatch.setattr(trials, "REFUSED_IN_A_ROW", 3)
    space = {"train.lr": None, "train.local_epochs": None, "train.momentum": None,
             "algorithm.lam": {"low": 5.0, "high": 10.0}, "algorithm.p": {"low": 0.1, "high": 0.2}}  # fmt: skip
    methods = {"L2GD": {"set": {"algorithm.name": "l2gd", "train.lr": 0.3}, "space": space}}
    tuner = _tuner(tmp_path, methods, budget=1)
    with pytest.raises(PflbedError, match=r"methods.L2GD: the algorithm refused the last 3 trials' values"):
        tuner.run_trials(max_trials=10, **QUIET)  # (the cap: without the rule, this would never end)
    assert len(tuner.study(tuner.methods[0]).get_trials()) == 3


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # a trial made by hand (study.ask)
def test_a_run_of_refusals_counts_finished_trials_only_and_names_the_last_refusal(tmp_path):
    """The run of refusals that stops a search is one of finished trials: a surplus trial (failed) or another
    worker's running trial in between neither breaks it nor ends it; a complete trial does. The message quotes the
    last refusal."""
    from pflbed.errors import PflbedError
    from pflbed.results.tune.trials import REFUSED_IN_A_ROW, refused_in_a_row

    tuner = _tuner(tmp_path, FEDAVG, budget=100, first="sampled")
    method = tuner.methods[0]
    study = tuner.study(method)
    for i in range(REFUSED_IN_A_ROW - 1):
        study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={"refused": f"reason {i}"}))
        if i == 3:
            study.add_trial(create_trial(state=TrialState.FAIL, user_attrs={"surplus": True}))
    refused_in_a_row(study, method)  # one refusal short
    study.ask()  # another worker's trial, running
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={"refused": "the last reason"}))
    with pytest.raises(PflbedError, match=rf"the last {REFUSED_IN_A_ROW} trials' values \(e.g. the last reason\)"):
        refused_in_a_row(study, method)
    study.add_trial(create_trial(value=0.5))
    refused_in_a_row(study, method)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # a trial made by hand (study.ask)
def test_the_main_process_waits_for_the_trials_running_elsewhere_and_a_worker_does_not(tmp_path, monkeypatch):
    """With nothing left to start (here the trial cap: one trial finished, one running in another process), a
    worker stops at once, and the main process (the default) waits until the other trial is finished: its final
    re-runs need finished studies."""
    import threading

    tuner = _tuner(tmp_path, FEDAVG, budget=100, trials=2, first="sampled")
    study = tuner.study(tuner.methods[0])
    study.add_trial(create_trial(value=0.5, user_attrs={"passes": 1}))
    elsewhere = study.ask()
    logs: list[str] = []
    assert tuner.run_trials(worker=True, log=logs.append) == 0
    assert "nothing left to start" in logs[-1] and study.get_trials()[1].state == TrialState.RUNNING
    threading.Timer(3.0, lambda: study.tell(elsewhere, 0.6)).start()  # after the first look (every 2 s)

    def locked(study):
        raise RuntimeError("database is locked")

    monkeypatch.setattr(optuna.storages, "fail_stale_trials", locked)  # a look that fails is only skipped
    assert tuner.run_trials(log=logs.append) == 0
    assert study.get_trials()[1].state == TrialState.COMPLETE
    # the same with the budget spent to the sample pass (1 base run) and no cap
    spent = _tuner(tmp_path / "spent", FEDAVG, budget=1, first="sampled")
    study = spent.study(spent.methods[0])
    study.add_trial(create_trial(value=0.5, user_attrs={"passes": int(spent.unit())}))
    elsewhere = study.ask()
    timer = threading.Timer(3.0, lambda: study.tell(elsewhere, 0.6))  # ends a wrong loop of surplus trials
    timer.start()
    assert spent.run_trials(worker=True, log=logs.append) == 0
    timer.cancel()
    assert "nothing left to start (1.00 of 1 base runs spent" in logs[-1] and len(study.get_trials()) == 2
    study.tell(elsewhere, 0.6)
    assert spent.run_trials(worker=True, log=logs.append) == 0
    assert logs[-1] == "A: its budget is spent (1.00 of 1 base runs, 2 trials finished)"


def test_the_main_process_fails_a_trial_whose_heartbeat_stopped_and_runs_it_again(tmp_path, monkeypatch):
    """A trial of another machine whose heartbeat stopped (that machine died; `recover` cannot see its process) is
    failed by the main process while it waits, and queued again, so the study finishes instead of waiting for ever.
    The storage's 1-s grace period here stands for its 2 minutes."""
    import threading
    import time

    class Brief(optuna.storages.RDBStorage):
        def __init__(self, url, **kwargs):
            super().__init__(url, **{**kwargs, "heartbeat_interval": 1, "grace_period": 1})

    monkeypatch.setattr(optuna.storages, "RDBStorage", Brief)
    tuner = _tuner(tmp_path, FEDAVG, budget=100, trials=2, first="sampled")
    study = tuner.study(tuner.methods[0])
    study.add_trial(create_trial(value=0.5, user_attrs={"passes": 1}))
    with pytest.warns(UserWarning, match="Heartbeat of storage"):
        lost = study.ask()
    lost.suggest_float("train.lr", 1e-3, 0.3, log=True)
    study._storage.record_heartbeat(lost._trial_id)
    time.sleep(1.5)
    guard = threading.Timer(30.0, lambda: study.tell(lost, state=TrialState.FAIL))  # ends a wait that never would
    guard.start()
    assert tuner.run_trials(**QUIET) == 1
    guard.cancel()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert trials[2].params["train.lr"] == trials[1].params["train.lr"]  # the lost trial's value, queued again


@pytest.mark.filterwarnings("error:Heartbeat of storage")
def test_a_trial_keeps_its_heartbeat_without_optunas_warning_that_only_optimize_does(tmp_path):
    """`pflbed tune` asks and tells (not `study.optimize`) and keeps the trial's heartbeat itself: Optuna's warning
    that heartbeats go with optimize is silenced where the trial is asked (an error here)."""
    tuner = _tuner(tmp_path, FEDAVG, budget=100, trials=1, first="sampled")
    assert tuner.run_trials(**QUIET) == 1


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_worker_draws_its_own_parameters_and_the_main_process_the_seeded_ones(tmp_path, monkeypatch, sampler):
    """The main process seeds its sampler (a study restarted draws the same way); a worker's sampler is unseeded, so
    two workers started together on one study do not draw the same parameters. Either sampler."""
    import pflbed.results.experiment

    monkeypatch.setattr(pflbed.results.experiment, "run", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    drawn = {}
    for name, worker in (("main", False), ("again", False), ("worker", True)):
        tuner = _tuner(tmp_path / name, FEDAVG, budget=100, first="sampled", sampler=sampler)
        with pytest.raises(KeyboardInterrupt):  # the trial's parameters are drawn, then it stops
            tuner.run_trials(worker=worker, **QUIET)
        (trial,) = tuner.study(tuner.methods[0]).get_trials()
        drawn[name] = trial.params
    assert drawn["main"] == drawn["again"] != drawn["worker"]


def test_a_trial_counts_no_compute_when_it_starts(tmp_path, monkeypatch):
    """A trial starts with 0 sample passes recorded (other workers read it into the spent budget at once) and its
    owner: the host and process that `recover` checks."""
    import pflbed.results.experiment

    seen = []

    def run(*args, **kwargs):
        seen.append(tuner.study(tuner.methods[0]).get_trials()[-1].user_attrs)
        raise KeyboardInterrupt

    monkeypatch.setattr(pflbed.results.experiment, "run", run)
    tuner = _tuner(tmp_path, FEDAVG, budget=100, first="sampled")
    with pytest.raises(KeyboardInterrupt):
        tuner.run_trials(**QUIET)
    (attrs,) = seen
    assert attrs["passes"] == 0 and {k: attrs[k] for k in _process()} == _process()


def test_a_trial_skips_the_new_client_stage_unless_its_objective_reads_it(tmp_path):
    """The new clients' personalization trains (and would count against the budget) but only `new_val` reads it:
    other trials skip it; the re-runs keep it (their new-client figures are reported)."""
    base = {**BASE, "federation": {"clients": 4, "new_clients": 1}}
    methods = {"A": {"set": {"algorithm.name": "fedavg"}}, "N": {"set": {"algorithm.name": "fedavg"},
                                                                  "objective": "new_val"}}  # fmt: skip
    tuner = Tuner(TuneSuite.model_validate({"name": "t", "out": str(tmp_path), "base": base, "seeds": [0],
                                            "tune": {"budget": 1}, "methods": methods}))  # fmt: skip
    plain, new = (m.config(tuner.seed, {}).eval.new_clients for m in tuner.methods)
    assert plain.methods == [] and not plain.zero_shot
    assert new.methods == ["ft", "lp"] and new.zero_shot
    rerun = tuner.methods[0].config(0, {}, trial=False)
    assert rerun.eval.new_clients.methods == ["ft", "lp"] and not rerun.federation.exclude_test_of


@pytest.mark.parametrize("objective", [None, "final.ft.pfl_val"])
def test_a_study_whose_trial_costs_more_than_its_budget_stops_its_first_trial_at_the_budget(tmp_path, objective):
    """3 local epochs cost 3 base runs a trial, 1.5 by its first evaluation; with a budget of 1 the first trial is
    not cut there (the study would end with nothing to choose) nor run on to its end (3× the budget, as pFedDF's
    default did on the leaderboard): it is stopped at that evaluation and completes, scored on the rounds it ran,
    so the study ends within one evaluation interval of its budget, as every other study does. An objective only a
    finished run has (the fine-tuned models' figure) is replaced by the curve the method is pruned on, and the trial
    says so."""
    space = {"train.local_epochs": None, "train.momentum": None, "algorithm.mu": None,
             "train.lr": {"low": 0.01, "high": 0.1}}  # fmt: skip
    methods = {"E3": {"set": {"algorithm.name": "fedprox", "train.local_epochs": 3}, "space": space}}
    if objective is not None:
        methods["E3"] |= {"objective": objective, "set": {**methods["E3"]["set"], "eval.finetune": ["ft"]}}
    tuner = _tuner(tmp_path, methods, budget=1)
    lines: list[str] = []
    took = _timed(tuner.run_trials, log=lines.append)
    (only,) = _done(tuner, tuner.methods[0])
    assert only.state == TrialState.COMPLETE and tuner.spent(tuner.study(tuner.methods[0])) == 1.5 * tuner.unit()
    assert only.user_attrs["truncated"] == {"round": 1, "scored_on": "pfl_val"}
    history = [json.loads(line) for line in (tuner.out / only.user_attrs["run_dir"] / "metrics.jsonl").open()]
    assert [h["round"] for h in history] == [1] and only.value == history[0]["pfl_val"]
    head = lines[0].split(": started")[0]
    assert _seconds(lines[-1], f"{head}: stopped at round 1, where the budget is spent (the study's first trial): "
                    f"pfl_val {_pct(only.value)}") <= took  # fmt: skip
    if objective is None:
        assert f"pfl_val {100 * only.value:.2f} (#0, stopped at round 1) |" in tuner.markdown(tuner.rows())


def test_a_chosen_default_configuration_is_not_re_run_twice(tmp_path):
    """A study whose best trial is the default configuration (its one trial here): the tuned re-runs would repeat the
    default's to the bit, so the bench holds no tuned cell for it and its tuned row is the default's."""
    methods = {"A": {"set": {"algorithm.name": "fedprox"}, "space": {"train.momentum": None}}}  # searches its mu
    tuner = _tuner(tmp_path, methods, budget=100, trials=1)
    tuner.run_trials(**QUIET)
    bench, label = tuner.bench()
    assert label == {"A": None} and bench.table("tuned") is None
    bench.run(log=lambda *a, **k: None)
    (row,) = tuner.rows()
    assert row["chosen_is_default"] and row["tuned"] == row["default"] and row["seeds"]["tuned"] == 1
    (summary,) = (tuner.out / "final").rglob("summary.json")  # one run serves both rows: its time counted once
    assert row["seconds"]["reruns"] == pytest.approx(json.loads(summary.read_text())["timing"]["wall_s"])
    assert "| the default (lr=0.05, local_epochs=1, mu=0.01) |" in tuner.markdown([row])


def test_a_row_states_the_studys_compute_in_sample_passes_and_in_base_runs(tmp_path):
    """A method training one round of a three-round base spends a third of a base run per trial: the row gives the
    sample passes, the unit and their ratio to three decimals (0.333: not rounded to a whole run, not to four
    places), with the objective, pruning curve, budget and state it was spent under."""
    methods = {"S": {"set": {"algorithm.name": "fedavg", "train.rounds": 1}}}
    tuner = _tuner(tmp_path, methods, base=_rounds(3), budget=100, trials=1)
    tuner.run_trials(**QUIET)
    (row,) = tuner.rows()
    method, unit = tuner.methods[0], tuner.unit()
    spent = tuner.spent(tuner.study(method))
    assert 3 * spent == unit > 0
    assert row["compute"] == {"sample_passes": spent, "base_runs": 0.333, "unit_sample_passes": unit}
    assert (row["objective"], row["pruned_on"], row["budget"], row["trials_cap"]) == ("pfl_val", "pfl_val", 100, 1)
    assert row["finished"] is True and row["complete"] == 1 and row["pruned"] == 0


def test_the_first_trials_values_are_the_defaults_its_space_holds_bounds_included(tmp_path):
    """The default trial's values (`tune.first: default`): a default on its space's upper bound (FedProx's μ 0.01)
    is held; an option whose default is unset (None) is left to the sampler, not queued as None; and a key a suite
    removes from every method's space (`tune.space: {algorithm.mu: null}`) is fine for a method that never had it."""
    space = {"algorithm.mu": {"low": 0.001, "high": 0.01, "log": True},
             "federation.train_per_client": {"low": 20, "high": 40, "int": True}}  # fmt: skip
    (prox,) = _tuner(tmp_path, {"P": {"set": {"algorithm.name": "fedprox"}, "space": space}}, budget=1).methods
    assert prox.default == {"train.lr": 0.05, "train.local_epochs": 1, "train.momentum": 0.0, "algorithm.mu": 0.01}
    assert "federation.train_per_client" in prox.space
    methods = {"A": {"set": {"algorithm.name": "fedavg"}}, "P": {"set": {"algorithm.name": "fedprox"}}}
    tuner = _tuner(tmp_path, methods, budget=1, space={"algorithm.mu": None})
    assert [sorted(m.space) for m in tuner.methods] == [["train.local_epochs", "train.lr", "train.momentum"]] * 2


def test_a_studys_first_trial_is_the_default_configuration(tmp_path):
    """With few trials (a costly method's budget pays for two or three), start-up draws alone could leave the chosen
    configuration far below the default on validation: the first trial runs the default's values of every searched
    key its space holds, an option whose None stands for another key filled in from it (FedRep's head_lr None =
    train.lr: drawn, the trial was not the default and a study choosing it was "tuned below default"); a default
    outside the space (head_epochs 10 here) is drawn; `first: sampled` draws it like the rest."""
    space = {"train.lr": {"low": 0.001, "high": 0.3, "log": True}, "algorithm.body_epochs": {"low": 1, "high": 5,
             "int": True}, "train.momentum": None}  # fmt: skip
    methods = {"R": {"set": {"algorithm.name": "fedrep"}, "space": {**space,
                                                                   "algorithm.head_epochs": {"low": 1, "high": 3,
                                                                                             "int": True}}}}
    tuner = _tuner(tmp_path / "default", methods, budget=100, trials=1)
    tuner.run_trials(**QUIET)
    (first,) = _done(tuner, tuner.methods[0])
    cfg = validate_config({**BASE, "algorithm": {"name": "fedrep"}})
    assert first.params["train.lr"] == cfg.train.lr and first.params["algorithm.body_epochs"] == 1  # its default
    assert first.user_attrs["default"] is True and first.params["algorithm.head_lr"] == cfg.train.lr  # its source
    assert 1 <= first.params["algorithm.head_epochs"] <= 3  # the default, 10, lies outside: drawn
    method = tuner.methods[0]
    assert method.resolved({"algorithm.head_lr": cfg.train.lr}) == method.resolved({})
    assert method.resolved({"algorithm.head_lr": 0.07})["algorithm"]["head_lr"] == 0.07  # set: kept, not filled
    rerun = method.resolved({})  # the re-run's config: all its data, the new-client stage as the base has it
    assert rerun["algorithm"]["name"] == "fedrep"
    assert rerun["federation"]["exclude_test_of"] == cfg.federation.exclude_test_of
    assert rerun["eval"]["new_clients"] == cfg.eval.new_clients.model_dump(mode="json")
    assert method.config(0, {}).federation.exclude_test_of == [0]  # (a trial's leaves the reported tests out)
    assert tuner.rows()[0]["default_trial"] == {"number": first.number, "state": "COMPLETE", "value": first.value}
    sampled = _tuner(tmp_path / "sampled", methods, budget=100, trials=1, first="sampled")
    sampled.run_trials(**QUIET)
    (draw,) = _done(sampled, sampled.methods[0])
    assert draw.params["train.lr"] != cfg.train.lr and "default" not in draw.user_attrs
    assert sampled.rows()[0]["default_trial"] is None


def _held(tuner) -> bool:
    """Whether this process holds the study's lock (`Studies.exclusive`): a second lock on the file would block."""
    import fcntl

    fd = os.open(tuner.out / "study.db.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # trials made by hand (study.ask)
def test_every_look_then_change_step_on_an_sqlite_study_holds_its_lock(tmp_path, monkeypatch):
    """SQLite cannot lock a row, so two processes taking one waiting trial at once could both get it (and ran it
    twice): queueing the default, queueing a dead process's trial again and taking a waiting trial each happen
    while this process holds the lock file beside the database, which is private."""
    seen: dict[str, list[bool]] = {"enqueue_trial": [], "ask": [], "set_trial_state_values": []}
    tuner = _tuner(tmp_path, FEDAVG, budget=100, trials=1)
    for name in ("enqueue_trial", "ask"):
        real = getattr(optuna.Study, name)
        monkeypatch.setattr(optuna.Study, name, lambda self, *a, _r=real, _n=name, **k: (
            seen[_n].append(_held(tuner)), _r(self, *a, **k))[1])  # fmt: skip
    study = tuner.study(tuner.methods[0])
    assert oct((tuner.out / "study.db.lock").stat().st_mode & 0o777) == "0o600"
    trial = study.ask()
    study._storage.set_trial_user_attr(trial._trial_id, "host", _process()["host"])
    study._storage.set_trial_user_attr(trial._trial_id, "pid", 2**22 + 12345)  # a process gone
    real_set = study._storage.set_trial_state_values
    monkeypatch.setattr(study._storage, "set_trial_state_values", lambda *a, **k: (
        seen["set_trial_state_values"].append(_held(tuner)), real_set(*a, **k))[1])  # fmt: skip
    assert tuner.recover(study) == 1
    assert tuner._one_trial(study, tuner.methods[0], lambda *_: None)
    # the test's own ask (above) is the one taken without the lock; the trial's state is set by recover and by the
    # take of the queued trial under it, and by the final tell without it (a trial only its own process tells)
    assert seen == {"enqueue_trial": [True, True], "ask": [False, True], "set_trial_state_values": [True, True, False]}
    assert not _held(tuner)  # released
    served = Tuner(tuner.suite, out=tmp_path / "served", storage="postgresql://u:p@localhost/db")
    with served.exclusive():  # a server database locks the row itself: no lock file
        assert not (tmp_path / "served").exists()


@pytest.mark.filterwarnings("error:The value None could not be cast")  # told failed, not told None
def test_a_trial_queued_twice_runs_once(tmp_path):
    """Two commands starting a study on a server database can both queue its default, and two processes of one
    machine can both queue a dead process's trial again: the later copy is dropped where it is taken (failed, not
    counted), the earliest runs."""
    tuner = _tuner(tmp_path, {"A": {"set": {"algorithm.name": "fedprox"}}}, budget=100, trials=3)
    study = tuner.study(tuner.methods[0])  # queues the default
    default = study.get_trials()[0].params or tuner.methods[0].default
    study.enqueue_trial(tuner.methods[0].default, user_attrs={"default": True})  # the other command's
    for _ in range(2):
        study.enqueue_trial({"train.lr": 0.02}, user_attrs={"retry_of": 7})
    assert tuner.run_trials(**QUIET) == 3
    trials = study.get_trials()
    assert [(t.state, t.user_attrs.get("duplicate_of")) for t in trials[:4]] == [
        (TrialState.COMPLETE, None), (TrialState.FAIL, 0), (TrialState.COMPLETE, None), (TrialState.FAIL, 2)]
    assert trials[0].params == default and trials[2].params["train.lr"] == 0.02
    assert len(_done(tuner, tuner.methods[0])) == 3  # the third is drawn: the repeats took none of the budget


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # trials made by hand (study.ask)
def test_recover_queues_each_trial_of_a_gone_process_again_once(tmp_path, monkeypatch):
    """`recover` fails every running trial whose process is gone and queues its parameters again, and says how many;
    a live process's trial keeps running. A trial another process of this machine recovered first (found failed: a
    server database locks the row) is neither raised on nor queued a second time, and the others are still
    recovered."""
    tuner = _tuner(tmp_path, FEDAVG, budget=100, first="sampled")
    study = tuner.study(tuner.methods[0])
    here = _process()
    gone = {**here, "pid": 2**22 + 12345}
    owners = [here, gone, gone, gone]  # alive; gone; gone, but recovered elsewhere first; gone
    trials = [study.ask() for _ in owners]
    for t, owner in zip(trials, owners, strict=True):
        t.suggest_float("train.lr", 1e-3, 0.3, log=True)
        for key, value in owner.items():
            study._storage.set_trial_user_attr(t._trial_id, key, value)
    stale = study.get_trials(deepcopy=True)  # what this process read: all running
    study._storage.set_trial_state_values(trials[2]._trial_id, TrialState.FAIL)  # the other process's recovery
    monkeypatch.setattr(type(study), "get_trials", lambda self, *a, **k: stale)
    assert tuner.recover(study) == 2
    monkeypatch.undo()
    after = study.get_trials()
    assert [t.state for t in after] == [TrialState.RUNNING, *[TrialState.FAIL] * 3, *[TrialState.WAITING] * 2]
    queued = [(t.user_attrs["retry_of"], t.system_attrs["fixed_params"]) for t in after[4:]]  # taken: its params
    assert queued == [(n, after[n].params) for n in (1, 3)]
