"""A node's warm worker: the pflbed side of a deployment's ClientApp, kept between messages.

Flower starts a ClientApp process for every message; pflbed's side of one (torch, the run's algorithm, a site's
data read and split, the model built) costs seconds of CPU before any work, paid again by the next message. The
ClientApp Flower starts (`node_app`) therefore stays light — Flower and the records — and hands each message to this
worker, one per node, started by the node's first message and kept while the node's SuperExec lives (and for at
most `IDLE_S` without a message). It runs `client.app`'s own handlers: a message gives the same reply, the same
files and the same refusals as in a fresh process; what it keeps between messages is what `client.algorithm` and
`site_node` already cache per process.

Trust: the worker listens on a Unix socket in a directory only its user may enter (`node_app.socket_dir`), accepts
a connection only from a process of its own user (the peer's credentials), and serves only the node it was started
for (the node config of its first message). Messages cross as Flower's protobuf encoding (`flwr.common.serde`),
never as pickles.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any

IDLE_S = 600.0  # a worker without a message for this long exits (a SuperNode idle between runs keeps no memory)


def read_blob(conn: socket.socket) -> bytes:
    """One length-prefixed blob (8-byte big-endian length, then the bytes)."""
    return _exact(conn, struct.unpack("!Q", _exact(conn, 8))[0])


def _exact(conn: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed mid-message")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def send_blob(conn: socket.socket, data: bytes) -> None:
    conn.sendall(struct.pack("!Q", len(data)) + data)


def peer_uid(conn: socket.socket) -> int | None:
    """The user id of the process at the other end (Linux); None where the platform does not say."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


class _Clock:
    def __init__(self) -> None:
        self.last = time.monotonic()


class Node:
    """The worker's one node: its answers, and what it keeps between them.

    What it keeps is kept for one run: a message of another run first clears the algorithms and site data built so
    far, so a site whose files changed between runs trains on what its files hold now, as a fresh process would
    (within a run a site's data is read once)."""

    def __init__(self) -> None:
        self.config: str | None = None  # the node config served: its first message's
        self.run: int | None = None

    def answer(self, kind: str, msg: Any, ctx: Any) -> Any:
        """`client`'s reply to the message (a Flower `Message`); raises as `client` does."""
        from pflbed.flower import client, site_node

        this = json.dumps(dict(ctx.node_config), sort_keys=True, default=str)
        self.config = self.config or this
        if this != self.config:
            raise RuntimeError("this node's worker serves another node config")
        if kind not in ("train", "query", "evaluate"):
            raise RuntimeError(f"unknown message kind {kind!r}")
        if msg.metadata.run_id != self.run:
            client.algorithm.cache_clear()
            site_node.clear_caches()
            self.run = msg.metadata.run_id
        return getattr(client, kind)(msg, ctx)


def _watch(parent: int, clock: _Clock, idle_s: float, path: str, inode: int) -> None:
    """Exit when the node's SuperExec (`parent`) is gone, or after `idle_s` without a message (`path`, `inode`: the
    socket this worker listens on)."""
    while True:
        try:
            os.kill(parent, 0)
        except (ProcessLookupError, PermissionError):  # gone (PermissionError: another user's process took its pid)
            _leave(path, inode)
        if time.monotonic() - clock.last > idle_s:
            _leave(path, inode)
        time.sleep(0.5)


def _leave(path: str, inode: int) -> None:
    """Exit, taking the socket along: every SuperExec's nodes get sockets of their own, so left behind they would
    pile up in the socket directory. Only our own: a worker that replaced it (after ours stopped answering) keeps
    its socket."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    os._exit(0)


def serve(path: str, parent: int, idle_s: float = IDLE_S) -> None:
    from flwr.common.serde import context_from_proto, message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Context as ProtoContext
    from flwr.proto.message_pb2 import Message as ProtoMessage

    clock, node = _Clock(), Node()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    server.bind(tmp)
    server.listen(8)
    inode = os.stat(tmp).st_ino
    os.replace(tmp, path)  # the socket appears only once it listens
    threading.Thread(target=_watch, args=(parent, clock, idle_s, path, inode), daemon=True).start()
    while True:
        conn, _ = server.accept()
        clock.last = time.monotonic()
        with conn:
            if peer_uid(conn) not in (None, os.getuid()):
                continue  # another user's process: not a word
            try:
                kind = read_blob(conn).decode()
                pm, pc = ProtoMessage(), ProtoContext()
                pm.ParseFromString(read_blob(conn))
                pc.ParseFromString(read_blob(conn))
                msg, ctx = message_from_proto(pm), context_from_proto(pc)
            except Exception:  # noqa: BLE001 (a broken request is dropped; the ClientApp reports the closed socket)
                continue
            try:
                out = b"M" + message_to_proto(node.answer(kind, msg, ctx)).SerializeToString()
            except Exception as e:  # noqa: BLE001 (handed back, raised again in the ClientApp process)
                traceback.print_exc()
                info = {"module": type(e).__module__, "name": type(e).__qualname__, "text": str(e)}
                out = b"E" + json.dumps(info).encode()
            with contextlib.suppress(OSError):
                send_blob(conn, out)
            clock.last = time.monotonic()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
