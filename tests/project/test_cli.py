"""The command line: results on disk, determinism, and one-line errors for bad input."""

import gzip
import json
import struct
from pathlib import Path

import pytest
import torch
import yaml

from pflbed.cli import main
from pflbed.config import load_config

FAST = [
    "--set", "dataset.name=synthetic", "--set", "model.name=mlp", "--set", "federation.clients=5",
    "--set", "train.rounds=3", "--set", "eval.every=1", "--set", "executor.strict=true", "--no-progress",
]  # fmt: skip


def test_run_writes_config_metrics_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert any("FedAvg+FT" in line for line in printed)  # the results table
    assert printed[-1] == f"results: {out}" and not [x for x in printed if x.startswith("[")]  # --no-progress
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2, 3]
    s = json.loads((out / "summary.json").read_text())
    assert {"algorithm", "dataset", "seed", "rounds", "final", "selected", "timing"} <= set(s)
    for k in ("gfl_acc", "pfl_acc", "pfl_acc_std", "pfl_acc_min", "pfl_acc_p10"):
        assert 0.0 <= s["final"][k] <= 1.0
    assert set(s["selected"]) >= {"round", "gfl_acc", "pfl_acc"}
    assert set(s["timing"]) >= {"wall_s", "train_s", "eval_s"}
    assert "train:\n  rounds: 3" in (out / "config.yaml").read_text()


def test_metrics_csv_holds_every_record_with_nested_values_as_columns(tmp_path):
    """metrics.csv = metrics.jsonl as a table: one row per record, nested values (diagnostics) as dotted columns, a
    column that appears only in a later record included (empty before)."""
    import csv

    out = tmp_path / "run"
    assert main(["run", *FAST, "--set", "algorithm.name=fedselect", "--out", str(out)]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["round"]) for r in rows] == [r["round"] for r in records] == [1, 2, 3]
    for rec, row in zip(records, rows, strict=True):
        assert float(row["pfl_acc"]) == rec["pfl_acc"]
        for k, v in rec["diag"]["personal_fraction"].items():  # nested two deep
            assert float(row[f"diag.personal_fraction.{k}"]) == v
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:1]))
    from pflbed.results.rundir import RunDir

    RunDir(out).log({**records[1], "failed_clients": {"2": [0, 3]}})
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [r["failed_clients.2"] for r in rows] == ["", "[0, 3]"]


def _without_timing(path):
    s = json.loads(path.read_text())
    s.pop("timing")
    return json.dumps(s, indent=2)


def test_same_config_and_seed_give_identical_summary(tmp_path):
    for name in ("a", "b"):
        assert main(["run", *FAST, "--out", str(tmp_path / name)]) == 0
    assert _without_timing(tmp_path / "a" / "summary.json") == _without_timing(tmp_path / "b" / "summary.json")
    assert main(["run", *FAST, "--set", "seed=1", "--out", str(tmp_path / "c")]) == 0
    assert _without_timing(tmp_path / "a" / "summary.json") != _without_timing(tmp_path / "c" / "summary.json")


def _write_idx(path, magic_dims, payload):
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">I", magic_dims[0]) + b"".join(struct.pack(">I", d) for d in magic_dims[1:]) + payload)


@pytest.fixture
def corrupt_fmnist(tmp_path):
    d = tmp_path / "fm"
    d.mkdir()
    for split, n in (("train", 20), ("t10k", 10)):
        _write_idx(d / f"{split}-images-idx3-ubyte.gz", (0x0803, n, 28, 28), bytes(n * 28 * 28 - 5))  # truncated
        _write_idx(d / f"{split}-labels-idx1-ubyte.gz", (0x0801, n), bytes(n))
    return d


BAD = {
    "unknown key": (["--set", "train.epochs=3"], "train.epochs: unknown key"),
    "wrong type": (["--set", "train.lr=fast"], "train.lr"),
    "alpha <= 0": (["--set", "federation.alpha=0"], "federation.alpha"),
    "more clients than samples": (["--set", "federation.clients=5000"], "federation.clients"),
    "unknown algorithm": (["--set", "algorithm.name=nope"], "algorithm.name"),
    "unknown algorithm option": (["--set", "algorithm.mu=0.1"], "algorithm.mu: unknown key"),
    "missing data dir": (["--set", "dataset.name=fmnist", "--set", "dataset.path=/nonexistent/fm"], "/nonexistent/fm"),
    "bad override": (["--set", "train.lr"], "train.lr"),
    # out of the documented ranges
    "threads beyond 4 × cores": (["--set", "executor.threads=1000000"], "executor.threads"),
    "unknown device": (["--set", "executor.device=gpu"], "executor.device: must be cpu, cuda, cuda:N"),
    # cuda:<device count> exists on no machine; with no CUDA at all (cuda:0 here) the message says so
    "GPU this machine lacks": (["--set", f"executor.device=cuda:{torch.cuda.device_count()}"], "executor.device: "),
    "batch size beyond int32": (["--set", "train.batch_size=100000000000000000000"], "train.batch_size"),
    "infinite alpha": (["--set", "federation.alpha=.inf"], "federation.alpha"),
    "lr read as inf": (["--set", "train.lr=1.0e+400"], "train.lr"),
    "nan lr": (["--set", "train.lr=.nan"], "train.lr"),
    "negative seed": (["--set", "seed=-1"], "seed"),
    "more labels per client than classes": (
        ["--set", "federation.partition=classes", "--set", "federation.classes_per_client=11"],
        "federation.classes_per_client",
    ),
    "non-finite algorithm option": (["--set", "algorithm.name=fedrod", "--set", "algorithm.personal_lr=.inf"],
                                    "algorithm.personal_lr"),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capsys):
    extra, expected = BAD[case]
    out = tmp_path / "run"
    assert main(["run", *FAST, *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("pflbed: error:") and expected in err, err
    assert not out.exists()


def test_corrupt_data_file_is_named(corrupt_fmnist, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--set", "dataset.name=fmnist", "--set", f"dataset.path={corrupt_fmnist}"]
    assert main(["run", *FAST, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "images-idx3-ubyte.gz" in err
    assert not out.exists()


def test_config_file_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    assert main(["run", "-c", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
    assert main(["run", "-c", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    nested = tmp_path / "nested.yaml"
    nested.write_text("federation:\n  clients: many\n")
    assert main(["run", "-c", str(nested)]) == 2
    assert "federation.clients" in capsys.readouterr().err


def test_out_dir_holding_another_run_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    before = (out / "summary.json").read_text()
    assert main(["run", *FAST, "--set", "seed=3", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "different config" in err and str(out) in err
    assert (out / "summary.json").read_text() == before
    for damaged in ("- 1\n", "a: [\n"):  # a config.yaml no run wrote is another config's (a list was a traceback)
        (out / "config.yaml").write_text(damaged)
        assert main(["run", *FAST, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"pflbed: error: --out {out}: holds a run of a different config; choose another --out (or " \
                      "pass --force to replace it)"


def test_data_list(capsys):
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "digits" in out and "synthetic" in out


def test_data_show_prints_partition_and_writes_heatmap(tmp_path, capsys):
    png = tmp_path / "p.png"
    args = ["--set", "dataset.name=digits-rot4", "--set", "federation.protocol=pflbed",
            "--set", "federation.pflbed.clients_per_domain=2",
            "--set", "federation.pflbed.new_clients_per_domain=1"]  # fmt: skip
    assert main(["data", "show", *args, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rot270" in out and "new" in out and "class-balanced" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "c.yaml").write_text("dataset: {name: digits-rot4}\n")  # the same from a file, and --set over it
    assert main(["data", "show", "-c", str(tmp_path / "c.yaml"), *args[2:]]) == 0
    assert capsys.readouterr().out == out.rpartition("heat-map: ")[0]


# --- unsafe run directories, failures mid-run --------------------------------------------------------------------
def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("pflbed: error:"), err
    return err


def test_config_file_that_is_not_utf8_is_named(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("train:\n  rounds: 3 # r\xe9sum\xe9\n".encode("latin-1"))
    assert main(["run", "-c", str(bad), "--out", str(tmp_path / "run")]) == 2
    assert str(bad) in _one_error_line(capsys) and not (tmp_path / "run").exists()


def test_out_under_an_existing_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run"
    assert main(["run", *FAST, "--out", str(out)]) == 2
    assert "is a file" in _one_error_line(capsys)


def test_unwritable_out_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import pflbed.results.rundir as rundir

    # Root ignores permission bits, so simulate both ways a location can be unwritable: access() says no
    # (read-only mount), or creating the directory fails anyway.
    monkeypatch.setattr(rundir.os, "access", lambda *a: False)
    assert main(["run", *FAST, "--out", str(tmp_path / "ro" / "run")]) == 2
    assert "not writable" in _one_error_line(capsys)
    monkeypatch.undo()

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(rundir.Path, "mkdir", refuse)
    assert main(["run", *FAST, "--out", str(tmp_path / "ro2")]) == 2
    assert "cannot write" in _one_error_line(capsys)
    assert not (tmp_path / "ro2").exists()


def test_finished_run_is_never_overwritten_silently(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    before = (out / "summary.json").read_bytes()
    capsys.readouterr()
    assert main(["run", *FAST, "--out", str(out)]) == 2  # the very same command again
    err = _one_error_line(capsys)
    assert "finished" in err and "--force" in err
    assert (out / "summary.json").read_bytes() == before
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0  # resume: says so, changes nothing
    assert "already finished" in capsys.readouterr().out
    assert (out / "summary.json").read_bytes() == before
    # --set alone changes the run's own config (where the run may run differently), not the defaults
    assert main(["run", "--resume", str(out), "--set", "executor.threads=1", "--no-progress"]) == 0
    assert "already finished" in capsys.readouterr().out
    summary = json.loads(before)
    (out / "summary.json").write_text(json.dumps({**summary, "selected": [1]}))  # hand-edited: was a traceback
    assert main(["run", "--resume", str(out), "--no-progress"]) == 2
    assert _one_error_line(capsys).startswith(f"pflbed: error: {out / 'summary.json'}: its results cannot be printed "
                                              "(TypeError: ")  # fmt: skip
    (out / "summary.json").write_bytes(before)
    for flags, said in ((["--out", str(tmp_path / "other")], "--out and --resume name different directories; "
                         "--resume continues in place"),
                        (["--force"], "--force and --resume contradict each other: --force starts over, --resume "
                         "continues")):  # fmt: skip
        assert main(["run", "--resume", str(out), *flags]) == 2
        assert _one_error_line(capsys) == f"pflbed: error: {said}"
    assert main(["run", "--resume", str(out), "--out", str(out), "--no-progress"]) == 0  # the same directory
    assert main(["run", *FAST, "--set", "seed=1", "--out", str(out), "--force"]) == 0  # explicit: replaced
    assert json.loads((out / "summary.json").read_text())["seed"] == 1


def test_unfinished_run_points_to_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    (out / "summary.json").unlink()  # as if killed after the last checkpoint
    assert main(["run", *FAST, "--out", str(out)]) == 2
    assert "--resume" in _one_error_line(capsys)


def test_resuming_a_finished_run_whose_summary_is_damaged_is_one_line(tmp_path, capsys):
    """`--resume` on a finished run prints its table; a summary.json without a run's keys (damaged, or a
    pretraining's beside a config.yaml that reads as a run's) was a KeyError traceback."""
    out = tmp_path / "run"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(out)]) == 0
    assert "already finished: nothing to resume, nothing changed" in capsys.readouterr().out
    for text, why in (('{"epochs": []}', "no algorithm (str) in it, as every pflbed summary has"),
                      ('{"algorithm":', "not valid JSON (Expecting value, line 1)")):
        (out / "summary.json").write_text(text)
        assert main(["run", "--resume", str(out)]) == 2
        assert _one_error_line(capsys) == (f"pflbed: error: {out / 'summary.json'}: {why}; the file is damaged "
                                           "(rerun the run, or restore the file)")  # fmt: skip


def test_final_state_is_saved_and_loads_without_pickled_code(tmp_path):
    import torch

    out = tmp_path / "run"
    assert main(["run", *FAST, "--set", "train.checkpoint_every=10", "--out", str(out)]) == 0  # 3 rounds < 10
    blob = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert blob["round"] == 3 and blob["server"] and len(blob["clients"]) > 0


def test_corrupt_checkpoint_says_how_to_recover(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    (out / "summary.json").unlink()
    (out / "checkpoints" / "last.pt").write_bytes(b"not a checkpoint")
    assert main(["run", "--resume", str(out), "--no-progress"]) == 2
    err = _one_error_line(capsys)
    assert "unreadable checkpoint" in err and "delete" in err and "--resume" in err


def test_a_finished_run_s_corrupt_checkpoint_says_to_run_it_again_and_that_works(tmp_path, capsys, monkeypatch):
    """A finished run's checkpoint holds its trained models: `--resume` (the advice for an unfinished run) would say
    "already finished" and mend nothing; the advice is the run again, in place, which then serves."""
    import shlex

    import numpy as np

    monkeypatch.chdir(tmp_path)
    assert main(["run", *FAST, "--out", "run"]) == 0
    (tmp_path / "run" / "checkpoints" / "last.pt").write_bytes(b"not a checkpoint")
    gen = np.random.default_rng(0)
    np.savez(tmp_path / "mine.npz", x=gen.normal(size=(8, 8, 8)).astype(np.float32), y=np.arange(8) % 2)
    personalize = ["personalize", "run", "--data", "mine.npz", "--out", "mine", "--epochs", "1"]
    capsys.readouterr()
    assert main(personalize) == 2
    err = _one_error_line(capsys)
    assert err.endswith("; the finished run's models were in it: run it again with 'pflbed run -c run/config.yaml "
                        "--out run --force'")  # fmt: skip
    again = shlex.split(err.rsplit("run it again with ", 1)[1].strip("'"))
    assert main(again[1:]) == 0 and main(personalize) == 0


def test_diverging_run_stops_with_exit_3_naming_round_and_client(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*FAST, "--set", "train.rounds=6", "--set", "train.checkpoint_every=1"]
    assert main(["run", *args, "--set", "train.lr=1e4", "--out", str(out)]) == 3
    err = _one_error_line(capsys)
    assert "diverged in round 1" in err and "client" in err and "non-finite" in err
    assert not (out / "summary.json").exists()
    # Divergence after some good rounds: the metrics so far and the last good checkpoint are kept.
    out2 = tmp_path / "later"
    assert main(["run", *args, "--set", "train.lr=5", "--out", str(out2)]) == 3
    err = _one_error_line(capsys)
    rnd = int(err.split("diverged in round ")[1].split(":")[0])
    assert rnd > 1, "this lr should diverge after at least one good round"
    import torch

    logged = [json.loads(x)["round"] for x in (out2 / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, rnd))
    assert torch.load(out2 / "checkpoints" / "last.pt", weights_only=True)["round"] == rnd - 1
    assert not (out2 / "summary.json").exists()


def test_summary_records_provenance(tmp_path):
    import torch

    out = tmp_path / "run"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    p = json.loads((out / "summary.json").read_text())["provenance"]
    assert p["torch"] == torch.__version__ and p["device"] == "cpu" and p["cpu"]
    assert p["threads"] == 1  # the small-model default (engine.threads.choose_threads)


def test_clients_without_validation_data_are_evaluated(tmp_path):
    """Hundreds of tiny clients leave some with an empty validation split; the linear probe's shared-feature path
    then predicts an empty set, which must give an empty prediction, not a crash (seen with 10,000 clients)."""
    out = tmp_path / "run"
    args = ["--set", "federation.clients=300", "--set", "federation.min_size=5", "--set", "train.rounds=1",
            "--set", "federation.sample_fraction=0.02", "--set", "federation.val_fraction=0.05",
            "--set", "eval.finetune=[lp]"]  # fmt: skip
    assert main(["run", *FAST, *args, "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["final"]["lp"]["pfl_acc"] is not None


def test_divergence_guard_names_the_first_non_finite_tensor_and_ignores_integers():
    import torch

    from pflbed.engine.guard import check_client, check_server, first_nonfinite
    from pflbed.errors import DivergedError

    ok = {"a": torch.ones(2), "steps": torch.tensor(7)}
    assert first_nonfinite(ok) is None
    bad = {**ok, "c": torch.tensor([1.0, float("inf")]), "b": torch.tensor([float("nan")])}
    assert first_nonfinite(bad) == "b"
    with pytest.raises(DivergedError, match="round 4: the aggregated server state has non-finite values in 'b'"):
        check_server(4, bad)
    with pytest.raises(DivergedError, match="client 2's state"):
        check_client(4, 2, ok, bad)
    # The sum screen: opposite infinities (sum NaN) are caught; finite values whose sum overflows are not flagged.
    assert first_nonfinite({"x": torch.tensor([float("inf"), float("-inf")])}) == "x"
    assert first_nonfinite({"x": torch.full((4,), 3e38)}) is None
    assert first_nonfinite({"x": torch.tensor([60000.0, 60000.0, float("nan")], dtype=torch.float16)}) == "x"


# --- discovering algorithms and configs; piped output -----------------------------------------------------------
def test_algorithms_lists_every_algorithm_and_its_options_from_the_option_models(capsys):
    from pflbed.algorithms import ALGORITHMS

    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")}
    assert rows >= set(ALGORITHMS)
    assert main(["algorithms", "fedbasis"]) == 0
    out = capsys.readouterr().out
    tau = next(line for line in out.splitlines() if line.startswith("│ tau "))
    cells = [c.strip() for c in tau.split("│")[1:-1]]
    assert cells[:4] == ["tau", "float", "0.1", "> 0, ≤ 1"]
    assert "Learning Shareable Bases" in out  # the paper, from the algorithm file
    assert "SecAgg+ (sites.secagg): refused, because each client's update of the bases" in " ".join(out.split())
    assert main(["algorithms", "fedrep"]) == 0
    assert "SecAgg+ (sites.secagg): apply" in capsys.readouterr().out
    assert main(["algorithms", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown algorithm 'nope'" in err


def test_config_prints_the_resolved_config_that_validates_back(capsys):
    import yaml

    from pflbed.config import validate_config

    assert main(["config", "--defaults"]) == 0
    assert validate_config(yaml.safe_load(capsys.readouterr().out)) == validate_config({})
    assert main(["config", "--set", "train.rounds=7", "--set", "algorithm.name=fedper"]) == 0
    cfg = validate_config(yaml.safe_load(capsys.readouterr().out))
    assert cfg.train.rounds == 7 and cfg.algorithm.name == "fedper"
    for extra in (["--set", "train.rounds=7"], ["-c", "any.yaml"]):
        assert main(["config", "--defaults", *extra]) == 2
        assert capsys.readouterr().err == "pflbed: error: --defaults prints the defaults: leave out -c and --set\n"


def test_piped_output_does_not_wrap(capsys):
    """stdout is not a terminal here: table rows keep their content on one line, however long."""
    assert main(["data", "list"]) == 0
    assert any("rot0, rot90, rot180, rot270" in line for line in capsys.readouterr().out.splitlines())
    assert main(["algorithms"]) == 0
    fedavg = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("│ fedavg "))
    assert "Communication-Efficient Learning of Deep Networks from Decentralized Data" in fedavg


def test_redirected_output_logs_each_evaluation_and_stage_as_it_happens(tmp_path, capsys, monkeypatch):
    """stdout is not a terminal: one line per evaluation, and a start and an end line per stage after training."""
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "1e9")  # no heartbeat line in between, however slow the machine
    sets = ["--set", "train.rounds=4", "--set", "eval.every=2", "--set", "federation.new_clients=1",
            "--set", "eval.new_clients.epochs=1", "--set", "eval.new_clients.lrs=[0.05]"]  # fmt: skip
    assert main(["run", *[a for a in FAST if a != "--no-progress"], *sets, "--out", str(tmp_path / "r")]) == 0
    lines = [x.split("] ", 1)[1] for x in capsys.readouterr().out.splitlines() if x.startswith("[")]
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [x for x in lines if "evaluated" in x]
    assert [x.split("round ")[1].split("/")[0] for x in evaluated] == [str(r["round"]) for r in records]
    assert f"P-FL {100 * records[-1]['pfl_acc']:.1f}" in evaluated[-1]
    stages = [x.split(": ", 1)[1] for x in lines if "evaluated" not in x]
    names = ["fine-tuning every client (ft)", "fine-tuning every client (lp)", "personalizing 1 new clients",
             "artifacts"]  # fmt: skip
    assert [s.split(":")[0].rstrip("…") for s in stages] == [n for n in names for _ in (0, 1)]
    assert all(s.endswith("…") for s in stages[::2]) and all(": done in" in s for s in stages[1::2])


def test_a_run_without_out_goes_to_runs_named_by_algorithm_dataset_and_seed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", *FAST, "--set", "seed=3"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "results: runs/fedavg-synthetic-seed3"
    assert (tmp_path / "runs" / "fedavg-synthetic-seed3" / "summary.json").is_file()


def test_tensorboard_logs_every_number_of_every_record_at_its_round(tmp_path):
    pytest.importorskip("tensorboard")  # the tensorboard extra; CI installs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main(["run", *FAST, "--set", "algorithm.name=fedselect", "--set", "log.tensorboard=true",
                 "--out", str(out)]) == 0  # fmt: skip
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert "round" not in events.Tags()["scalars"] and "pfl_acc" in events.Tags()["scalars"]  # the step, not a curve
    for key, get in (("pfl_acc", lambda r: r["pfl_acc"]),
                     ("diag/personal_fraction/all", lambda r: r["diag"]["personal_fraction"]["all"])):  # fmt: skip
        points = [(e.step, e.value) for e in events.Scalars(key)]
        assert points == [(r["round"], pytest.approx(get(r))) for r in records]


def test_the_time_line_names_what_it_covers_and_adds_the_commands_time(tmp_path, capsys):
    """`timing.wall_s` leaves out the start-up (imports, data, Flower's runtime), so the line says what it covers
    and the CLI adds the command's own time, which includes it: never less than the run's."""
    assert main(["run", *FAST, "--out", str(tmp_path / "run")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("time: "))
    wall = json.loads((tmp_path / "run" / "summary.json").read_text())["timing"]["wall_s"]
    head, _, command = line.partition("; ")
    assert head.startswith(f"time: {wall:.1f} s wall in the rounds and final stages, "), line
    assert command.endswith(" s since the command started") and float(command.split()[0]) >= round(wall, 1), line


def test_the_commands_time_counts_from_the_process_start():
    """Run as the process's command (`main()` without argv), the clock starts with the process — on Linux from
    /proc/self/stat — so the interpreter's start and the imports before the CLI's first line count; called from
    Python with argv, it starts with the call."""
    import subprocess
    import sys

    code = ("import time; time.sleep(1.0)\n"
            "from pflbed.cli import command_clock\n"
            "print(command_clock(True)(), command_clock(False)())")  # fmt: skip
    whole, call = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                            check=True).stdout.split())  # fmt: skip
    if sys.platform.startswith("linux"):
        assert 1.0 <= whole < 30, whole
    assert call < 0.5


def test_the_command_clock_counts_from_the_process_start_else_the_cli_s_first_line_and_from_the_call_in_python(
        monkeypatch):  # fmt: skip
    import time

    from pflbed import cli

    monkeypatch.setattr(cli, "_CLI_START", time.monotonic() - 1e4)  # the CLI's first line ran 10,000 s ago
    monkeypatch.setattr(cli, "since_process_start", lambda: None)  # a process start the OS does not tell
    assert 1e4 <= cli.command_clock(True)() < 1e4 + 60 and cli.command_clock(False)() < 60
    monkeypatch.setattr(cli, "_CLI_START", time.monotonic())  # ... or just now: no second is made up
    assert cli.command_clock(True)() < 0.5
    monkeypatch.setattr(cli, "since_process_start", lambda: 2e4)  # the process started before it
    assert cli.command_clock(True)() == 2e4 and cli.command_clock(False)() < 60


_DRIVER = """
import json, sys
from pflbed.cli import main
seen = []
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    seen.append([code, sorted(m for m in ("torch", "numpy") if m in sys.modules)])
print(json.dumps(seen))
"""

LIGHT_MISTAKES = [  # every one is reported before torch or NumPy is imported
    (["run", "--set", "train.round=3"], "train.round: unknown key; did you mean train.rounds?"),
    (["run", "-c", "nope.yaml"], "nope.yaml: cannot read config (No such file or directory)"),
    (["run", "--set", "algorithm.name=fedavgg"], "algorithm.name: unknown algorithm 'fedavgg'; known: apfl, "),
    (["run", "--set", "model.name=cn"], "model.name: unknown model; known: alexnet_small, "),
    (["run", "--set", "executor.device=gpu"], "executor.device: must be cpu, cuda, cuda:N (N = 0, 1, …) or auto"),
    (["run", "--set", "federation.partition=dirichlett"], "(got 'dirichlett'); did you mean dirichlet?"),
    (["run", "--resume", "gone", "--set", "train.rounds=3"], "config.yaml: cannot read config"),
    (["config", "--set", "train.round=3"], "train.round: unknown key"),
    (["pretrain", "--set", "train.round=3", "--out", "pre"], "train.round: unknown key"),
    (["flower", "local", "--set", "train.round=3"], "train.round: unknown key"),
]


def test_config_mistakes_are_reported_before_torch_is_imported(tmp_path):
    """A config mistake is one line and exit 2, found before torch and NumPy load (a second or more), for every
    command that reads a config; an algorithm's option is checked by the algorithm registry, which the config
    reaches by itself (`pflbed.hooks`, in a process where nothing imported it), still one line, nothing written."""
    import subprocess
    import sys

    option = (["run", "--set", "algorithm.name=ditto", "--set", "algorithm.lamda=1", "--out", "run"],
              "algorithm.lamda: unknown key; did you mean algorithm.lam? Options of ditto: lam, ")  # fmt: skip
    cases = [*LIGHT_MISTAKES, option]
    done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([argv for argv, _ in cases])], cwd=tmp_path,
                          capture_output=True, text=True, check=True)  # fmt: skip
    errors = done.stderr.splitlines()
    assert len(errors) == len(cases), done.stderr
    for (argv, expected), err in zip(cases, errors, strict=True):
        assert err.startswith("pflbed: error: ") and expected in err, (argv, err)
    seen = json.loads(done.stdout)
    assert seen[:-1] == [[2, []]] * len(LIGHT_MISTAKES)
    assert seen[-1] == [2, ["numpy", "torch"]]  # the registry knows the options: torch is loaded by then
    assert list(tmp_path.iterdir()) == []


def test_a_time_line_without_the_commands_time_says_the_start_up_is_not_counted():
    from pflbed.results.summary import time_line

    timing = {"wall_s": 12.34, "train_s": 5.06, "eval_s": 2.51, "s_per_round": 1.234}
    assert time_line(timing) == ("time: 12.3 s wall in the rounds and final stages (start-up not counted), 5.1 s "
                                 "training (1.23 s/round), 2.5 s evaluation")  # fmt: skip
    assert time_line(timing, 70.26).endswith("2.5 s evaluation; 70.3 s since the command started")


def test_every_subcommands_help_says_what_it_does(capsys):
    """`pflbed X --help` (nested ones too) opens with a description: `tune`'s its protocol in a few lines, the others
    their one-line help — argparse shows nothing there unless told."""
    import argparse

    from pflbed.cli import _parser

    def commands(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield [*path, name], sub
                    yield from commands(sub, [*path, name])

    found = list(commands(_parser(), []))
    assert len(found) >= 12
    for path, sub in found:
        assert sub.description, path
        with pytest.raises(SystemExit):
            main([*path, "--help"])
        out = capsys.readouterr().out
        assert " ".join(sub.description.split()[:4]) in " ".join(out.split()), path
    assert "never a test one" in _parser()._subparsers._group_actions[0].choices["tune"].description


@pytest.mark.parametrize("command", [["run"], ["config"], ["pretrain", "--out", "pre"], ["bench"], ["tune"]])
@pytest.mark.parametrize("kind", ["binary", "too large", "endless", "a directory"])
def test_a_config_or_suite_that_is_not_yaml_text_is_one_line(command, kind, tmp_path, monkeypatch, capsys):
    """Every command reading a config or suite file refuses one that is not YAML text in one line naming it: a
    binary file was a UnicodeDecodeError traceback (bench, tune), and `-c /dev/zero` read until the machine's
    memory was gone. The read stops one byte past the limit, so the endless file is refused as the too large one."""
    from pflbed.config.load import MAX_YAML_BYTES

    monkeypatch.chdir(tmp_path)
    large = f"larger than {MAX_YAML_BYTES // 2**20} MB; a {{what}} is a YAML text file"
    path, expected = {
        "binary": (tmp_path / "b.yaml", "not UTF-8 text (byte 1); a {what} is a YAML text file"),
        "too large": (tmp_path / "big.yaml", large),
        "endless": (Path("/dev/zero"), large),
        "a directory": (tmp_path / "dir", "cannot read {what} (Is a directory)"),
    }[kind]
    if kind == "binary":
        path.write_bytes(b"a\xff\xfe: 1\n")
    elif kind == "too large":
        path.write_bytes(b"# " + b"x" * MAX_YAML_BYTES + b"\n")
    elif kind == "a directory":
        path.mkdir()
    what = "suite" if command[0] in ("bench", "tune") else "config"
    if kind == "a directory" and command == ["bench"]:  # bench reads a suite's results directory: not this one
        expected = "a directory without suite.yaml; give a suite file or the results directory of one (`pflbed " \
                   "bench` writes its suite there)"
    assert main([*command, "-c", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pflbed: error: {path}: {expected.format(what=what)}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"b.yaml", "big.yaml", "dir"} & {path.name})


@pytest.mark.parametrize(("argv", "expected"), [
    (["bench", "--max-cells", "-1"], "argument --max-cells: must be 0 or more, got '-1'"),
    (["bench", "--max-cells", "x"], "argument --max-cells: expected a whole number, got 'x'"),
    (["bench", "--jobs", "0"], "argument --jobs: must be 1 to {top} (4 × this machine's cores), got '0'"),
    (["bench", "--jobs", "-1"], "argument --jobs: must be 1 to {top} (4 × this machine's cores), got '-1'"),
    (["tune", "--jobs", "x"], "argument --jobs: expected a whole number, got 'x'"),
    (["bench", "--jobs", "{over}"], "argument --jobs: must be 1 to {top} (4 × this machine's cores), got '{over}'"),
    (["tune", "--max-trials", "-2"], "argument --max-trials: must be 0 or more, got '-2'"),
    (["tune", "--jobs", "{over}"], "argument --jobs: must be 1 to {top} (4 × this machine's cores), got '{over}'"),
])  # fmt: skip
def test_counts_of_cells_trials_and_jobs_are_bounded(argv, expected, tmp_path, capsys):
    """`--max-cells -1` ran every cell but the last (a slice from the end); `--jobs 100000` started a worker process,
    each with its torch, per cell until the memory was gone. Both are refused before the suite is read."""
    from pflbed.config.base import max_threads

    top = max_threads()
    argv = [a.format(over=top + 1) for a in argv]
    with pytest.raises(SystemExit, match="2"):
        main([argv[0], "-c", str(tmp_path / "none.yaml"), *argv[1:]])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(expected.format(top=top, over=top + 1))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("command", "given", "said"), [
    (["run"], "suite", "a bench suite, not a run config: give it to `pflbed bench -c '{path}'`"),
    (["config"], "tune", "a tune suite, not a run config: give it to `pflbed tune -c '{path}'`"),
    (["pretrain", "--out", "pre"], "suite", "a bench suite, not a run config: give it to `pflbed bench -c '{path}'`"),
    (["bench"], "config", "a run config, not a bench suite: give it to `pflbed run -c '{path}'`"),
    (["bench"], "tune", "a tune suite (it has tune), not a bench suite: give it to `pflbed tune -c '{path}'`"),
    (["tune"], "config", "a run config, not a tune suite: give it to `pflbed run -c '{path}'`"),
    (["bench"], "full config", "a run config, not a bench suite: give it to `pflbed run -c '{path}'`"),  # every key
    (["tune"], "suite", "a bench suite (it has tables), not a tune suite: give it to `pflbed bench -c '{path}'`"),
])  # fmt: skip
def test_another_command_s_file_is_named_with_the_command_it_is_for(command, given, said, tmp_path, monkeypatch,
                                                                    capsys):  # fmt: skip
    """A suite given to `pflbed run` was "name: unknown key", a run config given to `pflbed bench` "name: Field
    required": neither said what the file is. Each says which command takes it (the path quoted for a shell)."""
    monkeypatch.chdir(tmp_path)
    trees = {"config": {"train": {"rounds": 2}, "dataset": {"name": "digits"}},
             "suite": {"name": "s", "tables": {"t": {"methods": {"A": {}}}}},
             "tune": {"name": "s", "tune": {"budget": 1}, "methods": {"A": {}}},
             "full config": load_config().to_dict()}  # fmt: skip
    path = tmp_path / "my file.yaml"
    path.write_text(yaml.safe_dump(trees[given]))
    assert main([*command, "-c", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"pflbed: error: {path}: {said.format(path=path)}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my file.yaml"]
