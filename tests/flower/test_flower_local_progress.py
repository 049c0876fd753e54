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


def test_no_progress_reads_nothing(tmp_path, capsys, monkeypatch):
    with RunProgress(False, "t", 4) as bar:
        follower = local.Follower(tmp_path, bar)
        monkeypatch.setattr(follower, "_records", lambda: pytest.fail("read with progress off"))
        follower.poll()
    assert capsys.readouterr().out == ""
