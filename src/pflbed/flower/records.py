"""pflbed tensors ↔ Flower records.

A client's work travels as one Flower `Message` whose `RecordDict` holds `ArrayRecord`s of flat tensor dicts (the
algorithm contract's payloads, replies and client states) and a `ConfigRecord` of plain values. Arrays go through
NumPy's format, which keeps every dtype pflbed uses (float32/64, int64, bool) bit for bit.
"""

from __future__ import annotations

import torch
from flwr.app import Array, ArrayRecord

Tensors = dict[str, torch.Tensor]
NONFINITE_STATE = "nonfinite"  # a reply's flag `nonfinite/<cid>`: the first non-finite entry of a client's new state


def to_record(tensors: Tensors) -> ArrayRecord:
    record = ArrayRecord()
    for k, v in tensors.items():
        record[k] = Array.from_numpy_ndarray(v.detach().cpu().numpy())
    return record


def from_record(record: ArrayRecord, device: torch.device | str = "cpu") -> Tensors:
    """The tensors of `to_record`, in this process's own memory on `device`."""
    return {k: torch.from_numpy(a.numpy()).to(device) for k, a in record.items()}
