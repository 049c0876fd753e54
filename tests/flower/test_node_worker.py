"""The node's warm worker and its light ClientApp (`node_worker`, `node_app`): where it listens, whom it answers,
when it goes. Its replies are pflbed's own handlers' (the deployment tests run every message through it)."""

import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("flwr")  # the `flower` extra

from pflbed.errors import PflbedError  # noqa: E402
from pflbed.flower import node_app  # noqa: E402
from pflbed.flower.node_worker import read_blob, send_blob  # noqa: E402


def test_a_workers_directory_someone_else_could_enter_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "pflbed").mkdir(mode=0o755)
    os.chmod(tmp_path / "pflbed", 0o755)
    with pytest.raises(PflbedError, match=r"/pflbed: the node workers' directory must be a directory of this user "
                                          r"with mode 0700; remove it, or set XDG_RUNTIME_DIR to a private directory$"):
        node_app.socket_dir()
    os.chmod(tmp_path / "pflbed", 0o700)
    assert node_app.socket_dir() == tmp_path / "pflbed"


def test_a_link_in_place_of_the_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "pflbed").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PflbedError, match="must be a directory"):
        node_app.socket_dir()


def _message(group, run_id=1):
    """A query as Flower hands it to the ClientApp (through its protobuf, as the worker reads it)."""
    from flwr.app import RecordDict
    from flwr.common.serde import message_from_proto, recorddict_to_proto
    from flwr.proto.message_pb2 import Message, Metadata

    meta = Metadata(run_id=run_id, message_id="m", src_node_id=1, dst_node_id=2, group_id=group, ttl=60,
                    message_type="query", created_at=1.0)  # fmt: skip
    return message_from_proto(Message(metadata=meta, content=recorddict_to_proto(RecordDict())))


def _context(node_config):
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=2, node_config=node_config, state=RecordDict(), run_config={})


def _refusal(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 (what Flower makes of it: the class and the text)
        return str(type(e)), str(e)
    raise AssertionError("the message was answered; it should have been refused")


@pytest.fixture
def short_dir():
    """A private directory whose sockets' paths fit a Unix socket (pytest's own can be too deep)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="nw", dir="/tmp")
    yield __import__("pathlib").Path(d)
    shutil.rmtree(d)


def test_a_message_goes_through_the_worker_and_a_refusal_reads_as_in_process(short_dir, monkeypatch):
    """The light ClientApp starts the node's worker, which answers as `client` does; a site's refusal reaches
    Flower with the same class and text (Flower's error reason), and a second message finds the same worker."""
    from pflbed.flower import client

    tmp_path = short_dir
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    superexec = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    monkeypatch.setattr(node_app.os, "getppid", lambda: superexec.pid)
    try:
        plain = _context({"partition-id": 1, "num-partitions": 3})
        got = node_app.query(_message("partitions"), plain)
        want = client.query(_message("partitions"), plain)
        assert dict(got.content["node"]) == dict(want.content["node"]) == {"partition-id": 1, "num-partitions": 3}
        site = _context({"data": str(tmp_path / "none.npz"), "partition-id": 0})
        through = _refusal(lambda: node_app.query(_message("train-me"), site))
        assert through == _refusal(lambda: client.query(_message("train-me"), site))
        assert through[0] == "<class 'pflbed.flower.sites.SiteError'>" and "answers only" in through[1]
        assert len(list((tmp_path / "pflbed").glob("*.sock"))) == 2  # one worker per node config
    finally:
        superexec.kill()
        superexec.wait()
    deadline = time.monotonic() + 10
    while list((tmp_path / "pflbed").glob("*.sock")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list((tmp_path / "pflbed").glob("*.sock"))  # the workers left with their SuperExec, and their sockets


def test_without_unix_sockets_the_clientapp_answers_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(node_app, "socket", type("NoUnix", (), {})())
    reply = node_app.query(_message("partitions"), _context({"partition-id": 2, "num-partitions": 4}))
    assert dict(reply.content["node"]) == {"partition-id": 2, "num-partitions": 4}
    assert not (tmp_path / "pflbed").exists()  # no worker, no directory


def test_a_socket_path_too_long_for_the_platform_is_answered_in_process(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    reply = node_app.query(_message("partitions"), _context({"partition-id": 0, "num-partitions": 2}))
    assert dict(reply.content["node"]) == {"partition-id": 0, "num-partitions": 2}
    assert not list((deep / "pflbed").iterdir())  # no worker was started (it could not have listened)


def test_a_message_of_another_run_clears_what_the_worker_built():
    """A site's files may change between runs; the worker keeps its algorithms and data for one run only."""
    from pflbed.config import Config
    from pflbed.flower import site_node
    from pflbed.flower.node_worker import Node

    site_node.clear_caches()
    config = Config().model_dump_json()
    node, plain = Node(), _context({"partition-id": 0, "num-partitions": 2})
    node.answer("query", _message("partitions", run_id=7), plain)
    site_node._validated(config)  # what a site-local message of run 7 builds
    node.answer("query", _message("partitions", run_id=7), plain)  # the same run: kept
    assert site_node._validated.cache_info().currsize == 1
    node.answer("query", _message("partitions", run_id=8), plain)
    assert site_node._validated.cache_info().currsize == 0
    with pytest.raises(RuntimeError, match="^this node's worker serves another node config$"):
        node.answer("query", _message("partitions", run_id=8), _context({"partition-id": 1, "num-partitions": 2}))


def _ask(path):
    """The worker's answer to a partition query (its first byte; b"" for none)."""
    return _reply(path, _blobs({}))[:1]


def _start(tmp_path, parent, idle_s=600.0):
    path = tmp_path / "w.sock"
    code = f"from pflbed.flower.node_worker import serve; serve({str(path)!r}, {parent}, {idle_s})"
    worker = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not path.exists():
        assert worker.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return worker, path


def test_the_worker_exits_with_its_superexec_and_when_idle_and_takes_its_socket_along(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker, path = _start(tmp_path, parent.pid)
    parent.kill()
    parent.wait()
    assert worker.wait(timeout=5) == 0  # within its 0.5 s watch, not at its idle limit
    assert not path.exists()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        idle, path = _start(tmp_path / "idle" if (tmp_path / "idle").mkdir() is None else tmp_path, other.pid,
                            idle_s=1.0)  # fmt: skip
        assert idle.wait(timeout=10) == 0
        assert not path.exists()
    finally:
        other.kill()


def test_a_worker_leaves_the_socket_of_the_worker_that_replaced_it(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker, path = _start(tmp_path, parent.pid)
    newer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        newer.bind(str(tmp_path / "newer.sock"))
        os.replace(tmp_path / "newer.sock", path)  # as a worker started where this one stopped answering does
        parent.kill()
        parent.wait()
        assert worker.wait(timeout=5) == 0
        assert path.exists()
    finally:
        newer.close()
        parent.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_users_process_gets_no_answer():
    import shutil
    import signal
    import struct
    import tempfile
    from pathlib import Path

    where = Path(tempfile.mkdtemp(dir="/tmp"))  # a place the other user can reach (pytest's own is private)
    os.chmod(where, 0o755)
    worker, path = _start(where, os.getpid())
    os.chmod(path, 0o777)  # the directory check is the first defense; this is the second
    try:
        assert _ask(path) == b"M"  # the control: its own user is answered
        request = _blobs({})  # built here: the forked child (of a threaded process) only makes system calls
        pid = os.fork()
        if pid == 0:  # the other user: connects, asks, must read nothing
            code = 2
            try:
                signal.alarm(30)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(20)
                    s.connect(str(path))  # reached (so the refusal below is the worker's, not the directory's)
                    try:
                        s.sendall(b"".join(struct.pack("!Q", len(b)) + b for b in request))
                        code = 0 if s.recv(1) == b"" else 1
                    except OSError:
                        code = 0  # closed or reset, while sending or reading: nothing read
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the other user's process did not finish")
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert _ask(path) == b"M"  # and its own user is still served
    finally:
        worker.kill()
        shutil.rmtree(where)


def test_a_workers_directory_of_another_user_is_refused_and_without_xdg_it_is_the_users_own_in_tmp(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "pflbed").mkdir(mode=0o700)
    uid = os.getuid()
    monkeypatch.setattr(node_app.os, "getuid", lambda: uid + 1)  # as if another user had made it first
    with pytest.raises(PflbedError, match="must be a directory of this user with mode 0700"):
        node_app.socket_dir()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setattr(node_app.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    if uid == 0:  # root: another user's (root makes it), since a name without the uid would also read `pflbed-0`
        uid = 4321
        (tmp_path / "tmp" / f"pflbed-{uid}").mkdir(mode=0o700)
        os.chown(tmp_path / "tmp" / f"pflbed-{uid}", uid, -1)
    monkeypatch.setattr(node_app.os, "getuid", lambda: uid)
    d = node_app.socket_dir()
    assert d == tmp_path / "tmp" / f"pflbed-{uid}" and d.stat().st_mode & 0o777 == 0o700


def test_one_node_config_in_any_key_order_is_one_worker_and_one_node(tmp_path, monkeypatch):
    """Flower may hand a node's config in another key order from one message to the next."""
    from pflbed.flower.node_worker import Node

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    one, other = {"partition-id": 1, "num-partitions": 3}, {"num-partitions": 3, "partition-id": 1}
    assert node_app._socket_path(_context(one)) == node_app._socket_path(_context(other))
    assert node_app._socket_path(_context(one)) != node_app._socket_path(_context({**one, "partition-id": 2}))
    node = Node()
    node.answer("query", _message("partitions"), _context(one))
    node.answer("query", _message("partitions"), _context(other))


def test_the_worker_answers_each_kind_with_its_handler_and_refuses_any_other(monkeypatch):
    from pflbed.flower import client
    from pflbed.flower.node_worker import Node

    for kind in ("train", "query", "evaluate"):
        monkeypatch.setattr(client, kind, lambda msg, ctx, k=kind: k)
    node, ctx = Node(), _context({"partition-id": 0, "num-partitions": 2})
    assert [node.answer(k, _message("x"), ctx) for k in ("train", "query", "evaluate")] == ["train", "query",
                                                                                            "evaluate"]  # fmt: skip
    with pytest.raises(RuntimeError, match="^unknown message kind 'algorithm'$"):
        node.answer("algorithm", _message("x"), ctx)


def test_a_blob_larger_than_one_read_arrives_whole_and_one_cut_short_is_a_connection_error():
    """Read from a connection whose every byte has arrived (the worst case for reading past a blob's end)."""

    class Arrived:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def recv(self, n: int) -> bytes:
            out, self.data = self.data[:n], self.data[n:]
            return out

        def sendall(self, data: bytes) -> None:
            self.data += data

    data, conn = os.urandom(3 * (1 << 20) + 5), Arrived(b"")  # more than three reads of 1 MiB
    send_blob(conn, data)
    send_blob(conn, b"next")
    assert read_blob(conn) == data and read_blob(conn) == b"next"  # nothing of the next blob read with the first
    conn.sendall((100).to_bytes(8, "big") + b"only ten b")
    with pytest.raises(ConnectionError, match="^the connection closed mid-message$"):
        read_blob(conn)


_STOPS = "print('out', flush=True); import sys; sys.exit('err')"


@pytest.mark.parametrize(("code", "start_s", "why"), [(_STOPS, 60.0, "stopped"),
                                                      ("import time; time.sleep(30)", 0.3, "did not start within 0 s")])
def test_a_worker_that_stops_or_does_not_listen_in_time_is_one_error_naming_its_log(short_dir, monkeypatch, code,
                                                                                     start_s, why):  # fmt: skip
    """The worker's log is private (0600): it holds what a site's handlers printed."""
    started = []
    real = subprocess.Popen

    def popen(args, **kw):
        started.append(real([sys.executable, "-c", code], **kw))
        return started[-1]

    monkeypatch.setattr(node_app.subprocess, "Popen", popen)
    monkeypatch.setattr(node_app, "START_S", start_s)
    path = short_dir / "w.sock"
    try:
        with pytest.raises(PflbedError, match=rf"^this node's pflbed worker {why}; see {path.with_suffix('.log')}$"):
            node_app._worker(path)
    finally:
        for p in started:
            p.kill()
            p.wait()
    assert len(started) == 1 and path.with_suffix(".log").stat().st_mode & 0o777 == 0o600
    if why == "stopped":  # what it printed, both streams
        assert path.with_suffix(".log").read_text().splitlines() == ["out", "err"]


def test_a_worker_that_closes_mid_answer_is_one_error_naming_its_log(short_dir, monkeypatch):
    """The worker died while answering (killed, out of memory): the ClientApp says so, not a traceback."""
    import threading

    ours, theirs = socket.socketpair()

    def read_and_close():
        for _ in range(3):
            read_blob(theirs)
        theirs.close()

    threading.Thread(target=read_and_close).start()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir))
    monkeypatch.setattr(node_app, "_worker", lambda path: ours)
    ctx = _context({"partition-id": 0, "num-partitions": 2})
    log = node_app._socket_path(ctx).with_suffix(".log")
    with pytest.raises(PflbedError, match=rf"^this node's pflbed worker stopped; see {log}$"):
        node_app.query(_message("partitions"), ctx)


@pytest.mark.parametrize("spare", [0, 1])
def test_a_socket_path_of_the_longest_length_still_goes_to_the_worker(tmp_path, monkeypatch, spare):
    from pflbed.flower import client

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    ctx = _context({"partition-id": 0, "num-partitions": 2})
    monkeypatch.setattr(node_app, "MAX_SOCKET_PATH", len(os.fsencode(node_app._socket_path(ctx))) - spare)
    monkeypatch.setattr(node_app, "_worker", lambda path: pytest.fail("to the worker"))
    monkeypatch.setattr(client, "query", lambda msg, ctx: pytest.fail("in process"))
    with pytest.raises(pytest.fail.Exception, match="to the worker" if spare == 0 else "in process"):
        node_app.query(_message("partitions"), ctx)


def _reply(path, blobs):
    """The worker's whole reply to three blobs (b"" for none: the connection closed)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(path))
        try:  # a broken request may be closed before its last blob is sent (a broken pipe, not only an empty read)
            for blob in blobs:
                send_blob(s, blob)
            return read_blob(s)
        except ConnectionError:
            return b""


def _blobs(node_config, group="partitions"):
    """A query as the ClientApp sends it to the worker: three blobs (its kind, the Message, the Context)."""
    from flwr.common.serde import context_to_proto, message_to_proto

    return [b"query", message_to_proto(_message(group)).SerializeToString(),
            context_to_proto(_context(node_config)).SerializeToString()]  # fmt: skip


def test_the_worker_answers_refuses_in_words_drops_what_it_cannot_read_and_outlives_a_client_that_left(tmp_path):
    """Served from `serve` itself (the ClientApp starts it as `__main__`): an answer; a refusal as the exception's
    module, name and text; a broken request closed unanswered; a client gone before its answer; then still serving,
    its SuperExec only watched (never signalled), and gone when idle even with its socket already removed."""
    import json

    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker, path = _start(tmp_path, parent.pid, idle_s=3.0)
    workers, plain = [worker], {"partition-id": 1, "num-partitions": 3}
    try:
        assert _reply(path, _blobs(plain))[:1] == b"M"
        refused = _reply(path, _blobs({"partition-id": 2, "num-partitions": 3}))
        assert refused[:1] == b"E" and json.loads(refused[1:]) == {
            "module": "builtins", "name": "RuntimeError", "text": "this node's worker serves another node config"}
        assert _reply(path, [b"query", b"\xff not a message", b""]) == b""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            gone.connect(str(path))
            gone.shutdown(socket.SHUT_RD)  # before its request: the answer meets a closed end, whatever the timing
            for blob in _blobs(plain):
                send_blob(gone, blob)
        assert _reply(path, _blobs(plain))[:1] == b"M"
        time.sleep(1.2)  # two of its watches
        assert parent.poll() is None and worker.poll() is None
        path.unlink()
        assert worker.wait(timeout=15) == 0
        (tmp_path / "site").mkdir()
        site_worker, site_path = _start(tmp_path / "site", parent.pid)  # a site's refusal: pflbed's own class
        workers.append(site_worker)
        refused = _reply(site_path, _blobs({"data": str(tmp_path / "none.npz"), "partition-id": 0}, "train-me"))
        info = json.loads(refused[1:])
        assert refused[:1] == b"E" and info["module"] == "pflbed.flower.sites"
        assert info["name"] == "SiteError" and "answers only" in info["text"]
    finally:
        parent.kill()
        for w in workers:
            w.kill()
