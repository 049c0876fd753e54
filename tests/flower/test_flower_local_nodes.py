"""The local deployment's ports and SuperNodes (`flower/local.py`): ports drawn outside the ephemeral range and
checked free, a SuperNode whose port was taken started again on another, and one that exits otherwise stopping the
run at once with its cause (it had the ServerApp wait out its 120 s for a node that would never come)."""

import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")  # the `flower` extra

from pflbed.cli import main  # noqa: E402
from pflbed.flower import local  # noqa: E402

from .test_flower_local import ARGS  # noqa: E402
from .test_flower_local_processes import fake_files  # noqa: E402

# a stand-in SuperNode: listens on its `--port` until stopped; a taken port is the OS's EADDRINUSE, as Flower's
NODE = """import os, socket, sys, time
print("home", os.environ["FLWR_HOME"], flush=True)
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])))
s.listen()
time.sleep(60)
"""


@pytest.fixture
def taken():
    """A port another process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


class Scripted(random.Random):
    """Draws `first` first, then what a seeded generator draws."""

    def __init__(self, first: int) -> None:
        super().__init__(0)
        self.first = [first]

    def choice(self, seq):
        return self.first.pop() if self.first else super().choice(seq)


def test_ports_are_drawn_outside_the_ephemeral_range_and_free(monkeypatch, taken):
    """Outgoing connections take their local ports from the ephemeral range, so one there can be taken between the
    draw and the bind; a port another process listens on is passed over; where the ephemeral range leaves too few
    ports to draw from, the kernel's choice."""
    ephemeral = local._ephemeral()
    ports = [local.free_port(random.Random(seed)) for seed in range(50)]
    assert all(p in local.PORTS and p not in ephemeral for p in ports), ports
    assert len(set(ports)) > 40  # drawn, not the first free one
    monkeypatch.setattr(local, "_ephemeral", lambda: range(30000, 60000))  # 10,000 of PORTS left
    drawn = local.free_port(Scripted(taken))
    assert drawn != taken and drawn in local.PORTS and drawn < 30000
    monkeypatch.setattr(local, "_ephemeral", lambda: range(21000, 60000))  # 1,000 left: still drawn
    assert 20000 <= local.free_port(random.Random(0)) < 21000
    monkeypatch.setattr(local, "_ephemeral", lambda: range(20999, 60000))  # 999 left: the kernel's
    port = local.free_port(Never())
    assert port in ephemeral  # where the kernel's choices lie
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # and free


class Never(random.Random):
    def choice(self, seq):
        raise AssertionError("drawn")


def test_the_ephemeral_range_is_the_kernels_setting():
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not path.exists():
        assert local._ephemeral() == range(32768, 61000)
        return
    low, high = map(int, path.read_text().split())
    assert local._ephemeral() == range(low, high + 1)


@pytest.mark.parametrize("setting", [PermissionError("not ours"), "32768\n"], ids=["unreadable", "malformed"])
def test_where_the_kernel_does_not_say_the_ephemeral_range_is_linuxs_default(setting, monkeypatch):
    fake_files(monkeypatch, {"/proc/sys/net/ipv4/ip_local_port_range": setting})
    assert local._ephemeral() == range(32768, 61000)


def test_a_supernode_on_a_taken_port_exits_and_says_so(tmp_path, taken):
    """Flower's own SuperNode: what `port_taken` reads is what it writes when its port is taken."""
    log = tmp_path / "supernode-0.log"
    with local._processes() as procs:
        node = local._start(procs, [local._tool("flower-supernode"), "--insecure", "--superlink", "127.0.0.1:9",
                                    "--port", str(taken)], log, local._env(tmp_path))  # fmt: skip
        assert node.wait(60) != 0
    assert local.port_taken(log)
    log.write_text("INFO: Starting Flower SuperNode\nRuntimeError: something else\n")
    assert not local.port_taken(log)
    assert not local.port_taken(tmp_path / "missing.log")


def _exited(node: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while node.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert node.poll() is not None


def _listening(port: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def test_a_supernode_whose_port_was_taken_starts_again_on_another_until_its_restarts_are_spent(
    tmp_path, monkeypatch, taken
):
    """The first port drawn is taken: the node exits, `watch` starts it again on a fresh port, appending to its log,
    and reports nothing; with its restarts spent, the exit is reported (node → exit code)."""
    draws, fresh = iter([taken]), local.free_port()  # not a fixed port: tests run side by side
    monkeypatch.setattr(local, "free_port", lambda: next(draws, None) or fresh)
    with local._processes() as procs:
        nodes = local.SuperNodes(procs, tmp_path, local._env(tmp_path), restarts=1)
        nodes.start(3, [sys.executable, "-c", NODE])
        first = nodes.nodes[3][0]
        _exited(first)
        assert nodes.watch() == {}
        again = nodes.nodes[3][0]
        assert again is not first and again.args[-1] == str(fresh)
        assert _listening(fresh) and again.poll() is None
        assert nodes.watch() == {}
        log = nodes.log(3).read_text()
        assert "Address already in use" in log
        assert log.count(f"home {tmp_path}\n") == 2  # the deployment's environment, at each start
        assert f"pflbed: SuperNode 3's port was taken; started again on port {fresh}" in log
        draws = iter([taken, taken])
        nodes.start(4, [sys.executable, "-c", NODE])
        _exited(nodes.nodes[4][0])
        assert nodes.watch() == {}
        _exited(nodes.nodes[4][0])
        assert nodes.watch() == {4: 1}


def test_a_supernode_that_exits_otherwise_stops_the_run_at_once_with_its_cause(tmp_path, monkeypatch, capsys):
    """A SuperNode that cannot run (here: a stand-in that fails at start) is one line naming it, its cause and the
    logs, exit code 4, seconds after the start, not the ServerApp's timeout waiting for nodes."""
    broken = tmp_path / "broken-supernode"
    broken.write_text(f"#!{sys.executable}\nraise RuntimeError('the node cannot start')\n")
    broken.chmod(0o755)
    real = local._tool
    monkeypatch.setattr(local, "_tool", lambda name: str(broken) if name == "flower-supernode" else real(name))
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    assert main(["flower", "local", "--supernodes", "1", "--out", "run", *ARGS]) == 4
    assert time.monotonic() - started < 90
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert err.startswith("pflbed: error: the Flower deployment's run did not finish: SuperNode 0 exited (code 1): "
                          "RuntimeError: the node cannot start (logs: run/flower/run.log, ")  # fmt: skip
    assert err.endswith("no round was checkpointed yet (it starts over); fix the cause, then continue with "
                        "'pflbed flower local --resume run'")  # fmt: skip
