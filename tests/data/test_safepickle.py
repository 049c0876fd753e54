"""The restricted unpickler (`pflbed.data.safepickle`) bounds memory as well as code.

Each hostile pickle here is a few dozen bytes written opcode by opcode; the loader must refuse it (or load it)
without allocating what it asks for. Sizes stay at megabytes: the assertions are the refusals and the traced
peaks, not a machine running out of memory.
"""

from __future__ import annotations

import pickle
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pflbed.data import load_dataset
from pflbed.data.safepickle import load_pickle
from pflbed.errors import DataError

from .. import data_formats as fx

PROTO2 = b"\x80\x02"


def glob(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def i4(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def write(tmp_path: Path, body: bytes) -> Path:
    path = tmp_path / "hostile.pkl"
    path.write_bytes(PROTO2 + body + b".")
    return path


def refused(path: Path, match: str) -> None:
    with pytest.raises(DataError, match=match) as info:
        load_pickle(path, "test")
    message = str(info.value)
    assert message.startswith(f"{path}: refused: ") and "\n" not in message, message


def peak_of(fn) -> tuple[int, str]:
    """The traced peak of `fn()` (NumPy's buffers included), and the message of the `DataError` it raised."""
    tracemalloc.start()
    try:
        fn()
        message = ""
    except DataError as exc:
        message = str(exc)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, message


@pytest.mark.parametrize("name", ["bytearray", "bytes"])
def test_bytes_and_bytearray_of_a_size_are_refused(tmp_path: Path, name: str) -> None:
    """`bytearray(n)` / `bytes(n)` allocate n zeroed bytes from a 30-byte file (three of 2**29 reached 1.76 GB)."""
    path = write(tmp_path, glob("builtins", name) + i4(2**24) + b"\x85R")
    refused(path, f"(builtins.{name}|bytes\\(16777216,\\))")


def test_array_shape_beyond_the_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, glob("numpy.core.multiarray", "_reconstruct") + glob("numpy", "ndarray")
                 + i4(2**22) + b"\x85U\x01b\x87R")  # fmt: skip
    refused(path, "asks for an array of 4,194,304 bytes, more than its file could hold")


def test_object_arrays_and_direct_ndarray_calls_are_refused(tmp_path: Path) -> None:
    objects = glob("numpy.core.multiarray", "_reconstruct") + glob("numpy", "ndarray") + b"K\x00\x85U\x01O\x87R"
    refused(write(tmp_path, objects), "dtype\\('O'\\), not plain numbers")
    refused(write(tmp_path, glob("numpy", "ndarray") + b"K\x10\x85R"), "calls numpy.ndarray directly")


def test_a_dtype_state_that_would_make_it_an_object_dtype_is_refused(tmp_path: Path) -> None:
    """NumPy takes a dtype's flags from its pickled state: 0x3f would make uint8 bytes read as object pointers."""
    state = b"(K\x03U\x01|NNN" + i4(-1) + i4(-1) + b"K\x3ft"
    path = write(tmp_path, glob("numpy", "dtype") + b"U\x02u1\x89\x88\x87R" + state + b"b")
    refused(path, "the state .*not a plain dtype's")


def test_one_buffer_reused_for_many_arrays_is_bounded(tmp_path: Path) -> None:
    """The memo lets 6 bytes of pickle rebuild an array from the same 1,000 bytes again: charged each time."""
    raw = b"T" + struct.pack("<I", 1000) + b"\0" * 1000 + b"q\x01"  # BINSTRING, memo 1
    dtype = glob("numpy", "dtype") + b"U\x02u1\x89\x88\x87R(K\x03U\x01|NNN" + i4(-1) + i4(-1) + b"K\x00tbq\x02"
    one = glob("numpy.core.multiarray", "_reconstruct") + glob("numpy", "ndarray") + b"K\x00\x85U\x01b\x87R"
    one += b"(K\x01M\xe8\x03\x85h\x02\x89h\x01tb"  # state (1, (1000,), dtype, False, raw)
    path = write(tmp_path, raw + dtype + b"0" + b"(" + one * 50 + b"l")  # POP the dtype, then a list of 50
    assert path.stat().st_size < 5000
    refused(path, "asks for an array of 1,000 bytes, more than its file could hold")


def test_memo_index_and_bytearray8_length_reserve_nothing(tmp_path: Path) -> None:
    """A memo slot at index 2**22 (the C unpickler grows an array of 2**23 pointers) and a BYTEARRAY8 that
    announces 16 MB in a 20-byte file."""
    memo = write(tmp_path, b"N" + b"r" + struct.pack("<I", 2**22))
    peak, message = peak_of(lambda: load_pickle(memo, "test"))
    assert peak < 2**20 and not message, (peak, message)
    announced = tmp_path / "short.pkl"
    announced.write_bytes(b"\x80\x05\x96" + struct.pack("<Q", 2**24) + b"xx.")
    peak, message = peak_of(lambda: load_pickle(announced, "test"))
    assert peak < 2**20 and "truncated or corrupt pickle" in message, (peak, message)


def test_nested_label_lists_through_the_memo_are_refused(tmp_path: Path) -> None:
    """100 × 100 × 100 labels from ~600 bytes: each list holds the previous one 100 times by memo reference."""
    d = fx.make_cifar10(tmp_path / "c10")
    image = np.zeros((1, 3072), dtype=np.uint8)
    nested = b"]q\x01(" + b"K\x00" * 100 + b"e0"  # memo 1, then POP it off the stack
    nested += b"]q\x02(" + b"h\x01" * 100 + b"e0" + b"]q\x03(" + b"h\x02" * 100 + b"e"
    body = b"}(" + fx._py2_str(b"data") + fx._py2_array(image) + fx._py2_str(b"labels") + nested + b"u"
    (d / "data_batch_1").write_bytes(PROTO2 + body + b".")
    peak, message = peak_of(lambda: load_dataset("cifar10", path=d))
    assert peak < 2**21 and message.endswith("data_batch_1: labels is not a list of integers"), (peak, message)


@pytest.mark.parametrize("protocol", range(6))
def test_what_the_formats_hold_loads_under_every_protocol(tmp_path: Path, protocol: int) -> None:
    blob = {
        "image_data": np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3),
        "empty": np.zeros((0, 3), dtype=np.uint8),
        "big_endian": np.arange(6, dtype=">i2").reshape(2, 3),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
        "strided": np.arange(10, dtype=np.int64)[::3],
        "names": np.array([b"ab", b"c"]),
        "scalars": [np.int64(3), np.float32(1.5), 7],
        "class_dict": {"n1": [0, 1], "n2": (2,)},
        b"label_names": [b"airplane", b""],
    }
    path = tmp_path / "ok.pkl"
    path.write_bytes(pickle.dumps(blob, protocol=protocol))
    got, unrestricted = load_pickle(path, "test"), pickle.loads(path.read_bytes())
    assert got.keys() == blob.keys()
    for key, value in unrestricted.items():  # NumPy's own unpickling (it makes big-endian arrays native)
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype and np.array_equal(got[key], value), key
        else:
            assert got[key] == value and [type(v) for v in got[key]] == [type(v) for v in value], key
