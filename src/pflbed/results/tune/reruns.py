"""The final re-runs: each method's default and chosen configuration over the reported seeds, as a bench suite, and
the rows of the table."""

from __future__ import annotations

from typing import Any

from pflbed.results.bench import Bench, MethodSpec, Suite, TableSpec
from pflbed.results.tune.studies import Method


class Reruns:
    """The re-runs of a `Tuner` (a mixin: the state is the tuner's)."""

    def best(self, method: Method) -> Any:
        from optuna.trial import TrialState

        study = self.study(method)
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return max(done, key=lambda t: (t.value, -t.number)) if done else None

    def bench(self) -> tuple[Bench, dict[str, str | None]]:
        """The final re-runs as a bench suite: per method its default and its tuned configuration (labelled by the
        chosen trial, so a better trial found later runs anew), over the suite's seeds; and method → tuned row, None
        where the chosen configuration is the default one (`tune.first: default` makes that common): its re-runs
        would repeat the default's to the bit, so the default's serve as both."""
        default, tuned, rows = {}, {}, {}
        for m in self.methods:
            report = {**self.suite.report, **(m.spec.report or {})}
            default[m.name] = MethodSpec(set=m.spec.set, report=report)
            best = self.best(m)
            if best is not None and m.resolved(best.params) == m.resolved({}):
                rows[m.name] = None
            elif best is not None:
                rows[m.name] = label = f"{m.name} trial{best.number}"
                tuned[label] = MethodSpec(set={**m.spec.set, **best.params}, report=report)
        tables = {"default": TableSpec(methods=default, report=self.suite.report)}
        if tuned:
            tables["tuned"] = TableSpec(methods=tuned, report=self.suite.report)
        suite = Suite(name=self.suite.name, base=self.suite.base, seeds=self.suite.seeds, tables=tables,
                      out=str(self.out / "final"))  # fmt: skip
        return Bench(suite), rows

    def rows(self) -> list[dict[str, Any]]:
        """One row per method: budget, trials, chosen values and objective, default and tuned test figures."""
        from optuna.trial import TrialState

        bench, tuned_label = self.bench()
        default_rows = {r["method"]: r for r in bench.table("default").collect()}
        tuned_t = bench.table("tuned")
        tuned_rows = {r["method"]: r for r in tuned_t.collect()} if tuned_t else {}
        out = []
        for m in self.methods:
            study = self.study(m)
            trials = study.get_trials(deepcopy=False)
            states = [t.state for t in trials]
            best = self.best(m)
            first = next((t for t in trials if t.user_attrs.get("default")), None)
            cols = {**self.suite.report, **(m.spec.report or {})}
            same = m.name in tuned_label and tuned_label[m.name] is None  # chosen = default: one set of re-runs
            d = default_rows[m.name]
            t = d if same else tuned_rows.get(tuned_label.get(m.name) or "", {})
            reruns = [d] if same else [d, t]
            spent = self.spent(study)
            out.append({
                "method": m.name, "objective": m.objective, "pruned_on": m.curve, "budget": m.budget,
                "trials_cap": m.trials, "finished": self.finished(m, study),
                "compute": {"sample_passes": spent, "base_runs": round(spent / self.unit(), 3),
                            "unit_sample_passes": self.unit()},
                "complete": sum(s == TrialState.COMPLETE for s in states),
                "pruned": sum(s == TrialState.PRUNED for s in states),
                "best_trial": None if best is None else best.number,
                "best_value": None if best is None else best.value,
                "best_truncated": None if best is None else best.user_attrs.get("truncated"),  # {round, scored_on}
                "chosen": {} if best is None else best.params, "chosen_is_default": same,
                "default_trial": None if first is None else {"number": first.number, "state": first.state.name,
                                                             "value": first.value},  # `tune.first: default`
                "space": {k: s.text() for k, s in m.space.items()}, "unread": m.unread,
                "default": {c: d.get(c) for c in cols if cols[c]}, "tuned": {c: t.get(c) for c in cols if cols[c]},
                "seeds": {"default": d["seeds"], "tuned": t.get("seeds", 0), "of": len(self.suite.seeds)},
                "seconds": {"search": _trial_seconds(study),
                            "reruns": sum((r.get("wall_s") or 0) * r["seeds"] for r in reruns if r)},
                "plots": self.plots.get(m.name, {}), "plots_absent": self.absent.get(m.name, {}),
            })  # fmt: skip
        return out


def _trial_seconds(study) -> float:
    """The study's trials' running time, summed (Optuna's start and end of each complete or pruned trial): its wall
    time when one process ran them one after another, pauses between resumptions left out. Failed trials are left
    out too: one a stopped process left running is marked failed when the study resumes, hours later perhaps."""
    from optuna.trial import TrialState

    return sum((t.datetime_complete - t.datetime_start).total_seconds()
               for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))

