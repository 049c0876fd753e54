"""Run directories (results/rundir.py) on fabricated files, nothing trained: the readers' one-line errors naming the
damaged file, which config keys a resumed run may change (`PLACEMENT`, the in-process executors), every refusal of
`--out` word for word (the user's only guide), and the files a run writes (config.yaml, metrics.jsonl / .csv,
summary.json) byte for byte."""

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from pflbed.config import validate_config
from pflbed.errors import PflbedError
from pflbed.results import rundir as rundir_mod
from pflbed.results.rundir import (
    IN_PROCESS,
    PLACEMENT,
    SUMMARY_KEYS,
    RunDir,
    _flat,
    _placed_anywhere,
    atomic_write,
    config_text,
    default_out,
    read_config_tree,
    read_json,
    read_jsonl,
    read_metrics,
    read_summary,
    require_run,
    run_config,
    same_config,
    suite_dir,
)

DAMAGED = "the file is damaged (rerun the run, or restore the file)"


def _cfg(**executor):
    return validate_config({"train": {"rounds": 3}, "executor": executor})


def _saved(tmp_path, cfg, name="run"):
    """A run directory holding `cfg`'s config.yaml, as `RunDir.start` leaves it (unfinished, no metrics yet)."""
    run = tmp_path / name
    run.mkdir()
    (run / "config.yaml").write_text(config_text(cfg))
    return run


def _bytes(path) -> str:
    """The file's text as written (read_text would turn a CSV's \\r\\n into \\n)."""
    return path.read_bytes().decode()


def _refused(call, *args, **kwargs) -> str:
    with pytest.raises(PflbedError) as e:
        call(*args, **kwargs)
    return str(e.value)


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine without CUDA, whatever it has: a GPU run's config then loads on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# --- reading run files --------------------------------------------------------------------------------------------
def test_read_json_names_the_damaged_file_and_the_line(tmp_path):
    """A truncated summary.json is one line naming the file, JSON's reason and the line, not a traceback."""
    f = tmp_path / "summary.json"
    f.write_text('{"rounds": 3}')
    assert read_json(f) == {"rounds": 3}
    f.write_text('{\n  "rounds": 3,\n')
    assert _refused(read_json, f) == (f"{f}: not valid JSON (Expecting property name enclosed in double quotes, "
                                      f"line 3); {DAMAGED}")  # fmt: skip
    f.write_text("[1, 2]")
    assert _refused(read_json, f) == f"{f}: a JSON list, not an object; {DAMAGED}"
    f.write_bytes(b'{"a": "\xff"}')
    assert _refused(read_json, f) == f"{f}: not text; {DAMAGED}"


SUMMARY = {"algorithm": "fedavg", "dataset": "digits", "rounds": 3, "final": {"pfl_acc": 0.5}, "timing": {}}


def test_summary_keys_and_their_types():
    """What every reader of summary.json takes, and of which type."""
    assert list(SUMMARY_KEYS.items()) == [("algorithm", str), ("dataset", str), ("rounds", int), ("final", dict),
                                          ("timing", dict)]  # fmt: skip


@pytest.mark.parametrize(("key", "value", "kind"), [
    ("algorithm", None, "str"), ("algorithm", 1, "str"), ("dataset", None, "str"), ("rounds", "3", "int"),
    ("rounds", 3.0, "int"), ("rounds", None, "int"), ("final", None, "dict"), ("final", [0.5], "dict"),
    ("timing", None, "dict"), ("timing", 1.0, "dict"),
])  # fmt: skip
def test_a_summary_without_a_key_of_its_type_is_refused(tmp_path, key, value, kind):
    """Each key of SUMMARY_KEYS, missing (None: left out) or of another type, is a damaged summary naming the key."""
    f = tmp_path / "summary.json"
    summary = {k: v for k, v in SUMMARY.items() if k != key or value is not None}
    if value is not None:
        summary[key] = value
    f.write_text(json.dumps(summary))
    assert _refused(read_summary, f) == f"{f}: no {key} ({kind}) in it, as every pflbed summary has; {DAMAGED}"


def test_a_whole_summary_is_read_as_written(tmp_path):
    f = tmp_path / "summary.json"
    f.write_text(json.dumps({**SUMMARY, "seed": 4}))
    assert read_summary(f) == {**SUMMARY, "seed": 4}


def test_read_jsonl_skips_blank_lines_and_names_the_bad_line(tmp_path):
    """Blank lines are skipped but still counted: the message's line is the one an editor shows."""
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"round": 1}\n\n{"round": 2}\n')
    assert read_jsonl(f) == [{"round": 1}, {"round": 2}]
    f.write_text('{"round": 1}\n\n{"round": 2\n')
    assert _refused(read_jsonl, f) == f"{f}: line 3 is not valid JSON (Expecting ',' delimiter); {DAMAGED}"
    f.write_text('{"round": 1}\n[1, 2]\n')
    assert _refused(read_jsonl, f) == f"{f}: line 2 is a JSON list, not an object; {DAMAGED}"
    f.write_text('{"round": 1}\n3\n')
    assert _refused(read_jsonl, f) == f"{f}: line 2 is a JSON int, not an object; {DAMAGED}"
    f.write_bytes(b'{"round": 1}\n\xff\n')
    assert _refused(read_jsonl, f) == f"{f}: not text; {DAMAGED}"


def test_read_metrics_wants_a_round_in_every_record(tmp_path):
    """The record's number counts records, not lines (a blank line before it is not one)."""
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"round": 2, "pfl_acc": 0.5}\n\n{"round": 4}\n')
    assert read_metrics(f) == [{"round": 2, "pfl_acc": 0.5}, {"round": 4}]
    for bad in ('{"pfl_acc": 0.5}', '{"round": "4"}', '{"round": 4.0}'):
        f.write_text(f'{{"round": 2}}\n\n{bad}\n')
        assert _refused(read_metrics, f) == (f"{f}: record 2 has no round (int), as every pflbed evaluation record "
                                             f"has; {DAMAGED}")  # fmt: skip


def test_read_config_tree_names_the_file_and_the_yaml_line(tmp_path):
    f = tmp_path / "config.yaml"
    f.write_text("train:\n  rounds: 3\n")
    assert read_config_tree(f) == {"train": {"rounds": 3}}
    f.write_text("")
    assert read_config_tree(f) == {}  # an empty file: no sections, every default
    f.write_text("train:\n  rounds: 3\n  lr: [0.1\nseed: 1\n")
    assert _refused(read_config_tree, f) == f"{f}: not valid YAML (line 4); {DAMAGED}"
    f.write_text("a: \x07\n")  # the reader's error has no line mark
    assert _refused(read_config_tree, f) == f"{f}: not valid YAML; {DAMAGED}"
    f.write_text("- 1\n- 2\n")
    assert _refused(read_config_tree, f) == f"{f}: a YAML list, not a mapping of config sections; {DAMAGED}"
    f.write_text("3\n")
    assert _refused(read_config_tree, f) == f"{f}: a YAML int, not a mapping of config sections; {DAMAGED}"
    f.write_bytes(b"seed: \xff\n")
    assert _refused(read_config_tree, f) == f"{f}: not text; {DAMAGED}"


def test_default_out_and_config_text():
    """config.yaml keeps the config's own key order (seed first), and reads back as the same config."""
    cfg = validate_config({"seed": 4, "algorithm": {"name": "fedper"}, "dataset": {"name": "synthetic"}})
    assert default_out(cfg) == Path("runs") / "fedper-synthetic-seed4"
    text = config_text(cfg)
    assert text.startswith("seed: 4\ndataset:\n  name: synthetic\n")
    assert validate_config(yaml.safe_load(text)) == cfg


# --- which configs are the same run ------------------------------------------------------------------------------
def test_placement_keys():
    assert PLACEMENT == ("device", "threads", "workers", "batch_clients", "compile", "deterministic", "autotune")
    assert IN_PROCESS == ("auto", "loop", "procs")


@pytest.mark.parametrize(("key", "saved", "now"), [
    ("device", "cpu", "auto"), ("threads", 1, 2), ("workers", 1, 2), ("batch_clients", True, False),
    ("compile", "default", "off"), ("deterministic", True, False), ("autotune", False, True),
])  # fmt: skip
def test_each_placement_key_may_differ_when_resuming(tmp_path, key, saved, now):
    """Where a run computes, not what: a run started with e.g. executor.threads=1 is the same run with threads=2,
    found by `check(resume=True)` and `for_resume`, which continue with the new value."""
    run = _saved(tmp_path, _cfg(name="loop", **{key: saved}))
    cfg = _cfg(name="loop", **{key: now})
    assert same_config(run / "config.yaml", cfg)
    assert RunDir.check(run, cfg, resume=True).path == run
    rd, resumed = RunDir.for_resume(run, cfg)
    assert rd.path == run and getattr(resumed.executor, key) == now and resumed == cfg


@pytest.mark.parametrize(("key", "saved", "now"), [
    ("precision", "fp32", "bf16"), ("strict", False, True), ("batch_max_clients", None, 4),
])  # fmt: skip
def test_other_executor_keys_may_not_differ(tmp_path, key, saved, now):
    """Keys that change the figures are the experiment: another value is another config."""
    run = _saved(tmp_path, _cfg(name="loop", **{key: saved}))
    assert not same_config(run / "config.yaml", _cfg(name="loop", **{key: now}))


@pytest.mark.parametrize(("saved", "now"), [("auto", "loop"), ("loop", "procs"), ("procs", "auto"), ("loop", "auto")])
def test_in_process_executors_interchange(tmp_path, saved, now):
    """auto, loop and procs give the same figures: a run may continue on another, and then runs on that one."""
    run = _saved(tmp_path, _cfg(name=saved))
    cfg = _cfg(name=now)
    assert same_config(run / "config.yaml", cfg)
    assert RunDir.for_resume(run, cfg)[1].executor.name == now


def test_flower_and_an_in_process_executor_are_different_runs(tmp_path):
    pytest.importorskip("flwr")
    run = _saved(tmp_path, _cfg(name="flower"))
    assert not same_config(run / "config.yaml", _cfg(name="loop"))
    assert same_config(run / "config.yaml", _cfg(name="flower", threads=2))
    loop = _saved(tmp_path, _cfg(name="loop"), "loop")
    assert not same_config(loop / "config.yaml", _cfg(name="flower"))


def test_placed_anywhere_drops_placement_and_in_process_names_only():
    """The comparison key of a config tree: its placement keys gone, and the executor's name unless it is Flower."""
    tree = {"seed": 1, "executor": {"name": "procs", "precision": "bf16", **{k: 1 for k in PLACEMENT}}}
    assert _placed_anywhere(tree) == {"seed": 1, "executor": {"precision": "bf16"}}
    assert tree["executor"]["name"] == "procs" and len(tree["executor"]) == 9  # the caller's tree is left alone
    for name in IN_PROCESS:
        assert _placed_anywhere({"executor": {"name": name}}) == {"executor": {}}
    assert _placed_anywhere({"executor": {"name": "flower", "threads": 2}}) == {"executor": {"name": "flower"}}
    assert _placed_anywhere({"seed": 1}) == {"seed": 1, "executor": {}}
    assert _placed_anywhere({"executor": None}) == {"executor": {}}
    assert _placed_anywhere({"executor": {"strict": True}}) == {"executor": {"strict": True}}


def test_same_config_is_false_for_a_missing_damaged_or_invalid_file(tmp_path):
    cfg = _cfg()
    assert not same_config(tmp_path / "config.yaml", cfg)  # missing: OSError
    (tmp_path / "config.yaml").write_text("- 1\n")
    assert not same_config(tmp_path / "config.yaml", cfg)  # damaged
    (tmp_path / "config.yaml").write_text("train:\n  rounds: many\n")
    assert not same_config(tmp_path / "config.yaml", cfg)  # invalid
    (tmp_path / "config.yaml").write_text("train:\n  rounds: 3\n")
    assert same_config(tmp_path / "config.yaml", cfg)  # only what differs from the defaults: still the same


def test_run_config_without_placement_loads_a_gpu_run_on_the_cpu(no_cuda):
    """A saved device this machine lacks becomes `cpu`; one it has (cpu, auto) is kept; nothing else changes."""
    tree = {"seed": 2, "executor": {"device": "cuda", "threads": 3, "name": "procs"}}
    cfg = run_config(tree)
    assert cfg == validate_config({"seed": 2, "executor": {"device": "cpu", "threads": 3, "name": "procs"}})
    assert tree["executor"]["device"] == "cuda"  # the caller's tree is left alone
    assert run_config({"executor": {"device": "cuda:3"}}).executor.device == "cpu"
    assert run_config({"executor": {"device": "auto"}}).executor.device == "auto"
    assert run_config({"seed": 5}) == validate_config({"seed": 5})


def test_run_config_with_placement_takes_its_placement_keys(no_cuda):
    """Each PLACEMENT key comes from `placement` (a saved GPU device included), every other key from the run."""
    saved = {"seed": 2, "executor": {"name": "loop", "device": "cuda", "threads": 1, "workers": 1,
                                     "batch_clients": True, "compile": "default", "deterministic": True,
                                     "autotune": False, "precision": "bf16"}}  # fmt: skip
    now = _cfg(name="procs", device="auto", threads=2, workers=3, batch_clients=False, deterministic=False,
               autotune=True)
    got = run_config(saved, now)
    assert got.seed == 2 and got.executor.precision == "bf16"
    assert {k: getattr(got.executor, k) for k in ("name", *PLACEMENT)} == {
        "name": "procs", "device": "auto", "threads": 2, "workers": 3, "batch_clients": False, "compile": "off",
        "deterministic": False, "autotune": True,
    }


def test_run_config_with_placement_changes_only_an_in_process_name():
    """A run without a saved name (auto) takes the new in-process name; Flower is never swapped in or out."""
    assert run_config({"seed": 1}, _cfg(name="procs")).executor.name == "procs"
    assert run_config({"executor": {"name": "loop"}}, _cfg(name="auto")).executor.name == "auto"
    pytest.importorskip("flwr")
    assert run_config({"executor": {"name": "flower"}}, _cfg(name="loop")).executor.name == "flower"
    assert run_config({"executor": {"name": "loop"}}, _cfg(name="flower")).executor.name == "loop"


# --- RunDir.check: every refusal of --out ---------------------------------------------------------------------------
def test_check_accepts_a_new_or_empty_directory_and_creates_nothing(tmp_path):
    cfg = _cfg()
    new = tmp_path / "a" / "b" / "run"
    run = RunDir.check(new, cfg)
    assert isinstance(run, RunDir) and run.path == new and not (tmp_path / "a").exists()
    (tmp_path / "empty").mkdir()
    assert RunDir.check(tmp_path / "empty", cfg, force=False).path == tmp_path / "empty"
    assert os.listdir(tmp_path / "empty") == []


def test_check_refuses_a_file_and_a_path_under_a_file(tmp_path):
    cfg = _cfg()
    f = tmp_path / "file"
    f.write_text("x")
    assert _refused(RunDir.check, f, cfg, force=True) == f"--out {f}: exists and is not a directory"
    deep = f / "a" / "run"
    assert _refused(RunDir.check, deep, cfg, force=True) == f"--out {deep}: {f} is a file, not a directory"


def test_check_refuses_an_unwritable_location_naming_the_nearest_existing_directory(tmp_path, monkeypatch):
    """The nearest existing directory (the path itself if it exists) must be writable and searchable. Root ignores
    permission bits, so `os.access` is what says no here."""
    calls = []

    def access(path, mode):
        calls.append((Path(path), mode))
        return Path(path) != tmp_path / "ro"

    monkeypatch.setattr(rundir_mod.os, "access", access)
    (tmp_path / "ro").mkdir()
    cfg = _cfg()
    for out in (tmp_path / "ro", tmp_path / "ro" / "a" / "run"):
        calls.clear()
        assert _refused(RunDir.check, out, cfg, force=True) == f"--out {out}: {tmp_path / 'ro'} is not writable"
        assert calls == [(tmp_path / "ro", os.W_OK | os.X_OK)]
    (tmp_path / "ro" / "ok").mkdir()
    assert RunDir.check(tmp_path / "ro" / "ok", cfg).path == tmp_path / "ro" / "ok"  # its own access decides


def test_check_refuses_a_non_empty_directory_holding_no_run_even_with_force(tmp_path):
    """--force removes an old run's files only: a directory of other files is never a run to replace."""
    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_text("x")
    for force in (False, True):
        assert _refused(RunDir.check, out, _cfg(), force=force) == (f"--out {out}: is a non-empty directory that "
                                                                    "holds no pflbed run")  # fmt: skip


def test_a_pretrained_or_personalized_model_s_directory_is_no_run_to_replace_or_resume(tmp_path, capsys):
    """A pretraining's directory holds a config.yaml that reads as a run's: `--force` took it and its summary.json
    and left the weights, and `--resume` printed a traceback. Its model.pt, which no run writes, says what it is."""
    cfg = _cfg()
    out = _saved(tmp_path, cfg, "pretrained")
    (out / "model.pt").write_bytes(b"weights")
    (out / "summary.json").write_text('{"epochs": []}')
    for force in (False, True):
        assert _refused(RunDir.check, out, cfg, force=force) == (f"--out {out}: holds a pretrained or personalized "
                                                                 "model (model.pt), not a run; choose another --out")
    assert _refused(RunDir.check, out, cfg, out_name="out") == (f"out {out}: holds a pretrained or personalized "
                                                                "model (model.pt), not a run; choose another out")
    assert _refused(RunDir.for_resume, out, None) == (f"--resume {out}: holds a pretrained or personalized model "
                                                      "(model.pt), not a run")  # fmt: skip
    assert _refused(require_run, out) == f"{out}: holds a pretrained or personalized model (model.pt), not a run"
    from pflbed.cli import main

    for argv in (["report", str(out), "-o", str(tmp_path / "r.html")], ["data", "new-client", str(out), "--out",
                 str(tmp_path / "nc")], ["personalize", str(out), "--data", "x.npz", "--out", str(tmp_path / "p")],
                 ["run", "--resume", str(out)]):  # a report of a "damaged" summary, a run "without a checkpoint"
        assert main(argv) == 2, argv
        said = capsys.readouterr().err
        assert said.endswith(f"{out}: holds a pretrained or personalized model (model.pt), not a run\n"), said
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.pt", "summary.json"]
    run = _saved(tmp_path, cfg, "a-run")
    assert require_run(run) == run
    assert _refused(require_run, tmp_path, "--resume") == f"--resume {tmp_path}: not a pflbed run directory (no " \
                                                          "config.yaml)"  # fmt: skip
    (out / "config.yaml").unlink()  # a personalization's: no config.yaml, so no run either
    assert _refused(RunDir.check, out, cfg, force=True) == f"--out {out}: is a non-empty directory that holds no " \
                                                            "pflbed run"  # fmt: skip


def test_a_directory_of_many_runs_given_for_one_says_where_its_runs_are(tmp_path):
    """`pflbed report DIR` / `personalize DIR` of a bench suite's results directory or a tune directory said only "no
    config.yaml": it names what it is and where its runs are. A directory with neither mark says no more."""
    bench, tune, trials, plain = (tmp_path / n for n in ("bench", "tune", "trials-only", "plain"))
    for d in (bench, tune, trials, plain):
        d.mkdir()
    (bench / "suite.yaml").write_text("name: s\n")
    (tune / "study.db").write_bytes(b"")
    (trials / "trials").mkdir()
    assert _refused(require_run, bench) == f"{bench}: not a pflbed run directory (no config.yaml): it is a bench " \
                                           f"suite's results directory, whose runs are {bench}/runs/<table>/" \
                                           "<setting>/<method>/seed<N>"  # fmt: skip
    for d in (tune, trials):
        assert _refused(require_run, d) == f"{d}: not a pflbed run directory (no config.yaml): it is a tune " \
                                           f"directory, whose trials are {d}/trials/<method>/trialNNNN and re-runs " \
                                           f"{d}/final/runs/…"  # fmt: skip
    assert _refused(require_run, plain) == f"{plain}: not a pflbed run directory (no config.yaml)"


def test_a_suite_s_directory_is_no_file_and_no_run_s_or_model_s_directory(tmp_path, capsys):
    """`bench` and `tune` wrote their tables, studies and trials among a run's files when the suite's out (or
    tune's --out) named a run; a file was a message about a cell's run directory or the study's database. A
    directory holding a config file alone (the user's own) is no run."""
    from pflbed.cli import main

    run = _saved(tmp_path, _cfg(), "run")
    (run / "metrics.jsonl").write_text("")
    model = _saved(tmp_path, _cfg(), "pretrained")
    (model / "model.pt").write_bytes(b"")
    personal = tmp_path / "personal"  # a personalization's: model.pt and summary.json, no config.yaml
    personal.mkdir()
    (personal / "model.pt").write_bytes(b"")
    (tmp_path / "file").write_text("")
    for path in (run, model, personal):
        for name in ("out", "--out"):
            assert _refused(suite_dir, path, name) == (f"{name} {path}: is a run's or a model's directory; give "
                                                       "the suite a directory of its own")  # fmt: skip
    assert _refused(suite_dir, tmp_path / "file") == f"out {tmp_path / 'file'}: is a file; give the suite a directory"
    assert _refused(suite_dir, tmp_path / "file" / "s", "--out") == f"--out {tmp_path / 'file' / 's'}: " \
                                                                   f"{tmp_path / 'file'} is a file, not a directory"
    own = _saved(tmp_path, _cfg(), "project")  # a config.yaml of the user's, no results
    assert suite_dir(own) == own and suite_dir(tmp_path / "new") == tmp_path / "new"
    suite = {"name": "s", "seeds": [0], "base": {"train": {"rounds": 1}},
             "tables": {"t": {"title": "t", "methods": {"FedAvg": {"set": {"algorithm.name": "fedavg"}}},
                              "report": {"P-FL": "final.pfl_acc"}}}}  # fmt: skip
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump({**suite, "out": str(run)}))
    before = sorted(p.name for p in run.iterdir())
    assert main(["bench", "-c", str(tmp_path / "suite.yaml")]) == 2
    assert capsys.readouterr().err == (f"pflbed: error: out {run}: is a run's or a model's directory; give the "
                                       "suite a directory of its own\n")  # fmt: skip
    tune = {"name": "s", "seeds": [0], "base": {"train": {"rounds": 1}}, "tune": {"budget": 1},
            "methods": {"FedAvg": {"set": {"algorithm.name": "fedavg"}}}}  # fmt: skip
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump(tune))
    assert main(["tune", "-c", str(tmp_path / "tune.yaml"), "--out", str(model)]) == 2
    assert capsys.readouterr().err == (f"pflbed: error: --out {model}: is a run's or a model's directory; give the "
                                       "suite a directory of its own\n")  # fmt: skip
    assert sorted(p.name for p in run.iterdir()) == before
    assert sorted(p.name for p in model.iterdir()) == ["config.yaml", "model.pt"]


def test_a_directory_is_held_by_one_run_at_a_time_from_its_start_or_its_resumption(tmp_path):
    """`hold` takes the directory (a lock of the kernel's on the directory itself: two holders in one process
    conflict as two processes do); `check`, `for_resume` and `hold` refuse while another holds it, and `start`
    takes it once the directory exists. Released, it is free again; a directory not made yet holds nothing."""
    said = "a run is in progress there, in another process; wait for it to end, or stop it first"
    cfg = _cfg()
    out = _saved(tmp_path, cfg)
    first = RunDir(out)
    first.hold()
    first.hold()  # again: still one hold, released at once below
    for refused in (lambda: RunDir.check(out, cfg, resume=True), lambda: RunDir.check(out, cfg, force=True),
                    lambda: RunDir.for_resume(out, None), lambda: RunDir(out).hold(),
                    lambda: RunDir(out).start(cfg)):  # fmt: skip
        assert _refused(refused) == f"{out}: {said}"
    assert (out / "config.yaml").read_text() == config_text(cfg)  # start removed nothing
    first.release()
    first.release()
    RunDir.check(out, cfg, resume=True).refuse_in_progress()
    new = RunDir(tmp_path / "new")
    new.hold()  # nothing to hold yet
    assert new._held is None and not new.path.exists()
    new.start(cfg)
    assert _refused(RunDir(new.path).hold) == f"{new.path}: {said}"
    new.release()
    RunDir(new.path).refuse_in_progress()


def test_a_file_system_without_locks_runs_unguarded_rather_than_failing(tmp_path, monkeypatch):
    """Some network file systems refuse `flock` (ENOLCK): the run goes on as on Windows, holding nothing, instead
    of stopping with a traceback."""
    import errno

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir_mod.fcntl, "flock", no_locks)
    out = _saved(tmp_path, _cfg())
    run = RunDir(out)
    run.hold()
    assert run._held is None
    RunDir.check(out, _cfg(), resume=True)


def test_check_refuses_another_configs_run_unless_forced(tmp_path):
    out = _saved(tmp_path, _cfg())
    other = validate_config({"train": {"rounds": 4}})
    expected = f"--out {out}: holds a run of a different config; choose another --out (or pass --force to replace it)"
    assert _refused(RunDir.check, out, other) == expected
    assert _refused(RunDir.check, out, other, resume=True) == expected
    assert RunDir.check(out, other, force=True).path == out
    assert (out / "config.yaml").read_text() == config_text(_cfg())  # check writes nothing


def test_check_refuses_a_finished_run_unless_forced(tmp_path):
    cfg = _cfg()
    out = _saved(tmp_path, cfg)
    (out / "summary.json").write_text(json.dumps(SUMMARY))
    assert RunDir(out).finished
    again = "choose another --out (or pass --force to run it again)"
    assert _refused(RunDir.check, out, cfg) == f"--out {out}: holds a finished run of this config; {again}"
    assert _refused(RunDir.check, out, cfg, resume=True) == f"--out {out}: is finished; nothing to resume; {again}"
    assert RunDir.check(out, cfg, force=True).path == out


def test_check_points_an_unfinished_run_to_the_command_that_continues_it(tmp_path):
    cfg = _cfg()
    out = _saved(tmp_path, cfg)
    (out / "summary.json").mkdir()  # not a file: not finished
    assert not RunDir(out).finished
    assert _refused(RunDir.check, out, cfg) == (
        f"--out {out}: holds an unfinished run of this config; continue it with 'pflbed run --resume {out}' (or "
        "pass --force to start over)")  # fmt: skip
    bench = "pflbed bench suite.yaml --resume"
    assert _refused(RunDir.check, out, cfg, resume_with=bench) == (
        f"--out {out}: holds an unfinished run of this config; continue it with '{bench}' (or pass --force to "
        "start over)")  # fmt: skip
    assert RunDir.check(out, cfg, resume=True).path == out
    assert RunDir.check(out, cfg, force=True).path == out


# --- RunDir.start, for_resume -------------------------------------------------------------------------------------
def test_start_creates_the_directory_with_only_its_config(tmp_path):
    cfg = _cfg(threads=2)
    out = tmp_path / "a" / "b" / "run"
    RunDir(out).start(cfg)
    assert os.listdir(out) == ["config.yaml"]  # no temp file left
    assert (out / "config.yaml").read_text() == config_text(cfg)


def test_start_removes_an_earlier_runs_files_and_only_those(tmp_path):
    """What `check(force=True)` allowed: the old run's files go, the user's own files stay."""
    out = _saved(tmp_path, validate_config({"seed": 9}))
    for name in ("metrics.jsonl", "metrics.csv", "summary.json", "notes.txt"):
        (out / name).write_text("old")
    for sub in ("checkpoints", "plots", "mine"):
        (out / sub).mkdir()
        (out / sub / "x").write_text("old")
    cfg = _cfg()
    RunDir(out).start(cfg)
    assert sorted(os.listdir(out)) == ["config.yaml", "mine", "notes.txt"]
    assert (out / "config.yaml").read_text() == config_text(cfg)


def test_start_at_an_unwritable_location_is_one_line_and_removes_what_it_created(tmp_path, monkeypatch):
    """Root writes anywhere, so the failures are simulated: creating the directory, or writing config.yaml."""
    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    out = tmp_path / "run"
    monkeypatch.setattr(rundir_mod.Path, "mkdir", refuse)
    assert _refused(RunDir(out).start, _cfg()) == f"--out {out}: cannot write the run directory (Permission denied)"
    monkeypatch.undo()

    monkeypatch.setattr(rundir_mod, "atomic_write", refuse)
    deep = tmp_path / "new" / "sub" / "run"
    assert _refused(RunDir(deep).start, _cfg()) == f"--out {deep}: cannot write the run directory (Permission denied)"
    assert not (tmp_path / "new").exists()  # the parents this call made go too

    existing = _saved(tmp_path, _cfg(), "existing")
    (existing / "notes.txt").write_text("mine")
    assert _refused(RunDir(existing).start, _cfg()) == (f"--out {existing}: cannot write the run directory "
                                                        "(Permission denied)")  # fmt: skip
    assert os.listdir(existing) == ["notes.txt"]  # a directory it did not create stays, with the user's files

    def another_run_meanwhile(path, text):  # `bench --jobs`: a parallel cell writes under the same new parent
        (tmp_path / "suite" / "b").mkdir()
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(rundir_mod, "atomic_write", another_run_meanwhile)
    assert "cannot write" in _refused(RunDir(tmp_path / "suite" / "a").start, _cfg())
    assert os.listdir(tmp_path / "suite") == ["b"]  # its own directory gone, the other run's parent kept


def test_for_resume_refuses_a_directory_without_config_and_another_config(tmp_path):
    empty = tmp_path / "empty"
    assert _refused(RunDir.for_resume, empty, None) == f"--resume {empty}: not a pflbed run directory (no config.yaml)"
    (empty / "config.yaml").mkdir(parents=True)
    assert _refused(RunDir.for_resume, empty, None) == f"--resume {empty}: not a pflbed run directory (no config.yaml)"
    out = _saved(tmp_path, _cfg())
    assert _refused(RunDir.for_resume, out, validate_config({"seed": 1})) == (
        f"--resume {out}: the run was started with a different config (only executor.device, executor.threads, "
        "executor.workers, executor.batch_clients, executor.compile, executor.deterministic, executor.autotune may "
        "change when resuming)")  # fmt: skip


def test_for_resume_refuses_a_run_whose_folder_is_a_file_or_whose_file_is_a_folder(tmp_path):
    """`checkpoints` as a file held no checkpoint: the run started over, deleting its metrics, then failed naming a
    temporary file. Each of the run's folders and files of the wrong kind is refused, and nothing is touched."""
    for name, folder in (("checkpoints", True), ("plots", True), ("metrics.jsonl", False), ("metrics.csv", False),
                         ("summary.json", False)):  # fmt: skip
        out = _saved(tmp_path, _cfg(), name)
        (out / "metrics.csv").write_text("round\n1\n") if name != "metrics.csv" else None
        (out / name).write_text("") if folder else (out / name).mkdir()
        kept = sorted(p.name for p in out.iterdir())
        assert _refused(RunDir.for_resume, out, None) == (
            f"--resume {out}: {name} is a {'file' if folder else 'directory'}, not the run's "
            f"{'folder' if folder else 'file'}; restore it or move it away")  # fmt: skip
        assert sorted(p.name for p in out.iterdir()) == kept
    edited = _saved(tmp_path, _cfg(), "edited")  # a mistake in an edited config.yaml is named with the file
    (edited / "config.yaml").write_text((edited / "config.yaml").read_text().replace("rounds: 3", "rounds: three"))
    assert _refused(RunDir.for_resume, edited, None).startswith(f"{edited / 'config.yaml'}: train.rounds: ")
    fine = _saved(tmp_path, _cfg(), "fine")
    (fine / "checkpoints").mkdir()
    (fine / "metrics.jsonl").write_text("")
    assert RunDir.for_resume(fine, None)[0].path == fine


def test_for_resume_without_a_config_loads_the_runs_own(tmp_path, no_cuda):
    saved = validate_config({"seed": 6, "executor": {"threads": 2}})
    out = _saved(tmp_path, saved)
    tree = yaml.safe_load(config_text(saved))
    tree["executor"]["device"] = "cuda"  # a GPU run continued on a CPU
    (out / "config.yaml").write_text(yaml.safe_dump(tree))
    run, cfg = RunDir.for_resume(out, None)
    assert isinstance(run, RunDir) and run.path == out and cfg == saved


# --- the files a run writes ----------------------------------------------------------------------------------------
RECORDS = [
    {"round": 2, "pfl_acc": 0.5, "gfl_acc": None},
    {"round": 4, "pfl_acc": 0.75, "diag": {"mask_iou": 0.125, "deep": {"x": 1}}, "failed_clients": [3, 1],
     "gfl_acc": 0.25},
    {"round": 6, "failed_clients": {"2": [0, 3]}, "note": "a, b"},
]  # fmt: skip
CSV = ("round,pfl_acc,gfl_acc,diag.mask_iou,diag.deep.x,failed_clients,failed_clients.2,note\n"
       "2,0.5,,,,,,\n"
       '4,0.75,0.25,0.125,1,"[3, 1]",,\n'
       '6,,,,,,"[0, 3]","a, b"\n')  # fmt: skip


def test_log_appends_the_record_and_rewrites_the_csv_whole(tmp_path):
    """Columns in first-seen order across all records (a later one may bring a new one), nested dicts dotted,
    lists as JSON text."""
    run = RunDir(tmp_path)
    run.log(RECORDS[0])
    assert _bytes(tmp_path / "metrics.csv") == "round,pfl_acc,gfl_acc\n2,0.5,\n"
    for record in RECORDS[1:]:
        run.log(record)
    assert _bytes(tmp_path / "metrics.jsonl") == "".join(json.dumps(r) + "\n" for r in RECORDS)
    assert _bytes(tmp_path / "metrics.csv") == CSV
    assert read_metrics(tmp_path / "metrics.jsonl") == RECORDS
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv", "metrics.jsonl"]


def test_the_csv_skips_blank_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(RECORDS[0]) + "\n\n")
    RunDir(tmp_path).log(RECORDS[1])
    assert _bytes(tmp_path / "metrics.csv") == ("round,pfl_acc,gfl_acc,diag.mask_iou,diag.deep.x,"
                                                      "failed_clients\n2,0.5,,,,\n" '4,0.75,0.25,0.125,1,"[3, 1]"\n')


def test_rewrite_metrics_keeps_the_checkpointed_history_and_unfinishes_the_run(tmp_path):
    """On resume: lines logged after the checkpoint go (they are replayed), in both files, and summary.json too
    (the run is not finished until it finishes again)."""
    run = RunDir(tmp_path)
    for record in RECORDS:
        run.log(record)
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    run.rewrite_metrics(RECORDS[:2])
    assert _bytes(tmp_path / "metrics.jsonl") == "".join(json.dumps(r) + "\n" for r in RECORDS[:2])
    assert _bytes(tmp_path / "metrics.csv") == ("round,pfl_acc,gfl_acc,diag.mask_iou,diag.deep.x,"
                                                      "failed_clients\n2,0.5,,,,\n" '4,0.75,0.25,0.125,1,"[3, 1]"\n')
    assert not run.finished and not (tmp_path / "summary.json").exists()
    run.rewrite_metrics([])  # no summary.json to remove: fine
    assert _bytes(tmp_path / "metrics.jsonl") == "" and _bytes(tmp_path / "metrics.csv") == "\n"


def test_write_summary_is_indented_json_that_reads_back(tmp_path):
    run = RunDir(tmp_path)
    run.write_summary({"rounds": 3, "final": {"pfl_acc": 0.5}})
    assert _bytes(tmp_path / "summary.json") == '{\n  "rounds": 3,\n  "final": {\n    "pfl_acc": 0.5\n  }\n}\n'
    run.write_summary(SUMMARY)
    assert read_summary(tmp_path / "summary.json") == SUMMARY and run.finished
    assert os.listdir(tmp_path) == ["summary.json"]


def test_flat_dots_nested_keys_and_writes_lists_as_json():
    assert _flat({"a": {"b": {"c": 1}, "d": ["ft", None, True]}, "e": "x", "f": None, "g": {}}) == {
        "a.b.c": 1, "a.d": '["ft", null, true]', "e": "x", "f": None}  # fmt: skip
    assert _flat({"k": 1}, "p.") == {"p.k": 1}


def testatomic_write_goes_through_a_temp_file_in_the_same_directory(tmp_path, monkeypatch):
    """A reader (or a crash) never sees half a file: the text is written to a hidden temp file beside it, then
    renamed over it."""
    target = tmp_path / "summary.json"
    target.write_text("old")
    renames = []
    real = Path.replace

    def replace(self, to):
        renames.append((self, Path(to), self.read_text()))
        return real(self, to)

    monkeypatch.setattr(Path, "replace", replace)
    atomic_write(target, "new")
    assert renames == [(tmp_path / f".summary.json.{os.getpid()}.tmp", target, "new")]
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["summary.json"]


def test_a_failedatomic_write_leaves_no_temp_file(tmp_path, monkeypatch):
    """A write that fails (a full disk) leaves the old file and no hidden temp file, which would make an empty run
    directory 'a non-empty directory that holds no pflbed run' on the next try."""
    target = tmp_path / "config.yaml"
    target.write_text("old")

    def full(self, to):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, "new")
    assert os.listdir(tmp_path) == ["config.yaml"] and target.read_text() == "old"


def test_a_write_failing_before_its_temp_file_exists_raises_its_own_error(tmp_path, monkeypatch):
    """Opening the temp file can fail (a read-only directory): the cause is raised as it is, not hidden behind a
    'no such file' from removing a temp file that never came to be."""

    def refused(self, text):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refused)
    with pytest.raises(PermissionError, match="Permission denied"):
        atomic_write(tmp_path / "config.yaml", "new")
    assert os.listdir(tmp_path) == []


def test_a_files_directory_is_no_other_command_s_directory(tmp_path):
    """`files_dir` (`data new-client --out`, `flower sites --out`, `flower app --out`): a run's directory (its
    config.yaml, or a result alone), a pretrained model's (its config.yaml), a bench suite's (suite.yaml) and a tune
    directory (its study, or its trials) are refused, each named; a new or empty directory, one of other files and a
    personalization's (whose --out a new client's samples may share) are taken."""
    from pflbed.results.rundir import files_dir

    made = {"config": "config.yaml", "summary": "summary.json", "metrics": "metrics.jsonl", "suite": "suite.yaml",
            "study": "study.db"}  # fmt: skip
    for name, file in made.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text("")
    for name in ("checkpoints", "trials"):
        (tmp_path / name / name).mkdir(parents=True)
    (tmp_path / "personal").mkdir()
    (tmp_path / "personal" / "model.pt").write_text("")
    (tmp_path / "file").write_text("")
    run_like = ("config", "summary", "metrics", "checkpoints")
    for name in (*run_like, "suite", "study", "trials", "file"):
        with pytest.raises(PflbedError) as e:
            files_dir(tmp_path / name, f"--out {tmp_path / name}", "samples")
        what = "a run's or a pretrained model's directory" if name in run_like else "a bench suite's or a tune " \
            "directory"  # fmt: skip
        said = "is a file; give the directory to write samples into" if name == "file" else \
            f"is {what}; write samples elsewhere"  # fmt: skip
        assert str(e.value) == f"--out {tmp_path / name}: {said}"
    for fine in (tmp_path / "new", tmp_path / "personal", tmp_path / "trials" / "trials"):
        assert files_dir(fine, "--out", "samples") == fine
    with pytest.raises(PflbedError, match=r"is a file, not a directory$"):
        files_dir(tmp_path / "file" / "under", "--out", "samples")


def test_a_checkpoint_s_config_record_leaves_out_placement_and_the_files_locations():
    """What a run may change once started: where it runs (`PLACEMENT`) and where its files are on this machine
    (`LOCATIONS`: a run moved to another machine); everything else is recorded, and compared on resume."""
    from pflbed.results.rundir import LOCATIONS, PLACEMENT, config_record

    cfg = validate_config({"dataset": {"path": "/data/digits"}, "executor": {"threads": 2}})
    record = config_record(cfg)
    assert not set(PLACEMENT) & set(record["executor"])
    for section, key in LOCATIONS.items():
        assert key in cfg.to_dict()[section] and key not in record[section], (section, key)
    assert record["seed"] == 0 and record["train"]["rounds"] == cfg.train.rounds
    assert record["dataset"]["name"] == "digits" and json.loads(json.dumps(record)) == record
