"""The commands `pflbed flower local` hands Flower (`flower/local.py`), run against stand-in tools that record how
they were called: the SuperLink's TLS and authentication options, each node's key registered, each SuperNode's
certificate, key and node config (its site's data and states), the `flwr` connection, and a resumed deployment
starting from a fresh SuperLink. The deployment tests (`-m deployment`) run the same commands against Flower."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from pflbed.config import load_config

pytest.importorskip("flwr")  # the `flower` extra

from pflbed.errors import PflbedError  # noqa: E402
from pflbed.flower import local  # noqa: E402
from pflbed.results.checkpoint import save_checkpoint  # noqa: E402

from .test_flower_local import SETS  # noqa: E402

# one stand-in for every tool: records its name, arguments and Flower home; the SuperLink listens on its port,
# a SuperNode waits to be stopped, `flwr supernode register` refuses a key named bad, `flwr run` waits for the
# `NODES` SuperNodes, then writes the run's summary (or none: a run that did not finish)
TOOL = """import json, os, socket, sys, time
from pathlib import Path
tool, args = Path(sys.argv[0]).name, sys.argv[1:]
with open(os.environ["PFLBED_TEST_CALLS"], "a") as f:
    f.write(json.dumps([tool, args, os.environ["FLWR_HOME"]]) + "\\n")
if tool == "flower-superlink" and os.environ.get("PFLBED_TEST_LINK_FAILS"):
    sys.exit("OSError: the database is locked")
elif tool == "flower-superlink":
    s = socket.socket()
    s.bind(("127.0.0.1", int(args[args.index("--port") + 1])))
    s.listen()
    time.sleep(60)
elif tool == "flower-supernode":
    time.sleep(60)
elif args[0] == "supernode":  # register
    print(*args, os.environ["FLWR_HOME"])
    if args[2].endswith("bad.pub"):
        sys.exit("ValueError: the key is not a public key")
elif args[0] == "run":
    deadline = time.monotonic() + 30  # the run waits for its SuperNodes, as Flower's does
    while open(os.environ["PFLBED_TEST_CALLS"]).read().count('"flower-supernode"') < int(os.environ["NODES"]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    print("INFO : the ServerApp starts", flush=True)
    print("pflbed: warning: a reply refused", file=sys.stderr, flush=True)
    if os.environ["PFLBED_TEST_SUMMARY"]:
        Path(os.environ["PFLBED_TEST_SUMMARY"]).write_text(json.dumps({"rounds": 2}))
"""


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """The stand-in tools' calls so far: [tool, arguments, FLWR_HOME] each, in order."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    for name in ("flower-superlink", "flower-supernode", "flwr"):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{TOOL}")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setattr(local, "_tool", lambda name: str(bin_dir / name))
    monkeypatch.setenv("PFLBED_TEST_CALLS", str(calls))
    monkeypatch.chdir(tmp_path)
    return lambda: [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_tls_auth_and_sites_reach_every_flower_command(tools, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PFLBED_TEST_SUMMARY", str(tmp_path / "run" / "summary.json"))
    monkeypatch.setenv("NODES", "2")
    sites = [tmp_path / "site-a", tmp_path / "site-b"]
    said: list[str] = []
    cfg = load_config(None, SETS)
    summary = local.run_local(cfg, Path("run"), 2, tls=True, auth=True, site_data=sites, log=said.append,
                              progress=False)  # fmt: skip
    assert summary == {"rounds": 2}
    work = tmp_path / "run" / "flower"
    certs, keys, home = work / "certificates", work / "keys", str(work / "home")
    calls = tools()
    # the SuperLink listens, then the keys are registered one by one; the SuperNodes and `flwr run` start side by side
    assert [c[0] for c in calls[:3]] == ["flower-superlink", "flwr", "flwr"]
    assert sorted(c[0] for c in calls[3:]) == ["flower-supernode", "flower-supernode", "flwr"]
    started = sorted(calls[3:], key=lambda c: c[0] == "flwr")  # the SuperNodes, then `flwr run`
    assert all(c[2] == home for c in calls)  # a Flower home of its own
    link = calls[0][1]
    port = _option(link, "--port")
    assert link == ["--ssl-ca-certfile", f"{certs}/ca.crt", "--ssl-certfile", f"{certs}/superlink.pem",
                    "--ssl-keyfile", f"{certs}/superlink.key", "--port", port, "--database", f"{work}/superlink.db",
                    "--disable-runtime-dependency-installation", "--enable-supernode-auth"]  # fmt: skip
    assert [c[1] for c in calls[1:3]] == [["supernode", "register", f"{keys}/node-{k}.pub", "pflbed-local"]
                                          for k in range(2)]  # fmt: skip
    nodes = sorted((c[1] for c in started[:2]), key=lambda a: _option(a, "--node-config"))
    for k, node in enumerate(nodes):
        assert node[:-2] == ["--root-certificates", f"{certs}/ca.crt", "--auth-supernode-private-key",
                             f"{keys}/node-{k}", "--superlink", f"127.0.0.1:{port}", "--node-config",
                             f'partition-id={k} num-partitions=2 data="{sites[k]}" '
                             f'state-dir="{work}/site-{k}-states"']  # fmt: skip
        assert node[-2] == "--port" and node[-1] != port
    assert started[2][1] == ["run", f"{work}/app", "pflbed-local", "--stream"]
    assert (work / "home" / "config.toml").read_text() == (
        f'[superlink]\ndefault = "pflbed-local"\n\n[superlink.pflbed-local]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{certs}/ca.crt"\n')  # fmt: skip
    assert "resume = false" in (work / "app" / "pyproject.toml").read_text()
    assert f'out = "{tmp_path}/run"' in (work / "app" / "pyproject.toml").read_text()  # absolute, for the ServerApp
    assert sorted(p.name for p in work.glob("*.log")) == ["register.log", "run.log", "superlink.log",
                                                           "supernode-0.log", "supernode-1.log"]  # fmt: skip
    assert (work / "run.log").read_text() == "INFO : the ServerApp starts\npflbed: warning: a reply refused\n"
    assert said == [f"SuperLink on 127.0.0.1:{port} (TLS and node authentication), 2 SuperNodes; logs in run/flower",
                    "pflbed: warning: a reply refused"]  # the ServerApp's warning, passed on
    with pytest.raises(PflbedError, match="holds a finished run of this config"):  # not overwritten unasked
        local.run_local(cfg, Path("run"), 2, tls=True, auth=True, site_data=sites, progress=False)
    for stale in ("superlink.db", "home/stale", "app/stale"):  # as the replaced deployment left them
        (work / stale).write_text("the replaced deployment's")
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "0")
    capsys.readouterr()
    assert local.run_local(cfg, Path("run"), 2, force=True, site_data=sites, log=said.append, progress=True) == (
        {"rounds": 2})  # fmt: skip
    lines = capsys.readouterr().out.splitlines()  # a new run: from round 0
    assert lines and all(x.endswith("] fedavg on synthetic: the deployment is running; no round evaluated or "
                                    "checkpointed yet") for x in lines[1:]), lines  # fmt: skip
    assert lines[0] == "fedavg on synthetic: 2 rounds; starting a SuperLink and 2 SuperNodes…"
    assert not any((work / s).exists() for s in ("superlink.db", "home/stale", "app/stale"))  # a fresh SuperLink
    assert (work / "home" / "config.toml").read_text().endswith("insecure = true\n")


def test_without_tls_every_connection_is_plain_and_a_resumed_deployment_starts_afresh(tools, tmp_path, monkeypatch,
                                                                                       capsys):  # fmt: skip
    """A deployment whose run did not finish, continued: the run directory stays, the SuperLink's state and the
    Flower home and app go (a fresh SuperLink), the app resumes, and the first command says so."""
    monkeypatch.setenv("PFLBED_TEST_SUMMARY", "")  # `flwr run` ends without a summary: the run did not finish
    monkeypatch.setenv("NODES", "1")
    shown: list[tuple[bool, str]] = []
    monkeypatch.setattr(local, "announce", lambda on, text: shown.append((on, text)))
    cfg = load_config(None, SETS)
    said: list[str] = []
    with pytest.raises(local.FlowerRunError) as e:
        local.run_local(cfg, Path("run"), 1, log=said.append, progress=False)
    assert str(e.value).startswith("the Flower deployment's run did not finish: pflbed: warning: a reply refused")
    assert str(e.value).endswith("no round was checkpointed yet (it starts over); fix the cause, then continue with "
                                 "'pflbed flower local --resume run'")  # fmt: skip
    work = tmp_path / "run" / "flower"
    calls = tools()
    assert calls[0][0] == "flower-superlink" and sorted(c[0] for c in calls[1:]) == ["flower-supernode", "flwr"]
    port = _option(calls[0][1], "--port")
    assert calls[0][1] == ["--insecure", "--port", port, "--database", f"{work}/superlink.db",
                           "--disable-runtime-dependency-installation"]  # fmt: skip
    node = next(c[1] for c in calls if c[0] == "flower-supernode")
    assert node[:-2] == ["--insecure", "--superlink", f"127.0.0.1:{port}", "--node-config",
                         "partition-id=0 num-partitions=1"]  # fmt: skip
    assert (work / "home" / "config.toml").read_text().endswith(f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    assert not (work / "certificates").exists() and not (work / "keys").exists()
    assert said[0] == f"SuperLink on 127.0.0.1:{port}, 1 SuperNodes; logs in run/flower"
    with pytest.raises(PflbedError, match="continue it with 'pflbed flower local --resume run --tls --site-data s'"):
        local.run_local(cfg, Path("run"), 1, tls=True, site_data=[Path("s")], progress=False)

    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "0")
    capsys.readouterr()
    with pytest.raises(local.FlowerRunError):  # resumed before any round was checkpointed: it starts over
        local.run_local(cfg, Path("run"), 1, resume=True, log=lambda _: None, progress=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(x.endswith("] fedavg on synthetic: the deployment is running; no round evaluated or "
                                    "checkpointed yet") for x in lines)  # fmt: skip

    for stale in ("superlink.db", "superlink.db-wal", "home/stale"):
        (work / stale).write_text("the failed deployment's")
    shutil.rmtree(work / "app")  # one the failed deployment left, one not
    (tmp_path / "run" / "kept").write_text("the run's")
    monkeypatch.setenv("PFLBED_TEST_SUMMARY", str(tmp_path / "run" / "summary.json"))
    save_checkpoint(tmp_path / "run", 1, {}, {}, [], {})
    assert local.run_local(cfg, Path("run"), 1, resume=True, log=lambda _: None, progress=True) == {"rounds": 2}
    lines = capsys.readouterr().out.splitlines()  # the resumed run's progress starts at its checkpoint
    assert lines[0].endswith("] fedavg on synthetic: resumed after round 1/2") and len(lines) > 1
    assert all(x.endswith("] fedavg on synthetic: the deployment is running; round 1/2 done") for x in lines[1:])
    assert shown == [(False, "fedavg on synthetic: 2 rounds; starting a SuperLink and 1 SuperNodes…"),
                     *[(True, "fedavg on synthetic: 2 rounds, resuming; starting a SuperLink and 1 SuperNodes…")] * 2]
    assert not any((work / s).exists() for s in ("superlink.db", "superlink.db-wal", "home/stale"))
    assert (tmp_path / "run" / "kept").read_text() == "the run's"
    assert "resume = true" in (work / "app" / "pyproject.toml").read_text()


def test_a_deployment_needs_a_supernode_and_one_data_directory_per_supernode(tools, tmp_path, monkeypatch):
    cfg = load_config(None, SETS)
    with pytest.raises(PflbedError, match="^--supernodes must be at least 1$"):
        local.run_local(cfg, Path("run"), 0, progress=False)
    with pytest.raises(PflbedError, match="^1 --site-data directories for 2 SuperNodes$"):
        local.run_local(cfg, Path("run"), 2, site_data=[tmp_path], progress=False)
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "soon")  # refused before anything starts, as by `pflbed run`
    with pytest.raises(PflbedError, match="PFLBED_PROGRESS_INTERVAL"):  # progress is shown unless turned off
        local.run_local(cfg, Path("run"), 1)
    assert tools() == [] and not (tmp_path / "run").exists()


def test_a_superlink_that_exits_at_start_is_the_error_with_its_cause_and_log(tools, tmp_path, monkeypatch):
    monkeypatch.setenv("PFLBED_TEST_LINK_FAILS", "1")
    with pytest.raises(local.FlowerRunError) as e:
        local.run_local(load_config(None, SETS), Path("run"), 1, progress=False)
    assert str(e.value) == ("the SuperLink exited at start (code 1): OSError: the database is locked; see "
                            f"{tmp_path}/run/flower/superlink.log")  # fmt: skip
    assert [c[0] for c in tools()] == ["flower-superlink"]  # nothing else started


def test_each_node_key_is_registered_with_the_superlink_and_a_refusal_stops_the_start(tools, tmp_path):
    """`--auth`: `flwr supernode register <public key> <connection>` per node, against the deployment's Flower home;
    the first refusal is the error, with Flower's cause and its log."""
    env, log = local._env(tmp_path / "home"), tmp_path / "register.log"
    keys = [(tmp_path / f"node-{k}", tmp_path / f"node-{k}.pub") for k in range(2)]
    local._register(keys, env, log)
    assert log.read_text().splitlines() == [
        f"supernode register {tmp_path}/node-{k}.pub pflbed-local {tmp_path}/home" for k in range(2)]
    bad = [*keys[:1], (tmp_path / "bad", tmp_path / "bad.pub"), *keys[1:]]
    with pytest.raises(local.FlowerRunError) as e:
        local._register(bad, env, log)
    assert str(e.value) == (f"registering the SuperNode key {tmp_path}/bad.pub failed: ValueError: the key is not a "
                            f"public key; see {log}")  # fmt: skip
    assert len(log.read_text().splitlines()) == 3  # the log begins anew; node-1 was not asked


def test_auth_without_tls_is_refused_before_anything_starts_or_is_written(tools, tmp_path):
    """Flower's SuperLink refuses node authentication over plain connections: it exited at start, its reason only
    in its log, and left an unfinished run that only --resume or --force would then take."""
    with pytest.raises(PflbedError, match=r"^--auth needs --tls: Flower authenticates SuperNodes only over encrypted "
                                          r"connections$"):  # fmt: skip
        local.run_local(load_config(None, SETS), Path("run"), 2, auth=True, progress=False)
    assert tools() == [] and not (tmp_path / "run").exists()
