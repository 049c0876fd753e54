"""Bytes at the client/server boundary (engine/wire.py): strict mode's copies, the bytes counted, and nothing but
tensors read back (a blob is never code to run)."""

import io
import pickle

import pytest
import torch

from pflbed.engine import wire


def test_wire_roundtrip_copies():
    t = {"w": torch.arange(6.0).reshape(2, 3)[:, 1:]}
    for back in (wire.roundtrip(t), wire.from_bytes(wire.to_bytes(t))):  # read back on the CPU by default
        assert torch.equal(back["w"], t["w"]) and back["w"].data_ptr() != t["w"].data_ptr()
    assert wire.num_bytes(t) == 4 * 4


class _Code:
    """What a crafted blob holds: unpickling it calls `print` (it could as well call anything)."""

    def __reduce__(self):
        return print, ("unpickled code ran",)


def test_bytes_holding_code_are_refused_and_not_run(capsys):
    blob = io.BytesIO()
    torch.save({"w": _Code()}, blob)
    with pytest.raises(pickle.UnpicklingError):
        wire.from_bytes(blob.getvalue())
    assert "unpickled code ran" not in capsys.readouterr().out
