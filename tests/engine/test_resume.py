"""Checkpoint / resume: a run killed with SIGKILL and resumed ends exactly like an uninterrupted one."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pflbed.cli import main
from pflbed.errors import PflbedError
from pflbed.results.checkpoint import checkpoint_path

from ..tiny import PARITY_CASES, loop_run, parity_config

ARGS = [
    "--set", "dataset.name=synthetic", "--set", "model.name=mlp", "--set", "federation.clients=8",
    "--set", "federation.sample_fraction=0.5", "--set", "train.rounds=80", "--set", "train.checkpoint_every=10",
    "--set", "eval.every=20", "--set", "train.lr=0.02", "--set", "algorithm.name=local", "--no-progress",
]  # fmt: skip


def _summary(path):
    s = json.loads((path / "summary.json").read_text())
    s.pop("timing")
    return s


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pflbed", "run", *ARGS, "--out", str(killed)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    ckpt = checkpoint_path(killed)
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.exists(), proc.stderr.read().decode()
    assert not (killed / "summary.json").exists(), "the run finished before it could be killed"
    blob = torch.load(ckpt, weights_only=True)  # loads without unpickling code
    assert 0 < blob["round"] < 80

    assert main(["run", "--resume", str(killed), "--no-progress"]) == 0
    assert main(["run", *ARGS, "--out", str(tmp_path / "straight")]) == 0
    assert _summary(killed) == _summary(tmp_path / "straight")
    lines = [json.loads(x)["round"] for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert lines == list(range(20, 81, 20))  # no duplicated or missing evaluations


def test_a_run_in_progress_is_neither_resumed_nor_replaced_by_a_second_process(tmp_path, capsys):
    """`--resume` (what the refusal of an unfinished run suggests) or `--force` while the first process still ran:
    both wrote the directory, its metrics interleaved (rounds 115, 135, 120, …) and both printed "results". Now
    refused in one line, the directory untouched; once the first process ends (here: killed), nothing holds it."""
    from pflbed.results.rundir import RunDir

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    long = [*ARGS, "--set", "train.rounds=100000"]
    proc = subprocess.Popen([sys.executable, "-m", "pflbed", "run", *long, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert (out / "metrics.jsonl").exists(), proc.stderr.read().decode()
        said = f"pflbed: error: {out}: a run is in progress there, in another process; wait for it to end, or stop " \
               "it first\n"  # fmt: skip
        for argv in ([*ARGS, "--out", str(out), "--force"], [*ARGS, "--out", str(out)]):  # short, should it run
            assert main(["run", *argv]) == 2
            assert capsys.readouterr().err == said, argv
        second = subprocess.run([sys.executable, "-m", "pflbed", "run", "--resume", str(out)], capture_output=True,
                                text=True, timeout=60)  # its own process: resumed here, it would run for ever
        assert (second.returncode, second.stderr) == (2, said)
        assert (out / "config.yaml").is_file() and proc.poll() is None  # not replaced; still running
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    RunDir(out).refuse_in_progress()  # the lock went with the process
    logged = len((out / "metrics.jsonl").read_text().splitlines())
    proc = subprocess.Popen([sys.executable, "-m", "pflbed", "run", "--resume", str(out), "--no-progress"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:  # a resumed run holds it as well
        deadline = time.time() + 120
        while len((out / "metrics.jsonl").read_text().splitlines()) <= logged and proc.poll() is None and \
                time.time() < deadline:  # fmt: skip
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode()
        assert main(["run", *ARGS, "--out", str(out), "--force"]) == 2
        assert capsys.readouterr().err == said
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    rounds = [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == sorted(set(rounds)) and len(rounds) > logged


def test_resume_refuses_another_config(tmp_path, capsys):
    out = tmp_path / "run"
    short = [*ARGS, "--set", "train.rounds=30"]
    assert main(["run", *short, "--out", str(out)]) == 0
    assert main(["run", *short, "--set", "seed=5", "--resume", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "different config" in err and str(out) in err
    assert main(["run", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a pflbed run directory" in capsys.readouterr().err


def test_a_run_written_before_a_config_key_existed_is_still_the_same_config(tmp_path, capsys):
    """config.yaml compared as configs: a key added since (absent in the file, its default applies) does not make
    an unfinished run 'another config'; a changed value does."""
    import yaml

    from pflbed.config import validate_config
    from pflbed.results.rundir import RunDir, config_text, same_config

    cfg = validate_config({"train": {"rounds": 3}})
    run = tmp_path / "run"
    run.mkdir()
    tree = yaml.safe_load(config_text(cfg))
    del tree["log"]  # as written before `log` existed
    tree["executor"].pop("state_dir")
    (run / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    assert same_config(run / "config.yaml", cfg)
    assert RunDir.check(run, cfg, resume=True).path == run
    other = validate_config({"train": {"rounds": 4}})
    assert not same_config(run / "config.yaml", other)
    with pytest.raises(PflbedError, match="different config"):
        RunDir.check(run, other)
    (run / "config.yaml").write_text("train: {rounds: [\n")  # unreadable: never the same
    assert not same_config(run / "config.yaml", cfg)


def test_checkpointed_client_states_come_back_exactly_and_shared_tensors_stay_shared(tmp_path):
    """Packed client states keep values, dtypes, shapes and strides (channels-last), a tensor several clients hold
    is stored once and shared again, and a checkpoint of the earlier format (dicts of tensors) still loads."""
    from pflbed.results.checkpoint import load_checkpoint, save_checkpoint

    initial = torch.randn(4, 3)
    states = {
        0: {"conv": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), "steps": torch.tensor(7),
            "mask": torch.tensor([True, False]), "empty": torch.zeros(0, 3), "half": torch.randn(3).half()},
        3: {"head": initial}, 5: {"head": initial},
    }  # fmt: skip
    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, states, [{"round": 2}], {"wall_s": 1.0})
    back = load_checkpoint(tmp_path)
    assert back["round"] == 2 and back["history"] == [{"round": 2}] and torch.equal(back["server"]["w"], torch.ones(2))
    assert back["clients"].keys() == states.keys()
    for cid, state in states.items():
        for k, v in state.items():
            got = back["clients"][cid][k]
            assert (got.dtype, got.shape, got.stride()) == (v.dtype, v.shape, v.stride()) and torch.equal(got, v)
    assert back["clients"][3]["head"].data_ptr() == back["clients"][5]["head"].data_ptr()
    assert len(json.loads(torch.load(checkpoint_path(tmp_path), weights_only=True)["clients"]["layout"])) == 6

    old = {"format": 1, "round": 1, "server": {"w": torch.ones(2)}, "clients": {"3": {"head": initial}},
           "history": "[]", "timing": "{}", "extra": "{}"}  # fmt: skip
    torch.save(old, checkpoint_path(tmp_path))
    assert torch.equal(load_checkpoint(tmp_path)["clients"][3]["head"], initial)


SPRUNG = []


def _spring() -> None:
    SPRUNG.append(True)


class _Trap:
    """Unpickled without restriction, it would call `_spring`: what a planted checkpoint could run instead."""

    def __reduce__(self):
        return (_spring, ())


def test_a_checkpoint_is_loaded_as_tensors_only_and_onto_the_resumed_run_s_device(tmp_path):
    """A checkpoint that would run code when unpickled is refused, with a line saying why and how to start over,
    by both readers; the tensors of an honest one (either format) land on the device asked for (`meta` here)."""
    from pflbed.results.checkpoint import checkpoint_round, load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {4: {"head": torch.ones(3)}}, [], {"wall_s": 1.0})
    back = load_checkpoint(tmp_path, "meta")
    assert back["server"]["w"].device.type == "meta" and back["clients"][4]["head"].device.type == "meta"
    old = {"format": 1, "round": 1, "server": {"w": torch.ones(2)}, "clients": {"3": {"head": torch.ones(3)}},
           "history": "[]", "timing": "{}", "extra": "{}"}  # fmt: skip
    torch.save(old, checkpoint_path(tmp_path))
    assert load_checkpoint(tmp_path, torch.device("meta"))["clients"][3]["head"].device.type == "meta"

    path = checkpoint_path(tmp_path)
    torch.save({**old, "round": 5, "trap": _Trap()}, path)
    assert checkpoint_round(tmp_path) is None
    with pytest.raises(PflbedError) as info:
        load_checkpoint(tmp_path)
    assert not SPRUNG
    message = str(info.value)
    assert message.startswith(f"{path}: unreadable checkpoint (UnpicklingError: ") and "\n" not in message
    assert message.endswith(f"); to start the run over, delete that file and run 'pflbed run --resume {tmp_path}' "
                            "again (or rerun it with --force)")  # fmt: skip
    reason = message.split("(UnpicklingError: ", 1)[1].split("); to start", 1)[0]
    assert len(reason) == 80 and "  " not in reason  # its first 80 characters, on one line

    torch.save({**old, "format": 7}, path)
    with pytest.raises(PflbedError, match=r"unreadable checkpoint \(ValueError: format 7\); to start"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {4: {"head": torch.ones(3)}}, [], {"wall_s": 1.0})
    blob = torch.load(path, weights_only=True)
    blob["clients"]["layout"] = json.dumps([["Tensor_of_a_long_name_indeed", [3], [1], 0]])
    torch.save(blob, path)
    with pytest.raises(PflbedError, match=r"\(ValueError: not a dtype: Tensor_of_a_long_nam\); to start"):
        load_checkpoint(tmp_path)


def _tiny_run(tmp_path, **train):
    from pflbed.config import validate_config

    from ..tiny import TINY

    return validate_config({**TINY, "train": {**TINY["train"], **train}, "eval": {"every": 4, "finetune": ["ft"]},
                            "executor": {"threads": 1}})  # fmt: skip


def test_checkpoints_come_every_n_rounds_after_every_evaluation_and_after_the_last_round(tmp_path, monkeypatch):
    from pflbed.results import experiment
    from pflbed.results.experiment import run

    saved = []
    real = experiment.save_checkpoint
    monkeypatch.setattr(experiment, "save_checkpoint",
                        lambda d, rnd, *a, **k: saved.append(rnd) or real(d, rnd, *a, **k))
    run(_tiny_run(tmp_path, rounds=9, checkpoint_every=3), tmp_path / "a", progress=False)
    assert saved == [3, 4, 6, 8, 9]  # every 3rd, each evaluated round (4, 8), the last
    saved.clear()
    run(_tiny_run(tmp_path, rounds=9, checkpoint_every=0), tmp_path / "b", progress=False)
    assert saved == [4, 8, 9]
    saved.clear()
    run(_tiny_run(tmp_path, rounds=9, checkpoint_every=3), None, write=False, progress=False)
    assert saved == []  # nowhere to write one


def test_a_run_stopped_in_its_final_stages_resumes_to_the_same_summary(tmp_path):
    """Killed after its last round's checkpoint, during the fine-tuning: resumed, it trains no round again and
    its summary (per-client figures included, which come from the checkpoint) is the uninterrupted one."""
    from pflbed.results.experiment import run

    cfg = _tiny_run(tmp_path, rounds=4)
    whole = run(cfg, tmp_path / "run", progress=False).summary
    (tmp_path / "run" / "summary.json").unlink()
    again = run(cfg, tmp_path / "run", progress=False, resume=True).summary
    for s in (whole, again):
        s.pop("timing")
    assert again == whole and again["per_client"]


def test_resume_where_no_checkpoint_was_written_yet_starts_the_run(tmp_path):
    from pflbed.results.experiment import run

    cfg = _tiny_run(tmp_path, rounds=4)
    fresh = run(cfg, tmp_path / "fresh", progress=False).summary
    resumed = run(cfg, tmp_path / "new", progress=False, resume=True).summary
    for s in (fresh, resumed):
        s.pop("timing")
    assert resumed == fresh
    assert (tmp_path / "new" / "config.yaml").read_text() == (tmp_path / "fresh" / "config.yaml").read_text()


def _finished_and_unfinished(tmp_path, name, *extra, label=None):
    """A finished run and an unfinished copy of it (its summary removed), of algorithm `name`."""
    import shutil

    label = label or name
    run_dir = tmp_path / label
    args = [*ARGS, "--set", f"algorithm.name={name}", "--set", "train.rounds=4", "--set", "train.checkpoint_every=1",
            "--set", "eval.every=2", *extra]  # fmt: skip
    assert main(["run", *args, "--out", str(run_dir)]) == 0
    unfinished = tmp_path / f"{label}-unfinished"
    shutil.copytree(run_dir, unfinished)
    (unfinished / "summary.json").unlink()
    return run_dir, unfinished


def test_a_checkpoint_another_config_wrote_is_refused_in_one_line_by_resume_and_personalize(tmp_path, capsys):
    """A checkpoint copied from a run of another model (a state of other shapes), of another algorithm (a state
    without the run's entries), of another federation (a client the run does not have), with a client's state of
    other shapes, or at a round after the config's last is refused before any tensor is loaded into the model: one
    line naming the file and what does not fit, exit 2, by `run --resume` and by `personalize`; the run's own
    checkpoint still resumes."""
    import numpy as np

    mlp, unfinished = _finished_and_unfinished(tmp_path, "fedavg")
    cnn, _ = _finished_and_unfinished(tmp_path, "fedper", "--set", "model.name=cnn", label="fedper-cnn")
    fedper_mlp, fedper_unfinished = _finished_and_unfinished(tmp_path, "fedper")
    own = checkpoint_path(unfinished).read_bytes()
    data = tmp_path / "new.npz"
    np.savez(data, x=np.zeros((8, 1, 8, 8), np.float32), y=np.arange(8) % 2)

    def refused(source_or_blob, why, target=unfinished):
        path = checkpoint_path(target)
        if isinstance(source_or_blob, dict):
            torch.save(source_or_blob, path)
        else:
            path.write_bytes(checkpoint_path(source_or_blob).read_bytes())
        for argv in (["run", "--resume", str(target), "--no-progress"],
                     ["personalize", str(target), "--data", str(data), "--out", str(tmp_path / "p"),
                      "--epochs", "1"]):  # fmt: skip
            assert main(argv) == 2
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and err.startswith(f"pflbed: error: {path}: the checkpoint does not fit the run's "
                                                      f"config ({why}")  # fmt: skip
        assert not (target / "summary.json").exists() and not (tmp_path / "p").exists()

    refused(cnn, "the server state's 'blocks.")  # another model: the same names, other shapes
    blob = torch.load(checkpoint_path(fedper_mlp), weights_only=True)
    refused(blob, "the server state has no 'blocks.classifier.")  # no head on FedPer's server
    layout = json.loads(blob["clients"]["layout"])
    refs = json.loads(blob["clients"]["refs"])
    cid, state = next(iter(refs.items()))
    key, at = next((k, i) for k, i in state.items() if len(layout[i][1]) == 1)  # the head's bias
    layout[at] = [layout[at][0], [1], [1], layout[at][3]]
    refused({**blob, "clients": {**blob["clients"], "layout": json.dumps(layout)}},
            f"client {cid}'s state's {key!r} is float [1] where", target=fedper_unfinished)  # fmt: skip
    blob = torch.load(checkpoint_path(mlp), weights_only=True)
    key = next(iter(blob["server"]))
    refused({**blob, "server": {**blob["server"], key: blob["server"][key][:1]}}, f"the server state's {key!r} is ")
    refused({**blob, "round": 5}, "it is at round 5, after the config's last round (4)")
    clients = json.loads(blob["clients"]["refs"])
    refused({**blob, "clients": {**blob["clients"], "refs": json.dumps({**clients, "8": {}})}},
            "it holds a state for client 8, which the federation does not have")
    checkpoint_path(unfinished).write_bytes(own)
    assert main(["run", "--resume", str(unfinished), "--no-progress"]) == 0
    assert _summary(unfinished) == _summary(mlp)


@pytest.mark.parametrize("field, value, reason", [
    ("round", "x", "ValueError: round x"), ("round", 0, "ValueError: round 0"),
    ("history", "not json", "JSONDecodeError: "), ("history", '[1]', "ValueError: history is not a list of records"),
    ("timing", '{"wall_s": "x"}', "ValueError: timing is not a mapping of seconds"),
    ("extra", '[]', "ValueError: extra is not a mapping"),
    ("extra", '{"per_client": 3}', "ValueError: extra is not a mapping"),
])  # fmt: skip
def test_a_checkpoint_s_plain_values_of_another_type_make_it_unreadable(tmp_path, field, value, reason):
    from pflbed.results.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {4: {"head": torch.ones(3)}}, [{"round": 2}], {"wall_s": 1.0},
                    {"per_client": {}})  # fmt: skip
    assert load_checkpoint(tmp_path)["extra"] == {"per_client": {}}
    blob = torch.load(checkpoint_path(tmp_path), weights_only=True)
    torch.save({**blob, field: value}, checkpoint_path(tmp_path))
    with pytest.raises(PflbedError, match=rf"unreadable checkpoint \({reason}"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name", PARITY_CASES)
def test_every_algorithm_s_trained_states_fit_its_fresh_set_up(name):
    """What a resume checks (`check_fits`) holds for every algorithm's own trained states: its server and client
    states keep every entry of their initial ones, of the same shapes (the parity tests' loop run, 4 rounds)."""
    from pflbed.engine.build import prepare
    from pflbed.results.checkpoint import check_fits

    done = loop_run(name)
    saved = {"round": 4, "server": done.server, "clients": done.executor.states}
    check_fits(saved, prepare(parity_config(name, {"threads": 1})), 4, Path("run"))


def test_checking_a_checkpoint_draws_nothing_from_the_run_s_random_stream_and_asks_each_client_s_own_state():
    """The fresh states a checkpoint is checked against may be drawn at random (an algorithm's initial models):
    torch's global RNG is as it was after the check, so the resumed run draws what the uninterrupted one drew. Each
    checkpointed client is compared with its own initial state (heterogeneous clients' differ), and an entry of
    another kind or shape is named with both."""
    from types import SimpleNamespace

    from pflbed.results.checkpoint import check_fits

    asked = []

    class Drawing:
        ctx = SimpleNamespace(federation=SimpleNamespace(participated=[0, 3]), device=torch.device("cpu"),
                              cfg=SimpleNamespace(sites=SimpleNamespace(local=False)))

        def init_server(self):
            return {"w": torch.rand(2)}

        def init_client(self, cid):
            asked.append(cid)
            return {"h": torch.rand(3), "n": torch.zeros(cid, dtype=torch.long)}

    before = torch.random.get_rng_state()
    states = {0: {"h": torch.ones(3), "n": torch.zeros(0, dtype=torch.long)},
              3: {"h": torch.ones(3), "n": torch.zeros(3, dtype=torch.long)}}  # fmt: skip
    check_fits({"round": 1, "server": {"w": torch.ones(2)}, "clients": states}, Drawing(), 1, Path("run"))
    assert torch.equal(torch.random.get_rng_state(), before) and asked == [0, 3]
    states[3]["n"] = torch.zeros(2)
    with pytest.raises(PflbedError, match=r"\(client 3's state's 'n' is float \[2\] where the run's set-up makes "
                                          r"integer \[3\]: another run's checkpoint"):  # fmt: skip
        check_fits({"round": 1, "server": {"w": torch.ones(2)}, "clients": states}, Drawing(), 1, Path("run"))


def test_a_config_edited_since_its_checkpoint_is_refused_by_resume_and_load_run(tmp_path, capsys):
    """An edited config.yaml whose checkpoint still fits went on under the edit: FedAvg's rounds resumed as FedProx's,
    another seed's federation, more rounds, and the summary named the edit as the whole run's config. Refused, naming
    the key, before anything is written; a placement key (threads) may change, and a checkpoint written before
    checkpoints kept their config, or a key only one side has, is not compared."""
    import pflbed

    _, unfinished = _finished_and_unfinished(tmp_path, "fedavg")
    conf = unfinished / "config.yaml"
    own, kept = conf.read_text(), sorted(p.name for p in unfinished.iterdir())
    metrics = (unfinished / "metrics.jsonl").read_text()
    for old, new, key, now, was in (("name: fedavg", "name: fedprox", "algorithm.name", '"fedprox"', '"fedavg"'),
                                    ("rounds: 4", "rounds: 6", "train.rounds", "6", "4"),
                                    ("seed: 0\ndataset:", "seed: 5\ndataset:", "seed", "5", "0")):  # fmt: skip
        assert old in own, old
        conf.write_text(own.replace(old, new, 1))
        said = f"{conf}: not the config the run's checkpoint (round 4) was written with: {key} is {now}, was {was}; "
        assert main(["run", "--resume", str(unfinished), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"pflbed: error: {said}only executor.device, ") and err.endswith(": restore it"), err
        with pytest.raises(PflbedError, match=f"^{re.escape(said)}"):
            pflbed.load_run(unfinished)
        assert sorted(p.name for p in unfinished.iterdir()) == kept
        assert (unfinished / "metrics.jsonl").read_text() == metrics
    conf.write_text(own.replace("threads: null", "threads: 2", 1))
    assert "threads: 2" in conf.read_text()
    pflbed.load_run(unfinished)  # a placement key is the run's to change
    blob = torch.load(checkpoint_path(unfinished), weights_only=True)
    extra = json.loads(blob["extra"])
    extra["config"]["algorithm"]["retired_option"] = 3  # a key this version no longer has
    extra["config"]["train"].pop("lr")  # a key the checkpoint's version did not have yet
    torch.save({**blob, "extra": json.dumps(extra)}, checkpoint_path(unfinished))
    pflbed.load_run(unfinished)
    conf.write_text(own.replace("name: fedavg", "name: fedprox", 1))
    extra.pop("config")  # written before checkpoints kept their config: nothing to compare with
    torch.save({**blob, "extra": json.dumps(extra)}, checkpoint_path(unfinished))
    assert pflbed.load_run(unfinished).config.algorithm.name == "fedprox"


def test_an_edit_is_named_by_the_first_key_changed_in_the_config_s_order():
    """Two edits at once name the earlier of them in the checkpoint's config, whatever the hash seed (a set's order
    named either); a section is entered where both sides have it, and a value that became a section is a change."""
    from pflbed.results.checkpoint import _first_change

    then = {"seed": 0, "train": {"lr": 0.1, "rounds": 4}, "algorithm": {"name": "fedavg"}}
    assert _first_change(then, {**then, "algorithm": {"name": "fedprox"}, "train": {"lr": 0.1, "rounds": 6}}) == \
        ("train.rounds", 4, 6)  # fmt: skip
    assert _first_change(then, {**then, "seed": 3, "train": {"lr": 0.2, "rounds": 4}}) == ("seed", 0, 3)
    assert _first_change(then, {**then, "seed": {"a": 1}}) == ("seed", 0, {"a": 1})
    assert _first_change(then, {"train": {"rounds": 4}, "new": 1}) is None
