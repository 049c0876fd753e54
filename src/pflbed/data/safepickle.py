"""Reading the pickle files some datasets are published as (CIFAR's python version, the miniImageNet cache).

A pickle is a program: unpickling one can call any importable function, so a file someone hands a user could
run code. The unpickler here resolves only the few globals these files hold — NumPy's array and dtype
reconstruction, NumPy scalars, and the plain containers — and refuses anything else before calling it, with a
one-line `DataError` naming the file and the refused global.

Python 2 pickles (CIFAR's) are decoded with `encoding="latin1"`, NumPy's documented choice for them: their byte
strings become `str` (dict keys such as `"data"`), and array buffers keep their bytes.
"""

from __future__ import annotations

import pickle
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from pflbed.errors import DataError

# (module, name) pairs a dataset pickle may reference. `numpy.core` is NumPy 1's module path, `numpy._core` NumPy
# 2's; `__builtin__` is Python 2's name for `builtins` (seen before the unpickler's own name fixing).
_NUMPY = [("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer")]
_BUILTINS = ["dict", "list", "tuple", "set", "frozenset", "bytes", "bytearray"]
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [(f"{root}.{module}", name) for root in ("numpy.core", "numpy._core") for module, name in _NUMPY]
    + [("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"), ("collections", "OrderedDict")]
    + [(root, name) for root in ("builtins", "__builtin__") for name in _BUILTINS]
)

_NUMPY2 = int(np.__version__.split(".")[0]) >= 2


class RefusedGlobal(pickle.UnpicklingError):
    """A global outside `ALLOWED`: the file is not a plain data pickle."""


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise RefusedGlobal(f"{module}.{name}")
        if _NUMPY2 and module.startswith("numpy.core."):  # NumPy 2 keeps numpy.core only as a deprecated alias
            module = "numpy._core." + module.removeprefix("numpy.core.")
        return super().find_class(module, name)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_pickle(path: str | Path, what: str) -> Any:
    """Unpickle `path` (a `what` file, named in errors) admitting only data: arrays, dtypes, scalars, containers.

    A refused global, a truncated or corrupt file and a missing file each raise a one-line `DataError` that starts
    with the path.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return _Restricted(fh, encoding="latin1").load()
    except RefusedGlobal as exc:
        raise DataError(f"{path}: refused: the pickle calls {exc}, which a {what} file never holds "
                        "(not loaded: unpickling it could run code)") from None  # fmt: skip
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (EOFError, pickle.UnpicklingError) as exc:
        raise DataError(f"{path}: truncated or corrupt pickle ({_one_line(exc)})") from None
    except (OSError, zlib.error, ValueError, TypeError, AttributeError, IndexError, KeyError, MemoryError,
            ImportError) as exc:  # ImportError: a NumPy 2 pickle read with NumPy 1
        raise DataError(f"{path}: not a readable {what} pickle ({_one_line(exc)})") from None


def as_str_keys(obj: Any, path: Path, what: str) -> dict[str, Any]:
    """A loaded pickle's top-level dict with `str` keys (Python 2 pickles may decode them as bytes)."""
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a dict in a {what} pickle, got {type(obj).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}
