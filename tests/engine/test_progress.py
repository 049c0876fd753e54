"""Progress where stdout is not a terminal (a log file, a batch system): a line at start-up, every evaluation, and in
between a line per round or stage step once `PFLBED_PROGRESS_INTERVAL` seconds have passed — never a long silence."""

import os
import subprocess
import sys

import pytest

from pflbed.cli import main
from pflbed.engine.progress import RunProgress

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
