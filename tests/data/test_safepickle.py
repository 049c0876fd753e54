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
from pflbed.data.safepickle import as_str_keys, int_vector, load_pickle
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


@pytest.mark.parametrize("value", [np.zeros(2, dtype="V4"), np.zeros(2, dtype="V4")[0],
                                   np.array([1], dtype="M8[s]"), np.datetime64(5, "s")],
                         ids=["void-array", "void-scalar", "date-array", "date-scalar"])
@pytest.mark.parametrize("protocol", [2, 5])
def test_raw_bytes_and_dates_are_not_plain_numbers(tmp_path: Path, value: object, protocol: int) -> None:
    """Only numbers and strings (`biufcSU`) load, refused by their kind: a void (`V4`) dtype has no object flag and
    no fields, so nothing else would stop it."""
    path = tmp_path / "v.pkl"
    path.write_bytes(pickle.dumps(value, protocol=protocol))
    refused(path, "of dtype dtype\\('[<|]?(V4|M8)'\\), not plain numbers")


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


# --- each refusal's own line, the allocation bound at its edge, what an honest file may still hold -------------

RECONSTRUCT = glob("numpy.core.multiarray", "_reconstruct") + glob("numpy", "ndarray")
F8 = glob("numpy", "dtype") + b"U\x02f8\x89\x88\x87R"  # dtype('f8', False, True)
EMPTY_ARRAY = RECONSTRUCT + b"K\x00\x85U\x01b\x87R"  # _reconstruct(ndarray, (0,), 'b'), state to follow


def reason(path: Path) -> str:
    """What `load_pickle` says after "<path>: refused: ", up to the "(not loaded: …)" that follows every refusal."""
    with pytest.raises(DataError) as info:
        load_pickle(path, "test")
    message = str(info.value)
    head, tail = f"{path}: refused: ", " (not loaded: a test file as published never does this)"
    assert message.startswith(head) and message.endswith(tail), message
    return message[len(head):-len(tail)]


@pytest.mark.parametrize(("body", "said"), [
    (glob("numpy", "ndarray") + b"K\x10\x85R", "the pickle calls numpy.ndarray directly"),
    (RECONSTRUCT + b"](K\x02e" + b"U\x01b\x87R", "the pickle gives an array the shape [2]"),
    (RECONSTRUCT + i4(-1) + i4(-1) + b"\x86U\x01b\x87R", "the pickle gives an array the shape (-1, -1)"),
    (glob("numpy", "dtype") + b"K\x01\x85R", "the pickle builds a dtype from int, not a type code"),
    (glob("numpy.core.multiarray", "_reconstruct") + b"NK\x00\x85U\x01b\x87R",
     "the pickle reconstructs an array of a type other than numpy.ndarray"),
    (glob("numpy.core.numeric", "_frombuffer") + b"(K\x01NNNtR", "the pickle reads an array from int"),
    (glob("numpy.core.multiarray", "scalar") + F8 + b"K\x05\x86R",
     "the pickle gives a float64 scalar int data, not its bytes"),
    (glob("numpy.core.multiarray", "scalar") + F8 + b"U\x01\x00\x86R",
     "the pickle gives a float64 scalar str data, not its bytes"),
    (glob("_codecs", "encode") + b"U\x01aU\x05utf-8\x86R",
     "the pickle calls _codecs.encode with 'utf-8', not as Python writes bytes"),
    (glob("_codecs", "encode") + b"K\x01U\x06latin1\x86R",
     "the pickle calls _codecs.encode with 'latin1', not as Python writes bytes"),
    (EMPTY_ARRAY + b"K\x01b", "the pickle gives an array the state int"),
    (EMPTY_ARRAY + b"(K\x00\x85N\x89t" + b"b", "the pickle gives an array the state tuple"),
    (EMPTY_ARRAY + b"(K\x01K\x00\x85N\x89K\x00t" + b"b", "the pickle fills an array from int, not its bytes"),
    (b"]}b", "the pickle sets the state of a list"),
])  # fmt: skip
def test_each_refusal_says_what_the_pickle_did(tmp_path: Path, body: bytes, said: str) -> None:
    assert reason(write(tmp_path, body)) == said


def test_the_allocation_bound_is_twice_the_file_to_the_byte(tmp_path: Path) -> None:
    """Protocol 2 writes an array's bytes (charged once as `_codecs.encode`'s), then its state copies them
    (charged again, by the state's shape): an honest file needs twice its size. A state that claims one byte more
    than the budget left is refused; one that claims exactly the rest is let through to NumPy (which refuses
    bytes shorter than the shape)."""
    honest = pickle.dumps(np.zeros(300, dtype=np.uint8), protocol=2)
    assert honest.count(b"M\x2c\x01") == 1  # the state's shape (300,), as BININT2
    size = len(honest)
    spent = 300 + 1  # the raw bytes and the typecode 'b', both `_codecs.encode`d
    path = tmp_path / "edge.pkl"
    path.write_bytes(honest.replace(b"M\x2c\x01", b"M" + struct.pack("<H", 2 * size - spent + 1)))
    claimed = 2 * size - spent + 1
    assert reason(path) == f"the pickle asks for an array of {claimed:,} bytes, more than its file could hold"
    path.write_bytes(honest.replace(b"M\x2c\x01", b"M" + struct.pack("<H", 2 * size - spent)))
    with pytest.raises(DataError) as info:
        load_pickle(path, "test")
    assert str(info.value) == f"{path}: not a readable test pickle (buffer size does not match array size)"


def test_a_charge_names_the_allocation_it_refused(tmp_path: Path) -> None:
    """Bytes, arrays and scalars built again and again from one memoized string: each charged, each named."""
    text = b"X" + struct.pack("<I", 400) + b"a" * 400 + b"q\x01"  # BINUNICODE of 400 chars, memo 1
    encode = glob("_codecs", "encode") + b"q\x02"
    twice = b"h\x02h\x01U\x06latin1\x86R0" * 2  # 800 bytes charged
    c16 = glob("numpy", "dtype") + b"U\x03c16\x89\x88\x87R"
    args = c16 + b"U\x10" + b"\x00" * 16 + b"\x86q\x03"  # (dtype('c16'), its 16 bytes), memo 3
    scalars = glob("numpy.core.multiarray", "scalar") + b"q\x04" + args + b"0(" + b"h\x04h\x03R" * 200  # 16 a call
    path = write(tmp_path, text + encode + twice + b"0" + scalars + b"l")
    assert reason(path) == "the pickle asks for a scalar of 16 bytes, more than its file could hold"
    path = write(tmp_path, text + encode + twice + b"(" + b"h\x02h\x01U\x06latin1\x86R" * 9 + b"l")
    assert reason(path) == "the pickle asks for bytes of 400 bytes, more than its file could hold"
    raw = b"C\xff" + b"\x00" * 255 + b"q\x01"  # SHORT_BINBYTES of 255 bytes
    frombuffer = glob("numpy.core.numeric", "_frombuffer") + b"q\x02"
    frombuffer += glob("numpy", "dtype") + b"U\x02u1\x89\x88\x87Rq\x03"
    one = b"h\x02(h\x01h\x03K\xff\x85U\x01Ct" + b"R"
    path = write(tmp_path, raw + frombuffer + b"(" + one * 9 + b"l")
    assert reason(path) == "the pickle asks for an array of 255 bytes, more than its file could hold"


def test_what_python_writes_for_bytes_and_python_2_writes_for_scalars_loads(tmp_path: Path) -> None:
    """Python 3 writes `b""` under protocol 2 as `builtins.bytes()` (`fix_imports=False`) or `__builtin__.bytes()`;
    Python 2 writes a scalar's data as a `str` holding its bytes."""
    path = tmp_path / "ok.pkl"
    for fix_imports in (True, False):
        path.write_bytes(pickle.dumps([b"", b"ab"], protocol=2, fix_imports=fix_imports))
        assert load_pickle(path, "test") == [b"", b"ab"]
    path.write_bytes(PROTO2 + glob("numpy.core.multiarray", "scalar") + F8 + b"U\x08" + struct.pack("<d", 1.5)
                     + b"\x86R.")  # fmt: skip
    got = load_pickle(path, "test")
    assert type(got) is np.float64 and got == 1.5


@pytest.mark.parametrize(("body", "said"), [
    (b"", "truncated or corrupt pickle (EOFError)"),
    (b"\x80\x05\x96" + struct.pack("<Q", 9) + b"xx.", "truncated or corrupt pickle (pickle data was truncated)"),
])  # fmt: skip
def test_a_corrupt_file_s_line_says_why(tmp_path: Path, body: bytes, said: str) -> None:
    path = tmp_path / "corrupt.pkl"
    path.write_bytes(body)
    with pytest.raises(DataError) as info:
        load_pickle(path, "test")
    assert str(info.value) == f"{path}: {said}"


def test_a_missing_file_and_another_global_each_get_their_line(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        load_pickle(tmp_path / "nope.pkl", "test")
    assert str(info.value) == f"{tmp_path / 'nope.pkl'}: no such file"
    path = write(tmp_path, glob("os", "system") + b"U\x02ls\x85R")
    with pytest.raises(DataError) as info:
        load_pickle(path, "test")
    assert str(info.value) == (f"{path}: refused: the pickle calls os.system, which a test file never holds "
                               "(not loaded: unpickling it could run code)")  # fmt: skip


def test_python_2_keys_decode_as_latin_1_and_a_non_dict_is_named(tmp_path: Path) -> None:
    assert as_str_keys({b"data": 1, b"caf\xe9": 2, 3: 4}, tmp_path, "test") == {"data": 1, "café": 2, "3": 4}
    with pytest.raises(DataError) as info:
        as_str_keys([1], tmp_path / "x.pkl", "test")
    assert str(info.value) == f"{tmp_path / 'x.pkl'}: expected a dict in a test pickle, got list"


@pytest.mark.parametrize(("value", "want"), [
    (np.array([3, 1], dtype=np.uint8), [3, 1]),
    (np.array([-2, 5], dtype=np.int32), [-2, 5]),
    (np.array([[1, 2]]), None),
    (np.array([1.0, 2.0]), None),
    (np.array([True, False]), None),
    ([np.uint8(200), 7], [200, 7]),
    ((1, 2), [1, 2]),
    ([1, 2.0], None),
    ([[1], [2]], None),
    ([2**64], None),
    ("12", None),
])  # fmt: skip
def test_int_vector_takes_flat_integers_only_as_int64(value: object, want: list[int] | None) -> None:
    got = int_vector(value)
    if want is None:
        assert got is None
    else:
        assert got.dtype == np.int64 and got.tolist() == want


def test_an_array_state_without_its_version_loads(tmp_path: Path) -> None:
    """Old NumPy wrote an array's state as (shape, dtype, is_fortran, raw), without the leading version."""
    a = np.arange(6, dtype=np.uint8).reshape(2, 3)
    body = fx._py2_array(a)
    assert body.count(b"\x87R(K\x01(") == 1  # the state's MARK, its version 1, the shape's MARK
    path = write(tmp_path, body.replace(b"\x87R(K\x01(", b"\x87R(("))
    assert np.array_equal(load_pickle(path, "test"), a)
