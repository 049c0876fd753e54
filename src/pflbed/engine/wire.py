"""Bytes at the client/server boundary.

Strict mode sends every payload, reply and client state through `to_bytes`/`from_bytes`, so a value that could
not cross a real network (a Python object, a non-tensor, a view sharing storage with server memory) fails in
the test suite instead of in a deployment.
"""

from __future__ import annotations

import io

import torch

Tensors = dict[str, torch.Tensor]


def to_bytes(tensors: Tensors) -> bytes:
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise TypeError("a payload, reply or client state must be a dict[str, Tensor]")
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, buf)  # bytes hold no device
    return buf.getvalue()


def from_bytes(blob: bytes, device: torch.device | str = "cpu") -> Tensors:
    """The tensors of `to_bytes`, on `device` (where the receiver reads them)."""
    return torch.load(io.BytesIO(blob), map_location=device, weights_only=True)


def roundtrip(tensors: Tensors, device: torch.device | str = "cpu") -> Tensors:
    return from_bytes(to_bytes(tensors), device)


def num_bytes(tensors: Tensors) -> int:
    """Raw tensor bytes, the communication cost of sending `tensors`."""
    return sum(v.numel() * v.element_size() for v in tensors.values())
