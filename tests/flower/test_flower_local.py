"""`pflbed flower local` as the README writes it: a relative `--out` with TLS, Ctrl-C and `--resume` of the
deployment itself, and a failed deployment's one-line cause, exit code and advice."""

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

from pflbed import memory
from pflbed.cli import main
from pflbed.config import load_config
from pflbed.results.checkpoint import checkpoint_round
from pflbed.results.experiment import run
from pflbed.results.rundir import config_text

from ..tiny import figures
from .processes import marked_processes

pytest.importorskip("flwr")  # the `flower` extra

from pflbed.flower import local  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"
SETS = ["dataset.name=synthetic", "model.name=mlp", "federation.clients=6", "federation.alpha=1.0",
        "federation.sample_fraction=0.5", "train.rounds=2", "train.batch_size=16", "train.lr=0.1",
        "train.checkpoint_every=1", "eval.every=2", "eval.finetune=[]", "executor.threads=1"]  # fmt: skip
ARGS = [a for s in SETS for a in ("--set", s)]


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-0")  # the lanes' lengths with it there: 381 s of tests (0), 398 s (1)
@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_tls_with_a_relative_out_interrupted_by_ctrl_c_then_resumed_on_the_deployment(
    stop, code, tmp_path, monkeypatch, deployment_mark
):
    """The README's TLS command with a relative `--out` (Flower wants absolute certificate paths) runs; Ctrl-C says
    which round is checkpointed and the deployment's own `--resume` command, which finishes the run as `loop` would.
    SIGTERM (`kill`, a scheduler's limit) stops it the same way with the shell's code for it: before, Python died at
    once and the SuperLink and SuperNodes, each in a session of its own, ran on (the resume is Ctrl-C's case only)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    # four rounds, checkpointed each: Ctrl-C lands after round 1's checkpoint with rounds still to run (with two,
    # a busy machine could deliver it after the last round, and the run would simply finish)
    sets = [s if not s.startswith("train.rounds=") else "train.rounds=4" for s in SETS]
    args = [a for s in sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "pflbed", "flower", "local", "--supernodes", "2", "--tls", "--out", "run", *args]
    # SIGINT back to its default in the child: a background shell starts jobs with it ignored, and Python then
    # installs no Ctrl-C handler (the run would go on to the end)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.monotonic() + 300
    while checkpoint_round(tmp_path / "run") is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    assert marked_processes(deployment_mark)  # the deployment's processes carry the mark (the check below can fail)
    proc.send_signal(stop)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert not (left := marked_processes(deployment_mark)), left
    rnd = checkpoint_round(tmp_path / "run")
    assert err.strip().splitlines()[-1] == (f"pflbed: interrupted; round {rnd} of 4 is checkpointed in "
                                            "run/checkpoints/last.pt; continue with 'pflbed flower local --resume "
                                            "run --tls'")  # fmt: skip
    assert 1 <= rnd < 4 and not (tmp_path / "run" / "summary.json").exists()
    if stop == signal.SIGTERM:
        return
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    assert main(["flower", "local", "--resume", "run", "--tls"]) == 0
    assert not (left := marked_processes(deployment_mark)), left
    assert "https://" in (tmp_path / "run" / "flower" / "superlink.log").read_text()  # TLS was on
    loop = run(load_config(None, sets), write=False, progress=False)
    assert figures(json.loads((tmp_path / "run" / "summary.json").read_text())) == figures(
        json.loads(json.dumps(loop.summary))
    )


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-0")
def test_a_failed_deployment_says_why_where_the_logs_are_and_how_to_continue(tmp_path, monkeypatch, capsys):
    """A run that stops inside Flower (here: a broken app config, so the ServerApp refuses it) is one line with
    Flower's cause, exit code 4 (not 3, "diverged"), and the deployment's own `--resume`; rerunning the same
    command points there too, not at `pflbed run --resume` (which would continue in the simulation)."""
    real = local.write_app

    def broken(path, cfg, out, resume=False):
        app = real(path, cfg, out, resume)
        (app / "pyproject.toml").write_text((app / "pyproject.toml").read_text().replace("config = ", "config = 1\n"
                                                                                         "broken = ", 1))  # fmt: skip
        return app

    monkeypatch.setattr(local, "write_app", broken)
    monkeypatch.chdir(tmp_path)
    args = ["flower", "local", "--supernodes", "1", "--out", "run", *ARGS]
    assert main(args) == 4
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert err.startswith("pflbed: error: the Flower deployment's run did not finish: pflbed.errors.ConfigError: "
                          "config: ")  # fmt: skip
    assert "(logs: run/flower/run.log, superlink.log, supernode-*.log)" in err
    assert err.endswith("no round was checkpointed yet (it starts over); fix the cause, then continue with "
                        "'pflbed flower local --resume run'")  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "continue it with 'pflbed flower local --resume run'" in err and "pflbed run --resume" not in err


def test_the_cause_is_read_from_flowers_log(tmp_path):
    """Flower's error panel, or the ServerApp's exception; a divergence inside the deployment keeps exit code 3 and
    its own advice (lower the lr), since resuming it unchanged would diverge again."""
    log = tmp_path / "run.log"
    log.write_text("╭─ Error ───╮\n│ Failed to parse the Flower    │\n│ configuration file. │\n╰──────╯\n")
    e = local.failed(log, tmp_path / "run", "pflbed flower local --resume run")
    assert e.exit_code == 4 and "did not finish: Failed to parse the Flower configuration file. (logs:" in str(e)
    log.write_text("╭─ Error ─╮\n│ Unknown key: X │\n╰─────────╯\n")
    assert local.failure_reason(log) == "Unknown key: X"
    log.write_text("Traceback (most recent call last):\n  File x\npflbed.errors.DivergedError: diverged in round 2: "
                   "client 0's reply — lower train.lr\nERROR : Exit Code: 201\n")  # fmt: skip
    e = local.failed(log, tmp_path / "run", "pflbed flower local --resume run")
    assert e.exit_code == 3 and str(e).startswith("diverged in round 2: client 0's reply — lower train.lr (logs:")
    assert "--resume" not in str(e)


def test_without_a_panel_or_an_exception_the_cause_is_the_logs_last_line_in_one_line_of_at_most_300_characters(
    tmp_path,
):
    """A log Flower wrote in another encoding is still read; a cause is one line (a user's terminal, the note the
    error ends with), cut at 300 characters; no log and an empty one say so."""
    log = tmp_path / "run.log"
    assert local.failure_reason(log) == "no log"
    log.write_bytes(b"")
    assert local.failure_reason(log) == "no output"
    log.write_bytes(b"INFO : starting\n  the SuperLink went \xff away\t  at   once \n\n  \n")
    assert local.failure_reason(log) == "the SuperLink went \ufffd away at once"
    log.write_text("x" * 299 + " yz\n")
    assert local.failure_reason(log) == "x" * 299 + " "
    log.write_text("ValueError: first\n  File x\nKeyError: 'second'\nERROR : Exit Code: 201\n")
    assert local.failure_reason(log) == "KeyError: 'second'"  # the last exception, not the last line


def test_the_resume_command_keeps_the_deployments_security_and_sites(tmp_path):
    out = tmp_path / "run"
    assert local.resume_command(out, False, False) == f"pflbed flower local --resume {out}"
    assert local.resume_command(out, True, True, [Path("a"), Path("b c")]) == (
        f"pflbed flower local --resume {out} --tls --auth --site-data a 'b c'")  # as a shell reads it back
    spaced = tmp_path / "my run"
    assert local.resume_command(spaced, False, False) == f"pflbed flower local --resume '{spaced}'"
    assert local.resume_command(out, False, True, []) == f"pflbed flower local --resume {out} --auth"


def test_a_failed_run_names_its_last_checkpointed_round(tmp_path):
    from pflbed.results.checkpoint import save_checkpoint

    log, out = tmp_path / "run.log", tmp_path / "run"
    log.write_text("RuntimeError: the SuperLink went away\n")
    save_checkpoint(out, 3, {}, {}, [], {})
    e = local.failed(log, out, "pflbed flower local --resume run --tls")
    assert str(e) == (f"the Flower deployment's run did not finish: RuntimeError: the SuperLink went away (logs: {out}/"
                      "flower/run.log, superlink.log, supernode-*.log); round 3 is checkpointed; fix the cause, then "
                      "continue with 'pflbed flower local --resume run --tls'")  # fmt: skip
    assert str(local.failed(log, out, "again", "SuperNode 1 exited (code 2): x")).startswith(
        "the Flower deployment's run did not finish: SuperNode 1 exited (code 2): x (logs: ")


def test_resume_takes_only_a_deployment_run_and_a_finished_one_is_left_alone(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--no-progress", "--out", str(out), *ARGS]) == 0
    capsys.readouterr()
    assert main(["flower", "local", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"not a run of 'pflbed flower local'; continue it with 'pflbed run --resume {out}'" in err
    done = tmp_path / "done"  # a finished deployment run
    done.mkdir()
    (done / "config.yaml").write_text(config_text(load_config(None, [*SETS, "executor.name=flower",
                                                                     "executor.supernodes=2"])))  # fmt: skip
    (done / "summary.json").write_text((out / "summary.json").read_text())
    assert main(["flower", "local", "--resume", str(done)]) == 0
    assert "already finished: nothing to resume" in capsys.readouterr().out


def test_supernodes_past_the_clients_or_the_machine_s_memory_are_refused_before_anything_starts(
    tmp_path, monkeypatch, capsys
):
    """`--supernodes 1000000` started SuperNodes (two processes each) until the machine's memory was gone. A node
    beyond the clients serves none, so more nodes than clients (held-out ones included) is a config error; and the
    nodes a deployment starts must fit in the machine's memory at rest (here made small), checked before the run
    directory is written or any process started."""
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(local, "_start", lambda *a, **k: started.append(a))
    assert main(["flower", "local", "--supernodes", "7", "--out", "run", *ARGS]) == 2
    assert capsys.readouterr().err.strip() == (
        "pflbed: error: config: executor.supernodes: 7 SuperNodes for 6 clients (node k serves the clients whose id "
        "is k modulo 7, so 1 would serve none); at most 6")  # fmt: skip
    load_config(None, [*SETS, "federation.new_clients=1", "executor.name=flower", "executor.supernodes=7"])
    monkeypatch.setattr(memory, "device_memory", lambda device: 3 * local.NODE_BYTES - 1)
    assert main(["flower", "local", "--supernodes", "3", "--out", "run", *ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pflbed: error: executor.supernodes (--supernodes): 3 SuperNodes need at least ") and (
        err.endswith("; at most 2 here")), err  # fmt: skip
    assert started == [] and list(tmp_path.iterdir()) == []


def test_what_flower_local_hands_its_deployment_from_its_options_and_on_resume(tmp_path, monkeypatch, capsys):
    """The options of `pflbed flower local` as the deployment receives them (`run_local`, here a stand-in: the
    deployments themselves are the deployment suite's): the SuperNodes (2 by default; one per `--site-data`
    directory, which sets `sites.local`, `federation.clients` and, with `--secagg`, `sites.secagg`); on `--resume`,
    the run's own config and SuperNodes, changed only where a resume may change it (`executor.threads`), a run of
    another kind (a Flower simulation included) refused, and a site-local run's sites asked for again."""
    import numpy as np

    from pflbed.errors import PflbedError

    calls, outcomes = [], []  # outcomes: what the next deployment ends with (default: a refusal)

    def deployment(cfg, out, supernodes, **kw):
        calls.append((cfg, out, supernodes, {k: kw[k] for k in ("tls", "auth", "force", "resume", "site_data",
                                                                "progress")}))  # fmt: skip
        outcome = outcomes.pop() if outcomes else PflbedError("not deployed")
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(local, "run_local", deployment)
    monkeypatch.chdir(tmp_path)

    def deploy(*argv: str) -> str:
        assert main(["flower", "local", *argv]) == 2
        return capsys.readouterr().err.strip().removeprefix("pflbed: error: ")

    assert deploy("--out", "run", "--tls", *ARGS) == "not deployed"
    cfg, out, supernodes, kw = calls.pop()
    assert (cfg.executor.name, cfg.executor.supernodes, supernodes, out) == ("flower", 2, 2, Path("run"))
    assert kw == {"tls": True, "auth": False, "force": False, "resume": False, "site_data": None, "progress": True}
    sites = [tmp_path / f"site-{k}" for k in range(3)]
    for d in sites:
        d.mkdir()
        np.savez(d / "train.npz", x=np.zeros((6, 8, 8)), y=np.arange(6) % 3)
    assert deploy("--site-data", *map(str, sites), "--secagg", "--auth", "--force", *ARGS) == "not deployed"
    cfg, out, supernodes, kw = calls.pop()
    assert (cfg.sites.local, cfg.sites.secagg, cfg.federation.clients, cfg.executor.supernodes, supernodes) == (
        True, True, 3, 3, 3)  # fmt: skip
    assert kw == {"tls": False, "auth": True, "force": True, "resume": False, "site_data": sites, "progress": True}
    assert deploy("--site-data", *map(str, sites), *ARGS) == "not deployed" and not calls.pop()[0].sites.secagg
    assert deploy("--site-data", *map(str, sites), "--supernodes", "2", *ARGS) == (
        "--supernodes 2 but 3 --site-data directories (one node each)")  # fmt: skip

    def unfinished(name: str, *sets: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(config_text(load_config(None, [*SETS, "executor.name=flower", *sets])))
        return d

    dep = unfinished("dep", "executor.supernodes=3")
    for given in ((), ("--supernodes", "3"), ("--set", "executor.threads=2")):
        assert deploy("--resume", str(dep), *given) == "not deployed", given
        cfg, out, supernodes, kw = calls.pop()
        assert (out, supernodes, kw["resume"], cfg.executor.supernodes) == (dep, 3, True, 3)
        assert cfg.executor.threads == (2 if "--set" in given else 1) and cfg.train.rounds == 2
    different = ("--resume {}: the run was started with a different config (only executor.device, executor.threads, "
                 "executor.workers, executor.batch_clients, executor.compile, executor.deterministic, "
                 "executor.autotune may change when resuming)")  # fmt: skip
    for given in (("--supernodes", "2"), ("--set", "train.rounds=5")):
        assert deploy("--resume", str(dep), *given) == different.format(dep)
    simulation = unfinished("sim")  # `pflbed run --set executor.name=flower`: no SuperNodes of its own
    assert deploy("--resume", str(simulation)) == (
        f"--resume {simulation}: not a run of 'pflbed flower local'; continue it with 'pflbed run --resume "
        f"{simulation}'")  # fmt: skip
    kept = unfinished("kept", "executor.supernodes=3", "sites.local=true", "sites.input_shape=[1,8,8]",
                      "sites.num_classes=3", "federation.clients=3")  # fmt: skip
    assert deploy("--resume", str(kept)) == (f"--resume {kept}: the run keeps its data on the sites; give their "
                                             "directories again with --site-data")  # fmt: skip
    assert deploy("--resume", str(kept), "--site-data", *map(str, sites)) == "not deployed"
    cfg, out, supernodes, kw = calls.pop()
    assert (out, supernodes, kw["site_data"], cfg.sites.local) == (kept, 3, sites, True)
    # what the command prints: the deployment's results and where; on Ctrl-C, the round kept and how to go on
    assert main(["run", "--no-progress", "--out", "plain", *ARGS]) == 0
    capsys.readouterr()
    outcomes.append(json.loads((tmp_path / "plain" / "summary.json").read_text()))
    assert main(["flower", "local", "--out", "run", "--no-progress", *ARGS]) == 0
    printed = capsys.readouterr().out
    assert calls.pop()[3]["progress"] is False and "│ FedAvg │" in printed and printed.endswith("results: run\n")
    assert re.search(r"\ntime: [\d.]+ s wall .*; [\d.]+ s since the command started\n", printed), printed
    from pflbed.results.checkpoint import save_checkpoint

    save_checkpoint(kept, 1, {}, {}, [], {})
    outcomes.append(KeyboardInterrupt())
    assert main(["flower", "local", "--resume", str(kept), "--site-data", *map(str, sites), "--tls"]) == 130
    assert capsys.readouterr().err == (f"pflbed: interrupted; round 1 of 2 is checkpointed in {kept}/checkpoints/"
                                       f"last.pt; continue with '{local.resume_command(kept, True, False, sites)}'\n")
    assert "--site-data" in local.resume_command(kept, True, False, sites)
    calls.pop()
    assert deploy("--resume", str(kept), "--site-data", *map(str, sites[:2])) == (
        f"--resume {kept}: the run has 3 sites; give as many --site-data directories (got 2)")  # fmt: skip
    assert deploy("--resume", str(kept), "--site-data", *map(str, sites), "--secagg") == different.format(kept)
    assert deploy("--resume", str(dep), "--site-data", *map(str, sites)) == (
        f"--resume {dep}: the run's data is the server's (not sites.local); resume it without --site-data")
    assert calls == []


def test_site_data_a_site_would_refuse_is_refused_before_the_deployment_starts(tmp_path, monkeypatch, capsys):
    """A site whose labels are negative or outside `sites.num_classes`, whose training file holds no sample, or
    whose inferred classes exceed a site's bound refused the run only once its node had started: exit 4, the reason
    in a log or in Flower's wrapping of it, and an unfinished run left behind that --resume would not mend. The
    same checks now run on each directory first, naming it; nothing is deployed or written."""
    import numpy as np

    from pflbed.errors import PflbedError

    deployed = []

    def deployment(*args, **kwargs):
        deployed.append(args)
        raise PflbedError("not deployed")

    monkeypatch.setattr(local, "run_local", deployment)
    monkeypatch.chdir(tmp_path)
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d in (good, bad):
        d.mkdir()
    np.savez(good / "train.npz", x=np.zeros((6, 8, 8)), y=np.arange(6) % 3)
    cases = [({"x": np.zeros((6, 8, 8)), "y": np.arange(6) - 3}, [], "labels [-3, -2, -1] are outside the run's "
              "label space 0…2 (sites.num_classes)"),
             ({"x": np.zeros((0, 8, 8)), "y": np.zeros(0, int)}, ["sites.input_shape=[1,8,8]", "sites.num_classes=3"],
              "its training data holds no samples"),
             ({"x": np.zeros((6, 8, 8)), "y": np.arange(6)}, ["sites.num_classes=3"], "labels [3, 4, 5] are outside "
              "the run's label space 0…2 (sites.num_classes)")]  # fmt: skip
    for arrays, sets, said in cases:
        np.savez(bad / "train.npz", **arrays)
        extra = [a for s in sets for a in ("--set", s)]
        assert main(["flower", "local", "--site-data", str(good), str(bad), "--out", "run", *extra, *ARGS]) == 2
        assert capsys.readouterr().err.strip() == f"pflbed: error: --site-data {bad}: {said}"
    np.savez(bad / "train.npz", x=np.zeros((6, 8, 8)), y=np.arange(6) + 1000)  # 1006 classes inferred: over the
    assert main(["flower", "local", "--site-data", str(good), str(bad), "--out", "run", *ARGS]) == 2  # bound
    assert "sites.num_classes=1006, above this site's bound max-classes=1000" in capsys.readouterr().err
    for twice in (str(good), f"{tmp_path}/x/../good"):  # one site's data trained twice, as two sites
        assert main(["flower", "local", "--site-data", str(good), twice, "--out", "run", *ARGS]) == 2
        said = capsys.readouterr().err.strip()
        assert said == f"pflbed: error: --site-data {Path(twice)}: given twice; each site once"
    assert deployed == [] and not (tmp_path / "run").exists()
    np.savez(bad / "train.npz", x=np.ones((6, 8, 8)), y=np.arange(6) % 3)
    assert main(["flower", "local", "--site-data", str(good), str(bad), "--out", "run", *ARGS]) == 2
    assert capsys.readouterr().err.strip() == "pflbed: error: not deployed" and len(deployed) == 1
