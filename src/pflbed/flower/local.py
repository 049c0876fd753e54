"""`pflbed flower local`: a real Flower deployment on this machine — one SuperLink and N SuperNodes as separate
processes on 127.0.0.1 — running one experiment, then stopped.

What it does, in order:
1. checks the run directory as `pflbed run` does (with `resume`: an unfinished run of this config, continued from
   its last checkpoint), writes the app project (`project.write_app`) and, for `tls`, a self-signed certificate
   authority and SuperLink certificate, for `auth` a key pair per SuperNode (`certificates.py`), under
   `<out>/flower/`; every path handed to Flower is absolute (Flower refuses relative certificate paths);
2. starts `flower-superlink` (one port serves its Fleet, Control and runtime APIs; with `auth`, only registered
   SuperNodes may connect: each node's public key is registered with `flwr supernode register`) and the
   SuperNodes, node k with `--node-config "partition-id=k num-partitions=N"` (and its private key), each in its
   own process group, each process on a port of its own (`free_port`); while the run goes, a SuperNode whose port
   was taken is started again on another and one that exits otherwise stops the run (`SuperNodes`);
3. submits the app with `flwr run`, against a Flower home of its own (`<out>/flower/home`: no user configuration
   read or changed), and waits for it: the ServerApp (`flower.server`) writes `<out>`'s config, metrics, checkpoints
   and summary, which are the progress shown meanwhile (`Follower`: each evaluation and checkpointed round, and
   with output redirected a line at least every `PFLBED_PROGRESS_INTERVAL` seconds while the deployment works);
4. stops every process it started — their process groups and the groups of every process they started, so the
   processes Flower itself starts go too (ClientApps in their SuperNode's group; the SuperExec, and with it the
   ServerApp, in a group of its own) — also after a failure or Ctrl-C.

Flower's logs land in `<out>/flower/*.log`. A deployment that fails (a process that does not start, a run that does
not finish) raises `FlowerRunError` (exit code 4) with the cause read from the logs and the command that continues
the run. Runtime dependency installation is disabled everywhere: the sites run the pflbed that is installed, with no
network.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pflbed.config import Config
from pflbed.engine.progress import RunProgress, announce, interval_s, plain_lines
from pflbed.errors import PflbedError
from pflbed.flower.certificates import write_certificates, write_node_keys
from pflbed.flower.project import write_app
from pflbed.memory import check_processes
from pflbed.results.checkpoint import checkpoint_path, checkpoint_round
from pflbed.results.rundir import RunDir

CONNECTION = "pflbed-local"
NODE_BYTES = 200 * 2**20  # a SuperNode and its SuperExec at rest: measured 105 + 110 MB resident (flwr 1.42)


class FlowerRunError(PflbedError):
    """The deployment did not finish: a Flower process failed to start or the run stopped (the message gives the
    cause from the logs, names them, and says how to continue). Exit code 4: neither bad input (2) nor a diverged
    run (3)."""

    exit_code = 4


class FlowerDivergedError(FlowerRunError):
    """The deployment's run diverged (a non-finite loss or parameter): exit code 3, as any diverged run."""

    exit_code = 3


def resume_command(out: Path, tls: bool, auth: bool, site_data: list[Path] | None = None) -> str:
    """The command that continues the deployment's run in `out` with the same security (and sites)."""
    sites = ["--site-data", *map(str, site_data)] if site_data else []
    return shlex.join(["pflbed", "flower", "local", "--resume", str(out), *["--tls"] * tls, *["--auth"] * auth, *sites])


def failure_reason(log: Path) -> str:
    """The cause of a failed `flwr run`, from its log: the text of Flower's error panel, else the last exception
    line (a ServerApp's traceback), else the log's last line."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    panel = [line.strip("│ ").strip() for line in lines if line.startswith("│")]
    if panel:
        return " ".join(p for p in panel if p)
    errors = [line.strip() for line in lines if re.match(r"\s*(\w+\.)*\w*(Error|Exception)\b:", line)]
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    return " ".join((errors[-1] if errors else last).split())[:300] or "no output"


PORTS = range(20000, 32768)  # below Linux's default ephemeral range (32768–60999) and macOS's (49152–65535)


def _ephemeral() -> range:
    """The ports the kernel gives outgoing connections (Linux's setting; its default where it cannot be read)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(draw: random.Random | None = None, attempts: int = 64) -> int:
    """A port on 127.0.0.1 that is free now, for a SuperLink or SuperNode to listen on. Drawn at random (`draw`;
    the OS's randomness by default) from `PORTS` outside the ephemeral range: a port the kernel picks as free (bind
    to 0) lies in that range, from which every outgoing connection (the deployment's own, and on a shared machine
    anyone's) takes its local port, so one could take it before the process started on it binds it; a port outside
    it only another listener can take, and concurrent deployments rarely draw the same. Where the ephemeral range
    leaves fewer than 1,000 of `PORTS` (an unusual setting), the kernel's choice."""
    draw = draw or random.SystemRandom()
    ephemeral = _ephemeral()
    ports = [p for p in PORTS if p not in ephemeral]
    for _ in range(attempts) if len(ports) >= 1000 else ():
        port = draw.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # another listener's
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_taken(log: Path) -> bool:
    """Whether the process that wrote `log` exited because its port was taken (EADDRINUSE, the OS's text)."""
    try:
        return "address already in use" in log.read_text(errors="replace").lower()
    except OSError:
        return False


class SuperNodes:
    """The deployment's SuperNodes, each started on a `free_port` and watched while the run goes. A SuperNode whose
    port was taken after all exits at once ("address already in use"): `watch` starts it again on another port (up
    to `restarts` times), appending to the same log, while the ServerApp still waits for its nodes. Any other exit
    is returned, so that the launcher stops the run with the node's cause at once rather than the ServerApp waiting
    out its timeout for a node that will not come."""

    def __init__(self, procs: list[subprocess.Popen], work: Path, env: dict[str, str], restarts: int = 3) -> None:
        self.procs, self.work, self.env, self.restarts = procs, work, env, restarts
        self.nodes: dict[int, tuple[subprocess.Popen, list[str], int]] = {}  # k → process, command, restarts left

    def log(self, k: int) -> Path:
        return self.work / f"supernode-{k}.log"

    def start(self, k: int, cmd: list[str]) -> None:
        """Start SuperNode `k` as `cmd` (its command line without `--port`)."""
        self.nodes[k] = (_start(self.procs, [*cmd, "--port", str(free_port())], self.log(k), self.env), cmd,
                         self.restarts)  # fmt: skip

    def watch(self) -> dict[int, int]:
        """Start again each SuperNode that exited because its port was taken; those that exited otherwise (k → exit
        code)."""
        exited = {}
        for k, (proc, cmd, left) in list(self.nodes.items()):
            if proc.poll() is None:
                continue
            if left and port_taken(self.log(k)):
                port = free_port()
                with open(self.log(k), "a") as f:
                    f.write(f"pflbed: SuperNode {k}'s port was taken; started again on port {port}\n")
                self.nodes[k] = (_start(self.procs, [*cmd, "--port", str(port)], self.log(k), self.env, "a"), cmd,
                                 left - 1)  # fmt: skip
            else:
                exited[k] = proc.returncode
        return exited


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1"}  # fmt: skip


def _tool(name: str) -> str:
    """A Flower executable next to this Python (the environment pflbed runs in)."""
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else name


def _descendants(roots: list[int]) -> set[int]:
    """The live descendants of the processes `roots` (read from /proc; none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{d}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _groups(procs: list[subprocess.Popen]) -> set[int]:
    """The process groups of the started processes and of all their descendants: Flower starts some in groups of
    their own (the SuperLink's SuperExec, and with it the ServerApp), which an orphaned child would keep alive."""
    groups = {p.pid for p in procs}
    for pid in _descendants([p.pid for p in procs]):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgrp())  # never this process's own group
    return groups


def _signal(groups: set[int], sig: int) -> None:
    for g in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, sig)


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen]]:
    """Started processes, each the leader of its own process group; on exit, those groups and the groups of every
    process they started are terminated (then killed), and this returns once all are gone."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        groups = _groups(procs)  # before any exits: an orphan's parent is no longer its started ancestor
        _signal(groups, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        _signal(groups, signal.SIGKILL)  # the stragglers
        for p in procs:
            p.wait()
        while any(_alive(g) for g in groups) and time.monotonic() < deadline + 10:
            time.sleep(0.05)


def _start(procs: list[subprocess.Popen], cmd: list[str], log: Path, env: dict[str, str],
           mode: str = "w") -> subprocess.Popen:  # fmt: skip
    with open(log, mode) as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs.append(p)
    return p


def _wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FlowerRunError(f"the SuperLink exited at start (code {proc.returncode}): {failure_reason(log)}; "
                                 f"see {log}")  # fmt: skip
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
                raise FlowerRunError(f"registering the SuperNode key {public} failed: {failure_reason(log)}; "
                                     f"see {log}")  # fmt: skip


class Follower:
    """The progress of the deployment's run, read from what its ServerApp writes to the run directory: each new
    evaluation record (metrics.jsonl) and each newly checkpointed round, shown on `bar`, and a heartbeat between
    them. The ServerApp runs in a process of Flower's, whose output nobody sees but `run_log`: its `pflbed: warning:`
    lines (a privacy noise that swamps the updates, a refused reply) are passed on to `log` as they appear, progress
    shown or not."""

    def __init__(self, out: Path, bar: RunProgress, run_log: Path | None = None, log=print) -> None:
        self.out, self.bar, self.run_log, self.log = out, bar, run_log, log
        self.seen = len(self._records())  # a resumed run's earlier records: shown by the run that logged them
        self.stamp = self._stamp()
        self.read = 0  # bytes of run_log read so far

    def _warnings(self) -> None:
        """The ServerApp's warning lines written since the last poll (whole lines: the last may be being written)."""
        if self.run_log is None:
            return
        try:
            with open(self.run_log, "rb") as f:
                f.seek(self.read)
                new = f.read()
        except OSError:
            return
        whole = new[: new.rfind(b"\n") + 1]
        self.read += len(whole)
        for line in whole.decode(errors="replace").splitlines():
            if line.lstrip().startswith("pflbed: warning:"):
                self.log(line.strip())

    def _records(self) -> list[dict]:
        """The complete lines of metrics.jsonl (the last one may be being written)."""
        try:
            lines = (self.out / "metrics.jsonl").read_text().splitlines(keepends=True)
        except OSError:
            return []
        records = []
        for line in lines:
            with contextlib.suppress(ValueError):
                records.append(json.loads(line) if line.endswith("\n") else None)
        return [r for r in records if isinstance(r, dict) and isinstance(r.get("round"), int)]

    def _stamp(self) -> float | None:
        with contextlib.suppress(OSError):
            return checkpoint_path(self.out).stat().st_mtime
        return None

    def poll(self) -> None:
        self._warnings()
        if self.bar.mode == "off":
            return
        records = self._records()
        self.seen = min(self.seen, len(records))  # a resumed run rewrites them to its checkpoint's first
        for record in records[self.seen :]:
            self.bar.round_done(int(record["round"]), record)
        self.seen = len(records)
        if (stamp := self._stamp()) != self.stamp:
            self.stamp = stamp
            if (rnd := checkpoint_round(self.out) or 0) > self.bar.done:
                self.bar.round_done(rnd, None)
        done, rounds = self.bar.done, self.bar.rounds
        if done >= rounds:
            self.bar.heartbeat(f"all {rounds} rounds done; the deployment runs the final evaluation stages")
        else:
            self.bar.heartbeat(f"the deployment is running; round {done}/{rounds} done" if done else
                               "the deployment is running; no round evaluated or checkpointed yet")  # fmt: skip


def _wait(proc: subprocess.Popen, follower: Follower, poll_s: float = 1.0, watch: Callable[[], None] = lambda: None
          ) -> int:  # fmt: skip
    """`proc`'s exit code, showing the run's progress meanwhile and calling `watch` (which may raise) at each poll;
    stopped with it on any exception (Ctrl-C)."""
    try:
        while proc.poll() is None:
            follower.poll()
            watch()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(poll_s)
        follower.poll()
        return proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def check_site_data(cfg: Config, path: Path, site: int, sites: int) -> None:
    """Site `site`'s data (`--site-data path`) as its SuperNode will read, report and have it checked at start-up:
    the run's config as the site accepts it (`site_policy.check`), its files (`sites.read_site`), its report against
    the run's input shape and label space (`sites.check_report`). Each site's own checks stay, and run again in its
    node: here they run before the deployment starts, since a site that refuses only once started left an unfinished
    run behind, its reason in a node's log or in Flower's wrapping of it."""
    from pflbed.flower.client import PARTITION, PARTITIONS
    from pflbed.flower.project import config_json
    from pflbed.flower.site_policy import check
    from pflbed.flower.sites import DATA, check_report, read_site, report

    node = {PARTITION: site, PARTITIONS: sites, DATA: str(path)}
    try:
        accepted = check(node, config_json(cfg))
        files = read_site(node, accepted)
        assert files is not None  # the node config names its data
        if not len(files.data):  # else "client 0 of 1 has no training samples; lower clients="
            raise PflbedError("its training data holds no samples")
        check_report(cfg, site, report(files, 1, accepted, site))
    except PflbedError as e:
        raise PflbedError(f"--site-data {path}: {str(e).removeprefix(f'site {site}: ')}") from None


def run_local(cfg: Config, out: Path, supernodes: int, *, tls: bool = False, auth: bool = False,
              force: bool = False, resume: bool = False, site_data: list[Path] | None = None,
              log=print, progress: bool = True) -> dict:  # fmt: skip
    """Run `cfg` on a local deployment of `supernodes` SuperNodes (`tls`: encrypted connections; `auth`: only the
    SuperNodes whose keys were registered may connect); the run's summary (also in `out`). With `resume`, continue
    the unfinished run in `out` from its last checkpoint on a fresh SuperLink and SuperNodes. `site_data`: one
    directory per SuperNode, its site's own data (`sites.local`); each site keeps its clients' states in
    `<out>/flower/site-<k>-states`. `progress`: show the run's progress (`Follower`), as `pflbed run` does."""
    started = time.perf_counter()
    if plain_lines(progress):  # a bad PFLBED_PROGRESS_INTERVAL is refused before anything starts
        interval_s()
    if supernodes < 1:
        raise PflbedError("--supernodes must be at least 1")
    if auth and not tls:  # the SuperLink exited at start, the reason in its log, leaving an unfinished run behind
        raise PflbedError("--auth needs --tls: Flower authenticates SuperNodes only over encrypted connections")
    check_processes(supernodes, NODE_BYTES, "SuperNodes", "executor.supernodes (--supernodes)")
    if site_data is not None and len(site_data) != supernodes:
        raise PflbedError(f"{len(site_data)} --site-data directories for {supernodes} SuperNodes")
    again = resume_command(out, tls, auth, site_data)
    rundir = RunDir.check(out, cfg, force=force, resume=resume, resume_with=again)
    if not resume:
        rundir.start(cfg)
        rundir.release()  # the ServerApp's process holds the run directory while it runs the experiment
    shown = out / "flower"  # as the user gave it, for messages; Flower gets absolute paths
    work = out.resolve() / "flower"
    home = work / "home"
    # an earlier deployment's SuperLink state, Flower home and app go (a resumed one's, or one `force` replaces):
    # each deployment starts a fresh SuperLink; the run directory and the sites' states stay
    for stale in ("home", "app"):
        shutil.rmtree(work / stale, ignore_errors=True)
    for db in work.glob("superlink.db*"):
        db.unlink()
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    app = write_app(work / "app", cfg, out.resolve(), resume=resume)
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
    title = f"{cfg.algorithm.name} on {cfg.dataset.name}"
    announce(progress, f"{title}: {cfg.train.rounds} rounds{', resuming' if resume else ''}; starting a SuperLink and "
                       f"{supernodes} SuperNodes…")  # fmt: skip
    with _processes() as procs:
        link_log = work / "superlink.log"
        link = _start(procs, [_tool("flower-superlink"), *link_tls, "--port", str(port), "--database",
                              str(work / "superlink.db"), *no_install,
                              *(["--enable-supernode-auth"] if auth else [])], link_log, env)  # fmt: skip
        _wait_for_port(port, link, link_log)
        if auth:
            _register(keys, env, work / "register.log")
        nodes = SuperNodes(procs, work, env)
        for k in range(supernodes):
            node = f"partition-id={k} num-partitions={supernodes}"
            if site_data is not None:  # TOML strings: the node config parser's format
                data, states = site_data[k].resolve(), work / f"site-{k}-states"
                node += f" data={json.dumps(str(data))} state-dir={json.dumps(str(states))}"
            key = ["--auth-supernode-private-key", str(keys[k][0])] if auth else []
            nodes.start(k, [_tool("flower-supernode"), *node_tls, *key, "--superlink", f"127.0.0.1:{port}",
                            "--node-config", node])  # fmt: skip
        security = " and ".join(w for w, on in (("TLS", tls), ("node authentication", auth)) if on)
        log(f"SuperLink on 127.0.0.1:{port}{f' ({security})' if security else ''}, {supernodes} SuperNodes; "
            f"logs in {shown}")  # fmt: skip
        run_log = work / "run.log"
        first = (checkpoint_round(out) or 0) if resume else 0
        with open(run_log, "w") as f, RunProgress(progress, title, cfg.train.rounds, first, t0=started) as bar:
            flwr = subprocess.Popen([_tool("flwr"), "run", str(app), CONNECTION, "--stream"], stdout=f,
                                    stderr=subprocess.STDOUT, env=env)  # fmt: skip

            def nodes_up() -> None:
                if exited := nodes.watch():
                    k, code = min(exited.items())
                    cause = f"SuperNode {k} exited (code {code}): {failure_reason(nodes.log(k))}"
                    raise failed(run_log, out, again, cause)

            code = _wait(flwr, Follower(out, bar, run_log, log), watch=nodes_up)
    summary = out / "summary.json"
    if code != 0 or not summary.exists():
        raise failed(run_log, out, again)
    return json.loads(summary.read_text())


def failed(run_log: Path, out: Path, again: str, reason: str | None = None) -> FlowerRunError:
    """The error for a deployment whose run did not finish: the cause (`reason`, else read from `run_log`), where the
    logs are, and (unless it diverged, where the lr must change first) from which round and with which command it
    continues."""
    reason = failure_reason(run_log) if reason is None else reason
    logs = f"(logs: {out / 'flower'}/run.log, superlink.log, supernode-*.log)"
    diverged = "pflbed.errors.DivergedError: "
    if reason.startswith(diverged):
        return FlowerDivergedError(f"{reason.removeprefix(diverged)} {logs}")
    return FlowerRunError(f"the Flower deployment's run did not finish: {reason} {logs}; {_continue(out, again)}")


def _continue(out: Path, again: str) -> str:
    """How to continue the run in `out`: from which checkpoint, with which command."""
    rnd = checkpoint_round(out)
    where = f"round {rnd} is checkpointed" if rnd else "no round was checkpointed yet (it starts over)"
    return f"{where}; fix the cause, then continue with '{again}'"
