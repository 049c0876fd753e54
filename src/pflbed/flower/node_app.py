"""The ClientApp of a deployment (`pflbed flower local`, `pflbed flower app`): light, each message handed to its
node's warm worker (`node_worker`), which runs pflbed's own handlers (`client`) and keeps torch, the algorithm and
a site's data between messages.

Flower starts this ClientApp in a fresh process for every message; importing only Flower and the standard library,
it costs Flower's start-up and no more. Where the platform has no Unix sockets, or the socket's path would be too
long for one (a deep `$XDG_RUNTIME_DIR`), the message is handled in this process (`client.app`), as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.serde import context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage

from pflbed.errors import PflbedError
from pflbed.flower.node_worker import read_blob, send_blob

app = ClientApp()
START_S = 120.0  # the longest a new worker may take to listen (imports, and on a busy machine)
MAX_SOCKET_PATH = 100  # a Unix socket's path holds at most 107 bytes on Linux (103 on macOS), its bind name 8 more


def _secagg_if_asked(msg: Message, context: Context, call_next) -> Message:  # noqa: ANN001 (Flower's callable)
    """SecAgg+'s mod here, in the ClientApp's process (its state is Flower's context); the masked-vector step's
    training goes on to the worker."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def socket_dir() -> Path:
    """The directory of this user's workers: `$XDG_RUNTIME_DIR/pflbed` or `<tmp>/pflbed-<uid>`, created 0700 and
    refused unless it is a directory (not a link) of this user that no one else may enter — in a shared /tmp another
    user could have made it first, to listen in their place."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(base) / "pflbed" if base else Path(tempfile.gettempdir()) / f"pflbed-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o700)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PflbedError(f"{d}: the node workers' directory must be a directory of this user with mode 0700; "
                          "remove it, or set XDG_RUNTIME_DIR to a private directory")  # fmt: skip
    return d


def _socket_path(context: Context) -> Path:
    """One worker per node: its node config, the SuperExec that runs its ClientApps, this Python."""
    key = json.dumps(dict(context.node_config), sort_keys=True, default=str) + f"|{os.getppid()}|{sys.executable}"
    return socket_dir() / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".sock")


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        raise
    return s


def _worker(path: Path) -> socket.socket:
    """A connection to the worker listening at `path`, started first if there is none (one start at a time: a
    lock file)."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _connect(path)
        except OSError:
            pass
        log = open(path.with_suffix(".log"), "ab")  # noqa: SIM115 (the worker's, kept open by it)
        os.chmod(log.name, 0o600)
        worker = subprocess.Popen([sys.executable, "-m", "pflbed.flower.node_worker", str(path), str(os.getppid())],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)  # fmt: skip
        log.close()
        deadline = time.monotonic() + START_S
        while True:
            try:
                return _connect(path)
            except OSError:
                if worker.poll() is not None or time.monotonic() > deadline:
                    why = "stopped" if worker.poll() is not None else f"did not start within {START_S:.0f} s"
                    raise PflbedError(f"this node's pflbed worker {why}; see {path.with_suffix('.log')}") from None
                time.sleep(0.05)


def _raised(info: dict) -> Exception:
    """The worker's exception, as Flower shows it (`<class 'module.Name'>:<'text'>`) had it been raised here: a
    class of that name, since importing the real one would import what the worker keeps."""
    cls = type(str(info["name"]), (Exception,), {"__module__": str(info["module"]), "__qualname__": str(info["name"])})
    return cls(str(info["text"]))


def _forward(kind: str, msg: Message, context: Context) -> Message:
    path = _socket_path(context) if hasattr(socket, "AF_UNIX") else None
    if path is None or len(os.fsencode(path)) > MAX_SOCKET_PATH:
        from pflbed.flower import client

        return getattr(client, kind)(msg, context)
    with _worker(path) as conn:
        send_blob(conn, kind.encode())
        send_blob(conn, message_to_proto(msg).SerializeToString())
        send_blob(conn, context_to_proto(context).SerializeToString())
        try:
            out = read_blob(conn)
        except ConnectionError:
            raise PflbedError(f"this node's pflbed worker stopped; see {path.with_suffix('.log')}") from None
    if out[:1] == b"E":
        raise _raised(json.loads(out[1:]))
    pm = ProtoMessage()
    pm.ParseFromString(out[1:])
    return Message(message_from_proto(pm).content, reply_to=msg)


@app.train(mods=[_secagg_if_asked])
def train(msg: Message, context: Context) -> Message:
    return _forward("train", msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return _forward("query", msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _forward("evaluate", msg, context)
