"""`pflbed bench` on fabricated run directories: the tables' exact figures and layout, the progress log, a cell's run
and the `--jobs` pool, without training anything (each test writes the `summary.json` / `diverged.json` files a
finished or diverged cell leaves, with known numbers)."""

import json
import re
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from pflbed.config import _first_error, validate_config
from pflbed.errors import ConfigError, DivergedError, PflbedError
from pflbed.results import bench as bench_mod
from pflbed.results.bench import DIVERGED, Bench, Suite, Table, _fields, _get, _merge, _slug, _source, load_suite
from pflbed.results.rundir import config_text

from ..tiny import TINY

SUITE = {
    "name": "fab",
    "base": TINY,
    "seeds": [0, 1],
    "tables": {
        "main": {
            "settings": {"Dir(0.3)": {"federation.alpha": 0.3}, "Dir(0.1)": {"federation.alpha": 0.1}},
            "methods": {
                "FedAvg": {"set": {"algorithm.name": "fedavg"}},
                "FedAvg+FT": {"same_as": "FedAvg", "report": {"G-FL": None, "P-FL": "final.ft.pfl_acc"}},
                "Local": {"set": {"algorithm.name": "local"}},
            },
        },
        "reuse": {"title": "Reused runs", "settings": {"Dir(0.3)": {}, "Dir(0.1)": {}},
                  "methods": {"Local": {"same_as": "main/Local"}}, "report": {"P-FL": "final.pfl_acc"}},
    },
}  # fmt: skip


def _bench(tmp_path, suite=SUITE):
    return Bench(Suite.model_validate({**suite, "out": str(tmp_path / "res")}))


def finish(table, setting, method, seed, final, wall_s=1.0):
    """A finished cell: the summary.json a run leaves (what `read_summary` requires, with known figures)."""
    d = table.run_dir(setting, method, seed)
    d.mkdir(parents=True, exist_ok=True)
    summary = {"algorithm": "fedavg", "dataset": "synthetic", "rounds": 2, "final": final,
               "timing": {"wall_s": wall_s}}  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def diverge(table, setting, method, seed, rnd=3):
    d = table.run_dir(setting, method, seed)
    d.mkdir(parents=True, exist_ok=True)
    (d / DIVERGED).write_text(json.dumps({"round": rnd, "error": "diverged"}) + "\n")
    return d


@pytest.fixture
def filled(tmp_path):
    """FedAvg: both seeds at Dir(0.3), seed 0 only at Dir(0.1) (seed 1 still to run); Local: seed 0 at Dir(0.3), every
    other seed diverged. The `reuse` table reads main's Local runs."""
    bench = _bench(tmp_path)
    main = bench.table("main")
    finish(main, "Dir(0.3)", "FedAvg", 0, {"gfl_acc": 0.50, "pfl_acc": 0.60, "ft": {"pfl_acc": 0.70}}, wall_s=10.0)
    finish(main, "Dir(0.3)", "FedAvg", 1, {"gfl_acc": 0.54, "pfl_acc": 0.64, "ft": {"pfl_acc": 0.74}}, wall_s=21.0)
    finish(main, "Dir(0.1)", "FedAvg", 0, {"gfl_acc": 0.40, "pfl_acc": 0.45, "ft": {"pfl_acc": 0.50}}, wall_s=30.0)
    finish(main, "Dir(0.3)", "Local", 0, {"gfl_acc": None, "pfl_acc": 0.80}, wall_s=5.0)
    for setting, seed in (("Dir(0.3)", 1), ("Dir(0.1)", 0), ("Dir(0.1)", 1)):
        diverge(main, setting, "Local", seed)
    return bench


MAIN_MD = """### main

| method | Dir(0.3) G-FL | Dir(0.3) P-FL | Dir(0.1) G-FL | Dir(0.1) P-FL | seeds |
|---|---|---|---|---|---|
| FedAvg | 52.00 ± 2.00 | 62.00 ± 2.00 | 40.00 ± 0.00 | 45.00 ± 0.00 | 1/2 |
| FedAvg+FT | — | 72.00 ± 2.00 | — | 50.00 ± 0.00 | 1/2 |
| Local | — | 80.00 ± 0.00 | diverged | diverged | 0/2, 3 diverged |
"""
REUSE_MD = """### Reused runs

| method | Dir(0.3) P-FL | Dir(0.1) P-FL | seeds |
|---|---|---|---|
| Local | 80.00 ± 0.00 | diverged | 0/2, 3 diverged |
"""
CSV = """table,method,setting,column,mean,std,seeds,wall_s
main,FedAvg,Dir(0.3),G-FL,52.0000,2.0000,2,15.5
main,FedAvg,Dir(0.3),P-FL,62.0000,2.0000,2,15.5
main,FedAvg,Dir(0.1),G-FL,40.0000,0.0000,1,30.0
main,FedAvg,Dir(0.1),P-FL,45.0000,0.0000,1,30.0
main,FedAvg+FT,Dir(0.3),G-FL,,,2,15.5
main,FedAvg+FT,Dir(0.3),P-FL,72.0000,2.0000,2,15.5
main,FedAvg+FT,Dir(0.1),G-FL,,,1,30.0
main,FedAvg+FT,Dir(0.1),P-FL,50.0000,0.0000,1,30.0
main,Local,Dir(0.3),G-FL,,,1,5.0
main,Local,Dir(0.3),P-FL,80.0000,0.0000,1,5.0
main,Local,Dir(0.1),G-FL,,,0,
main,Local,Dir(0.1),P-FL,,,0,
reuse,Local,Dir(0.3),P-FL,80.0000,0.0000,1,5.0
reuse,Local,Dir(0.1),P-FL,,,0,
"""


def test_rows_are_the_finished_seeds_mean_and_population_std(filled):
    """Each (method, setting) row: mean ± population std (ddof 0: [50, 54] → 2, not 2.83) over the seeds that
    finished, the diverged seeds counted apart, and wall_s the mean of the finished seeds' `timing.wall_s`; a row
    reusing another table's runs counts that table's diverged runs too."""
    main, reuse = filled.tables
    rows = {(r["method"], r["setting"]): r for r in main.collect()}
    assert list(rows) == [(m, s) for m in ("FedAvg", "FedAvg+FT", "Local") for s in ("Dir(0.3)", "Dir(0.1)")]
    fedavg = rows[("FedAvg", "Dir(0.3)")]
    assert fedavg == {"method": "FedAvg", "setting": "Dir(0.3)", "seeds": 2, "diverged": 0,
                      "G-FL": (pytest.approx(52.0), pytest.approx(2.0)),
                      "P-FL": (pytest.approx(62.0), pytest.approx(2.0)), "wall_s": 15.5}  # fmt: skip
    assert rows[("FedAvg+FT", "Dir(0.3)")]["G-FL"] is None
    assert rows[("FedAvg+FT", "Dir(0.3)")]["P-FL"] == (pytest.approx(72.0), pytest.approx(2.0))
    assert rows[("FedAvg", "Dir(0.1)")]["seeds"] == 1 and rows[("FedAvg", "Dir(0.1)")]["wall_s"] == 30.0
    assert rows[("Local", "Dir(0.3)")] == {"method": "Local", "setting": "Dir(0.3)", "seeds": 1, "diverged": 1,
                                           "G-FL": None, "P-FL": (pytest.approx(80.0), 0.0), "wall_s": 5.0}  # fmt: skip
    assert rows[("Local", "Dir(0.1)")] == {"method": "Local", "setting": "Dir(0.1)", "seeds": 0, "diverged": 2,
                                           "G-FL": None, "P-FL": None, "wall_s": None}  # fmt: skip
    reused = [(r["setting"], r["seeds"], r["diverged"]) for r in reuse.collect()]
    assert reused == [("Dir(0.3)", 1, 1), ("Dir(0.1)", 0, 2)]
    assert reuse.diverged_runs("Local", "Dir(0.1)") == [main.run_dir("Dir(0.1)", "Local", s) for s in (0, 1)]


def test_markdown_and_csv_are_exactly_what_users_paste(filled, tmp_path):
    """The whole rendered Markdown (title or table name, blank line, header, `|---|` row, `m ± s` cells, "—" for a
    column the row does not report, "diverged" where no seed is left, `k/n` seeds with `, j diverged`) and the
    long-format CSV (4 decimals, "" for no figure, wall_s to 0.1 s, "\\n" line ends)."""
    main, reuse = filled.tables
    assert main.markdown() == MAIN_MD and reuse.markdown() == REUSE_MD
    assert filled.markdown() == "## fab\n\n" + MAIN_MD + "\n" + REUSE_MD
    assert filled.csv() == CSV
    assert main.csv_rows()[4] == ["main", "FedAvg+FT", "Dir(0.3)", "G-FL", "", "", "2", "15.5"]
    assert main.csv_rows()[-1] == ["main", "Local", "Dir(0.1)", "P-FL", "", "", "0", ""]


def test_tables_are_written_into_a_new_nested_directory(filled, tmp_path):
    """`write_tables` creates the results directory with its parents (a suite's `out` may name a new path)."""
    deep = Bench(Suite.model_validate({**SUITE, "out": str(tmp_path / "new" / "deeper" / "res")}))
    md, cs = deep.write_tables()
    assert (md, cs) == (tmp_path / "new/deeper/res/table.md", tmp_path / "new/deeper/res/table.csv")
    assert md.read_text() == deep.markdown() and cs.read_text() == deep.csv()
    md, cs = filled.write_tables()
    assert md.read_text() == "## fab\n\n" + MAIN_MD + "\n" + REUSE_MD and cs.read_text() == CSV


def half_then_full_disk(monkeypatch, name: str):
    """From now on, a `Path.write_text` into a file whose name holds `name` (the file, or a temp file beside it)
    writes half its text, then fails as a full disk does; other files are written."""
    write_text = Path.write_text

    def write(self, text, *args, **kwargs):
        if name not in self.name:
            return write_text(self, text, *args, **kwargs)
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", write)


@pytest.mark.parametrize("name", ["table.md", "table.csv"])
def test_tables_are_replaced_whole_or_left_as_they_were(filled, monkeypatch, name):
    """Each table is written beside itself, then renamed over it: shards of a suite finishing together both write
    them, and two writes into one file at once left a mix of both; a write that fails half way (a full disk)
    leaves the table before it, not half a table."""
    md, cs = filled.write_tables()
    before = md.read_text(), cs.read_text()
    half_then_full_disk(monkeypatch, name)
    with pytest.raises(OSError, match="No space left"):
        filled.write_tables()
    monkeypatch.undo()
    assert (md.read_text(), cs.read_text()) == before and list(md.parent.glob(".*.tmp")) == []


def test_a_cell_is_logged_with_its_rows_columns(filled):
    """The figures line of a finished cell: a column whose field is None is skipped and the later ones still shown
    (FedAvg+FT: only its fine-tuned P-FL), a field the summary lacks is "—"."""
    main = filled.table("main")
    assert main.figures("FedAvg+FT", main.run_dir("Dir(0.3)", "FedAvg", 1)) == "P-FL 74.00"
    assert main.figures("FedAvg", main.run_dir("Dir(0.3)", "FedAvg", 1)) == "G-FL 54.00 P-FL 64.00"
    assert main.figures("Local", main.run_dir("Dir(0.3)", "Local", 0)) == "G-FL — P-FL 80.00"


def test_run_directories_and_labels():
    """Cells live under `<out>/runs/<table>/<setting>/<method>/seed<k>`, labels made directory names: runs of other
    characters become one "-", none at the ends, `_ . + =` and letters kept (an "X" at an end too), empty → default."""
    assert _slug("Dir(0.3)") == "Dir-0.3" and _slug("FedRoD (hyper)") == "FedRoD-hyper"
    assert _slug("a  b") == "a-b" and _slug("a_b.c+d=e") == "a_b.c+d=e"
    assert _slug("MAX") == "MAX" and _slug("(X)") == "X"
    assert _slug("") == "default" and _slug("()") == "default"
    assert _slug("..") == "default" and _slug("(.)") == "default" and _slug("..a") == "..a"  # never . or ..
    suite = Suite.model_validate(SUITE)
    table = Table("main", suite.tables["main"], suite, Path("out"))
    assert table.run_dir("Dir(0.3)", "FedAvg+FT", 2) == Path("out/runs/main/Dir-0.3/FedAvg+FT/seed2")
    assert table.run_dir("", "FedRoD (hyper)", 0, "other t") == Path("out/runs/other-t/default/FedRoD-hyper/seed0")


def test_same_as_names_a_table_only_before_the_first_slash():
    """`same_as: <table>/<method>`: the method's own name may hold a slash ("FedAvg w/ FT")."""
    assert _source("FedAvg") == (None, "FedAvg")
    assert _source("main/FedAvg w/ FT") == ("main", "FedAvg w/ FT")


def test_a_method_with_a_slash_in_its_name_has_its_own_runs_and_can_be_reused(tmp_path):
    """A method's own name is a label, not a `same_as` reference: "FedAvg w/ FT" with runs of its own was refused
    ("no table 'FedAvg w' with a method ' FT'") and its rows looked for that table's runs."""
    suite = {**SUITE, "tables": {"main": {"methods": {"FedAvg w/ FT": {"set": {"algorithm.name": "fedavg"}}}},
                                 "reuse": {"methods": {"R": {"same_as": "main/FedAvg w/ FT"}}}}}  # fmt: skip
    bench = _bench(tmp_path, suite)
    main, reuse = bench.tables
    assert main.runs_of("FedAvg w/ FT") == (None, "FedAvg w/ FT") and reuse.runs_of("R") == ("main", "FedAvg w/ FT")
    own = finish(main, "", "FedAvg w/ FT", 0, {"gfl_acc": 0.5, "pfl_acc": 0.25})
    assert own == tmp_path / "res/runs/main/default/FedAvg-w-FT/seed0"
    diverge(main, "", "FedAvg w/ FT", 1)
    assert main.finished_runs("FedAvg w/ FT", "") == {0: own} == reuse.finished_runs("R", "")
    rows = [(r["P-FL"], r["seeds"], r["diverged"]) for t in (main, reuse) for r in t.collect()]
    assert rows == [((25.0, 0.0), 1, 1)] * 2


def test_merged_bases_share_no_nested_dicts():
    """A table's base is the suite's with the table's merged in, nested sections merged key by key, and no dict
    shared with either: editing one (`cell_config` sets keys in a copy of it) cannot change another table's."""
    base, over = {"a": {"x": 1}, "b": {"y": 2}}, {"a": {"z": 3}, "c": {"d": {"e": 4}}}
    out = _merge(base, over)
    assert out == {"a": {"x": 1, "z": 3}, "b": {"y": 2}, "c": {"d": {"e": 4}}}
    out["b"]["y"], out["c"]["d"]["e"], out["a"]["x"] = 20, 40, 10
    assert base == {"a": {"x": 1}, "b": {"y": 2}} and over == {"a": {"z": 3}, "c": {"d": {"e": 4}}}
    suite = Suite.model_validate({**SUITE, "tables": {"t": {"base": {"train": {"rounds": 3}}, "methods": {"A": {}}},
                                                      "u": {"methods": {"A": {}}}}})  # fmt: skip
    bench = Bench(suite, Path("r"))
    t, u = bench.tables
    assert t.base["train"] == {**TINY["train"], "rounds": 3} and u.base["train"] == TINY["train"]
    t.base["federation"]["clients"] = 99
    u.base["model"]["name"] = "cnn"
    assert suite.base["federation"]["clients"] == 6 and suite.base["model"]["name"] == "mlp"
    assert u.base["federation"]["clients"] == 6 and t.base["model"]["name"] == "mlp"


def test_get_reads_numbers_only():
    assert _get({"a": {"b": 3}}, "a.b") == 3.0 and isinstance(_get({"a": {"b": 3}}, "a.b"), float)
    assert _get({"a": 1}, "a.b") is None and _get({"a": {"b": "x"}}, "a.b") is None and _get({}, "a") is None


def test_a_report_field_no_finished_run_has_is_named_with_the_nearest_field_they_have(tmp_path):
    """A misspelt report field showed "—", as a figure merely missing: each field that none of its row's finished
    runs has, over every setting, is named with the closest field they do have. A field some run has, if only as
    null (Local's G-FL) or in one setting's run (Local's `ft`), a column the row leaves out (None), and a row with no
    finished run give no line. A column of the table's own is named once, and only where none of the rows reading it
    has the field (`zs`, over FedAvg's runs only: FedAvg+FT's are FedAvg's, Local gives its own zs): a field only some
    methods give (`diag`, Local's only) is their figure and the others' "—" is the answer."""
    suite = json.loads(json.dumps(SUITE))
    methods = suite["tables"]["main"]["methods"]
    methods["FedAvg"]["report"] = {"P-FL": "final.pfl_ac"}
    methods["FedAvg+FT"]["report"]["G-FL"] = "algoritm"  # close to no figure: `algorithm` is a name
    methods["Local"]["report"] = {"P-FL": "final.ft.pfl_acc", "zs": "final.diag.x"}  # its own zs, which it has
    methods["Ditto"] = {"set": {"algorithm.name": "ditto"}, "report": {"P-FL": "final.nothing"}}
    suite["tables"]["reuse"]["report"].update(eps="privacy.epsilon", FT="final.ft.pfl_ac")  # FT: Dir(0.1)'s run has ft
    suite["tables"]["main"]["report"] = {"G-FL": "final.gfl_acc", "P-FL": "final.pfl_acc", "diag": "final.diag.x",
                                         "zs": "final.zero_shot"}  # fmt: skip
    bench = _bench(tmp_path, suite)
    main = bench.table("main")
    assert bench.unreported() == []  # no finished run yet
    for setting, seed in (("Dir(0.3)", 0), ("Dir(0.1)", 1)):
        finish(main, setting, "FedAvg", seed, {"gfl_acc": 0.5, "pfl_acc": 0.6, "ft": {"pfl_acc": 0.7}})
    finish(main, "Dir(0.3)", "Local", 0, {"gfl_acc": None, "pfl_acc": 0.8})
    finish(main, "Dir(0.1)", "Local", 1, {"gfl_acc": None, "pfl_acc": 0.8, "ft": {"pfl_acc": 0.9}, "diag": {"x": 1}})
    assert bench.unreported() == [
        "table main: column zs's field final.zero_shot is in none of the table's 2 finished run(s)' summary.json",
        "table main, FedAvg: column P-FL's field final.pfl_ac is in none of its 2 finished run(s)' summary.json; did "
        "you mean final.pfl_acc?",
        "table main, FedAvg+FT: column G-FL's field algoritm is in none of its 2 finished run(s)' summary.json",
        "table reuse: column eps's field privacy.epsilon is in none of the table's 2 finished run(s)' summary.json",
        "table reuse: column FT's field final.ft.pfl_ac is in none of the table's 2 finished run(s)' summary.json; "
        "did "
        "you mean final.ft.pfl_acc?"]
    assert main.markdown().splitlines()[4].startswith("| FedAvg | 50.00 ± 0.00 | — | — | — | 50.00 ± 0.00 | — |")
    # the fields offered: a summary's figures at any depth, not its names or flags
    assert _fields({"a": {"b": {"c": 1}, "d": "x"}, "flag": True, "n": 2.5}) == ["a.b.c", "n"]


def test_a_suites_results_directory_holds_its_suite_and_stands_for_it(tmp_path):
    """`--out` runs a suite elsewhere; the directory keeps the suite it ran (without its `out`), so the directory,
    wherever it is moved, is read as that suite with its results there: `-c DIR --table-only` and the scripts that
    read a suite's runs take it in place of the suite file. The suite is written before any cell runs."""
    suite = Suite.model_validate({**SUITE, "out": "elsewhere"})
    res = tmp_path / "res"
    bench = Bench(suite, tmp_path / "root", out=res)
    assert bench.out == res  # the command's --out, before the suite's out and the root
    assert bench.run(max_cells=0) == 0 and "elsewhere" not in (res / "suite.yaml").read_text()
    assert load_suite(res) == suite.model_copy(update={"out": str(res)})
    assert list(load_suite(res).tables["main"].settings) == ["Dir(0.3)", "Dir(0.1)"]  # its columns' order, not sorted
    assert Bench(load_suite(res)).out == res
    res.rename(tmp_path / "moved")
    assert Bench(load_suite(tmp_path / "moved")).out == tmp_path / "moved"
    (tmp_path / "moved" / "suite.yaml").unlink()
    bench.write_tables()  # the tables write it too
    assert load_suite(res).tables == suite.tables
    with pytest.raises(ConfigError, match=r"^\S+moved: a directory without suite.yaml; give a suite file or the "
                                          r"results directory of one"):  # fmt: skip
        load_suite(tmp_path / "moved")


def test_default_results_directory_and_unknown_table(tmp_path):
    suite = Suite.model_validate(SUITE)
    assert Bench(suite).out == Path("benchmarks/results/fab")
    assert Bench(suite, tmp_path).out == tmp_path / "fab"
    assert Bench(suite).table("nope") is None


def test_suite_file_errors_name_the_file_and_the_field(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'none.yaml'}: cannot read suite (")):
        load_suite(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nseeed: [1]\ntables: {t: {methods: {A: {}}}}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{bad}: seeed: unknown key; did you mean seeds?")):
        load_suite(bad)
    bad.write_text("name: x\ntables: {t: {methods: {A: {}}, metods: {}}}\n")  # in a table, by its name
    with pytest.raises(ConfigError, match=re.escape(f"{bad}: tables.t.metods: unknown key; did you mean "
                                                    "tables.t.methods?") + "$"):  # fmt: skip
        load_suite(bad)
    bad.write_text("name: x\ntables: {t: {methods: {A: {sme_as: B}}}}\n")  # two mappings down
    with pytest.raises(ConfigError, match=re.escape(f"{bad}: tables.t.methods.A.sme_as: unknown key; did you mean "
                                                    "tables.t.methods.A.same_as?") + "$"):  # fmt: skip
        load_suite(bad)
    for name in ("../../elsewhere", "a/b", "a\\\\b", "..", ".", ""):  # the results went outside benchmarks/results
        bad.write_text(f"name: '{name}'\ntables: {{t: {{methods: {{A: {{}}}}}}}}\n")
        with pytest.raises(ConfigError) as e:
            load_suite(bad)
        assert str(e.value) == (f"{bad}: name: must be one directory's name (no /, \\ or NUL, not . or ..); give out "
                                f"to choose where the results go (got {name!r})")  # fmt: skip
    for name in ("...a b", "X", "x.X"):
        bad.write_text(f"name: '{name}'\ntables: {{t: {{methods: {{A: {{}}}}}}}}\n")
        assert Bench(load_suite(bad), tmp_path).out == tmp_path / name


def test_a_bad_cell_config_names_the_cell(tmp_path):
    """A table without settings has one, "" (shown as "default")."""
    solo = {"seeds": [4], "methods": {"X": {"set": {"train.epochs": 3}}}}
    suite = Suite.model_validate({**SUITE, "tables": {"solo": solo}})
    table = Bench(suite, tmp_path).tables[0]
    with pytest.raises(ConfigError, match=re.escape("table solo, default / X / seed 4: train.epochs: unknown key")):
        table.cell_config("", "X", 4)


def test_cells_of_an_edited_suite_are_listed_and_refused(filled):
    main = filled.table("main")
    cell = ("Dir(0.3)", "FedAvg", 0)
    (main.run_dir(*cell) / "config.yaml").write_text(config_text(main.cell_config(*cell)))
    assert filled.stale() == []
    other = ("Dir(0.1)", "FedAvg", 0)
    old = main.cell_config(*other).to_dict()
    old["train"]["lr"] = 0.5
    (main.run_dir(*other) / "config.yaml").write_text(config_text(validate_config(old)))
    assert filled.stale() == [main.run_dir(*other)]
    with pytest.raises(PflbedError, match=re.escape(f"1 cell(s) were run with another version of the suite, e.g. "
                                                    f"{main.run_dir(*other)}; delete them, restore the suite, or run "
                                                    "it in another directory (--out)")):  # fmt: skip
        filled.run(log=lambda _: None)


def test_the_progress_log_numbers_cells_across_the_suite(tmp_path, monkeypatch):
    """`[i/n]`: i counts the cells finished before this bench started; a cell another process finished meanwhile says
    so instead of a duration; a diverged cell gives its round. One process (`jobs` 1) unless asked."""
    bench = _bench(tmp_path)
    main = bench.table("main")
    for setting in ("Dir(0.3)", "Dir(0.1)"):  # cells 1 and 3 of the 8 (seed-major)
        finish(main, setting, "FedAvg", 0, {"gfl_acc": 0.5, "pfl_acc": 0.5})
    calls = []

    def fake_run_cells(tasks, jobs):
        calls.append(([p for _, p in tasks], jobs))
        finish(main, "Dir(0.3)", "Local", 0, {"gfl_acc": None, "pfl_acc": 0.8})
        yield {"pfl_acc": 0.8}, None
        yield {"diverged": 7}, 3.4

    monkeypatch.setattr(bench_mod, "_run_cells", fake_run_cells)
    log = []
    assert bench.run(max_cells=2, log=log.append) == 2
    assert calls == [([main.run_dir("Dir(0.3)", "Local", 0), main.run_dir("Dir(0.1)", "Local", 0)], 1)]
    assert log == ["[3/8] main · Dir(0.3) · Local · seed 0: G-FL — P-FL 80.00 (finished by another process)",
                   "[4/8] main · Dir(0.1) · Local · seed 0: diverged in round 7 (3 s)"]  # fmt: skip


class _Clock:
    """`time` for `_run_cell`: perf_counter reads 100.0, then 103.5."""

    def __init__(self):
        self.ticks = iter([100.0, 103.5])

    def perf_counter(self):
        return next(self.ticks)


@pytest.fixture
def fake_run(monkeypatch):
    """`pflbed.results.experiment.run` recorded, not run: its arguments, and a summary with known figures."""
    calls = []

    def run(cfg, path, **kwargs):
        calls.append((cfg, path, kwargs))
        return SimpleNamespace(summary={"final": {"pfl_acc": 0.9}})

    monkeypatch.setattr("pflbed.results.experiment.run", run)
    monkeypatch.setattr(bench_mod, "time", _Clock())
    return calls


def test_a_cell_runs_without_progress_and_resumes_an_interrupted_directory(tmp_path, fake_run, monkeypatch):
    """A new cell runs fresh; a cell whose directory exists without a summary (interrupted midway) is resumed, not
    refused; the bench's own progress lines replace the run's; the worker's thread count is passed on."""
    cfg = validate_config(TINY)
    assert bench_mod._run_cell(cfg, tmp_path / "new", 1) == ({"pfl_acc": 0.9}, 3.5)
    assert fake_run == [(cfg, tmp_path / "new", {"progress": False, "resume": False, "threads": 1})]
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "checkpoint.pt").write_bytes(b"")
    monkeypatch.setattr(bench_mod, "time", _Clock())
    assert bench_mod._run_cell(cfg, tmp_path / "half") == ({"pfl_acc": 0.9}, 3.5)
    assert fake_run[1][2] == {"progress": False, "resume": True, "threads": None}


def test_a_diverged_cell_records_its_round_and_message(tmp_path, monkeypatch):
    err = DivergedError(5, "client 2's loss")

    def run(cfg, path, **kwargs):
        path.mkdir()
        raise err

    monkeypatch.setattr("pflbed.results.experiment.run", run)
    monkeypatch.setattr(bench_mod, "time", _Clock())
    assert bench_mod._run_cell(validate_config(TINY), tmp_path / "c") == ({"diverged": 5}, 3.5)
    assert json.loads((tmp_path / "c" / DIVERGED).read_text()) == {"round": 5, "error": str(err)}
    assert "round 5" in str(err)


class _Proc:
    def __init__(self):
        self.terminated = False

    def terminate(self):
        self.terminated = True


class _Pool:
    """A `ProcessPoolExecutor` recorded: runs each task at once, in this process."""

    made = []

    def __init__(self, **kwargs):
        self.kwargs, self.submitted, self.shutdowns = kwargs, [], []
        self._processes = {1: _Proc(), 2: _Proc()}
        _Pool.made.append(self)

    def submit(self, fn, *args):
        self.submitted.append(args)
        fut = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def shutdown(self, wait=True, cancel_futures=False):
        self.shutdowns.append((wait, cancel_futures))


class _BarePool(_Pool):
    """A pool without the private `_processes` (another Python's)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.procs = self.__dict__.pop("_processes")


@pytest.fixture
def pool(monkeypatch):
    _Pool.made = []
    monkeypatch.setattr("concurrent.futures.ProcessPoolExecutor", _Pool)
    ran = []

    def run_cell(cfg, path, threads=None):
        ran.append((cfg.executor.name, path, threads))
        if path.name == "bad":
            raise PflbedError("cell bad failed")
        return {"cell": path.name}, 1.0

    monkeypatch.setattr(bench_mod, "_run_cell", run_cell)
    return ran


def test_one_job_runs_cells_in_this_process(tmp_path, pool):
    cfg = validate_config(TINY)
    tasks = [(cfg, tmp_path / "a"), (cfg, tmp_path / "b")]
    assert list(bench_mod._run_cells(tasks, 1)) == [({"cell": "a"}, 1.0), ({"cell": "b"}, 1.0)]
    assert _Pool.made == [] and pool == [(cfg.executor.name, tmp_path / n, None) for n in "ab"]


def test_jobs_run_in_a_pool_of_fresh_one_thread_workers_that_exit_with_the_bench(tmp_path, pool):
    """`--jobs N`: N spawned workers (not forked from a process with torch's threads running), each watching its
    parent (`exit_with_parent`), each cell with one thread and the `loop` executor; results in task order."""
    from pflbed.engine.procs import exit_with_parent

    cfg = validate_config({**TINY, "executor": {"name": "auto"}})
    tasks = [(cfg, tmp_path / n) for n in "abc"]
    assert list(bench_mod._run_cells(tasks, 2)) == [({"cell": n}, 1.0) for n in "abc"]
    (made,) = _Pool.made
    assert made.kwargs["max_workers"] == 2 and made.kwargs["initializer"] is exit_with_parent
    assert made.kwargs["mp_context"].get_start_method() == "spawn"
    assert [(c.executor.name, p, t) for c, p, t in made.submitted] == [("loop", tmp_path / n, 1) for n in "abc"]
    assert pool == [("loop", tmp_path / n, 1) for n in "abc"] and made.shutdowns == [(True, False)]


@pytest.mark.parametrize("pool_class", [_Pool, _BarePool])
def test_a_failed_job_stops_the_other_workers_now(tmp_path, pool, monkeypatch, pool_class):
    """A failing cell ends the bench with its own error; the workers are terminated and the pool shut down without
    waiting, its queued cells cancelled, also where the pool keeps no `_processes`."""
    monkeypatch.setattr("concurrent.futures.ProcessPoolExecutor", pool_class)
    cfg = validate_config(TINY)
    tasks = [(cfg, tmp_path / n) for n in ("a", "bad", "c")]
    results = bench_mod._run_cells(tasks, 2)
    assert next(results) == ({"cell": "a"}, 1.0)
    with pytest.raises(PflbedError, match="^cell bad failed$"):
        next(results)
    (made,) = _Pool.made
    procs = made._processes if pool_class is _Pool else made.procs
    assert all(p.terminated for p in procs.values()) == (pool_class is _Pool)
    ((wait, cancel),) = made.shutdowns
    assert not wait and cancel


@pytest.mark.parametrize(("tables", "message", "passes"), [
    ({"main": {"methods": {"A": {"set": {"train.lr": 0.1}}, "B": {"same_as": "A", "set": {"train.lr": 0.2}}}}},
     "tables.main: methods.B: give either set or same_as",
     {"main": {"methods": {"A": {"set": {"train.lr": 0.1}}, "B": {"same_as": "A"}}}}),
    ({"main": {"settings": {"s1": {}, "s2": {}}, "methods": {"A": {"same_as": "other/A"}}},
      "other": {"settings": {"s1": {}}, "methods": {"A": {}}}},
     "config: tables.main.methods.A.same_as: table 'other' lacks some settings",  # the suite's own check
     {"main": {"settings": {"s1": {}}, "methods": {"A": {"same_as": "other/A"}}},
      "other": {"settings": {"s1": {}, "s2": {}}, "methods": {"A": {}}}}),
])  # fmt: skip
def test_a_method_that_reuses_runs_takes_nothing_else_and_finds_every_setting(tables, message, passes):
    """Runs reused from another method (`same_as`) are that method's: settings of their own would be ignored, and
    every setting of the reusing table must have been run by the other table."""
    with pytest.raises(ValidationError) as e:
        Suite.model_validate({**SUITE, "tables": tables})
    assert _first_error(e.value, model=Suite) == message
    Suite.model_validate({**SUITE, "tables": passes})


def test_a_summary_whose_time_is_no_number_keeps_its_figures_and_leaves_the_time_to_the_others(tmp_path):
    """A hand-edited `timing.wall_s` ("x", true) was a TypeError traceback from the table: the row's time is the
    mean over the summaries that hold one, and its figures count every finished seed."""
    main = _bench(tmp_path).table("main")
    finish(main, "Dir(0.3)", "FedAvg", 0, {"gfl_acc": 0.50, "pfl_acc": 0.60}, wall_s="x")
    finish(main, "Dir(0.3)", "FedAvg", 1, {"gfl_acc": 0.54, "pfl_acc": 0.64}, wall_s=8.0)
    finish(main, "Dir(0.1)", "FedAvg", 0, {"gfl_acc": 0.40, "pfl_acc": 0.45}, wall_s=True)
    rows = {(r["method"], r["setting"]): r for r in main.collect()}
    assert rows[("FedAvg", "Dir(0.3)")]["seeds"] == 2 and rows[("FedAvg", "Dir(0.3)")]["wall_s"] == 8.0
    assert rows[("FedAvg", "Dir(0.3)")]["P-FL"] == (pytest.approx(62.0), pytest.approx(2.0))
    assert rows[("FedAvg", "Dir(0.1)")]["seeds"] == 1 and rows[("FedAvg", "Dir(0.1)")]["wall_s"] is None
