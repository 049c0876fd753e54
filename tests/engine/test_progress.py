"""Progress where stdout is not a terminal (a log file, a batch system): a line at start-up, every evaluation, and in
between a line per round or stage step once `PFLBED_PROGRESS_INTERVAL` seconds have passed — never a long silence."""

import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from pflbed.cli import main
from pflbed.engine.progress import RunProgress, announce, clock_text, interval_s, status

RUN = ["--set", "algorithm.name=fedavg", "--set", "dataset.name=synthetic", "--set", "model.name=mlp",
       "--set", "federation.clients=4", "--set", "train.rounds=3", "--set", "eval.every=3",
       "--set", "eval.finetune=[ft]", "--set", "executor.threads=1"]  # fmt: skip


def test_a_piped_run_prints_a_start_line_then_each_round_and_step_at_the_interval(tmp_path):
    """Interval 0: a line for every round and every fine-tuned client, each with what is left."""
    env = {**os.environ, "PFLBED_PROGRESS_INTERVAL": "0"}
    done = subprocess.run([sys.executable, "-m", "pflbed", "run", *RUN, "--out", str(tmp_path / "r")], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "fedavg on synthetic: 3 rounds; loading the data…"
    timed = [x.split("] fedavg on synthetic: ", 1)[1] for x in lines if x.startswith("[")]
    assert [x.split(",")[0] for x in timed[:2]] == ["round 1/3", "round 2/3"] and "ETA 0:00:" in timed[0]
    assert timed[2].startswith("round 3/3 evaluated: G-FL")
    steps = [x for x in timed if x.startswith("fine-tuning every client (ft): ") and "done" not in x]
    assert [x.split(": ")[1].split(",")[0] for x in steps] == ["1/4", "2/4", "3/4", "4/4"]


def test_no_progress_prints_no_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "0")
    assert main(["run", *RUN, "--no-progress", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "loading the data" not in out and not any(x.startswith("[") for x in out.splitlines())


def test_lines_come_at_most_once_per_round_and_per_interval(capsys):
    """Rounds end at 10, 20, 35, 40, 70 s (interval 30): lines at 35 and 70 only, each with the time left at the
    pace so far; an evaluation always has its line; a stage's steps likewise."""
    now = [0.0]
    with RunProgress(True, "t", 6, clock=lambda: now[0], interval=30) as bar:
        for rnd, t in enumerate([10, 20, 35, 40, 70], 1):
            now[0] = t
            bar.round_done(rnd, None)
        now[0] = 71
        bar.round_done(6, {"pfl_acc": 0.5})
        with bar.stage("fine-tuning", 3) as tick:
            for t in (80, 102, 110):
                now[0] = t
                tick()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[   35.0 s] t: round 3/6, ETA 0:00:35", "[   70.0 s] t: round 5/6, ETA 0:00:14",
                     "[   71.0 s] t: round 6/6 evaluated: P-FL 50.0", "[   71.0 s] t: fine-tuning…",
                     "[  102.0 s] t: fine-tuning: 2/3, ETA 0:00:16", "[  110.0 s] t: fine-tuning: done in 39.0 s"]


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_bad_interval_is_one_line_naming_the_variable(tmp_path, capsys, monkeypatch, value):
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", value)
    assert main(["run", *RUN, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "PFLBED_PROGRESS_INTERVAL" in err and not (tmp_path / "r").exists()


class _Stream(io.StringIO):
    """stdout as a test sees it: what was written, how much of it had been flushed, and whether it is a terminal."""

    def __init__(self, tty: bool = False) -> None:
        super().__init__()
        self.tty, self.flushed = tty, 0

    def isatty(self) -> bool:
        return self.tty

    def flush(self) -> None:
        self.flushed = len(self.getvalue())


def _clock(t=0.0):
    now = [t]
    return now, lambda: now[0]


@pytest.mark.parametrize(("seconds", "text"), [(0, "0:00:00"), (0.4, "0:00:00"), (-3, "0:00:00"), (59, "0:00:59"),
                                               (60, "0:01:00"), (3599, "0:59:59"), (3600, "1:00:00"),
                                               (3661, "1:01:01"), (36_000, "10:00:00")])  # fmt: skip
def test_clock_text_is_hours_minutes_seconds_never_negative(seconds, text):
    assert clock_text(seconds) == text


@pytest.mark.parametrize(("value", "want"), [(None, 30.0), ("  ", 30.0), ("0", 0.0), ("0.5", 0.5), ("90", 90.0)])
def test_the_interval_is_the_variable_s_seconds_else_30(value, want, monkeypatch):
    if value is None:
        monkeypatch.delenv("PFLBED_PROGRESS_INTERVAL", raising=False)
    else:
        monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", value)
    assert interval_s() == want


def test_the_status_shows_each_measured_accuracy_a_zero_included():
    assert status({"gfl_acc": 0.25, "pfl_acc": 0.5}) == "G-FL 25.0 · P-FL 50.0"
    assert status({"gfl_acc": None, "pfl_acc": 0.0}) == "P-FL 0.0"
    assert status({"gfl_acc": 0.125}) == "G-FL 12.5" and status({"round": 3}) == ""


@pytest.mark.parametrize("tty", [False, True])
def test_the_start_up_line_goes_out_flushed_where_output_is_plain_lines_only(tty, monkeypatch):
    out = _Stream(tty)
    monkeypatch.setattr(sys, "stdout", out)
    announce(False, "not shown")
    announce(True, "fedavg on synthetic: 3 rounds; loading the data…")
    assert out.getvalue() == ("" if tty else "fedavg on synthetic: 3 rounds; loading the data…\n")
    assert out.flushed == len(out.getvalue())


def test_a_resumed_run_says_so_and_takes_its_pace_and_timestamps_from_its_own_rounds(monkeypatch):
    """Resumed after round 2 of 6, the command started at 5 s, rounds at 10 s: the lines' times count from the
    command's start, the ETA from the rounds this process ran (round 3 at 20 s: 10 s a round, 3 left); a line is
    due once exactly the interval has passed, each is flushed at once, and a heartbeat follows the same interval."""
    out, (now, clock) = _Stream(), _clock(10.0)
    monkeypatch.setattr(sys, "stdout", out)
    bar = RunProgress(True, "t", 6, 2, t0=5.0, clock=clock, interval=10)
    assert out.flushed == len(out.getvalue())
    now[0] = 20.0
    bar.round_done(3, None)
    assert out.flushed == len(out.getvalue())
    now[0] = 29.0
    bar.heartbeat("waiting")
    now[0] = 30.0
    bar.heartbeat("waiting")
    now[0] = 35.0
    bar.round_done(4, None)  # 5 s after the last line: none
    now[0] = 40.0
    bar.round_done(4, None)  # round 4 reported again, due: its line, the pace of the two rounds run
    assert out.getvalue().splitlines() == ["[    5.0 s] t: resumed after round 2/6",
                                           "[   15.0 s] t: round 3/6, ETA 0:00:30", "[   25.0 s] t: waiting",
                                           "[   35.0 s] t: round 4/6, ETA 0:00:30"]  # fmt: skip


def test_a_round_reported_before_any_ran_has_no_pace(monkeypatch):
    out, (_, clock) = _Stream(), _clock()
    monkeypatch.setattr(sys, "stdout", out)
    RunProgress(True, "t", 6, 2, clock=clock, interval=0).round_done(2, None)
    assert out.getvalue().splitlines()[-1] == "[    0.0 s] t: round 2/6"


def test_the_interval_comes_from_the_variable_in_plain_lines_only(monkeypatch):
    """Unset `interval`: plain lines wait `PFLBED_PROGRESS_INTERVAL` seconds; a display that prints no lines never
    reads the variable (a bad value there does not stop a run that shows no lines)."""
    out, (now, clock) = _Stream(), _clock()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "20")
    bar = RunProgress(True, "t", 6, clock=clock)
    for rnd, t in enumerate([10, 19, 21], 1):
        now[0] = t
        bar.round_done(rnd, None)
    assert [x.split("] t: ")[1] for x in out.getvalue().splitlines()] == ["round 3/6, ETA 0:00:21"]
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "nan")
    with RunProgress(False, "t", 6, clock=clock) as off:
        off.round_done(1, None)
        off.heartbeat("waiting")
    assert out.getvalue().count("\n") == 1


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _shown(bar: RunProgress) -> list[str]:
    """The live display as it is drawn now, as plain text lines."""
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(bar.live.get_renderable())
    return [_ANSI.sub("", x).rstrip() for x in console.file.getvalue().splitlines()]


def test_a_terminal_gets_a_bar_for_the_rounds_with_the_last_evaluation_and_one_per_stage(monkeypatch):
    """Resumed after round 2 of 6: the rounds' bar starts at 2/6 with no accuracy, moves with each round, shows
    the last evaluation beside it; a stage's bar counts its steps and is full when it ends; nothing is printed as
    lines, and closing twice is harmless."""
    monkeypatch.setattr(sys, "stdout", _Stream(tty=True))
    time_ = r"\d:\d\d:\d\d"
    bar_ = r"[━╸╺]+ *"  # uncoloured: the part still to go is blank
    with RunProgress(True, "t", 6, 2, interval=0) as bar:
        assert bar.mode == "live"
        assert re.fullmatch(rf"t: rounds {bar_} 2/6 +{time_} ETA (-:--:--|{time_})", _shown(bar)[0])
        bar.round_done(3, None)
        bar.round_done(4, {"gfl_acc": 0.25, "pfl_acc": 0.5})
        bar.round_done(5, None)  # the evaluation stays beside the bar
        assert re.fullmatch(rf"t: rounds +{bar_} 5/6 G-FL 25.0 · P-FL 50.0 {time_} ETA {time_}", _shown(bar)[0])
        bar.heartbeat("waiting")
        with bar.stage("fine-tuning", 3) as tick:
            tick()
            tick()
            assert re.fullmatch(rf"t: fine-tuning {bar_} 2/3 +{time_} ETA (-:--:--|{time_})", _shown(bar)[1])
        assert " 3/3 " in _shown(bar)[1]
        bar.close()
    assert bar.live is None and "waiting" not in sys.stdout.getvalue()


def test_a_terminal_s_bar_shows_the_title_and_the_status_as_written_brackets_included(monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Stream(tty=True))
    with RunProgress(True, "fedavg [lenet5]", 2, interval=0) as bar:
        bar.round_done(1, {"gfl_acc": 0.25})
        bar.live.update(bar.task, status="[bold]x[/bold]")
        assert _shown(bar)[0].startswith("fedavg [lenet5]: rounds ") and " [bold]x[/bold] " in _shown(bar)[0]
