"""How `pflbed flower local` finds and stops what it started (`flower/local.py`): the process tree read from /proc
(a process name may hold ")" and spaces; a process may vanish while it is read), the process groups to stop (never
this process's own), signals to groups already gone or not ours, and the environment and tools its processes get."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")  # the `flower` extra

from pflbed.flower import local  # noqa: E402

# /proc/<pid>/stat as Linux writes it: pid (comm) state ppid …; comm is the process's name, which may hold anything
STATS = {
    "10": "10 (supernode) S 1 10 10 0",
    "11": "11 (a) 2 (b) S 10 10 10 0",  # a name holding ") 2 (": the parent is the field after the last ")"
    "12": "12 (clientapp) R 10 12 12 0",
    "13": "13 (x y) S 11 12 12 0",  # a grandchild, under a name with a space
    "14": "14 (other) S 1 14 14 0",  # not a descendant
    "15": "15 (cut",  # written while the process went: no ")"
    "16": "16 (odd) S ? 16 16 0",  # a parent that is no number
}


def fake_files(monkeypatch, files: dict[str, str | OSError]) -> None:
    """`local` reads `files` (path → its text, or the error reading it raises) and no other file: a path it was not
    meant to read fails the test rather than passing for a missing file."""

    class Read(Path(".").__class__):
        def read_text(self, *a, **k):
            if str(self) not in files:
                pytest.fail(f"read {self}")
            if isinstance(text := files[str(self)], OSError):
                raise text
            return text

    monkeypatch.setattr(local, "Path", Read)


@pytest.fixture
def proc_tree(monkeypatch):
    """/proc as `STATS` (plus "17", a process gone before its stat is read, and entries that are not processes)."""
    fake_files(monkeypatch, {**{f"/proc/{pid}/stat": stat for pid, stat in STATS.items()},
                             "/proc/17/stat": FileNotFoundError("/proc/17/stat")})  # fmt: skip
    monkeypatch.setattr(local.os, "listdir", lambda d: [*STATS, "17", "self", "sys"] if d == "/proc" else [])


def test_descendants_are_read_from_each_process_s_parent_whatever_its_name(proc_tree):
    assert local._descendants([10]) == {11, 12, 13}
    assert local._descendants([11]) == {13}
    assert local._descendants([1]) == {10, 11, 12, 13, 14}
    assert local._descendants([14, 13]) == set()
    assert local._descendants([]) == set()


def test_descendants_of_a_real_process_include_its_grandchildren():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); " \
           "time.sleep(30)"  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not (found := local._descendants([child.pid])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(found) == 1 and child.pid not in found and os.getpid() not in found
        assert child.pid in local._descendants([os.getpid()])
    finally:
        for pid in local._descendants([child.pid]):
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)


def test_the_groups_to_stop_are_the_started_and_their_descendants_never_this_process_s_own(monkeypatch):
    """A descendant that exited since the scan is passed over; one in this process's group (a child that did not
    start a session of its own) would take the test runner (or the user's shell) down with the deployment."""
    started, other = _sleeper(), _sleeper()
    try:
        gone = 2**22 + 12345  # above Linux's largest pid: no such process
        monkeypatch.setattr(local, "_descendants", lambda roots: {os.getpid(), gone, other.pid})
        assert local._groups([started]) == {started.pid, other.pid}
        monkeypatch.setattr(local, "_descendants", lambda roots: set())
        assert local._groups([started, other]) == {started.pid, other.pid}
    finally:
        for p in (started, other):
            p.kill()
            p.wait()


def test_a_group_is_alive_while_any_process_is_in_it_and_asking_does_not_signal_it():
    p = _sleeper()
    try:
        assert local._alive(p.pid)
        time.sleep(0.2)
        assert p.poll() is None  # signal 0 only asks
    finally:
        p.kill()
        p.wait()
    assert not local._alive(p.pid)


def test_signals_go_to_every_group_and_a_group_gone_or_not_ours_is_passed_over(monkeypatch):
    sent = []

    def killpg(group, sig):
        sent.append((group, sig))
        if group == 1:
            raise ProcessLookupError(group)
        if group == 2:
            raise PermissionError(group)

    monkeypatch.setattr(local.os, "killpg", killpg)
    local._signal({1, 2, 3}, signal.SIGTERM)
    assert sorted(sent) == [(1, signal.SIGTERM), (2, signal.SIGTERM), (3, signal.SIGTERM)]


def test_a_started_process_gets_the_deployment_s_environment_and_its_log(tmp_path):
    env = {**local._env(tmp_path / "home"), "PFLBED_TEST_ONLY_HERE": "yes"}
    assert env["FLWR_HOME"] == str(tmp_path / "home") and env["FLWR_TELEMETRY_ENABLED"] == "0"
    assert env["FLWR_DISABLE_UPDATE_CHECK"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"] == os.environ["PATH"]
    code = "import os; print(os.environ.get('PFLBED_TEST_ONLY_HERE'), os.getsid(0) == os.getpid())"
    procs: list[subprocess.Popen] = []
    log = tmp_path / "p.log"
    p = local._start(procs, [sys.executable, "-c", code], log, env)
    assert procs == [p] and p.wait(30) == 0
    assert log.read_text() == "yes True\n"  # its own session: its group is stopped, not ours
    local._start(procs, [sys.executable, "-c", "import sys; sys.exit('to stderr')"], log, env, "a").wait(30)
    assert log.read_text() == "yes True\nto stderr\n" and len(procs) == 2


def test_flowers_tools_are_those_beside_this_python_else_found_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setattr(local.sys, "executable", str(tmp_path / "python"))
    (tmp_path / "flwr").touch()
    assert local._tool("flwr") == str(tmp_path / "flwr")
    assert local._tool("flower-supernode") == "flower-supernode"


def test_a_port_taken_is_read_from_a_log_in_any_encoding(tmp_path):
    log = tmp_path / "supernode-0.log"
    log.write_bytes(b"\xff\xfe node \xe9\nOSError: [Errno 98] Address already in use\n")
    assert local.port_taken(log)
    log.write_bytes(b"\xff\xfe node \xe9\n")
    assert not local.port_taken(log)
    assert not local.port_taken(Path(tmp_path / "none.log"))


def test_the_superlink_is_waited_for_until_it_listens_exits_or_its_time_is_up(tmp_path):
    log = tmp_path / "superlink.log"
    log.write_text("ValueError: bad certificate\n")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        sleeping = _sleeper()
        try:
            local._wait_for_port(port, sleeping, log)  # returns: it listens
            listening.close()  # nobody listens any more
            with pytest.raises(local.FlowerRunError) as e:
                local._wait_for_port(port, sleeping, log, timeout=1)
            assert str(e.value) == f"the SuperLink did not listen on port {port} within 1 s; see {log}"
        finally:
            sleeping.kill()
            sleeping.wait()
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    exited.wait()
    with pytest.raises(local.FlowerRunError) as e:
        local._wait_for_port(port, exited, log)
    assert str(e.value) == f"the SuperLink exited at start (code 3): ValueError: bad certificate; see {log}"
