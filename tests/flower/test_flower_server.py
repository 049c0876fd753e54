"""The ServerApp's run directory (`flower.server.run_directory`): what `pflbed flower local` prepared is taken as
it is; anything else — `flwr run` of a `pflbed flower app` project, once or again — is checked as `pflbed run`
checks `--out`, in the run config's own words."""

import json

import pytest

from pflbed.config import validate_config
from pflbed.errors import PflbedError
from pflbed.results.rundir import RunDir, config_text

pytest.importorskip("flwr")  # the `flower` extra; CI installs it, so these tests run there

from flwr.common.config import fuse_dicts, get_project_config, parse_config_args  # noqa: E402

from pflbed.flower.project import write_app  # noqa: E402
from pflbed.flower.server import run_directory  # noqa: E402

CFG = validate_config({"train": {"rounds": 3}, "executor": {"name": "flower"}})
AGAIN = "flwr run DIR CONNECTION --run-config resume=true"  # DIR, CONNECTION: as the Flower guide says


def _started(tmp_path, cfg=CFG):
    """The run directory as `pflbed flower local` leaves it before it submits (checked, started, released for the
    ServerApp's process to hold)."""
    out = tmp_path / "run"
    rundir = RunDir.check(out, cfg)
    rundir.start(cfg)
    rundir.release()
    (out / "flower" / "home").mkdir(parents=True)  # the deployment's own files sit beside it
    return out


def _refused(cfg, run_config) -> str:
    with pytest.raises(PflbedError) as e:
        run_directory(cfg, run_config)
    return str(e.value)


def test_what_flower_local_started_is_taken_as_it_is(tmp_path):
    out = _started(tmp_path)
    rundir, resume = run_directory(CFG, {"out": str(out), "resume": False})
    assert (rundir.path, resume) == (out, False)
    assert run_directory(CFG, {"out": str(tmp_path / "new")})[0].path == tmp_path / "new"  # a fresh out: no flags
    assert not (tmp_path / "new").exists()  # nothing written before the experiment starts


def test_a_second_flwr_run_neither_replaces_a_finished_run_nor_restarts_one_with_results(tmp_path):
    """A project submitted again: its out holds this config's run, finished or with results (each alone), which
    `flower local`'s fresh directory does not; only force=true replaces it, resume=true continues it."""
    out = _started(tmp_path)
    (out / "summary.json").write_text("{}")
    again = "choose another out (or pass --run-config force=true to run it again)"
    assert _refused(CFG, {"out": str(out)}) == f"out {out}: holds a finished run of this config; {again}"
    assert _refused(CFG, {"out": str(out), "resume": True}) == f"out {out}: is finished; nothing to resume; {again}"
    assert run_directory(CFG, {"out": str(out), "force": True})[0].path == out
    for result in ("metrics.jsonl", "checkpoints"):  # a summary is the finished case above
        out = _started(tmp_path / result)
        if result == "checkpoints":
            (out / result).mkdir()
        else:
            (out / result).write_text("{}\n")
        assert _refused(CFG, {"out": str(out), "resume": False}) == (
            f"out {out}: holds an unfinished run of this config; continue it with '{AGAIN}' (or pass --run-config "
            "force=true to start over)")  # fmt: skip
        rundir, resume = run_directory(CFG, {"out": str(out), "resume": True})
        assert (rundir.path, resume) == (out, True)
        assert run_directory(CFG, {"out": str(out), "force": True})[1] is False


def test_another_config_s_run_is_refused_even_when_freshly_started(tmp_path):
    out = _started(tmp_path, validate_config({"train": {"rounds": 4}, "executor": {"name": "flower"}}))
    for resume in (False, True):
        assert _refused(CFG, {"out": str(out), "resume": resume}) == (
            f"out {out}: holds a run of a different config; choose another out (or pass --run-config force=true to "
            "replace it)")  # fmt: skip
    assert (out / "config.yaml").read_text() != config_text(CFG)  # refused before anything was written


@pytest.mark.parametrize(("key", "value"), [("resume", "true"), ("force", "false"), ("force", 1), ("resume", 0.0)])
def test_resume_and_force_are_true_or_false_only(tmp_path, key, value):
    """TOML's booleans only: a quoted "false" would be a yes if read as Python truth."""
    assert _refused(CFG, {"out": str(tmp_path / "run"), key: value}) == f"run config {key}: {value!r} is not true " \
                                                                        "or false"  # fmt: skip


def test_a_project_s_run_config_takes_resume_and_force_from_flwr_run(tmp_path):
    """`flwr run DIR --run-config "resume=true force=true"` changes only keys the project declares (Flower refuses
    others), so the project written by `pflbed flower app` declares both, false by default."""
    out = _started(tmp_path)
    (out / "summary.json").write_text(json.dumps({}))
    app = write_app(tmp_path / "app", CFG, out)
    declared = get_project_config(app)["tool"]["flwr"]["app"]["config"]
    assert (declared["resume"], declared["force"]) == (False, False)
    with pytest.raises(PflbedError, match="holds a finished run"):
        run_directory(CFG, declared)
    forced = fuse_dicts(declared, parse_config_args(["force=true"]))
    rundir, resume = run_directory(CFG, forced)
    assert (rundir.path, resume, forced["force"]) == (out, False, True)
