"""`pflbed flower local` shows its run's progress while it waits for the deployment: the ServerApp's output goes to
Flower's logs, so the progress is read from what it writes to the run directory (`local.Follower`)."""

import json
import subprocess
import sys

import pytest

from pflbed.engine.progress import RunProgress
from pflbed.results.checkpoint import save_checkpoint

pytest.importorskip("flwr")  # the `flower` extra

from pflbed.flower import local  # noqa: E402

# a stand-in for `flwr run`: the ServerApp logs round 2's evaluation, then works on
APP = """import json, sys, time
time.sleep(0.3)
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"round": 2, "pfl_acc": 0.5}) + "\\n")
time.sleep(0.5)
"""


def test_evaluations_checkpoints_and_a_heartbeat_are_shown_while_the_deployment_runs(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 1, "pfl_acc": 0.1}) + "\n")  # an earlier attempt's
    with RunProgress(True, "t", 4, interval=0) as bar:
        follower = local.Follower(tmp_path, bar)
        proc = subprocess.Popen([sys.executable, "-c", APP, str(tmp_path / "metrics.jsonl")])
        assert local._wait(proc, follower, poll_s=0.05) == 0
        save_checkpoint(tmp_path, 3, {}, {}, [], {})
        follower.poll()
    lines = [x.split("] t: ", 1)[1] for x in capsys.readouterr().out.splitlines()]
    assert lines[0] == "the deployment is running; no round evaluated or checkpointed yet"
    assert "round 2/4 evaluated: P-FL 50.0" in lines and "round 1/4 evaluated: P-FL 10.0" not in lines
    assert lines.index("round 2/4 evaluated: P-FL 50.0") < lines.index("the deployment is running; round 2/4 done")
    assert lines[-2].startswith("round 3/4, ETA ") and lines[-1] == "the deployment is running; round 3/4 done"


def test_ctrl_c_while_waiting_stops_the_run_command(tmp_path):
    class Interrupting(local.Follower):
        def poll(self):
            raise KeyboardInterrupt

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(KeyboardInterrupt), RunProgress(False, "t", 4) as bar:
        local._wait(proc, Interrupting(tmp_path, bar))
    assert proc.poll() is not None


def test_the_server_app_s_warnings_are_passed_on_once_even_without_progress(tmp_path):
    """The ServerApp's output goes to run.log only: its warnings (DP noise that swamps the updates) would stay there."""
    run_log, said = tmp_path / "run.log", []
    with RunProgress(False, "t", 4) as bar:
        follower = local.Follower(tmp_path, bar, run_log, said.append)
        follower.poll()  # no log yet
        run_log.write_text("INFO : starting\npflbed: warning: privacy noise … ≥ 1: the noise outweighs …\n")
        follower.poll()
        with open(run_log, "a") as f:
            f.write("INFO : round 1\n  pflbed: warning: a second one\n")
        follower.poll()
    assert said == ["pflbed: warning: privacy noise … ≥ 1: the noise outweighs …", "pflbed: warning: a second one"]


def test_a_warning_is_passed_on_once_it_is_whole_from_the_log_s_first_byte_in_any_encoding(tmp_path):
    """The ServerApp writes while the launcher reads: a line is read once it ends, from where the last whole line
    ended; a line that does not decode is still passed on."""
    run_log, said = tmp_path / "run.log", []
    with RunProgress(False, "t", 4) as bar:
        follower = local.Follower(tmp_path, bar, run_log, said.append)
        run_log.write_bytes(b"pflbed: warning: first \xff\nINFO : x\npflbed: warn")
        follower.poll()
        assert said == ["pflbed: warning: first \ufffd"]
        with open(run_log, "ab") as f:
            f.write(b"ing: second\n")
        follower.poll()
        follower.poll()
        with open(run_log, "ab") as f:
            f.write(b"pflbed: warning: third\n")
        follower.poll()
    assert said == ["pflbed: warning: first \ufffd", "pflbed: warning: second", "pflbed: warning: third"]


def test_only_whole_evaluation_records_count(tmp_path):
    """metrics.jsonl as the ServerApp may leave it between two writes: a last line not yet ended (even one that
    parses), a broken line, a record without a round or with a round that is no integer."""
    with RunProgress(False, "t", 4) as bar:
        follower = local.Follower(tmp_path, bar)
        assert follower._records() == []
        (tmp_path / "metrics.jsonl").write_text('{"round": 1}\nnot json\n[2]\n{"round": "2"}\n{"pfl_acc": 1}\n'
                                                '{"round": 2, "pfl_acc": 0.5}\n{"round": 3}')  # fmt: skip
        assert follower._records() == [{"round": 1}, {"round": 2, "pfl_acc": 0.5}]


def test_a_checkpoint_shows_its_round_once_and_the_last_round_says_the_final_stages_run(tmp_path, capsys):
    with RunProgress(True, "t", 2, interval=0) as bar:
        follower = local.Follower(tmp_path, bar)
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "last.pt").write_bytes(b"being written")  # no round to read yet
        follower.poll()
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 1, "pfl_acc": 0.25}) + "\n")
        follower.poll()
        save_checkpoint(tmp_path, 1, {}, {}, [], {})  # the evaluated round: nothing new
        follower.poll()
        save_checkpoint(tmp_path, 2, {}, {}, [], {})
        follower.poll()
    lines = [x.split("] t: ", 1)[1] for x in capsys.readouterr().out.splitlines()]
    rounds = [x for x in lines if x.startswith("round ")]
    assert rounds[0] == "round 1/2 evaluated: P-FL 25.0" and len(rounds) == 2 and rounds[1].startswith("round 2/2, ")
    assert lines[-1] == "all 2 rounds done; the deployment runs the final evaluation stages"
    assert lines[0] == "the deployment is running; no round evaluated or checkpointed yet"
    assert lines.count("the deployment is running; round 1/2 done") == 2, lines


def test_no_progress_reads_nothing(tmp_path, capsys, monkeypatch):
    with RunProgress(False, "t", 4) as bar:
        follower = local.Follower(tmp_path, bar)
        monkeypatch.setattr(follower, "_records", lambda: pytest.fail("read with progress off"))
        follower.poll()
    assert capsys.readouterr().out == ""
