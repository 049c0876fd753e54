"""Reader for the IDX format used by MNIST and its drop-in replacements (Fashion-MNIST, KMNIST, ...).

Layout: two zero bytes, a dtype code byte, an ndim byte, `ndim` big-endian uint32 dimensions, then the
row-major payload in big-endian order. Files are distributed gzipped and are often unpacked by hand, so both
forms are read; the choice is made by the `.gz` suffix, so a mislabelled file is reported rather than
silently parsed as something else.

Every failure becomes a one-line `DataError` starting with the path: a half-downloaded or corrupt file is the
most common way a user reaches this code, and a traceback from `gzip` or `numpy` does not say which file.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pflbed.errors import DataError

# IDX dtype codes; all multi-byte types are big-endian on disk.
_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


@contextmanager
def _read_errors(path: Path) -> Iterator[None]:
    """Turn I/O and decompression failures into a `DataError` naming `path`."""
    try:
        yield
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except EOFError:
        raise DataError(f"{path}: truncated gzip stream (incomplete download?)") from None
    except gzip.BadGzipFile as exc:
        raise DataError(f"{path}: not a valid gzip file ({_one_line(exc)})") from None
    except (OSError, zlib.error) as exc:
        raise DataError(f"{path}: cannot read ({_one_line(exc)})") from None


def _open(path: Path) -> BinaryIO:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return path.open("rb")


def _parse_header(path: Path, head: bytes) -> tuple[np.dtype, tuple[int, ...]]:
    """Validate the 4-byte magic and return the dtype and dims; `head` must hold at least the magic."""
    if len(head) < 4:
        raise DataError(f"{path}: file too short for an IDX header ({len(head)} bytes)")
    zero, code, ndim = struct.unpack(">HBB", head[:4])
    if zero != 0:
        raise DataError(f"{path}: bad IDX magic 0x{head[:4].hex()} (expected 0x0000 + dtype + ndim)")
    if code not in _DTYPES:
        raise DataError(f"{path}: unknown IDX dtype code 0x{code:02x}")
    if ndim == 0:
        raise DataError(f"{path}: IDX header declares 0 dimensions")
    need = 4 + 4 * ndim
    if len(head) < need:
        raise DataError(f"{path}: truncated IDX header ({len(head)} of {need} bytes)")
    dims = struct.unpack(f">{ndim}I", head[4:need])
    return _DTYPES[code], tuple(int(d) for d in dims)


def read_idx_shape(path: str | Path) -> tuple[int, ...]:
    """Dimensions from the header alone, so listings can report sizes without decoding 47 MB of pixels."""
    path = Path(path)
    with _read_errors(path), _open(path) as fh:
        head = fh.read(4)
        ndim = head[3] if len(head) == 4 else 0
        head += fh.read(4 * ndim)
    return _parse_header(path, head)[1]


def read_idx(path: str | Path) -> np.ndarray:
    """Read a whole IDX file (raw or `.gz`) into a native-endian, writable array of the declared shape.

    The payload must be exactly `prod(dims) * itemsize` bytes: a short payload is a truncated file and a
    long one means the header and data disagree; both are errors rather than a silent crop or pad.
    """
    path = Path(path)
    with _read_errors(path), _open(path) as fh:
        data = fh.read()
    dtype, dims = _parse_header(path, data)
    offset = 4 + 4 * len(dims)
    expected = math.prod(dims) * dtype.itemsize
    got = len(data) - offset
    if got != expected:
        problem = "truncated" if got < expected else "trailing data"
        raise DataError(f"{path}: {problem}: payload is {got} bytes, header dims {dims} need {expected}")
    array = np.frombuffer(data, dtype=dtype, count=math.prod(dims), offset=offset).reshape(dims)
    return array.astype(dtype.newbyteorder("="), copy=True)
