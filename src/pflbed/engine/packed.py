"""Dicts of tensors in one byte buffer: how many small tensors cross a process boundary (`procs`) or go into a
checkpoint (`results.checkpoint`) at the cost of one.

Why: whatever moves tensors one by one pays per tensor. `torch.multiprocessing` shares each tensor's storage
separately, each costing a file descriptor passed over a socket (at 10,000 clients holding a few samples each, the
~20 tensors a client update sent and received cost more than training it: LeNet-5, 4.5× loop's round time);
`torch.save` pickles each one (≈ 0.1 ms a tensor: 10,000 clients' two-tensor heads took 2 s to checkpoint, four
times an evaluation of them). Packed, it is one storage. Every tensor keeps its dtype, shape and strides (a
channels-last weight stays channels-last), so what is unpacked computes exactly as what was packed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

Tensors = dict[str, torch.Tensor]


class Packed(NamedTuple):
    """Dicts of tensors in one CPU byte buffer, and where each tensor lies in it."""

    buffer: torch.Tensor  # uint8
    layouts: list[list[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], int]]]  # key, dtype, shape, stride, at


def pack(*dicts: Tensors) -> Packed:
    """`dicts` copied into one buffer, each tensor at a 64-byte aligned offset, with the strides a copy keeps
    (`Tensor.to(copy=True)`'s: a dense tensor's own, e.g. channels-last; contiguous otherwise)."""
    layouts, at = [], 0
    for tensors in dicts:
        layout = []
        for k, v in tensors.items():
            stride = torch.empty_like(v, device="meta").stride()
            layout.append((k, v.dtype, tuple(v.shape), stride, at))
            at += -(-v.numel() * v.element_size() // 64) * 64
        layouts.append(layout)
    buffer = torch.empty(at, dtype=torch.uint8)
    for tensors, layout in zip(dicts, layouts, strict=True):
        for v, (_, _, _, _, start) in zip(tensors.values(), layout, strict=True):
            raw = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            buffer[start : start + len(raw)].copy_(raw)
    return Packed(buffer, layouts)


def unpack(packed: Packed, device: torch.device) -> list[Tensors]:
    """Private copies on `device` of the packed dicts (the buffer may be shared memory, or a loaded file's)."""
    out = []
    for layout in packed.layouts:
        tensors = {}
        for k, dtype, shape, stride, start in layout:
            n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            src = packed.buffer[start : start + n].view(dtype).view(shape)
            tensors[k] = torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(src)
        out.append(tensors)
    return out
