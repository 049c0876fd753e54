"""Ctrl-C: the message says which round is checkpointed and the exact command that continues, which then works."""

import json

from pflbed.cli import main
from pflbed.results.rundir import RunDir

FAST = ["--set", "dataset.name=synthetic", "--set", "model.name=mlp", "--set", "federation.clients=5",
        "--set", "train.rounds=4", "--set", "train.checkpoint_every=2", "--set", "eval.every=1",
        "--set", "eval.finetune=[]", "--set", "executor.threads=1", "--no-progress"]  # fmt: skip


def _interrupt_at(monkeypatch, rnd):
    """Ctrl-C as round `rnd`'s record is logged (after round `rnd` - 1's checkpoint)."""
    real = RunDir.log

    def log(self, record):
        if record["round"] == rnd:
            raise KeyboardInterrupt
        real(self, record)

    monkeypatch.setattr(RunDir, "log", log)


def test_ctrl_c_names_the_checkpointed_round_and_the_resume_command(tmp_path, monkeypatch, capsys):
    out = tmp_path / "my run"  # a space: the command quotes the path as a shell reads it back
    _interrupt_at(monkeypatch, 3)
    assert main(["run", *FAST, "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    assert err == (f"pflbed: interrupted; round 2 of 4 is checkpointed in {out}/checkpoints/last.pt; continue with "
                   f"'pflbed run --resume '{out}''")  # fmt: skip
    monkeypatch.undo()
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0  # the command it gave
    assert [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_ctrl_c_after_the_run_finished_points_to_its_results(tmp_path):
    from pflbed.cli import _interrupted_run

    (tmp_path / "config.yaml").write_text("{}")
    (tmp_path / "summary.json").write_text("{}")
    said = _interrupted_run(tmp_path, "pflbed run --resume x", 5)
    assert said == f"interrupted after the run finished; results in {tmp_path}"


def test_ctrl_c_before_any_checkpoint_or_before_the_run_started(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, 1)
    assert main(["run", *FAST, "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip() == (f"pflbed: interrupted before the first checkpoint (the first "
                                               f"evaluation or train.checkpoint_every); 'pflbed run --resume {out}' "
                                               "starts the run over")  # fmt: skip
    monkeypatch.setattr("pflbed.results.experiment.prepare", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    fresh = tmp_path / "fresh"
    assert main(["run", *FAST, "--out", str(fresh)]) == 130
    err = capsys.readouterr().err.strip()
    assert err == f"pflbed: interrupted before the run started; nothing was written to {fresh}"


def test_ctrl_c_in_a_bench_says_how_to_continue(tmp_path, monkeypatch, capsys):
    from pflbed.results import bench

    suite = tmp_path / "my suite.yaml"
    suite.write_text("name: s\n")
    monkeypatch.setattr(bench, "load_suite", lambda path, overrides: object())
    monkeypatch.setattr(bench, "Bench", lambda s, out=None: type("B", (), {"pending": lambda self: [],
                                                                          "refuse_stale": lambda self: None,
                                                                          "run": lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt)})())  # fmt: skip
    assert main(["bench", "-c", str(suite), "--jobs", "2", "--shard", "2/3"]) == 130
    assert capsys.readouterr().err.strip() == (f"pflbed: interrupted; finished cells are kept and an interrupted cell "
                                               f"continues from its checkpoint: continue with 'pflbed bench -c "
                                               f"'{suite}' --jobs 2 --shard 2/3'")  # fmt: skip


def test_ctrl_c_keeps_every_evaluated_round_and_the_resumed_run_ends_the_same(tmp_path, monkeypatch, capsys):
    """Each evaluation is checkpointed, whatever `train.checkpoint_every` (here 10, beyond the run): Ctrl-C as round
    6's record is logged keeps rounds 2 and 4, and the resumed run's summary is the uninterrupted run's."""
    sets = [*FAST, "--set", "train.rounds=6", "--set", "train.checkpoint_every=10", "--set", "eval.every=2"]
    out, straight = tmp_path / "run", tmp_path / "straight"
    _interrupt_at(monkeypatch, 6)
    assert main(["run", *sets, "--out", str(out)]) == 130
    assert "round 4 of 6 is checkpointed" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert main(["run", *sets, "--out", str(straight)]) == 0
    assert [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6]
    resumed, uninterrupted = ({k: v for k, v in json.loads((d / "summary.json").read_text()).items()
                               if k != "timing"} for d in (out, straight))  # fmt: skip
    assert resumed == uninterrupted
