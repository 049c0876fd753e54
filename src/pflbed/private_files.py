"""Files only their owner may read: keys, client states and checkpoints.

Why not write the file and `chmod` it afterwards: between the two calls the file exists with the umask's mode
(usually 0644), and any local user who opens it then keeps the open file. A file created here is private from its
first byte: `tempfile.mkstemp` creates it with mode 0600 and `O_EXCL` under a random name (no other process can
have created it first, or guess its name to create a link there), it is written, flushed to disk, then renamed
over the destination — atomic, so a process killed mid-write leaves the previous version whole. Directories are
created 0700 for the same reason.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch

PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700


def private_dir(path: Path) -> Path:
    """`path` and any missing parent created 0700 (before anything is written into them); an existing directory is
    left as it is, except `path` itself, made 0700 if it is ours (a key directory an earlier version made 0755)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
        path.chmod(PRIVATE_DIR)
    return path


def write_private(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write `path` through `write(file)` into a new 0600 file, then rename it into place (see the module's
    docstring); the temporary file goes if writing fails."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_private_bytes(path: Path, data: bytes) -> Path:
    return write_private(path, lambda f: f.write(data))


def save_private(obj: object, path: Path) -> Path:
    """`torch.save(obj)` into a private file (`write_private`)."""
    return write_private(path, lambda f: torch.save(obj, f))
