"""`pflbed bench`: cells are ordinary runs, finished cells are skipped, tables are the seeds' mean ± std."""

import json
import os
from pathlib import Path

import pytest
import yaml

from pflbed.cli import main
from pflbed.errors import PflbedError
from pflbed.results.bench import Bench, load_suite

from ..doc_commands import page_command
from ..tiny import TINY

TABLE = {
    "settings": {"a0.5": {"federation.alpha": 0.5}, "a5": {"federation.alpha": 5.0}},
    "methods": {
        "FedAvg": {"set": {"algorithm.name": "fedavg"}},
        "FedAvg+FT": {"same_as": "FedAvg", "report": {"G-FL": None, "P-FL": "final.ft.pfl_acc"}},
        "Local": {"set": {"algorithm.name": "local"}},
    },
}
SUITE = {
    "name": "tiny",
    "base": {**TINY, "train": {**TINY["train"], "rounds": 2, "checkpoint_every": 0},
             "eval": {"every": 2, "finetune": ["ft"]}},
    "seeds": [0, 1],
    "tables": {"main": TABLE, "other": {"base": {"federation": {"clients": 4}}, "seeds": [3],
                                        "methods": {"FedAvg": {"set": {"algorithm.name": "fedavg"}}},
                                        "report": {"up": "communication.up_bytes_per_round"},
                                        "column_scale": {"up": 0.001}},
               "reuse": {"settings": {"a5": {}}, "methods": {"Local": {"same_as": "main/Local"}}}},
}  # fmt: skip


@pytest.fixture
def suite_file(tmp_path):
    f = tmp_path / "suite.yaml"
    f.write_text(yaml.safe_dump({**SUITE, "out": str(tmp_path / "out")}))
    return f


def test_bench_is_resumable_and_tables_are_means(suite_file, tmp_path, capsys):
    bench = Bench(load_suite(suite_file))
    assert len(bench.cells()) == 9  # 2 settings × 2 methods with runs × 2 seeds (FedAvg+FT reuses FedAvg), + 1
    assert main(["bench", "-c", str(suite_file), "--max-cells", "3"]) == 0
    log = " ".join(capsys.readouterr().out.split())
    assert len(bench.pending()) == 6 and "6 cells still to run" in log
    main_t, other, reuse = bench.tables
    first = main_t.run_dir("a0.5", "FedAvg", 0) / "summary.json"
    stamp = first.stat().st_mtime_ns
    assert main(["bench", "-c", str(suite_file)]) == 0
    assert bench.pending() == [] and first.stat().st_mtime_ns == stamp  # finished cells are not re-run
    log += " " + " ".join(capsys.readouterr().out.split())

    rows = {(r["method"], r["setting"]): r for r in main_t.collect()}
    s = [json.loads((main_t.run_dir("a5", "FedAvg", k) / "summary.json").read_text()) for k in (0, 1)]
    mean_ft = 100 * (s[0]["final"]["ft"]["pfl_acc"] + s[1]["final"]["ft"]["pfl_acc"]) / 2
    assert rows[("FedAvg+FT", "a5")]["P-FL"][0] == pytest.approx(mean_ft)
    assert rows[("FedAvg+FT", "a5")]["G-FL"] is None and rows[("Local", "a5")]["G-FL"] is None
    assert reuse.collect()[0]["P-FL"] == rows[("Local", "a5")]["P-FL"]  # another table's runs, not new ones
    assert len(bench.cell_files("summary.json")) == 9 and bench.cell_files("plots/none.png") == []
    other_summary = json.loads((other.run_dir("", "FedAvg", 3) / "summary.json").read_text())
    assert other_summary["clients"]["participated"] == 4
    up = other.collect()[0]["up"]
    assert up == (pytest.approx(other_summary["communication"]["up_bytes_per_round"] / 1000), 0.0)
    assert f"other · - · FedAvg · seed 3: up {up[0]:.2f} (" in log  # a cell is logged with its table's columns
    md = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert "| method | a0.5 G-FL | a0.5 P-FL | a5 G-FL | a5 P-FL | seeds |" in md
    assert sum("±" in line for line in md) == 5  # 3 rows of the main table + 1 of each other table
    csv_lines = (tmp_path / "out" / "table.csv").read_text().splitlines()
    assert csv_lines[0] == "table,method,setting,column,mean,std,seeds,wall_s"
    assert len(csv_lines) == 1 + 3 * 2 * 2 + 1 + 2


def test_bad_suites_are_one_line_errors(tmp_path, capsys, monkeypatch):
    """... and write nothing: the suites have no `out`, so anything written would be under the working directory."""
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**SUITE, "tables": {"t": {"methods": {"X": {"same_as": "Nope"}}}}}))
    assert main(["bench", "-c", str(bad)]) == 2
    assert "same_as" in capsys.readouterr().err
    bad.write_text(yaml.safe_dump({**SUITE, "tables": {"t": {"methods": {"X": {"same_as": "nope/FedAvg"}}}}}))
    assert main(["bench", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "no table 'nope'" in err and "{" not in err  # the message, not the whole suite
    clash = {"A ✓": {"set": {"algorithm.name": "fedavg"}}, "A ✗": {"set": {"algorithm.name": "local"}}}
    bad.write_text(yaml.safe_dump({**SUITE, "tables": {"t": {"methods": clash}}}))
    assert main(["bench", "-c", str(bad)]) == 2
    assert "would share the run directory 'A'" in capsys.readouterr().err
    bad.write_text(yaml.safe_dump({**SUITE, "tables": {"t": {"methods": {"X": {"set": {"train.epochs": 3}}}}}}))
    assert main(["bench", "-c", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "train.epochs: unknown key" in err and "X" in err
    for seeds, message in (([3, 3], "seeds: each seed once: a repeated seed reruns the same run and counts it twice "
                                       "in mean ± std (got [3, 3])"),
                           ([2**63], "seeds.0: Input should be less than or equal to 9223372036854775807")):
        for where in ("suite", "table"):  # a repeated seed was two cells sharing one run directory, counted twice
            tables = {"t": {**({"seeds": seeds} if where == "table" else {}), "methods": {"X": {}}}}
            top = {"seeds": seeds} if where == "suite" else {}
            bad.write_text(yaml.safe_dump({**SUITE, **top, "tables": tables}))
            assert main(["bench", "-c", str(bad)]) == 2
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_cells_of_an_edited_suite_are_refused(suite_file, capsys):
    assert main(["bench", "-c", str(suite_file), "--max-cells", "1"]) == 0
    tree = yaml.safe_load(suite_file.read_text())
    tree["base"]["train"]["lr"] = 0.2
    suite_file.write_text(yaml.safe_dump(tree))
    out = yaml.safe_load(suite_file.read_text())["out"]
    tables = {p.name: p.read_text() for p in Path(out).glob("table.*")}
    for flags in ([], ["--list"], ["--table-only"]):  # the last two listed it as done, tabled it with the others
        assert main(["bench", "-c", str(suite_file), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "another version of the suite" in err, flags
    assert {p.name: p.read_text() for p in Path(out).glob("table.*")} == tables


def test_another_suite_s_results_directory_is_refused_as_out(tmp_path, capsys):
    """`bench -c A --out <B's results>` replaced B's suite.yaml and tables with A's, B's cells left under runs/ as
    if they were A's. A suite of the same name continues there (its edited cells are refused cell by cell)."""
    from pflbed.results.bench import Suite

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "suite.yaml").write_text("name: other\n")
    for given, shown in ((theirs, "--out"), (None, "out")):
        suite = Suite.model_validate({**SUITE, **({} if given else {"out": str(theirs)})})
        with pytest.raises(PflbedError) as e:
            Bench(suite, out=given)
        assert str(e.value) == f"{shown} {theirs}: holds the results of suite 'other'; give suite 'tiny' a directory " \
                               "of its own"  # fmt: skip
    assert (theirs / "suite.yaml").read_text() == "name: other\n"
    for text in ("name: tiny\n", "[broken", "- a list\n"):  # its own; a damaged file is its readers' to name
        (theirs / "suite.yaml").write_text(text)
        assert Bench(Suite.model_validate(SUITE), out=theirs).out == theirs


def test_report_paths_may_cross_keys_with_dots():
    from pflbed.results.bench import _get

    tree = {"new_clients": {"per_lr": {"0.005": {"last": 0.5}, "0.05": {"last": 0.7}}}, "flag": True}
    assert _get(tree, "new_clients.per_lr.0.005.last") == 0.5
    assert _get(tree, "new_clients.per_lr.0.05.last") == 0.7
    assert _get(tree, "new_clients.per_lr.0.1.last") is None and _get(tree, "flag") is None


def test_shards_split_the_cells_without_overlap(suite_file, capsys):
    with pytest.raises(SystemExit, match="2"):
        main(["bench", "-c", str(suite_file), "--jobs", "0"])
    assert "argument --jobs: must be 1 to " in capsys.readouterr().err
    bench = Bench(load_suite(suite_file))
    ran = [bench.run(max_cells=None, log=lambda _: None, shard=(k, 3)) for k in (1, 2, 3)]
    assert ran == [3, 3, 3] and bench.pending() == []
    with pytest.raises(SystemExit):
        main(["bench", "-c", str(suite_file), "--shard", "3/2"])
    assert "argument --shard: need 1 <= I <= N" in capsys.readouterr().err


def test_parallel_jobs_give_the_same_cells_as_one_process(tmp_path):
    one, two = (tmp_path / n for n in ("one", "two"))
    for out in (one, two):
        (out / "suite.yaml").parent.mkdir()
        (out / "suite.yaml").write_text(yaml.safe_dump({**SUITE, "out": str(out / "res"), "seeds": [0]}))
    assert main(["bench", "-c", str(one / "suite.yaml")]) == 0
    assert main(["bench", "-c", str(two / "suite.yaml"), "--jobs", "2"]) == 0
    a, b = (Bench(load_suite(out / "suite.yaml")) for out in (one, two))
    assert b.pending() == [] and len(b.cells()) == len(a.cells())
    for (t, c), (u, d) in zip(a.cells(), b.cells(), strict=True):
        s, r = (json.loads((x.run_dir(*y) / "summary.json").read_text()) for x, y in ((t, c), (u, d)))
        assert s["final"] == r["final"]  # workers use one torch thread, as the test session does


def test_a_jobs_worker_runs_an_in_process_cell_with_loop_and_leaves_flower_alone():
    """--jobs workers hold a core each: `procs` (or `auto` choosing it) there would start workers beside the other
    jobs'."""
    from pflbed.config import validate_config
    from pflbed.results.bench import _one_core

    auto = validate_config({**TINY, "executor": {"name": "auto", "threads": 1}})
    assert _one_core(auto).executor.name == "loop" and auto.executor.name == "auto"
    assert _one_core(auto).model_dump(exclude={"executor"}) == auto.model_dump(exclude={"executor"})
    procs = validate_config({**TINY, "executor": {"name": "procs", "workers": 2}})
    assert _one_core(procs).executor.name == "loop"
    flower = validate_config({**TINY, "executor": {"name": "flower"}})
    assert _one_core(flower) is flower


def test_a_table_says_diverged_only_where_no_seed_finished(suite_file, monkeypatch):
    """One seed of two diverged: the figures come from the other, and a column the method never reports stays
    "—"; with every seed diverged, the cells say "diverged"."""
    table = Bench(load_suite(suite_file)).table("main")
    fig = (50.0, 1.0)
    rows = [{"method": m, "setting": st, "seeds": n, "diverged": 2 - n, "G-FL": None, "P-FL": fig if n else None,
             "wall_s": 1.0} for m, n in (("FedAvg", 1), ("FedAvg+FT", 0), ("Local", 2)) for st in ("a0.5", "a5")]
    monkeypatch.setattr(table, "collect", lambda: rows)
    lines = {line.split(" | ")[0]: line for line in table.markdown().splitlines() if line.startswith("| ")}
    assert lines["| FedAvg"].startswith("| FedAvg | — | 50.00 ± 1.00 | — | 50.00 ± 1.00 |")
    assert lines["| FedAvg+FT"].startswith("| FedAvg+FT | diverged | diverged | diverged | diverged |")


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_diverging_cell_is_a_result_and_the_others_still_run_in_any_worker_layout(tmp_path, capsys, jobs):
    """A cell that diverges is recorded (`diverged.json`: its round), the bench runs the rest, the table says
    "diverged" where it has no figure, a re-run does not run it again, and the command ends with exit 3 and one
    line. Divergence crosses the worker-process boundary intact (`DivergedError` pickles; with --jobs 2 this was
    once a BrokenProcessPool traceback)."""
    suite = {**SUITE, "out": str(tmp_path / "res"), "seeds": [0]}
    wild = next(iter(suite["tables"]["main"]["methods"]))  # its lr makes it diverge; the others train normally
    methods = {m: ({"set": {**s["set"], "train.lr": 1e12}} if m == wild else s)
               for m, s in suite["tables"]["main"]["methods"].items()}  # fmt: skip
    suite["tables"] = {"main": {**suite["tables"]["main"], "settings": {"a5": {"federation.alpha": 5.0}},
                                "methods": methods}}  # fmt: skip
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    assert main(["bench", "-c", str(tmp_path / "suite.yaml"), "--jobs", jobs]) == 3
    out, err = capsys.readouterr()
    assert "\n" not in err.strip() and "1 cell(s) diverged" in err and "diverged in round" in out
    bench = Bench(load_suite(tmp_path / "suite.yaml"))
    assert bench.pending() == [] and len(bench.diverged()) == 1
    assert json.loads((bench.diverged()[0] / "diverged.json").read_text())["round"] >= 1
    table = (tmp_path / "res" / "table.md").read_text().splitlines()
    row = next(line for line in table if line.startswith(f"| {wild} "))
    assert "diverged" in row and row.endswith("0/1, 1 diverged |")
    assert main(["bench", "-c", str(tmp_path / "suite.yaml")]) == 3  # nothing re-run: same line
    assert "diverged in round" not in capsys.readouterr().out


def _children(pid):
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_workers_do_not_outlive_a_killed_bench(tmp_path):
    """`bench --jobs 2` killed outright (SIGKILL: no cleanup of its own): its worker processes exit too, instead of
    training cells on, orphaned, and holding the cores."""
    import signal
    import subprocess
    import sys
    import time

    slow = {**SUITE, "out": str(tmp_path / "res"), "seeds": [0, 1],
            "base": {**SUITE["base"], "train": {**SUITE["base"]["train"], "rounds": 400}}}  # fmt: skip
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(slow))
    proc = subprocess.Popen([sys.executable, "-m", "pflbed", "bench", "-c", str(tmp_path / "suite.yaml"), "--jobs",
                             "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 60
    spawned = lambda: [c for c in _children(proc.pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]  # noqa: E731
    while len(workers := spawned()) < 2:
        assert time.time() < deadline and proc.poll() is None, "the workers did not start"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while any(os.path.exists(f"/proc/{w}") and "spawn_main" in Path(f"/proc/{w}/cmdline").read_text() for w in workers):
        assert time.time() < deadline, "workers outlived the bench"
        time.sleep(0.2)


SUITES = sorted(p for p in (Path(__file__).resolve().parents[2] / "benchmarks" / "suites").glob("*.yaml")
                if "tune" not in yaml.safe_load(p.read_text()))  # tune suites: tests/results/test_tune.py


@pytest.mark.parametrize("path", SUITES, ids=[p.stem for p in SUITES])
def test_the_committed_results_match_their_suites(path, monkeypatch):
    """Every finished cell under benchmarks/results was run with the config its suite gives it today: a changed
    default or an edited suite would otherwise leave tables that no command reproduces (the bench refuses them)."""
    monkeypatch.chdir(path.parent.parent.parent)  # suites name their outputs relative to the repository root
    assert Bench(load_suite(path)).stale() == []


def test_paired_differences_are_per_seed_differences_of_the_same_column(suite_file, capsys):
    """benchmarks/paired_differences.py: A − B seed by seed, only over the seeds both rows finished."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "paired_differences.py"
    spec = importlib.util.spec_from_file_location("paired_differences", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = Bench(load_suite(suite_file)).tables[0]
    fake = {("FedAvg", 0): (0.70, 0.80), ("FedAvg", 1): (0.60, 0.90), ("Local", 0): (None, 0.75),
            ("Local", 1): (None, 0.95)}  # fmt: skip  # (G-FL, P-FL); FedAvg+FT reads final.ft.pfl_acc
    for (method, seed), (g, p) in fake.items():
        d = table.run_dir("a5", method, seed)
        d.mkdir(parents=True)
        final = {"gfl_acc": g, "pfl_acc": p, "ft": {"pfl_acc": p - 0.1}}
        (d / "summary.json").write_text(json.dumps({"final": final}))
    module.main(str(suite_file), "main", "FedAvg+FT", "Local")
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| a5")]
    # P-FL: FedAvg+FT (0.70, 0.80) − Local (0.75, 0.95) = −5, −15 points; G-FL is null for both rows
    assert rows == ["| a5 | P-FL | -5.00, -15.00 | -10.00 ± 5.00 (2 seeds) |"]


def test_a_cell_finished_by_another_bench_meanwhile_is_read_not_rerun(suite_file, capsys):
    """Two benches on overlapping cells: a cell the other one finished after this one planned is skipped, not an
    error that stops the bench (the run itself refuses a finished directory)."""
    from pflbed.results.bench import _run_cells

    bench = Bench(load_suite(suite_file))
    assert main(["bench", "-c", str(suite_file), "--max-cells", "1"]) == 0
    table, cell = bench.cells()[0]
    summary = table.run_dir(*cell) / "summary.json"
    stamp = summary.stat().st_mtime_ns
    final, took = next(_run_cells([(table.cell_config(*cell), table.run_dir(*cell))], jobs=1))
    assert took is None and final == json.loads(summary.read_text())["final"]
    assert summary.stat().st_mtime_ns == stamp


# --- `pflbed bench` itself, on a stand-in suite: what it lists, runs, prints and returns -----------------------------


class _Table:
    name = "t"

    @staticmethod
    def run_dir(seed: int) -> str:
        return f"runs/t/seed{seed}"

    @staticmethod
    def cell_config(seed: int) -> None:
        return None


class _FakeBench:
    """Cells seed 0 and 1 of one table; seed 1 still to run unless `done`; `diverged` names diverged cells."""

    def __init__(self, calls: list, done: bool = False, diverged: tuple[str, ...] = (), stop: bool = False,
                 unreported: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.calls, self.done, self._diverged, self.stop = calls, done, list(diverged), stop
        self._unreported = list(unreported)

    def cells(self):
        return [(_Table, (0,)), (_Table, (1,))]

    def pending(self):
        return [] if self.done else [(_Table, (1,))]

    def refuse_stale(self):  # no cell of another version of the suite here
        pass

    def run(self, max_cells, log, shard, jobs):
        self.calls.append(("run", max_cells, shard, jobs, log is not None))
        if self.stop:
            raise KeyboardInterrupt

    def write_tables(self):
        self.calls.append(("tables",))
        md = self.tmp / "table.md"
        md.write_text("| the table |\n")
        return md, self.tmp / "table.csv"

    def diverged(self):
        return self._diverged

    def unreported(self):
        return self._unreported


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    from pflbed.results import bench

    calls: list = []
    made: dict = {}

    def use(**kwargs):
        made.update(kwargs)

    def build(suite, out=None):
        b = _FakeBench(calls, **made)
        b.tmp, b.out = tmp_path, out or Path("benchmarks/results/s")
        calls.append(("bench", suite, out))
        return b

    monkeypatch.setattr(bench, "load_suite", lambda path, overrides: (path, *overrides) if overrides else path)
    monkeypatch.setattr(bench, "Bench", build)
    monkeypatch.chdir(tmp_path)
    Path("benchmarks/results/s").mkdir(parents=True)  # the suite's results directory, which --table-only reads
    return calls, use


def test_bench_list_says_which_cells_are_done_and_runs_nothing(fake_bench, capsys):
    calls, _ = fake_bench
    assert main(["bench", "-c", "s.yaml", "--list"]) == 0
    assert capsys.readouterr().out == "done  runs/t/seed0\ntodo  runs/t/seed1\n"
    assert calls == [("bench", "s.yaml", None)]


def test_bench_list_refuses_a_cell_the_run_would_refuse(tmp_path, capsys):
    """A setting with a mistyped key: `--list` listed its cells as to do (exit 0) where running them is refused."""
    import yaml

    suite = {"name": "s", "out": str(tmp_path / "out"), "seeds": [0],
             "tables": {"t": {"settings": {"a": {"train.rondz": 3}},
                              "methods": {"FedAvg": {"set": {"algorithm.name": "fedavg"}}}}}}  # fmt: skip
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(suite))
    for extra in ([], ["--list"]):
        assert main(["bench", "-c", str(tmp_path / "s.yaml"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "train.rondz: unknown key; did you mean train.rounds?" in err, err
    assert not (tmp_path / "out").exists()


def test_bench_runs_its_cells_as_asked_then_writes_and_prints_the_tables(fake_bench, tmp_path, capsys):
    calls, use = fake_bench
    assert main(["bench", "-c", "s.yaml", "--max-cells", "1", "--jobs", "2", "--shard", "2/3"]) == 0
    assert calls == [("bench", "s.yaml", None), ("run", 1, (2, 3), 2, True), ("tables",)]
    out = capsys.readouterr().out
    assert out == (f"| the table |\n\ntables: {tmp_path / 'table.md'}, {tmp_path / 'table.csv'} — 1 cells still to "
                   "run (re-run to continue)\n")  # fmt: skip
    calls.clear()
    use(done=True)
    assert main(["bench", "-c", "s.yaml", "--table-only"]) == 0
    assert calls == [("bench", "s.yaml", None), ("tables",)]
    assert capsys.readouterr().out.endswith(f"tables: {tmp_path / 'table.md'}, {tmp_path / 'table.csv'}\n")
    calls.clear()  # a directory that does not exist: no tables of nothing, and no directory made for them
    assert main(["bench", "-c", "s.yaml", "--table-only", "--out", "new"]) == 2
    assert capsys.readouterr().err == ("pflbed: error: --table-only: new holds no results of this suite; run it first "
                                       "(without --table-only)\n")  # fmt: skip
    assert calls == [("bench", "s.yaml", Path("new"))] and not Path("new").exists()


def test_a_bench_whose_cells_had_all_finished_says_that_nothing_ran_and_how_to_run_it_anew(fake_bench, tmp_path,
                                                                                         capsys):  # fmt: skip
    """A clone's committed results answer `pflbed bench -c SUITE` with their tables at once: without a word, a user
    reproducing a table took them for a run. Said only when nothing was left to run (not for --table-only, which
    asks for no run); `--out` goes to the bench, and to the command that continues it."""
    calls, use = fake_bench
    tables = f"tables: {tmp_path / 'table.md'}, {tmp_path / 'table.csv'}"
    use(done=True)
    assert main(["bench", "-c", "s.yaml"]) == 0
    assert capsys.readouterr().out.endswith(f"{tables}\nnote: nothing ran: every cell in benchmarks/results/s had "
                                            "finished before (the tables are theirs); --out ANOTHER_DIRECTORY runs "
                                            "the suite anew there\n")  # fmt: skip
    assert main(["bench", "-c", "s.yaml", "--table-only"]) == 0
    assert capsys.readouterr().out.endswith(f"{tables}\n")
    use(done=False)
    calls.clear()
    assert main(["bench", "-c", "s.yaml", "--out", "elsewhere"]) == 0
    assert capsys.readouterr().out.endswith(f"{tables} — 1 cells still to run (re-run to continue)\n")
    assert calls[0] == ("bench", "s.yaml", Path("elsewhere"))
    calls.clear()
    assert main(["bench", "-c", "s.yaml", "--set", "seeds=[0]", "--set", "base.train.rounds=2", "--out", "o"]) == 0
    assert calls[0] == ("bench", ("s.yaml", "seeds=[0]", "base.train.rounds=2"), Path("o"))  # the suite, as set


def test_each_report_field_no_finished_run_has_is_a_note_after_the_tables(fake_bench, tmp_path, capsys):
    _, use = fake_bench
    use(done=True, unreported=("table t, A: column P-FL's field f is in none", "table t, B: …"))
    assert main(["bench", "-c", "s.yaml", "--table-only"]) == 0
    assert capsys.readouterr().out.endswith(f"tables: {tmp_path / 'table.md'}, {tmp_path / 'table.csv'}\nnote: table "
                                            "t, A: column P-FL's field f is in none (its cells show —)\nnote: table "
                                            "t, B: … (its cells show —)\n")  # fmt: skip


def test_bench_with_diverged_cells_writes_the_tables_and_exits_3_naming_one(fake_bench, capsys):
    calls, use = fake_bench
    use(done=True, diverged=("runs/t/seed1", "runs/t/seed0"))
    assert main(["bench", "-c", "s.yaml"]) == 3
    assert calls == [("bench", "s.yaml", None), ("run", None, (1, 1), 1, True), ("tables",)]
    assert capsys.readouterr().err == ("pflbed: error: 2 cell(s) diverged, e.g. runs/t/seed1 (its diverged.json says "
                                       "where; delete a cell's directory to run it anew)\n")  # fmt: skip


@pytest.mark.parametrize(("given", "again"), [
    ([], "pflbed bench -c s.yaml"),
    (["--jobs", "1", "--shard", "1/1"], "pflbed bench -c s.yaml"),  # the defaults, not repeated
    (["--shard", "1/2", "--max-cells", "0"], "pflbed bench -c s.yaml --shard 1/2 --max-cells 0"),
    (["--jobs", "2"], "pflbed bench -c s.yaml --jobs 2"),
    (["--jobs", "2", "--out", "my dir"], "pflbed bench -c s.yaml --out 'my dir' --jobs 2"),
    (["--out", "o", "--set", "seeds=[0]", "--set", "tables=[t]"],
     "pflbed bench -c s.yaml --set 'seeds=[0]' --set 'tables=[t]' --out o"),
])  # fmt: skip
def test_a_ctrl_c_in_a_bench_repeats_only_the_options_given(fake_bench, capsys, given, again):
    _, use = fake_bench
    use(stop=True)
    assert main(["bench", "-c", "s.yaml", *given]) == 130
    assert capsys.readouterr().err.strip().endswith(f"continue with '{again}'")


def test_the_benchmarks_guide_s_small_trial_runs_as_written(tmp_path, monkeypatch, capsys):
    """docs/guide/benchmarks.md's `--set`/`--out` example, as the page shows it, from a working directory of its own
    (the suite file named from the repository): the three rows it keeps run for 2 rounds on one seed, into `--out`,
    whose suite.yaml is the suite as changed."""
    from pflbed.data.fmnist import HOW_TO_GET, find_fmnist

    if find_fmnist() is None:
        pytest.skip(f"Fashion-MNIST is not on this machine: {HOW_TO_GET}")
    argv = page_command("docs/guide/benchmarks.md", "--out runs/bench/fedselect-small")
    assert argv[:2] == ["bench", "-c"]
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    out = tmp_path / "runs" / "bench" / "fedselect-small"
    assert "| FedSelect α=0.3 |" in (out / "table.md").read_text()
    suite = load_suite(out)
    assert suite.seeds == [0] and suite.base["train"]["rounds"] == 2
    assert list(suite.tables["fedselect"].methods) == ["FedAvg", "FedAvg+FT", "FedSelect α=0.3"]
    assert sorted(p.name for p in (out / "runs" / "fedselect" / "default").iterdir()) == ["FedAvg", "FedSelect-α=0.3"]


def test_pretrained_targets_scores_the_weights_per_setting_and_seed_on_each_cell_s_own_test_sets(tmp_path, capsys):
    """benchmarks/pretrained_targets.py: each setting's and seed's federation is its own (the figures differ by seed
    and setting), and every row is `init_from.test_acc` of that cell, in %."""
    import importlib.util

    from pflbed.engine.build import prepare
    from pflbed.engine.pretrain import pretrain
    from pflbed.evaluation.pretrained import pretrained_accuracy

    from ..evaluation.test_pretrained import _cfg

    weights = tmp_path / "mlp"
    pretrain(_cfg(), weights, log=lambda *_: None)
    base = {"dataset": {"name": "digits-rot4"}, "model": {"name": "mlp", "init_from": str(weights)},
            "federation": {"protocol": "pflbed", "pflbed": {"clients_per_domain": 4, "new_clients_per_domain": 2}},
            "train": {"rounds": 1}, "executor": {"threads": 1}}  # fmt: skip
    settings = {"rot4": {}, "two": {"dataset.name": "digits", "dataset.domains": ["rot0", "rot180"]}}
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"name": "p", "seeds": [0, 1], "base": base, "out": str(tmp_path / "out"),
                                     "tables": {"t": {"settings": settings, "methods": {
                                         "A": {"set": {"algorithm.name": "fedavg"}}}}}}))  # fmt: skip
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "pretrained_targets.py"
    spec = importlib.util.spec_from_file_location("pretrained_targets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(suite), "t")
    rows = [r.split(" | ") for r in capsys.readouterr().out.splitlines() if r.startswith(("| rot4", "| two"))]
    table = Bench(load_suite(suite)).tables[0]
    want = {}
    for setting in settings:
        for seed in (0, 1):
            acc = pretrained_accuracy(prepare(table.cell_config(setting, "A", seed)).ctx)
            for name, v in {"all (G-FL)": acc["global"], **acc["domains"]}.items():
                want.setdefault((setting, name), []).append(f"{100 * v:.2f}")
    assert {(r[0].removeprefix("| "), r[1]): r[2].split(", ") for r in rows} == want
    assert [n for s, n in want if s == "two"] == ["all (G-FL)", "rot0", "rot180"]
    assert want[("rot4", "rot0")][0] != want[("rot4", "rot0")][1] and want[("two", "rot0")] != want[("rot4", "rot0")]


def test_a_table_without_settings_or_columns_or_scaling_a_column_it_lacks_is_refused(tmp_path):
    """`settings: {}` crashed once the cells were counted (min() of nothing), `report: {}` gave rows without a
    figure, and a `column_scale` of a column not reported was ignored without a word."""
    from pflbed.errors import ConfigError
    from pflbed.results.bench import load_suite

    table = {"methods": {"A": {"set": {"algorithm.name": "fedavg"}}}}
    for extra, message in (({"settings": {}}, "tables.t.settings: Dictionary should have at least 1 item"),
                           ({"report": {}}, "tables.t.report: Dictionary should have at least 1 item"),
                           ({"report": {"P-FL": "final.pfl_acc"}, "column_scale": {"G-FL": 1.0}},
                            "column_scale.G-FL: no such column; the report's are P-FL")):  # fmt: skip
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump({"name": "s", "seeds": [0], "tables": {"t": {**table, **extra}}}))
        with pytest.raises(ConfigError) as e:
            load_suite(path)
        assert message in str(e.value), str(e.value)
    path.write_text(yaml.safe_dump({"name": "s", "seeds": [0], "tables": {"t": {
        **table, "report": {"P-FL": "final.pfl_acc"}, "column_scale": {"P-FL": 1.0}}}}))  # fmt: skip
    assert load_suite(path).tables["t"].column_scale == {"P-FL": 1.0}
