"""The table (markdown, JSON, self-contained HTML) and Optuna's plots per method."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pflbed.results.bench import _slug
from pflbed.results.rundir import atomic_write
from pflbed.results.tune.studies import optuna_module
from pflbed.results.tune.suite import IMPORTANCE_MIN_TRIALS, PLOTS


class Tables:
    """The table and plots of a `Tuner` (a mixin: the state is the tuner's)."""

    def draw(self) -> dict[str, dict[str, str]]:
        """Optuna's matplotlib plots per method, as PNGs under plots/: the optimization history (objective in %, as
        the table gives it) and, from `IMPORTANCE_MIN_TRIALS` complete trials over at least two parameters, the
        parameter importances; method → {kind: path relative to the tune directory}. A plot not drawn gets its
        reason in `absent`, which the table's pages say."""
        optuna = optuna_module()
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, MaxNLocator
        from optuna.trial import TrialState
        from optuna.visualization import matplotlib as vis

        (self.out / "plots").mkdir(parents=True, exist_ok=True)
        self.plots, self.absent = {}, {}
        for m in self.methods:
            study = self.study(m)
            n = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            why = {"history": "no complete trial yet" if not n else None,
                   "importance": (f"{len(m.space)} parameter{'s' * (len(m.space) != 1)} searched: nothing to rank"
                                  if len(m.space) < 2 else
                                  f"{n} complete trial{'s' * (n != 1)}; importances need at least "
                                  f"{IMPORTANCE_MIN_TRIALS} to mean anything" if n < IMPORTANCE_MIN_TRIALS else None)}
            kinds = {"history": vis.plot_optimization_history, "importance": vis.plot_param_importances}
            for kind, plot in kinds.items():
                path = Path("plots") / f"{_slug(m.name)}-{kind}.png"
                (self.out / path).unlink(missing_ok=True)  # an earlier drawing, from other trials: never left stale
                if why[kind]:
                    self.absent.setdefault(m.name, {})[kind] = why[kind]
                    continue
                try:
                    ax = plot(study)
                    for loc in ("left", "right"):  # Optuna's own title, where it puts one: would overlap ours
                        ax.set_title("", loc=loc)
                    ax.set_title(f"{m.name}: {PLOTS[kind]}")
                    if kind == "history":
                        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:g}"))
                        ax.set_ylabel(f"{m.objective} (%)")
                        # trial numbers: integers, a lone trial's too (MaxNLocator falls back to fractions
                        # where fewer than min_n_ticks integers lie in view)
                        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
                    ax.figure.set_size_inches(7, 4)
                    ax.figure.tight_layout()
                    ax.figure.savefig(self.out / path, dpi=90)
                    self.plots.setdefault(m.name, {})[kind] = str(path)
                except (ValueError, RuntimeError, optuna.exceptions.OptunaError) as e:  # e.g. a constant parameter
                    self.absent.setdefault(m.name, {})[kind] = f"Optuna could not draw it ({e})"
                finally:
                    plt.close("all")
        return self.plots

    def table(self, rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
        """The table's header and cells: per method the budget, the best trial, the chosen values, and each test
        column of the default and of the tuned configuration side by side."""
        cols = list(dict.fromkeys(c for r in rows for c in r["default"]))
        head = ["method", "trials (complete / pruned)", "search compute (base runs)", "objective (best, trial)",
                "chosen values"]  # fmt: skip
        head += [f"{c} {w}" for c in cols for w in ("default", "tuned")] + ["seeds (default/tuned)",
                                                                          "search / re-runs (min)"]
        out = []
        for r in rows:
            chosen = ", ".join(f"{k.split('.', 1)[1]}={_short(v)}" for k, v in r["chosen"].items()) or "—"
            chosen = f"the default ({chosen})" if r.get("chosen_is_default") else chosen  # its re-runs serve both
            best = "—" if r["best_value"] is None else f"{r['objective']} {_pct(r['best_value'])} (#{r['best_trial']})"
            if r.get("best_truncated"):  # the first trial, stopped where the budget was spent
                cut = r["best_truncated"]
                on = "" if cut["scored_on"] == r["objective"] else f", scored on {cut['scored_on']}"
                best = best[:-1] + f", stopped at round {cut['round']}{on})"
            trials = f"{r['complete'] + r['pruned']} ({r['complete']} / {r['pruned']})"
            spent = f"{r['compute']['base_runs']:.2f} of {r['budget']:g}"  # a study stopped early: not comparable yet
            cells = [r["method"], trials, spent + ("" if r["finished"] else ", **short**"), best, chosen]
            for c in cols:
                for w in ("default", "tuned"):
                    v = r[w].get(c)
                    cells.append("—" if v is None else f"{v[0]:.2f} ± {v[1]:.2f}")
            s = r["seeds"]
            cells.append(f"{s['default']}/{s['tuned']} of {s['of']}")
            cells.append(f"{r['seconds']['search'] / 60:.0f} / {r['seconds']['reruns'] / 60:.0f}")
            out.append(cells)
        return head, out

    def _intro(self, rows: list[dict[str, Any]]) -> str:
        t = self.suite.tune
        search, reruns = (sum(r["seconds"][k] for r in rows) / 60 for k in ("search", "reruns"))
        n = len(self.suite.seeds)
        unit = rows[0]["compute"]["unit_sample_passes"] if rows else self.unit()
        cap = f", at most {t.trials} trials" if t.trials else ""
        return (f"Test figures (%), mean ± std over seeds {self.suite.seeds} (the population standard deviation of "
                f"the {n} figures: divided by n, not n − 1), of each method's default configuration and of the "
                f"configuration its study chose on validation ({t.sampler}, pruner {t.pruner} from round "
                f"{math.ceil(t.warmup * (self.methods[0].rounds if self.methods else 1))} on, trials on seed "
                f"{self.seed}, whose data leaves out every sample seeds {self.suite.seeds} test on). Every method's "
                f"search gets the same training compute: {t.budget:g} base runs{cap}, a base run being the "
                f"{unit:,.0f} sample passes (samples through a gradient) of FedAvg's local training over one run "
                "of the base configuration; a trial running when its study's budget is spent is cut at that "
                "evaluation, so a study overshoots by at most the training between two evaluations and the final "
                "stages of its last trial. Where no trial has completed by then (a method whose trials each cost "
                "more than the budget), the first one is stopped there instead and scored on the rounds it ran "
                "(\"stopped at round r\"). The objective is the validation figure of the round selected on "
                "validation (pfl_val, gfl_val), else the one its column names: a summary field is read where the "
                "run puts it (FedAvg+FT's fine-tuned figure: at the final round). Wall time: "
                f"{search:.0f} min of trials (their running times summed) and {reruns:.0f} min of re-runs "
                f"(each run's wall time), {search + reruns:.0f} min in all. A compute marked short: the study has "
                "not spent its budget yet (stopped early): its row is not yet an equal-budget comparison.")

    def markdown(self, rows: list[dict[str, Any]]) -> str:
        from pflbed.results.report import _md_table

        lines = [f"## {self.suite.name}: default vs tuned", "", self._intro(rows), "", _md_table(*self.table(rows)), "",
                 "Search spaces:", ""]  # fmt: skip
        lines += [f"- {r['method']}: {_space(r, '`')}" for r in rows]
        for r in rows:
            lines += ["", f"### {r['method']}", ""]
            lines += [f"![{r['method']} {kind}]({p})\n" for kind, p in r["plots"].items()]
            lines += [f"{PLOTS[kind].capitalize()}: not drawn ({why}).\n" for kind, why in r["plots_absent"].items()]
        return "\n".join(lines) + "\n"

    def html(self, rows: list[dict[str, Any]]) -> str:
        """The table and the plots as one self-contained HTML file (the plots embedded)."""
        import base64
        import html

        from pflbed.results.report import STYLE, _html_table

        title = f"pflbed tune: {self.suite.name}"
        parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                 f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
                 f"<h2>Default vs tuned</h2><p>{html.escape(self._intro(rows))}</p>", _html_table(*self.table(rows)),
                 "<h2>Search spaces</h2><ul>"]  # fmt: skip
        parts += [f"<li>{html.escape(r['method'])}: {html.escape(_space(r))}</li>" for r in rows]
        parts.append("</ul>")
        for r in rows:
            parts.append(f"<h2>{html.escape(r['method'])}</h2>")
            for kind, p in r["plots"].items():
                data = base64.b64encode((self.out / p).read_bytes()).decode()
                parts.append(f"<img alt='{html.escape(r['method'])} {kind}' src='data:image/png;base64,{data}'>")
            parts += [f"<p>{PLOTS[kind].capitalize()}: not drawn ({html.escape(why)}).</p>"
                      for kind, why in r["plots_absent"].items()]
        return "\n".join(parts + ["</body></html>"])

    def write_tables(self) -> tuple[Path, Path]:
        """table.md (plots linked), table.json and report.html (self-contained) in the tune directory."""
        self.draw()
        rows = self.rows()
        self.out.mkdir(parents=True, exist_ok=True)
        md, js = self.out / "table.md", self.out / "table.json"
        atomic_write(self.out / "report.html", self.html(rows))  # each whole or as it was (`atomic_write`)
        atomic_write(md, self.markdown(rows))
        atomic_write(js, json.dumps({"suite": self.suite.name, "seeds": self.suite.seeds, "trial_seed": self.seed,
                                     "sampler": self.suite.tune.sampler, "pruner": self.suite.tune.pruner,
                                     "storage": self.storage_shown, "methods": rows}, indent=2) + "\n")  # fmt: skip
        return md, js


def _pct(v: float) -> str:
    return "—" if v is None or v == -math.inf else f"{100 * v:.2f}"


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _space(row: dict[str, Any], quote: str = "") -> str:
    """A method's search space as text, and the shared `train.*` keys left out of it because its trials never read
    them (`Method.unread`; a table from before those were left out has none)."""
    text = ", ".join(f"{quote}{k}{quote} {t}" for k, t in row["space"].items()) or "none"
    unread = row.get("unread") or []
    return text + (f"; not searched, never read by its trials: {', '.join(f'{quote}{k}{quote}' for k in unread)}"
                   if unread else "")
