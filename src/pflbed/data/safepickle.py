"""Reading the pickle files some datasets are published as (CIFAR's python version, the miniImageNet cache).

A pickle is a program: unpickling one can call any importable function, so a file someone hands a user could
run code, or ask for more memory than the machine has. The unpickler here admits only what these files hold —
NumPy arrays of plain numbers (`_reconstruct` then the array's state, or `_frombuffer` under protocol 5), NumPy
dtypes and scalars, and the `bytes` that Python 3 writes under protocol 2 — and refuses anything else before
calling it, with a one-line `DataError` naming the file and what was refused.

Memory is bounded as well as code. Each admitted call is checked before it allocates, and all of them together may
allocate no more than twice the file's size: a real array's bytes are in the file, so a request for more cannot be
honest (e.g. `_reconstruct` with a huge shape, or one buffer reused through the memo for many arrays). The memo is a
dict (pickle's pure-Python unpickler), not the C unpickler's array that a single `LONG_BINPUT 2**31` grows to
16 GB; and a `BYTEARRAY8` length is checked against the bytes actually there before anything is reserved. Object
arrays (whose state is a list of arbitrary objects, and whose dtype flags NumPy would otherwise take from the
file) and structured or void dtypes are refused: no published file of these formats holds them.

Python 2 pickles (CIFAR's) are decoded with `encoding="latin1"`, NumPy's documented choice for them: their byte
strings become `str` (dict keys such as `"data"`), and array buffers keep their bytes.
"""

from __future__ import annotations

import math
import pickle
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pflbed.errors import DataError

# Plain-number dtype kinds: bool, ints, floats, complex, fixed-length bytes / text. No object, void or datetime.
_KINDS = "biufcSU"
# The state every plain dtype is pickled with, after (version, byte order): no subarray, names or fields.
_DTYPE_VERSION = 3


class Refused(pickle.UnpicklingError):
    """Something a data pickle of these formats never does: the file is not loaded."""


class RefusedGlobal(Refused):
    """A global outside the admitted few: the file is not a plain data pickle."""


def _ndarray(*_: Any) -> Any:
    """Stands for `numpy.ndarray`, which only ever appears as `_reconstruct`'s first argument: called directly it
    would allocate any shape without a state to fill it."""
    raise Refused("the pickle calls numpy.ndarray directly")


def _shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise Refused(f"the pickle gives an array the shape {shape!r}")
    return shape


def _plain(dtype: Any) -> np.dtype:
    if not isinstance(dtype, np.dtype) or dtype.kind not in _KINDS or dtype.hasobject or dtype.fields is not None:
        raise Refused(f"the pickle holds an array or scalar of dtype {dtype!r}, not plain numbers")
    return dtype


class _Restricted(pickle._Unpickler):  # noqa: SLF001 — the pure-Python unpickler: its memo is a dict, its BUILD ours
    def __init__(self, fh: Any, size: int) -> None:
        super().__init__(fh, encoding="latin1")
        # Bytes the admitted calls may still allocate. Twice the file: an honest file materializes each of its bytes
        # at most twice (Python 3's protocol 2 encodes an array's bytes, then the array's state copies them).
        self.size, self.budget = size, 2 * size
        self.calls: dict[tuple[str, str], Callable[..., Any]] = {
            ("numpy", "ndarray"): _ndarray,
            ("numpy", "dtype"): self._dtype,
            ("_codecs", "encode"): self._encode,
            ("builtins", "bytes"): _empty_bytes,
            ("__builtin__", "bytes"): _empty_bytes,  # Python 3 writes this name under protocol 2
        }
        for root in ("numpy.core", "numpy._core"):  # NumPy 1's module path, NumPy 2's
            self.calls[(f"{root}.multiarray", "_reconstruct")] = self._reconstruct
            self.calls[(f"{root}.multiarray", "scalar")] = self._scalar
            self.calls[(f"{root}.numeric", "_frombuffer")] = self._frombuffer

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.calls:
            raise RefusedGlobal(f"{module}.{name}")
        return self.calls[(module, name)]

    def _charge(self, nbytes: int, what: str) -> None:
        if nbytes > self.budget:
            raise Refused(f"the pickle asks for {what} of {nbytes:,} bytes, more than its file could hold")
        self.budget -= nbytes

    def _nbytes(self, shape: Any, dtype: np.dtype) -> int:
        return math.prod(_shape(shape)) * dtype.itemsize

    # --- the admitted calls -------------------------------------------------------------------------------------

    def _dtype(self, spec: Any, align: Any = False, copy: Any = True) -> np.dtype:
        del copy  # always a fresh dtype: the BUILD that follows sets its state, which must never reach a shared one
        if not isinstance(spec, str):
            raise Refused(f"the pickle builds a dtype from {type(spec).__name__}, not a type code")
        return _plain(np.dtype(spec, bool(align), True))

    def _reconstruct(self, subtype: Any, shape: Any, typecode: Any) -> np.ndarray:
        if subtype is not _ndarray:
            raise Refused("the pickle reconstructs an array of a type other than numpy.ndarray")
        dtype = _plain(np.dtype(typecode))
        self._charge(self._nbytes(shape, dtype), "an array")
        return np.empty(shape, dtype)

    def _frombuffer(self, buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
        if not isinstance(buf, (bytes, bytearray)):
            raise Refused(f"the pickle reads an array from {type(buf).__name__}")
        self._charge(self._nbytes(shape, _plain(dtype)), "an array")
        return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)

    def _scalar(self, dtype: Any, data: Any) -> Any:
        dtype = _plain(dtype)
        raw = data.encode("latin1") if isinstance(data, str) else data  # a Python 2 str holds the bytes
        if not isinstance(raw, bytes) or len(raw) < dtype.itemsize:
            raise Refused(f"the pickle gives a {dtype} scalar {type(data).__name__} data, not its bytes")
        self._charge(dtype.itemsize, "a scalar")
        return np.frombuffer(raw, dtype=dtype, count=1)[0]

    def _encode(self, text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
        # Python 3 writes non-empty `bytes` under protocol 2 as encode(<latin-1 str>, "latin1"); nothing else.
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
            raise Refused(f"the pickle calls _codecs.encode with {encoding!r}, not as Python writes bytes")
        self._charge(len(text), "bytes")
        return text.encode("latin1")

    # --- opcodes that set state or reserve memory ---------------------------------------------------------------

    def load_build(self) -> None:
        state, inst = self.stack.pop(), self.stack[-1]
        if isinstance(inst, np.dtype):
            plain = inst.__reduce__()[2]  # its state now, as `_dtype` made it: only the byte order may change
            if not (isinstance(state, tuple) and len(state) == len(plain) and state[0] == _DTYPE_VERSION
                    and state[1] in ("<", ">", "|", "=") and state[2:] == plain[2:]):  # fmt: skip
                raise Refused(f"the pickle gives dtype {inst} the state {state!r}, not a plain dtype's")
        elif isinstance(inst, np.ndarray):
            # (version, shape, dtype, is_fortran, raw bytes), or the 4-tuple without the version
            if not (isinstance(state, tuple) and len(state) in (4, 5)):
                raise Refused(f"the pickle gives an array the state {type(state).__name__}")
            shape, dtype, _, raw = state[-4:]
            if not isinstance(raw, (bytes, str)):
                raise Refused(f"the pickle fills an array from {type(raw).__name__}, not its bytes")
            self._charge(self._nbytes(shape, _plain(dtype)), "an array")
        else:
            raise Refused(f"the pickle sets the state of a {type(inst).__name__}")
        inst.__setstate__(state)

    def load_bytearray8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        data = self.read(min(n, self.size))  # never reserves more than the file could hold
        if len(data) != n:
            raise pickle.UnpicklingError("pickle data was truncated")
        self.append(bytearray(data))

    dispatch = {**pickle._Unpickler.dispatch,  # noqa: SLF001
                pickle.BUILD[0]: load_build, pickle.BYTEARRAY8[0]: load_bytearray8}  # fmt: skip


def _empty_bytes(*args: Any) -> bytes:
    """Python 3 writes `b""` under protocol 2 as `bytes()`; `bytes(n)` would allocate n zeros."""
    if args:
        raise Refused(f"the pickle calls bytes{args!r}")
    return b""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_pickle(path: str | Path, what: str) -> Any:
    """Unpickle `path` (a `what` file, named in errors) admitting only data: arrays, dtypes, scalars, containers.

    A refused global or allocation, a truncated or corrupt file and a missing file each raise a one-line
    `DataError` that starts with the path.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return _Restricted(fh, path.stat().st_size).load()
    except RefusedGlobal as exc:
        raise DataError(f"{path}: refused: the pickle calls {exc}, which a {what} file never holds "
                        "(not loaded: unpickling it could run code)") from None  # fmt: skip
    except Refused as exc:
        raise DataError(f"{path}: refused: {exc} (not loaded: a {what} file as published never does this)") from None
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (EOFError, pickle.UnpicklingError) as exc:
        raise DataError(f"{path}: truncated or corrupt pickle ({_one_line(exc)})") from None
    except (OSError, zlib.error, ValueError, TypeError, AttributeError, IndexError, KeyError, MemoryError,
            struct.error, RecursionError) as exc:  # fmt: skip
        raise DataError(f"{path}: not a readable {what} pickle ({_one_line(exc)})") from None


def as_str_keys(obj: Any, path: Path, what: str) -> dict[str, Any]:
    """A loaded pickle's top-level dict with `str` keys (Python 2 pickles may decode them as bytes)."""
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a dict in a {what} pickle, got {type(obj).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def int_vector(value: Any) -> np.ndarray | None:
    """`value` — a flat list of integers or a 1-D integer array — as int64 [n]; None when it is anything else.

    Checked flat before NumPy sees it: nested lists in a pickle can share one inner list many times through the
    memo, so a file of a few kilobytes would otherwise make `np.asarray` allocate gigabytes.
    """
    if isinstance(value, np.ndarray):
        return value.astype(np.int64) if value.ndim == 1 and value.dtype.kind in "iu" else None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, np.integer)) for v in value):
        return None
    try:
        return np.asarray(value, dtype=np.int64)
    except OverflowError:
        return None
