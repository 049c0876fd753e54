"""What each command line parses to: the names, types and defaults the commands read (`args.out` a Path, `--shard`
a pair, `--set` a list in order), and a missing or malformed option refused by argparse in one line, exit code 2.
Every option is given once here; the generated reference (`docs/reference/cli.md`) pins the help texts. Then `main`:
each command to its function, and each kind of failure to its one line and exit code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pflbed.cli import _parser

P = Path

CASES = [  # argv, the parsed names and values (all of them)
    (["run"], dict(command="run", config=None, overrides=[], out=None, resume=None, force=False, no_progress=False)),
    (["run", "-c", "a.yaml", "--set", "x=1", "--set", "y=2", "--out", "o", "--resume", "r", "--force",
      "--no-progress"],
     dict(command="run", config="a.yaml", overrides=["x=1", "y=2"], out=P("o"), resume=P("r"), force=True,
          no_progress=True)),
    (["bench", "-c", "s.yaml"],
     dict(command="bench", config="s.yaml", overrides=[], out=None, max_cells=None, jobs=1, shard=(1, 1),
          table_only=False, list=False)),
    (["bench", "--config", "s.yaml", "--max-cells", "0", "--jobs", "2", "--shard", "2/3", "--table-only", "--list",
      "--out", "o", "--set", "seeds=[0]"],
     dict(command="bench", config="s.yaml", overrides=["seeds=[0]"], out=Path("o"), max_cells=0, jobs=2,
          shard=(2, 3), table_only=True, list=True)),
    (["tune", "-c", "t.yaml"],
     dict(command="tune", config="t.yaml", overrides=[], out=None, storage=None, worker=False, max_trials=None,
          jobs=1, table_only=False)),
    (["tune", "-c", "t.yaml", "--set", "seeds=[0]", "--out", "o", "--storage", "sqlite:///s.db", "--worker",
      "--max-trials", "3", "--jobs", "2", "--table-only"],
     dict(command="tune", config="t.yaml", overrides=["seeds=[0]"], out=P("o"), storage="sqlite:///s.db",
          worker=True, max_trials=3, jobs=2, table_only=True)),
    (["flower", "local"],
     dict(command="flower", action="local", config=None, overrides=[], supernodes=None, site_data=None,
          secagg=False, tls=False, auth=False, out=None, force=False, resume=None, no_progress=False)),
    (["flower", "local", "-c", "a.yaml", "--set", "x=1", "--supernodes", "3", "--site-data", "s1", "s2", "--secagg",
      "--tls", "--auth", "--out", "o", "--force", "--resume", "r", "--no-progress"],
     dict(command="flower", action="local", config="a.yaml", overrides=["x=1"], supernodes=3,
          site_data=[P("s1"), P("s2")], secagg=True, tls=True, auth=True, out=P("o"), force=True, resume=P("r"),
          no_progress=True)),
    (["flower", "app", "--out", "o"],
     dict(command="flower", action="app", config=None, overrides=[], out=P("o"), run_dir=None, force=False)),
    (["flower", "app", "-c", "a.yaml", "--set", "x=1", "--out", "o", "--run-dir", "d", "--force"],
     dict(command="flower", action="app", config="a.yaml", overrides=["x=1"], out=P("o"), run_dir=P("d"),
          force=True)),
    (["flower", "sites", "-c", "a.yaml", "--set", "x=1", "--out", "o", "--force"],
     dict(command="flower", action="sites", config="a.yaml", overrides=["x=1"], out=P("o"), force=True)),
    (["flower", "sites", "--out", "o"],
     dict(command="flower", action="sites", config=None, overrides=[], out=P("o"), force=False)),
    (["pretrain", "--out", "o"], dict(command="pretrain", config=None, overrides=[], out=P("o"), force=False)),
    (["pretrain", "-c", "a.yaml", "--set", "x=1", "--out", "o", "--force"],
     dict(command="pretrain", config="a.yaml", overrides=["x=1"], out=P("o"), force=True)),
    (["personalize", "r", "--data", "d.npz", "--out", "o"],
     dict(command="personalize", run=P("r"), data=P("d.npz"), val=None, test=None, method="native", epochs=None,
          lr=None, seed=0, out=P("o"), force=False)),
    (["personalize", "r", "--data", "d.npz", "--val", "v.npz", "--test", "t.npz", "--method", "lp", "--epochs", "4",
      "--lr", "0.05", "--seed", "3", "--out", "o", "--force"],
     dict(command="personalize", run=P("r"), data=P("d.npz"), val=P("v.npz"), test=P("t.npz"), method="lp",
          epochs=4, lr=0.05, seed=3, out=P("o"), force=True)),
    (["report", "a", "b", "-o", "x.html"], dict(command="report", runs=[P("a"), P("b")], out=P("x.html"), format=None)),
    (["report", "a", "--out", "x", "--format", "md"], dict(command="report", runs=[P("a")], out=P("x"), format="md")),
    (["algorithms"], dict(command="algorithms", name=None)),
    (["algorithms", "fedrod"], dict(command="algorithms", name="fedrod")),
    (["config"], dict(command="config", config=None, overrides=[], defaults=False)),
    (["config", "-c", "a.yaml", "--set", "x=1", "--defaults"],
     dict(command="config", config="a.yaml", overrides=["x=1"], defaults=True)),
    (["data", "list"],
     dict(command="data", action="list", target=None, path=None, config=None, overrides=[], png=None, force=False,
          out_dir=None, client=None)),
    (["data", "new-client", "r", "--path", "p", "-c", "a.yaml", "--set", "x=1", "--png", "m.png", "--force", "--out",
      "o", "--client", "7"],
     dict(command="data", action="new-client", target=P("r"), path="p", config="a.yaml", overrides=["x=1"],
          png=P("m.png"), force=True, out_dir=P("o"), client=7)),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "parsed"), CASES, ids=[" ".join(a[:2]) + f"-{i}" for i, (a, _) in enumerate(CASES)])
def test_a_command_line_parses_to_the_names_types_and_defaults_its_command_reads(argv, parsed):
    assert vars(_parser().parse_args(argv)) == parsed


MALFORMED = [  # argv, the one line: the command that refuses it, what is wrong (and what may follow a command)
    ([], "pflbed: error: the following arguments are required: command (one of: run, bench, tune, flower, pretrain, "
         "personalize, report, algorithms, config, data; see 'pflbed --help')"),
    (["bench"], "pflbed bench: error: the following arguments are required: -c/--config"),
    (["tune"], "pflbed tune: error: the following arguments are required: -c/--config"),
    (["flower"], "pflbed flower: error: the following arguments are required: {local,app,sites} (one of: local, app, "
                 "sites; see 'pflbed flower --help')"),
    (["flower", "app"], "pflbed flower app: error: the following arguments are required: --out"),
    (["flower", "sites"], "pflbed flower sites: error: the following arguments are required: --out"),
    (["pretrain"], "pflbed pretrain: error: the following arguments are required: --out"),
    (["personalize"], "pflbed personalize: error: the following arguments are required: RUN, --data, --out"),
    (["personalize", "r", "--out", "o"], "pflbed personalize: error: the following arguments are required: --data"),
    (["personalize", "r", "--data", "d"], "pflbed personalize: error: the following arguments are required: --out"),
    (["report", "a"], "pflbed report: error: the following arguments are required: -o/--out"),
    (["data"], "pflbed data: error: the following arguments are required: action (one of: list, show, export, "
               "new-client; see 'pflbed data --help')"),
    (["data", "drop"],
     "pflbed data: error: argument action: invalid choice: 'drop' (choose from 'list', 'show', 'export', "
     "'new-client')"),
    (["personalize", "r", "--data", "d", "--out", "o", "--method", "all"],
     "pflbed personalize: error: argument --method: invalid choice: 'all' (choose from 'native', 'ft', 'lp')"),
    (["report", "a", "-o", "x", "--format", "pdf"],
     "pflbed report: error: argument --format: invalid choice: 'pdf' (choose from 'html', 'md')"),
    (["personalize", "r", "--data", "d", "--out", "o", "--epochs", "2.5"],
     "pflbed personalize: error: argument --epochs: invalid int value: '2.5'"),
    (["flower", "local", "--supernodes", "x"],
     "pflbed flower local: error: argument --supernodes: invalid int value: 'x'"),
    (["bench", "-c", "s", "--shard", "3/2"], "pflbed bench: error: argument --shard: need 1 <= I <= N, got '3/2'"),
    (["run", "--rounds", "3"], "pflbed: error: unrecognized arguments: --rounds 3"),  # the root parser's line
]  # fmt: skip


@pytest.mark.parametrize(("argv", "said"), MALFORMED)
def test_a_missing_or_malformed_option_is_one_line_with_exit_code_2(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    err = capsys.readouterr().err  # one line: argparse's usage block above it is left to --help
    assert exc.value.code == 2 and err == said + "\n", err


def test_version_prints_the_package_s_version(capsys):
    from pflbed import __version__

    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"pflbed {__version__}\n"


def test_counts_jobs_and_shards_are_taken_up_to_their_edges_and_refused_past_them(capsys):
    """The neighbours of `test_cli`'s refusals: the smallest and largest value taken, and each malformed shard."""
    from pflbed.config.base import max_threads

    top = max_threads()
    taken = [(["--jobs", "1"], "jobs", 1), (["--jobs", str(top)], "jobs", top), (["--max-cells", "0"], "max_cells", 0),
             (["--shard", "1/1"], "shard", (1, 1)), (["--shard", "3/3"], "shard", (3, 3)),
             (["--shard", "1/3"], "shard", (1, 3))]  # fmt: skip
    for argv, name, value in taken:
        assert getattr(_parser().parse_args(["bench", "-c", "s", *argv]), name) == value, argv
    refused = [("0/2", "need 1 <= I <= N, got '0/2'"), ("x", "expected I/N such as 1/2, got 'x'"),
               ("1/2/3", "expected I/N such as 1/2, got '1/2/3'"), ("1/", "expected I/N such as 1/2, got '1/'")]
    for shard, said in refused:
        with pytest.raises(SystemExit):
            _parser().parse_args(["bench", "-c", "s", "--shard", shard])
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"pflbed bench: error: argument --shard: {said}"


# --- main: each command to its function, each failure to its line and exit code -----------------------------------


@pytest.fixture
def called(monkeypatch) -> list[str]:
    """Each command's function replaced by one that records the command's name."""
    import pflbed.cli as cli

    seen: list[str] = []
    for name in ("run", "bench", "data", "flower", "personalize", "pretrain", "algorithms", "config", "report", "tune"):
        monkeypatch.setattr(cli, f"_cmd_{name}", lambda args, name=name: seen.append(name))
    return seen


def test_main_runs_each_command_s_own_function(called):
    from pflbed.cli import main

    for argv, parsed in CASES:
        called.clear()
        assert main(argv) == 0 and called == [parsed["command"]], argv


def _raising(monkeypatch, exc: BaseException) -> None:
    import pflbed.cli as cli

    def fail(args):
        raise exc

    monkeypatch.setattr(cli, "_cmd_config", fail)


@pytest.mark.parametrize(("exc", "code", "line"), [
    ("user", 2, "pflbed: error: config.yaml: train.lr: must be > 0"),
    ("diverged", 3, "pflbed: error: diverged in round 4: the loss is nan — lower train.lr (or the algorithm's own "
                    "lrs)"),
    ("cells", 3, "pflbed: error: 2 cell(s) diverged"),
    ("file", 2, "pflbed: error: runs/a/metrics.jsonl: No space left on device"),
    ("io", 2, "pflbed: error: I/O: disk gone"),
    ("ctrl-c", 130, "pflbed: interrupted"),
    ("described", 130, "pflbed: interrupted; round 3 of 5 is checkpointed"),
])  # fmt: skip
def test_main_says_each_failure_in_one_line_with_its_exit_code(monkeypatch, capsys, exc, code, line):
    import errno

    from pflbed.cli import DivergedCells, Interrupted, main
    from pflbed.errors import DivergedError, PflbedError

    made = {"user": PflbedError("config.yaml: train.lr: must be > 0"), "diverged": DivergedError(4, "the loss is nan"),
            "cells": DivergedCells("2 cell(s) diverged"), "io": OSError("disk gone"),
            "file": OSError(errno.ENOSPC, "No space left on device", "runs/a/metrics.jsonl"),
            "ctrl-c": KeyboardInterrupt(),
            "described": Interrupted(lambda: "interrupted; round 3 of 5 is checkpointed")}
    _raising(monkeypatch, made[exc])
    assert main(["config"]) == code
    assert capsys.readouterr().err == line + "\n"


def test_a_sigterm_stops_the_command_with_its_own_exit_code(monkeypatch, capsys):
    import pflbed.cli as cli

    _raising(monkeypatch, KeyboardInterrupt())
    monkeypatch.setattr(cli, "_TERMINATED", [True])  # as the SIGTERM handler leaves it
    assert cli.main(["config"]) == 128 + 15
    assert capsys.readouterr().err == "pflbed: interrupted\n"


def test_only_the_process_s_own_command_line_counts_from_the_process_start_and_takes_sigterm(monkeypatch, called):
    """`main()` (no argv: `pflbed ...`) times the whole process and turns SIGTERM into Ctrl-C; `main([...])` from
    Python times the call and leaves the caller's signal handlers alone."""
    import pflbed.cli as cli

    clocks, handlers = [], []
    monkeypatch.setattr(cli, "command_clock", lambda whole_process: clocks.append(whole_process) or (lambda: 0.0))
    monkeypatch.setattr(cli, "_terminate_as_ctrl_c", lambda: handlers.append(True))
    assert cli.main(["config"]) == 0 and (clocks, handlers) == ([False], [])
    monkeypatch.setattr("sys.argv", ["pflbed", "config"])
    assert cli.main() == 0 and (clocks, handlers) == ([False, True], [True])


def test_data_list_joins_a_dataset_s_sizes_and_domains_on_its_second_line():
    from pflbed.cli import _data_listing

    rows = [{"name": "pacs", "location": "/d/pacs", "train": 30, "test": 0, "domains": "art, photo", "error": None},
            {"name": "x", "location": "not found", "train": None, "test": None, "domains": "", "error": "x: bad"}]
    assert _data_listing(rows) == "pacs  /d/pacs\n      30 train, 0 test; domains art, photo\nx     x: bad\n"
    far = "/data/" + "-".join(["fashion-mnist"] * 10)  # a path wider than the listing: kept whole, to copy it
    wide = [{**rows[0], "location": far, "train": None}, {**rows[1], "error": f"not found: set dataset.path to {far}"}]
    assert _data_listing(wide) == (f"pacs  {far}\n      domains art, photo\n"
                                   f"x     not found: set dataset.path to\n      {far}\n")


def test_data_list_on_a_terminal_wraps_to_its_width_up_to_120_columns(monkeypatch):
    import shutil
    import sys

    from pflbed.cli import _data_listing

    row = [{"name": "x", "location": "not found: " + " ".join(["word"] * 40), "train": None, "test": None,
            "domains": "", "error": None}]  # fmt: skip
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    for columns, width in ((60, 60), (200, 120)):
        monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback, c=columns: os.terminal_size((c, 24)))
        lines = _data_listing(row).splitlines()
        assert max(map(len, lines)) <= width and max(map(len, lines)) > width - 6, (columns, lines)


def test_data_list_in_a_pipe_is_120_columns_whatever_the_terminal_s_width(monkeypatch):
    from pflbed.cli import _data_listing

    row = [{"name": "x", "location": "not found: " + " ".join(["word"] * 40), "train": None, "test": None,
            "domains": "", "error": None}]  # fmt: skip
    monkeypatch.setenv("COLUMNS", "60")  # the terminal the pipe's reader may sit at: not where the text goes
    assert max(map(len, _data_listing(row).splitlines())) > 100
