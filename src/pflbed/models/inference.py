"""How many samples one inference forward takes: `eval.batch_size`, capped so the widest activation fits a cache.

Measured on one thread (Fashion-MNIST, 28×28): the McMahan CNN forwards 1.5× more samples per second at 64–128
rows than at 256 (its first conv map is 100 KB a sample: past ~128 rows the maps leave the cache), while LeNet-5
(19 KB a sample) and the MLP are fastest at 256–512. One batch size cannot serve both, so each model's rows per
forward are bounded by `ACTIVATION_BYTES` of its widest activation. Rows per forward never change a prediction's
definition, only how many samples share a call.

The bound is a CPU cache effect, so it applies to inputs on the CPU only; on a GPU every call takes
`eval.batch_size` rows (a 224-px ImageNet ResNet-18's first map, 3.2 MB a sample, would otherwise be evaluated two
samples a call).
"""

from __future__ import annotations

import torch
from torch import nn

ACTIVATION_BYTES = 1 << 23  # 8 MiB: the CNN at 83 rows, LeNet-5 and the MLP at `eval.batch_size` (256)


def inference_rows(model: nn.Module, method: str, x: torch.Tensor, batch_size: int) -> int:
    """Rows per call of `getattr(model, method)` on inputs shaped like `x`'s rows: at most `batch_size`, and few
    enough that the widest output of any of the model's layers stays within `ACTIVATION_BYTES`.

    The widest output is measured once per (model object, method, row shape) by a one-row forward with hooks on
    the leaf modules, and kept on the model (the run reuses its model objects).
    """
    if len(x) == 0 or x.device.type != "cpu":
        return batch_size
    cache: dict = model.__dict__.setdefault("_inference_rows", {})
    key = (method, tuple(x.shape[1:]), x.dtype, batch_size)
    if key not in cache:
        widest = 1

        def hook(_module: nn.Module, _inputs: object, out: object) -> None:
            nonlocal widest
            if isinstance(out, torch.Tensor) and out.dim() > 0 and len(out):
                widest = max(widest, out[0].numel() * out.element_size())

        handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
        try:
            with torch.no_grad():
                getattr(model, method)(x[:1])
        finally:
            for h in handles:
                h.remove()
        cache[key] = max(1, min(batch_size, ACTIVATION_BYTES // widest))
    return cache[key]
