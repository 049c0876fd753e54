"""`pflbed flower local`: a real Flower deployment on this machine — one SuperLink and N SuperNodes as separate
processes on 127.0.0.1 — running one experiment, then stopped.

What it does, in order:
1. checks the run directory as `pflbed run` does, writes the app project (`project.write_app`) and, for `tls`, a
   self-signed certificate authority and SuperLink certificate, for `auth` a key pair per SuperNode
   (`certificates.py`), under `<out>/flower/`;
2. starts `flower-superlink` (one port serves its Fleet, Control and runtime APIs; with `auth`, only registered
   SuperNodes may connect: each node's public key is registered with `flwr supernode register`) and the
   SuperNodes, node k with `--node-config "partition-id=k num-partitions=N"` (and its private key), each in its
   own process group;
3. submits the app with `flwr run`, against a Flower home of its own (`<out>/flower/home`: no user configuration
   read or changed), and waits for it: the ServerApp (`flower.server`) writes `<out>`'s config, metrics, checkpoints
   and summary;
4. stops every process it started — process groups, so the processes Flower itself starts (SuperExec, ServerApp,
   ClientApps) go too — also after a failure or Ctrl-C.

Flower's logs land in `<out>/flower/*.log`. Runtime dependency installation is disabled everywhere: the sites run
the pflbed that is installed, with no network.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pflbed.config import Config
from pflbed.errors import PflbedError
from pflbed.flower.certificates import write_certificates, write_node_keys
from pflbed.flower.project import write_app
from pflbed.results.rundir import RunDir

CONNECTION = "pflbed-local"


class FlowerRunError(PflbedError):
    """The deployment's run did not finish (its logs are named in the message)."""

    exit_code = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1"}  # fmt: skip


def _tool(name: str) -> str:
    """A Flower executable next to this Python (the environment pflbed runs in)."""
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else name


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen]]:
    """Started processes, each the leader of its own process group; all groups terminated (then killed) on exit."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the group's stragglers too
            p.wait()
        for p in procs:  # return only once every process of every group is gone
            while time.monotonic() < deadline + 10:
                try:
                    os.killpg(p.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)


def _start(procs: list[subprocess.Popen], cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs.append(p)
    return p


def _wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FlowerRunError(f"the SuperLink exited at start (code {proc.returncode}); see {log}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise FlowerRunError(f"the SuperLink did not listen on port {port} within {timeout:.0f} s; see {log}")


def _register(keys: list[tuple[Path, Path]], env: dict[str, str], log: Path) -> None:
    """Register each SuperNode's public key with the SuperLink (SuperNode authentication)."""
    with open(log, "w") as f:
        for _, public in keys:
            done = subprocess.run([_tool("flwr"), "supernode", "register", str(public), CONNECTION], stdout=f,
                                  stderr=subprocess.STDOUT, env=env)  # fmt: skip
            if done.returncode != 0:
                raise FlowerRunError(f"registering the SuperNode key {public} failed; see {log}")


def run_local(cfg: Config, out: Path, supernodes: int, *, tls: bool = False, auth: bool = False,
              force: bool = False, log=print) -> dict:  # fmt: skip
    """Run `cfg` on a local deployment of `supernodes` SuperNodes (`tls`: encrypted connections; `auth`: only the
    SuperNodes whose keys were registered may connect); the run's summary (also in `out`)."""
    if supernodes < 1:
        raise PflbedError("--supernodes must be at least 1")
    rundir = RunDir.check(out, cfg, force=force)
    rundir.start(cfg)
    work = out / "flower"
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    app = write_app(work / "app", cfg, out.resolve())
    link_tls: list[str] = ["--insecure"]
    node_tls: list[str] = ["--insecure"]
    connection = f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    if tls:
        ca, cert, key = write_certificates(work / "certificates")
        link_tls = ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
        node_tls = ["--root-certificates", str(ca)]
        connection = f'address = "127.0.0.1:{port}"\nroot-certificates = "{ca}"\n'
    flwr_config = f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n{connection}'
    (home / "config.toml").write_text(flwr_config)
    env = _env(home)
    no_install = ["--disable-runtime-dependency-installation"]
    keys = write_node_keys(work / "keys", supernodes) if auth else []
    with _processes() as procs:
        link_log = work / "superlink.log"
        link = _start(procs, [_tool("flower-superlink"), *link_tls, "--port", str(port), "--database",
                              str(work / "superlink.db"), *no_install,
                              *(["--enable-supernode-auth"] if auth else [])], link_log, env)  # fmt: skip
        _wait_for_port(port, link, link_log)
        if auth:
            _register(keys, env, work / "register.log")
        for k in range(supernodes):
            node = f"partition-id={k} num-partitions={supernodes}"
            key = ["--auth-supernode-private-key", str(keys[k][0])] if auth else []
            _start(procs, [_tool("flower-supernode"), *node_tls, *key, "--superlink", f"127.0.0.1:{port}",
                           "--port", str(free_port()), "--node-config", node], work / f"supernode-{k}.log", env)
        security = " and ".join(w for w, on in (("TLS", tls), ("node authentication", auth)) if on)
        log(f"SuperLink on 127.0.0.1:{port}{f' ({security})' if security else ''}, {supernodes} SuperNodes; "
            f"logs in {work}")  # fmt: skip
        run_log = work / "run.log"
        with open(run_log, "w") as f:
            done = subprocess.run([_tool("flwr"), "run", str(app), CONNECTION, "--stream"], stdout=f,
                                  stderr=subprocess.STDOUT, env=env)  # fmt: skip
    summary = out / "summary.json"
    if done.returncode != 0 or not summary.exists():
        raise FlowerRunError(f"the Flower run did not finish (flwr run exit code {done.returncode}); see {run_log} "
                             f"and {work / 'superlink.log'}")  # fmt: skip
    return json.loads(summary.read_text())
