"""Running trials: ask the study, run the trial's config with the pruner watching its validation curve and its
compute, tell the study how it ended."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any

from pflbed import compute
from pflbed.errors import ConfigError, DivergedError, PflbedError
from pflbed.results.bench import _get
from pflbed.results.tune.studies import Method, _heartbeat, _process, optuna_module
from pflbed.results.tune.suite import CURVES
from pflbed.results.tune.tables import _pct, _short


class _Surplus(Exception):
    """A trial begun when others had already taken the whole budget (it ends as FAIL, not counted)."""



class _Truncated(Exception):
    """The study's first trial, stopped where its study's budget is spent and scored on the rounds it ran."""

    def __init__(self, round: int):
        super().__init__(round)
        self.round = round


def first_to_finish(study, number: int) -> bool:
    """Whether trial `number` is stopped, not cut, where the budget is spent: the study has no complete trial yet and
    it is the oldest running one. A cut (pruned) trial would leave a method whose trials each cost more than the
    budget (or than its share, with several workers starting trials at once) with none complete, nothing to choose;
    running it to the end instead let one such trial overshoot its budget several times over (pFedDF's default
    alone cost 3.9 times the budget on the leaderboard). Stopped and scored on the rounds it ran (`_Truncated`), it
    completes within one evaluation interval of the budget, as every other trial does."""
    from optuna.trial import TrialState

    if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return False
    running = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    return bool(running) and number == min(running)


def twin(study, number: int) -> int | None:
    """The earlier trial that trial `number` repeats, if it was queued twice: the default configuration (queued
    once per study) or a dead process's trial queued again. Two commands starting one study on a server database
    can both queue its default, and the repeat would spend the budget on a configuration already run; it is dropped
    (failed, not counted) where it is taken, the earliest kept."""
    trials = study.get_trials(deepcopy=False)
    mine = next(t for t in trials if t.number == number).user_attrs
    for key in ("default", "retry_of"):
        if key in mine:
            return next((t.number for t in trials if t.number < number and t.user_attrs.get(key) == mine[key]), None)
    return None


REFUSED_IN_A_ROW = 25  # trials the algorithm refused, one after another, before the search gives up


def refused_in_a_row(study, method: Method) -> None:
    """Stop a search whose last `REFUSED_IN_A_ROW` finished trials the algorithm all refused: a refused trial trains
    nothing, so it spends none of the budget, and a space where most draws are refused would never end."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))[-REFUSED_IN_A_ROW:]
    if len(done) == REFUSED_IN_A_ROW and all("refused" in t.user_attrs for t in done):
        why = done[-1].user_attrs["refused"]
        raise PflbedError(f"methods.{method.name}: the algorithm refused the last {REFUSED_IN_A_ROW} trials' values "
                          f"(e.g. {why}); narrow its space (methods.{method.name}.space)")


class Trials:
    """The trials of a `Tuner`'s studies (a mixin: the state is the tuner's)."""

    def run_trials(self, max_trials: int | None = None, worker: bool = False, log=print) -> int:
        """Trials until every study holds its budget (at most `max_trials` here); returns how many ran here.

        The main process waits for trials other workers are running (the final re-runs need finished studies); a
        worker (`worker`) stops when nothing is left to start."""
        ran = 0
        for method in self.methods:
            study = self.study(method, worker)
            if self.recover(study):
                log(f"{method.name}: re-queued the trials a stopped process left running")
            budget = method.budget * self.unit()
            while max_trials is None or ran < max_trials:
                done, running = self.counts(study)
                spent = self.spent(study)
                capped = method.trials is not None and done + running >= method.trials
                if not running and (spent >= budget or capped):
                    if worker:
                        log(f"{method.name}: its budget is spent ({spent / self.unit():.2f} of {method.budget:g} "
                            f"base runs, {done} trials finished)")  # fmt: skip
                    break
                if spent >= budget or capped:  # the rest is running elsewhere
                    if worker:
                        log(f"{method.name}: nothing left to start ({spent / self.unit():.2f} of {method.budget:g} "
                            f"base runs spent, {running} trial{'s' * (running != 1)} running elsewhere)")  # fmt: skip
                        break
                    time.sleep(2)
                    with contextlib.suppress(Exception):
                        optuna_module().storages.fail_stale_trials(study)
                    self.recover(study)
                    continue
                ran += self._one_trial(study, method, log)
                refused_in_a_row(study, method)
        return ran

    def _one_trial(self, study, method: Method, log) -> bool:
        """Ask the study for a trial, run it and tell the study how it ended; whether it counted (not surplus).

        Why ask/tell, not `study.optimize`: on a Ctrl-C (or any escape) optimize records the trial as failed at once
        and logs Optuna's traceback before pflbed's one-line message. Here an interrupted trial is left running:
        the next command's `recover` sees its process gone and queues its parameters again, as the guide says."""
        from optuna.trial import TrialState

        optuna = optuna_module()
        with warnings.catch_warnings(), self.exclusive():  # the heartbeat is kept below, as optimize keeps it
            warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with Study.optimize")
            trial = study.ask()
        first = twin(study, trial.number)
        if first is not None:
            trial.set_user_attr("duplicate_of", first)
            study.tell(trial, state=TrialState.FAIL)
            return False
        try:
            with _heartbeat(study._storage, trial._trial_id):
                value = self._objective(method, trial, log)
        except _Surplus:
            study.tell(trial, state=TrialState.FAIL)
            return False
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
            return True
        except KeyboardInterrupt:
            raise  # left RUNNING on purpose (see above)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
        study.tell(trial, value)
        return True

    def _objective(self, method: Method, trial, log) -> float:
        optuna = optuna_module()
        from optuna.trial import TrialState

        from pflbed.results.experiment import run

        for key, value in _process().items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("passes", 0)
        study, budget = trial.study, method.budget * self.unit()
        ahead = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                       TrialState.RUNNING))
                 if t.number < trial.number]  # fmt: skip
        if self.spent(study, but=trial.number) >= budget or (method.trials is not None and len(ahead) >= method.trials):
            trial.set_user_attr("surplus", True)
            raise _Surplus
        params = {k: s.suggest(trial, k) for k, s in method.space.items()}
        cfg = method.config(self.seed, params)
        path = method.dir / f"trial{trial.number:04d}"
        trial.set_user_attr("run_dir", str(path.relative_to(self.out)))
        best = -math.inf

        shown = ", ".join(f"{k.split('.', 1)[1]}={_short(v)}" for k, v in params.items())
        head = f"{method.name} trial {trial.number} ({shown})"
        unit = self.unit()
        log(f"{head}: started, trial {len(ahead) + 1}; {self.spent(study) / unit:.2f} of {method.budget:g} base runs "
            "spent")  # fmt: skip
        rounds, start, records = cfg.train.rounds, compute.total(), []

        def report(record: dict[str, Any]) -> None:
            """At each evaluation: the compute so far (cut where it spends the budget; the study's first trial is
            stopped there instead, once it has an evaluation to be scored on), and the pruner's judgment of the best
            validation figure so far on the method's curve."""
            nonlocal best
            rnd, passes = record["round"], compute.total() - start
            trial.set_user_attr("passes", passes)
            records.append(record)
            v = record.get(method.curve)
            if v is not None and v == v:
                best = max(best, v)
                log(f"  {method.name} trial {trial.number}: round {rnd}/{rounds}, {method.curve} {_pct(v)}, "
                    f"{passes / unit:.2f} base runs")  # fmt: skip
                trial.report(best, rnd)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"pruned at round {rnd}")
            if rnd < rounds and self.spent(study, but=trial.number) + passes >= budget:
                if not first_to_finish(study, trial.number):
                    trial.set_user_attr("cut", rnd)
                    raise optuna.TrialPruned(f"the budget is spent at round {rnd}")
                if best > -math.inf:
                    raise _Truncated(rnd)

        t0 = time.perf_counter()
        try:
            res = run(cfg, path, progress=False, force=True, on_record=report)
        except _Truncated as e:
            return self._truncated(method, trial, records, e.round, head, t0, log)
        except optuna.TrialPruned as e:
            log(f"{head}: {'cut: ' if 'budget' in str(e) else ''}{e}, best {method.curve} {_pct(best)} "
                f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
            raise
        except DivergedError as e:
            trial.set_user_attr("diverged", e.round)
            log(f"{head}: diverged in round {e.round}: counted as pruned")
            raise optuna.TrialPruned(f"diverged in round {e.round}") from None
        except ConfigError as e:  # valid key by key (checked above), refused together by the algorithm (L2GD's θ ≤ 1)
            trial.set_user_attr("refused", str(e))
            log(f"{head}: refused ({e}): counted as pruned")
            raise optuna.TrialPruned(f"refused: {e}") from None
        finally:  # the trial's compute, however it ended
            trial.set_user_attr("passes", compute.total() - start)
        value = objective_value(res.summary, res.history, method.objective)
        if value is None:
            raise PflbedError(f"methods.{method.name}: the run has no {method.objective} (objective: pick a "
                              "validation figure the method reports)")  # fmt: skip
        log(f"{head}: {method.objective} {_pct(value)} ({time.perf_counter() - t0:.0f} s)")
        return value

    @staticmethod
    def _truncated(method: Method, trial, records: list[dict[str, Any]], rnd: int, head: str, t0: float,
                   log) -> float:
        """A first trial stopped at round `rnd`: its objective over the rounds it ran; an objective only a finished
        run has (a summary field, `new_val`) is replaced by the curve the method is pruned on, and the trial says
        which it was scored on (`truncated`)."""
        figure = method.objective if method.objective in CURVES else method.curve
        value = objective_value({}, records, figure)
        trial.set_user_attr("truncated", {"round": rnd, "scored_on": figure})
        log(f"{head}: stopped at round {rnd}, where the budget is spent (the study's first trial): {figure} "
            f"{_pct(value)} ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        return value


def objective_value(summary: dict[str, Any], history: list[dict[str, Any]], objective: str) -> float | None:
    """A finished run's validation figure: `pfl_val` / `gfl_val` at the round selected on that same figure (the
    best, earliest on ties); `new_val` = the new clients' validation figure (Best-by-validation, at the rate chosen
    on validation, mean over the sizes, of the first new-client method); else the summary field `objective`."""
    from pflbed.results.summary import select_round

    if objective in CURVES:
        if not any(h.get(objective) is not None for h in history):
            return None
        rnd = select_round(history, objective)["round"]
        v = next(h for h in history if h["round"] == rnd).get(objective)
    elif objective == "new_val":
        nc = summary.get("new_clients")
        if not nc or not nc.get("methods"):
            return None
        per_size = next(iter(nc["methods"].values()))
        vals = [r["per_lr"][f"{r['lr_best']:g}"]["best_val"] for r in per_size.values()]
        v = sum(vals) / len(vals)
    else:
        v = _get(summary, objective)
    return None if v is None or v != v else float(v)

