"""SGD with momentum and weight decay: `torch.optim.SGD`'s update, without importing `torch._dynamo`.

Every local update of the algorithms is SGD (dampening 0, no Nesterov). `torch.optim` imports `torch._dynamo` at an
optimizer's first `add_param_group` and `step` (to keep the compiler out of them), which costs about a second of
CPU in a process that never compiles anything — and a Flower ClientApp is a fresh process for every message, so a
deployment paid that second for each client's work (a quarter of a round's CPU on a small model). This class is the
same update, op for op, as `torch.optim.SGD` with its default implementation: per tensor where the parameters are
on the CPU, and `torch._foreach_*` over each (device, dtype) group elsewhere, as torch defaults to there — so a run
gives the same bits with either (`tests/algorithms/test_sgd.py` compares them step by step).

For parameter p with gradient g, in each group (lr η, momentum μ, weight decay λ):
    d = g + λ·p;  b = d at the first step, else b = μ·b + d;  p ← p − η·b   (b = d where μ = 0)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_FOREACH_DEVICES = ("cuda", "xpu", "mps")  # where torch.optim.SGD defaults to its foreach implementation


class SGD:
    """`torch.optim.SGD(params, lr, momentum, weight_decay)` (see the module): `params` is tensors, or groups as
    dicts with "params" and optionally "lr", "momentum", "weight_decay" overriding the defaults for that group."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:  # fmt: skip
        given = list(params)
        groups = given if given and isinstance(given[0], dict) else [{"params": given}]
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        self.param_groups = []
        for group in groups:
            unknown = set(group) - {"params", *defaults}
            if unknown:
                raise ValueError(f"unknown SGD option(s) {sorted(unknown)}")
            self.param_groups.append({**defaults, **group, "params": list(group["params"])})
        self.state: dict[torch.Tensor, torch.Tensor] = {}  # parameter → its momentum buffer

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if all(p.device.type in _FOREACH_DEVICES for p in params):
                self._foreach_step(params, group["lr"], group["momentum"], group["weight_decay"])
            else:
                self._tensor_step(params, group["lr"], group["momentum"], group["weight_decay"])

    def _tensor_step(self, params: list[torch.Tensor], lr: float, momentum: float, weight_decay: float) -> None:
        for p in params:
            d = p.grad if weight_decay == 0 else p.grad.add(p, alpha=weight_decay)
            if momentum != 0:
                buf = self.state.get(p)
                if buf is None:
                    buf = self.state[p] = d.detach().clone()
                else:
                    buf.mul_(momentum).add_(d)
                d = buf
            p.add_(d, alpha=-lr)

    def _foreach_step(self, params: list[torch.Tensor], lr: float, momentum: float, weight_decay: float) -> None:
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        for ps in by_kind.values():
            grads = [p.grad for p in ps]
            if weight_decay != 0:
                grads = torch._foreach_add(grads, ps, alpha=weight_decay)
            if momentum != 0:
                bufs = [self.state.get(p) for p in ps]
                if all(b is not None for b in bufs):
                    torch._foreach_mul_(bufs, momentum)
                    torch._foreach_add_(bufs, grads)
                else:
                    for i, (p, g) in enumerate(zip(ps, grads, strict=True)):
                        if bufs[i] is None:
                            bufs[i] = self.state[p] = g.detach().clone()
                        else:
                            bufs[i].mul_(momentum).add_(g)
                grads = bufs
            torch._foreach_add_(ps, grads, alpha=-lr)
