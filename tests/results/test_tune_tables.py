"""`pflbed tune`'s outputs on fabricated rows (no trial runs): the default-vs-tuned table's header and cells, the
paragraph stating the protocol and the compute, the Markdown page, the self-contained HTML page, table.json, and
Optuna's plots per method (or the reason each is absent) drawn from in-memory studies with hand-made trials."""

from __future__ import annotations

import base64
import copy
import html
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from pflbed.results.report import STYLE, _html_table, _md_table
from pflbed.results.tune.suite import TuneSuite
from pflbed.results.tune.tables import Tables, _pct, _short, _space

from .test_bench_tables import half_then_full_disk


def make_suite(name="fab", seeds=(0, 1, 2), **tune):
    tune = {"budget": 5, "trials": 20, "sampler": "random", "pruner": "hyperband", **tune}
    return TuneSuite.model_validate({"name": name, "seeds": list(seeds), "tune": tune,
                                     "methods": {"FedProx": {}, "FedAvg+FT": {}}})  # fmt: skip


def method(name, space=("train.lr", "algorithm.mu"), objective="pfl_val", rounds=10):
    """What the mixin reads of a `Method`: its name, its search space (only its size), objective and rounds."""
    return SimpleNamespace(name=name, space=dict.fromkeys(space, None), objective=objective, rounds=rounds)


class FakeTuner(Tables):
    """The state a `Tuner` gives its `Tables` mixin (suite, out, methods, seed, storage_shown, study(), unit(),
    rows()), without a run config: `rows()` returns the fabricated rows with the plots `draw()` made, as
    `Reruns.rows` does."""

    def __init__(self, out, suite=None, methods=(), studies=None, unit=2500.0, rows=(), storage="study.db"):
        self.suite, self.out, self.methods = suite or make_suite(), Path(out), list(methods)
        self.seed, self.storage_shown, self._unit = 100, storage, unit
        self._studies, self._rows = studies or {}, list(rows)
        self.plots, self.absent = {}, {}

    def study(self, m):
        return self._studies[m.name]

    def unit(self):
        return self._unit

    def rows(self):
        return [dict(r, plots=self.plots.get(r["method"], {}), plots_absent=self.absent.get(r["method"], {}))
                for r in self._rows]  # fmt: skip


# Two rows shaped as `Reruns.rows` makes them (cf. benchmarks/results/tune_fmnist/table.json).
ROW_A = {
    "method": "FedProx", "objective": "pfl_val", "pruned_on": "pfl_val", "budget": 5.0, "trials_cap": 20,
    "finished": False, "compute": {"sample_passes": 5555551, "base_runs": 4.5, "unit_sample_passes": 1234567.4},
    "complete": 3, "pruned": 2, "best_trial": 3, "best_value": 0.91234, "best_truncated": None,
    "chosen": {"train.lr": 0.012512593595929865, "algorithm.mu": 0.01}, "chosen_is_default": False,
    "default_trial": {"number": 0, "state": "COMPLETE", "value": 0.9},
    "space": {"train.lr": "log-uniform [0.001, 0.3]", "algorithm.mu": "log-uniform [0.001, 0.1]"}, "unread": [],
    "default": {"P-FL": [91.35, 0.754], "G-FL": [83.926, 0.5978]}, "tuned": {"P-FL": [93.284, 0.303], "G-FL": None},
    "seeds": {"default": 3, "tuned": 2, "of": 3}, "seconds": {"search": 5192.2, "reruns": 1002.5},
    "plots": {"history": "plots/FedProx-history.png"},
    "plots_absent": {"importance": "3 complete trials; importances need at least 10 to mean anything"},
}  # fmt: skip
ROW_B = {
    "method": "FedAvg+FT", "objective": "final.ft.pfl_val", "pruned_on": "pfl_val", "budget": 5.0, "trials_cap": 20,
    "finished": True, "compute": {"sample_passes": 6211000, "base_runs": 5.031, "unit_sample_passes": 1234567.4},
    "complete": 1, "pruned": 0, "best_trial": 0, "best_value": 0.5,
    "best_truncated": {"round": 4, "scored_on": "pfl_val"},
    "chosen": {"train.local_epochs": 1, "algorithm.opt.beta": 0.9}, "chosen_is_default": True,
    "default_trial": {"number": 0, "state": "COMPLETE", "value": 0.5},
    "space": {"train.local_epochs": "int [1, 5]", "algorithm.opt.beta": "uniform [0.5, 0.99]"},
    "unread": ["train.momentum"],
    "default": {"P-FL": [88.0, 1.0], "G-FL": [80.5, 0.25], "new": [70.1, 0.0]},
    "tuned": {"P-FL": [88.0, 1.0], "G-FL": [80.5, 0.25], "new": [70.1, 0.0]},
    "seeds": {"default": 3, "tuned": 3, "of": 3}, "seconds": {"search": 600.0, "reruns": 120.0},
    "plots": {"history": "plots/FedAvg-FT-history.png"},
    "plots_absent": {"importance": "1 complete trial; importances need at least 10 to mean anything"},
}  # fmt: skip

HEAD = ["method", "trials (complete / pruned)", "search compute (base runs)", "objective (best, trial)",
        "chosen values", "P-FL default", "P-FL tuned", "G-FL default", "G-FL tuned", "new default", "new tuned",
        "seeds (default/tuned)", "search / re-runs (min)"]  # fmt: skip
CELLS_A = ["FedProx", "5 (3 / 2)", "4.50 of 5, **short**", "pfl_val 91.23 (#3)", "lr=0.01251, mu=0.01",
           "91.35 ± 0.75", "93.28 ± 0.30", "83.93 ± 0.60", "—", "—", "—", "3/2 of 3", "87 / 17"]  # fmt: skip
CELLS_B = ["FedAvg+FT", "1 (1 / 0)", "5.03 of 5", "final.ft.pfl_val 50.00 (#0, stopped at round 4, scored on pfl_val)",
           "the default (local_epochs=1, opt.beta=0.9)", "88.00 ± 1.00", "88.00 ± 1.00", "80.50 ± 0.25",
           "80.50 ± 0.25", "70.10 ± 0.00", "70.10 ± 0.00", "3/3 of 3", "10 / 2"]  # fmt: skip

INTRO = (
    "Test figures (%), mean ± std over seeds [0, 1, 2] (the population standard deviation of the 3 figures: "
    "divided by n, not n − 1), of each method's default configuration and of the configuration its study chose on "
    "validation (random, pruner hyperband from round 3 on, trials on seed 100, whose data leaves out every sample "
    "seeds [0, 1, 2] test on). Every method's search gets the same training compute: 5 base runs, at most 20 trials, "
    "a base run being the 1,234,567 sample passes (samples through a gradient) of FedAvg's local training over one "
    "run of the base configuration; a trial running when its study's budget is spent is cut at that evaluation, so a "
    "study overshoots by at most the training between two evaluations and the final stages of its last trial. Where "
    "no trial has completed by then (a method whose trials each cost more than the budget), the first one is "
    "stopped there instead and scored on the rounds it ran (\"stopped at round r\"). The objective is the validation "
    "figure of the round selected on validation (pfl_val, gfl_val), else the one its column names: a summary field "
    "is read where the run puts it (FedAvg+FT's fine-tuned figure: at the final round). Wall time: 97 min of trials "
    "(their running times summed) and 19 min of re-runs (each run's wall time), 115 min in all. A compute marked "
    "short: the study has not spent its budget yet (stopped early): its row is not yet an equal-budget comparison."
)


def two_methods(tmp_path, **kw):
    return FakeTuner(tmp_path / "out", methods=[method("FedProx"), method("FedAvg+FT")], rows=[ROW_A, ROW_B], **kw)


def row(**changes):
    return {**copy.deepcopy(ROW_A), **changes}


# --- the table's header and cells ---------------------------------------------------------------------------------


def test_header_and_cells_of_two_methods(tmp_path):
    """Every cell's format: trials `n (complete / pruned)`, the compute spent `x.xx of B` (`**short**` while the
    study has not spent its budget), the best objective in % with its trial (a truncated first trial: where it
    stopped and, if not the objective, what it was scored on), the chosen values (keys without their section; the
    chosen one being the default says so), `mean ± std` per test column of default and tuned (`—` where absent,
    columns in first-seen order over the rows), seeds `default/tuned of n` and minutes of search / re-runs."""
    head, cells = two_methods(tmp_path).table([ROW_A, ROW_B])
    assert head == HEAD
    assert cells == [CELLS_A, CELLS_B]


def test_the_columns_follow_the_rows_in_order(tmp_path):
    """A test column only a later row has comes after the others, and an earlier row gets `—` there; a row with
    none of the columns has only its fixed cells."""
    head, cells = two_methods(tmp_path).table([ROW_B, ROW_A])
    assert head[5:11] == ["P-FL default", "P-FL tuned", "G-FL default", "G-FL tuned", "new default", "new tuned"]
    bare = row(default={}, tuned={})
    head, cells = two_methods(tmp_path).table([bare])
    assert head == HEAD[:5] + HEAD[-2:] and cells == [CELLS_A[:5] + CELLS_A[-2:]]
    assert two_methods(tmp_path).table([]) == (HEAD[:5] + HEAD[-2:], [])


@pytest.mark.parametrize(("changes", "index", "cell"), [
    ({"best_value": None, "best_trial": None}, 3, "—"),
    ({"best_value": 0.5, "best_trial": 0, "best_truncated": {"round": 7, "scored_on": "pfl_val"}}, 3,
     "pfl_val 50.00 (#0, stopped at round 7)"),
    ({"best_value": 0.123456, "best_trial": 12}, 3, "pfl_val 12.35 (#12)"),
    ({"chosen": {}}, 4, "—"),
    ({"chosen": {}, "chosen_is_default": True}, 4, "the default (—)"),
    ({"chosen": {"algorithm.opt": "adam", "train.local_epochs": 4, "algorithm.wd": 1e-05}}, 4,
     "opt=adam, local_epochs=4, wd=1e-05"),
    ({"finished": True, "budget": 2.5, "compute": {"base_runs": 2.556, "unit_sample_passes": 1.0}}, 2, "2.56 of 2.5"),
    ({"complete": 0, "pruned": 7}, 1, "7 (0 / 7)"),
    ({"seeds": {"default": 0, "tuned": 1, "of": 2}}, -2, "0/1 of 2"),
    ({"seconds": {"search": 29.0, "reruns": 91.0}}, -1, "0 / 2"),
    ({"default": {"P-FL": [5.004, 12.346]}, "tuned": {"P-FL": None}}, 5, "5.00 ± 12.35"),
])  # fmt: skip
def test_a_cell(tmp_path, changes, index, cell):
    """One cell at a time, on the first row changed: no best trial, a first trial stopped and scored on the
    objective itself (nothing more said), the objective rounded to two decimals in %, no chosen value, the default
    chosen with no value, values of several types (strings, ints, floats to four significant digits), a finished
    study's budget given as is, the pruned trials counted, seeds, minutes rounded."""
    assert two_methods(tmp_path).table([row(**changes)])[1][0][index] == cell


def test_pct_short_and_space():
    """The objective in % (`—` where there is none, or minus infinity: a diverged trial's value), a chosen value
    shortened (a float to four significant digits, anything else as is), a search space as text."""
    assert (_pct(None), _pct(-float("inf")), _pct(0.5), _pct(0.123456), _pct(1.0)) == ("—", "—", "50.00", "12.35",
                                                                                      "100.00")  # fmt: skip
    assert (_short(0.012512593595929865), _short(1e-05), _short(3.0), _short(4), _short("adam"),
            _short(True)) == ("0.01251", "1e-05", "3", "4", "adam", "True")  # fmt: skip
    assert _space(ROW_A) == "train.lr log-uniform [0.001, 0.3], algorithm.mu log-uniform [0.001, 0.1]"
    assert _space(ROW_B, "`") == ("`train.local_epochs` int [1, 5], `algorithm.opt.beta` uniform [0.5, 0.99]; "
                                  "not searched, never read by its trials: `train.momentum`")  # fmt: skip
    assert _space({"space": {}, "unread": ["train.lr", "train.momentum"]}) == (
        "none; not searched, never read by its trials: train.lr, train.momentum")
    assert _space({"space": {}}) == "none"  # a table from before `unread` existed
    assert _space({"space": {"train.lr": "uniform [0, 1]"}, "unread": None}) == "train.lr uniform [0, 1]"


# --- the paragraph stating the protocol and the compute -----------------------------------------------------------


def test_intro_states_seeds_pruner_start_budget_unit_and_minutes(tmp_path):
    """The whole paragraph for two methods: the seeds and their count, the sampler, the pruner and its first round
    (ceil of warmup × rounds: 0.25 × 10 → 3), the trial seed, the budget (`:g`) and the trials cap, the unit (sample
    passes of one base run, thousands separated), and the minutes of search and re-runs summed over the rows."""
    assert two_methods(tmp_path)._intro([ROW_A, ROW_B]) == INTRO


def test_intro_without_cap_rows_or_methods(tmp_path):
    """No trials cap: nothing said of one. No row yet: the unit is the tuner's own and no minute spent. No method:
    the pruner's first round reckoned on one round. The first method's rounds and the first row's unit count; the
    count of seeds is theirs."""
    t = FakeTuner(tmp_path, suite=make_suite(seeds=[3, 5], trials=None, budget=2.5, warmup=0.6), unit=2500.0)
    text = t._intro([])
    assert "over seeds [3, 5] (the population standard deviation of the 2 figures:" in text
    assert "from round 1 on" in text  # ceil(0.6 × 1)
    assert "compute: 2.5 base runs, a base run being the 2,500 sample passes" in text
    assert "Wall time: 0 min of trials (their running times summed) and 0 min of re-runs (each run's wall time), " \
           "0 min in all." in text
    t.methods = [method("A", rounds=7), method("B", rounds=40)]
    later = row(compute={"base_runs": 1.0, "unit_sample_passes": 999.0})
    text = t._intro([row(), later])
    assert "from round 5 on" in text  # ceil(0.6 × 7) = ceil(4.2), neither floor nor the second method's 24
    assert "being the 1,234,567 sample passes" in text
    assert "Wall time: 173 min of trials" in text and "and 33 min of re-runs" in text and "206 min in all" in text


@pytest.mark.parametrize(("warmup", "rounds", "start"), [(0.25, 10, 3), (0.0, 10, 0), (0.5, 10, 5), (0.34, 3, 2)])
def test_intro_pruner_start_is_the_ceiling(tmp_path, warmup, rounds, start):
    """The round from which the pruner judges a trial is ceil(warmup × rounds), as `Studies.study` sets it."""
    t = FakeTuner(tmp_path, suite=make_suite(warmup=warmup), methods=[method("A", rounds=rounds)])
    assert f"pruner hyperband from round {start} on," in t._intro([ROW_A])


# --- the Markdown page ---------------------------------------------------------------------------------------------


def test_markdown_page_whole(tmp_path):
    """The page users paste, whole: title, intro, table, search spaces (keys quoted, unread keys named) and per method
    its plots linked then the reasons a plot is absent."""
    table = _md_table(HEAD, [CELLS_A, CELLS_B])
    assert table.splitlines()[2] == "| " + " | ".join(CELLS_A) + " |"
    expected = (
        "## fab: default vs tuned\n\n" + INTRO + "\n\n" + table + "\n\n"
        "Search spaces:\n\n"
        "- FedProx: `train.lr` log-uniform [0.001, 0.3], `algorithm.mu` log-uniform [0.001, 0.1]\n"
        "- FedAvg+FT: `train.local_epochs` int [1, 5], `algorithm.opt.beta` uniform [0.5, 0.99]; not searched, never "
        "read by its trials: `train.momentum`\n\n"
        "### FedProx\n\n"
        "![FedProx history](plots/FedProx-history.png)\n\n"
        "Parameter importances: not drawn (3 complete trials; importances need at least 10 to mean anything).\n\n\n"
        "### FedAvg+FT\n\n"
        "![FedAvg+FT history](plots/FedAvg-FT-history.png)\n\n"
        "Parameter importances: not drawn (1 complete trial; importances need at least 10 to mean anything).\n\n"
    )
    assert two_methods(tmp_path).markdown([ROW_A, ROW_B]) == expected


def test_markdown_names_every_absent_plot(tmp_path):
    """A method with no plot: both reasons, history first, each capitalized from its plot's name."""
    r = row(plots={}, plots_absent={"history": "no complete trial yet",
                                    "importance": "1 parameter searched: nothing to rank"})  # fmt: skip
    text = two_methods(tmp_path).markdown([r])
    assert text.endswith("### FedProx\n\nOptimization history: not drawn (no complete trial yet).\n\n"
                         "Parameter importances: not drawn (1 parameter searched: nothing to rank).\n\n")  # fmt: skip
    assert "![" not in text


# --- the HTML page ---------------------------------------------------------------------------------------------------


def test_html_page_whole_escaped_with_the_plot_embedded(tmp_path):
    """The self-contained page: the suite's and the method's names escaped (a method named `<b>x</b>` is shown, not
    rendered), the intro escaped, the table, the spaces unquoted, each plot embedded as base64 PNG read from the tune
    directory, and the reasons for an absent plot escaped."""
    t = FakeTuner(tmp_path / "out", suite=make_suite(name="a&b"), methods=[method("<b>x</b>")])
    (t.out / "plots").mkdir(parents=True)
    (t.out / "plots" / "b-x-b-history.png").write_bytes(b"png bytes")
    r = row(method="<b>x</b>", plots={"history": "plots/b-x-b-history.png"},
            plots_absent={"importance": "Optuna could not draw it (<bad> & co)"})  # fmt: skip
    page = t.html([r])
    intro = t._intro([r])
    shown = html.escape(intro)
    assert "each method&#x27;s default" in shown and "(&quot;stopped at round r&quot;)" in shown
    expected = "\n".join([
        f"<!doctype html><html><head><meta charset='utf-8'><title>pflbed tune: a&amp;b</title><style>{STYLE}</style>"
        "</head><body><h1>pflbed tune: a&amp;b</h1>",
        f"<h2>Default vs tuned</h2><p>{html.escape(intro)}</p>",
        _html_table(*t.table([r])),
        "<h2>Search spaces</h2><ul>",
        "<li>&lt;b&gt;x&lt;/b&gt;: train.lr log-uniform [0.001, 0.3], algorithm.mu log-uniform [0.001, 0.1]</li>",
        "</ul>",
        "<h2>&lt;b&gt;x&lt;/b&gt;</h2>",
        "<img alt='&lt;b&gt;x&lt;/b&gt; history' src='data:image/png;base64,cG5nIGJ5dGVz'>",
        "<p>Parameter importances: not drawn (Optuna could not draw it (&lt;bad&gt; &amp; co)).</p>",
        "</body></html>",
    ])  # fmt: skip
    assert page == expected
    assert "<td>&lt;b&gt;x&lt;/b&gt;</td>" in page and "<b>" not in page


def test_html_lists_every_method_and_space_with_unread_keys(tmp_path):
    """Two methods: each in the spaces list (unread keys named, unquoted), each with its own section, in order."""
    (tmp_path / "out" / "plots").mkdir(parents=True)
    for name in ("FedProx", "FedAvg-FT"):
        (tmp_path / "out" / "plots" / f"{name}-history.png").write_bytes(name.encode())
    page = two_methods(tmp_path).html([ROW_A, ROW_B])
    assert ("<h2>Search spaces</h2><ul>\n<li>FedProx: train.lr log-uniform [0.001, 0.3], algorithm.mu log-uniform "
            "[0.001, 0.1]</li>\n<li>FedAvg+FT: train.local_epochs int [1, 5], algorithm.opt.beta uniform [0.5, 0.99]; "
            "not searched, never read by its trials: train.momentum</li>\n</ul>\n<h2>FedProx</h2>\n"
            f"<img alt='FedProx history' src='data:image/png;base64,{base64.b64encode(b'FedProx').decode()}'>\n"
            "<p>Parameter importances: not drawn (3 complete trials; importances need at least 10 to mean anything)."
            "</p>\n<h2>FedAvg+FT</h2>\n"
            f"<img alt='FedAvg+FT history' src='data:image/png;base64,{base64.b64encode(b'FedAvg-FT').decode()}'>\n"
            "<p>Parameter importances: not drawn (1 complete trial; importances need at least 10 to mean anything)."
            "</p>\n</body></html>") in page  # fmt: skip


# --- Optuna's plots ---------------------------------------------------------------------------------------------------


def _study(n_complete, params=("a", "b"), pruned=0, failed=0):
    """An in-memory study with hand-made trials: `n_complete` complete ones (values rising), then pruned and failed."""
    optuna = pytest.importorskip("optuna")
    pytest.importorskip("matplotlib")
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    dists = {p: FloatDistribution(0.0, 1.0) for p in params}
    for i in range(n_complete):
        study.add_trial(create_trial(params={p: ((i * 7 + j * 3) % 10) / 10 for j, p in enumerate(params)},
                                     distributions=dists, value=0.5 + 0.01 * i))  # fmt: skip
    for state, k in ((TrialState.PRUNED, pruned), (TrialState.FAIL, failed)):
        for _ in range(k):
            steps = {1: 0.2} if state == TrialState.PRUNED else {}
            study.add_trial(create_trial(state=state, params=dict.fromkeys(params, 0.5), distributions=dists,
                                         value=None, intermediate_values=steps))  # fmt: skip
    return study


def _png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_draw_plots_and_the_reason_each_absent_one_is_not_drawn(tmp_path, monkeypatch):
    """Per method: the history from one complete trial on; importances from `IMPORTANCE_MIN_TRIALS` (10) complete
    trials (pruned and failed ones do not count) over at least two parameters, else the reason, in the plural or
    singular; a plot's file named by the method's slug, 7 × 4 in at 90 dpi; an earlier drawing removed when not
    drawn again; nothing of the plot (labels, legend) off the page; titled by the method, the history's objective
    in % with integer trial numbers (a lone trial's too); no figure left open."""
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    drawn = {}
    real = Figure.savefig

    def record(fig, path, **kw):
        ax = fig.axes[0]
        box, page = ax.get_tightbbox(fig.canvas.get_renderer()), fig.bbox  # labels, legend: all on the page
        inside = min(box.x0 - page.x0, box.y0 - page.y0, page.x1 - box.x1, page.y1 - box.y1) >= 0
        drawn[Path(path).name] = {"inside": inside, "title": ax.get_title(), "left": ax.get_title(loc="left"),
                                  "right": ax.get_title(loc="right"), "ylabel": ax.get_ylabel(),
                                  "y": [ax.yaxis.get_major_formatter()(v, 0) for v in (0.5, 0.123)],
                                  "x": list(ax.get_xticks())}  # fmt: skip
        return real(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", record)
    studies = {"A": _study(10, pruned=1), "B (x)": _study(0, pruned=1, failed=1), "C": _study(1, params=("a",)),
               "D": _study(9, params=("a", "b", "c"), pruned=2, failed=1), "E": _study(1), "F": _study(2, params=())}
    methods = [method("A", space=("a", "b"), objective="final.ft.pfl_val"), method("B (x)", space=("a", "b")),
               method("C", space=("a",)), method("D", space=("a", "b", "c")), method("E", space=("a", "b")),
               method("F", space=())]  # fmt: skip
    t = FakeTuner(tmp_path / "deep" / "out", methods=methods, studies=studies)
    plots = t.out / "plots"
    plots.mkdir(parents=True)
    for name in ("A-importance.png", "B-x-history.png", "B-x-importance.png", "C-importance.png"):
        (plots / name).write_bytes(b"an earlier drawing")
    got = t.draw()
    assert got is t.plots
    assert t.plots == {"A": {"history": "plots/A-history.png", "importance": "plots/A-importance.png"},
                       "C": {"history": "plots/C-history.png"}, "D": {"history": "plots/D-history.png"},
                       "E": {"history": "plots/E-history.png"}, "F": {"history": "plots/F-history.png"}}  # fmt: skip
    need = "importances need at least 10 to mean anything"
    assert t.absent == {"B (x)": {"history": "no complete trial yet", "importance": f"0 complete trials; {need}"},
                        "C": {"importance": "1 parameter searched: nothing to rank"},
                        "D": {"importance": f"9 complete trials; {need}"},
                        "E": {"importance": f"1 complete trial; {need}"},
                        "F": {"importance": "0 parameters searched: nothing to rank"}}  # fmt: skip
    assert sorted(p.name for p in plots.iterdir()) == sorted(Path(p).name for m in t.plots.values() for p in m.values())
    for m in t.plots.values():
        for p in m.values():
            assert _png_size(t.out / p) == (630, 360) and drawn[Path(p).name]["inside"], p
    assert drawn["A-history.png"] == {"inside": True, "title": "A: optimization history", "left": "", "right": "",
                                      "ylabel": "final.ft.pfl_val (%)", "y": ["50", "12.3"],
                                      "x": drawn["A-history.png"]["x"]}  # fmt: skip
    assert (drawn["C-history.png"]["ylabel"], drawn["C-history.png"]["title"]) == ("pfl_val (%)",
                                                                                   "C: optimization history")
    for name in ("A-history.png", "C-history.png"):
        assert drawn[name]["x"] and all(x == int(x) for x in drawn[name]["x"]), drawn[name]["x"]
    assert {k: drawn["A-importance.png"][k] for k in ("title", "left", "right")} == {
        "title": "A: parameter importances", "left": "", "right": ""}
    assert plt.get_fignums() == []
    t.draw()  # again, over its own plots directory
    assert sorted(p.name for p in plots.iterdir()) == sorted(Path(p).name for m in t.plots.values() for p in m.values())


@pytest.mark.parametrize("error", ["ValueError", "RuntimeError", "OptunaError"])
def test_draw_records_why_optuna_could_not_draw(tmp_path, monkeypatch, error):
    """A plot Optuna refuses (e.g. over a constant parameter) is absent with Optuna's reason, the other one drawn,
    and no figure left open."""
    import matplotlib.pyplot as plt

    study = _study(1)
    import optuna
    from optuna.visualization import matplotlib as vis

    exc = {"ValueError": ValueError, "RuntimeError": RuntimeError, "OptunaError": optuna.exceptions.OptunaError}

    def refuse(study):
        plt.figure()
        raise exc[error]("cannot <plot>")

    monkeypatch.setattr(vis, "plot_optimization_history", refuse)
    t = FakeTuner(tmp_path / "out", methods=[method("A", space=("a",))], studies={"A": study})
    assert t.draw() == {}
    assert t.absent == {"A": {"history": "Optuna could not draw it (cannot <plot>)",
                              "importance": "1 parameter searched: nothing to rank"}}  # fmt: skip
    assert plt.get_fignums() == [] and list((t.out / "plots").iterdir()) == []


# --- table.md, table.json, report.html -------------------------------------------------------------------------------


def test_write_tables(tmp_path, monkeypatch):
    """`write_tables` draws, then writes table.md and report.html from the rows with those plots, and table.json
    (the suite, seeds, trial seed, sampler, pruner, the storage as shown, and the rows), into a new directory."""
    studies = {"FedProx": _study(2), "FedAvg+FT": _study(0, pruned=1)}
    rows = [{k: v for k, v in r.items() if k not in ("plots", "plots_absent")} for r in (ROW_A, ROW_B)]
    t = FakeTuner(tmp_path / "a" / "out", methods=[method("FedProx"), method("FedAvg+FT")], studies=studies, rows=rows,
                  storage="postgresql://u@db/x")
    md, js = t.write_tables()
    assert (md, js) == (t.out / "table.md", t.out / "table.json")
    final = t.rows()
    assert final[0]["plots"] == {"history": "plots/FedProx-history.png"}
    assert final[1]["plots_absent"]["history"] == "no complete trial yet"
    assert md.read_text() == t.markdown(final)
    assert (t.out / "report.html").read_text() == t.html(final)
    assert "<img alt='FedProx history' src='data:image/png;base64,iVBORw0KGgo" in t.html(final)
    text = js.read_text()
    assert text == json.dumps(json.loads(text), indent=2) + "\n"
    assert json.loads(text) == {"suite": "fab", "seeds": [0, 1, 2], "trial_seed": 100, "sampler": "random",
                                "pruner": "hyperband", "storage": "postgresql://u@db/x",
                                "methods": json.loads(json.dumps(final))}  # fmt: skip
    written = {p: p.read_text() for p in (md, js, t.out / "report.html")}
    for name in written:  # each file is replaced whole or left as it was
        half_then_full_disk(monkeypatch, name.name)
        with pytest.raises(OSError, match="No space left"):
            t.write_tables()
        monkeypatch.undo()
        assert {p: p.read_text() for p in written} == written and list(t.out.glob(".*.tmp")) == []
