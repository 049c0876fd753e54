"""BatchNorm and dropout for batched clients (`engine.batched`): each client's running statistics and masks.

A vmapped step (`torch.func.vmap` over clients) runs one forward for every client at once, but a BatchNorm layer
keeps its running statistics in buffers it updates in place, and dropout draws its masks from torch's one global
generator: neither is per client. For the duration of a batched phase, `PerClientLayers` gives each such module
of the model a forward that works per client, as the client-by-client loop would:

- **BatchNorm**: the client's running statistics come in as stacked per-client tensors and the updated ones go out
  as the step's auxiliary output (functionally, nothing updated in place). The batch statistics are taken over the
  client's real samples only — a batched step pads a client's shorter batch, and the padding must not move its
  mean and variance — and the running ones move as torch's do (momentum, unbiased variance, one more batch
  tracked). A batch holding a single value per channel is normalized with the running statistics, which it leaves
  as they were (`models.zoo.SafeBatchNorm*`, the zoo's deviation). Computed in float32 at least (float64 stays float64)
  and returned in the input's dtype, as torch's kernels do.
- **Dropout**: each call's mask is drawn before the step, outside the vmapped call, from the client's own
  generator (`rng.global_stream`, the stream the loop's update draws from torch's global RNG): per step, every
  dropout call of the forward in order, `bernoulli_(1 − p)` over the client's real batch, scaled by 1/(1 − p) —
  `models.zoo.ReproducibleDropout`'s draw, so the same masks.
- **Eval mode**, a forward the step makes through a frozen model (MOON's global and previous models): as in the
  loop, BatchNorm normalizes with the running statistics that forward is given and moves none, and dropout draws
  no mask.

The loop's and the batched parameters then differ by float rounding only (the normalization's reductions are
summed in another order than torch's kernel sums them): the tolerance of `engine.batched`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pflbed.engine import conv_weight_grad

Tensors = dict[str, torch.Tensor]
_STATS = ("running_mean", "running_var", "num_batches_tracked")


def supported(model: nn.Module) -> bool:
    """Every buffer is a BatchNorm's running statistics (tracked, with a momentum), every random layer plain
    dropout: what `PerClientLayers` carries per client."""
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            if not (m.track_running_stats and m.affine and m.momentum is not None):
                return False
        elif list(m.buffers(recurse=False)):
            return False
        if isinstance(m, nn.modules.dropout._DropoutNd) and type(m) not in (nn.Dropout, _reproducible()):
            return False  # channel-wise or alpha dropout draws other masks
    return True


def _reproducible() -> type:
    from pflbed.models.zoo import ReproducibleDropout

    return ReproducibleDropout


class PerClientLayers:
    """The model's BatchNorm and dropout layers made per client for a vmapped step (see the module docstring).

    Use: `layers.trace(...)` once; `masks = layers.draw(...)` before each step; inside the vmapped function
    `layers.enter(stats, real, masks)`, the forward, then `layers.leave()` returns the new statistics — all within
    `layers.patched()`. `products`: the convolutions whose weight gradient the step computes as a product
    (`conv_weight_grad.chosen`), patched with the rest."""

    def __init__(self, model: nn.Module, products: frozenset[str] = frozenset()) -> None:
        self.model, self.products = model, products
        self.norms = {n: m for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
        self.drops = {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd)}
        self.buffer_keys = [f"{n}.{s}" for n in self.norms for s in _STATS]
        self.calls: list[tuple[str, tuple[int, ...]]] = []  # the forward's dropout calls: module, sample shape
        self._stats: Tensors = {}
        self._sets: dict[int, str] | None = None
        self._new: Tensors = {}
        self._real: torch.Tensor | None = None
        self._masks: list[torch.Tensor] = []

    def trace(self, model: nn.Module, forward: Callable[[], object]) -> None:
        """Record the order and per-sample shapes of the dropout calls `forward()` makes: the model's forward on
        one sample, or one objective's forwards. Run in training mode, as the step runs, so that a forward the
        objective makes in eval mode (MOON's frozen models) is not recorded: it draws no mask there. Nothing is
        drawn and no statistic moves (dropout passes its input, BatchNorm normalizes with the running ones)."""
        self.calls = []

        def record(name: str, m: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
            def forward(x: torch.Tensor) -> torch.Tensor:
                if m.training:
                    self.calls.append((name, tuple(x.shape[1:])))
                return x

            return forward

        was = model.training
        model.train()
        try:
            with self._forwards(lambda _n, m: functools.partial(_eval_norm, m), record), torch.no_grad():
                forward()
        finally:
            model.train(was)

    def draw(
        self, sizes: list[int], width: int, gens: list[torch.Generator], device: torch.device
    ) -> list[torch.Tensor]:
        """One step's masks: per dropout call, [clients, width, *shape]; client i's first `sizes[i]` rows drawn from
        `gens[i]` in the loop's order (the calls in forward order), its padding rows 1."""
        out = [torch.ones(len(sizes), width, *shape, device=device) for _, shape in self.calls]
        for i, (n, g) in enumerate(zip(sizes, gens, strict=True)):
            for mask, (name, shape) in zip(out, self.calls, strict=True):
                p = float(self.drops[name].p)
                if p == 1.0:
                    mask[i, :n] = 0.0
                elif p > 0.0:
                    mask[i, :n] = torch.empty(n, *shape, device=device).bernoulli_(1.0 - p, generator=g).div_(1.0 - p)
        return out

    def enter(self, stats: Tensors, real: torch.Tensor, masks: list[torch.Tensor], sets: bool = False) -> None:
        """Inside the vmapped function: this client's running statistics, which of its rows are real, its masks.
        `sets`: `stats` holds further sets of statistics under key prefixes (an objective's `models`), which a
        forward names by passing them to `functional_call` as the layer's buffers; a layer finds its set by the
        identity of the running mean it is given (one not among `stats`: the model's own)."""
        self._stats, self._new, self._real, self._masks = stats, {}, real, list(masks)
        self._sets = {id(v): k[: -len(".running_mean")] for k, v in stats.items()
                      if k.endswith(".running_mean")} if sets else None  # fmt: skip

    def leave(self) -> Tensors:
        """The client's running statistics after the forward."""
        assert not self._masks, "a dropout mask was drawn for a call the forward did not make"
        new, self._stats, self._new, self._real, self._sets = self._new, {}, {}, None, None
        return new

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """The layers' per-client forwards, for the duration (the model's own afterwards)."""
        with self._forwards(self._norm_forward, self._drop_forward), conv_weight_grad.patched(self.model,
                                                                                               self.products):
            yield

    @contextlib.contextmanager
    def _forwards(self, norm: Callable[[str, nn.Module], Callable], drop: Callable[[str, nn.Module], Callable]
                  ) -> Iterator[None]:  # fmt: skip
        """Each BatchNorm's forward `norm(name, layer)` and each dropout's `drop(name, layer)` for the duration."""
        for n, m in self.norms.items():
            m.forward = norm(n, m)
        for n, m in self.drops.items():
            m.forward = drop(n, m)
        try:
            yield
        finally:
            for m in [*self.norms.values(), *self.drops.values()]:
                del m.forward

    def _drop_forward(self, _name: str, m: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x * self._masks.pop(0) if m.training else x  # eval mode (a frozen model's forward): no mask

        return forward

    def _norm_forward(self, name: str, m: _BatchNorm) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not m.training:  # a frozen model's forward (MOON's): its own running statistics, which stay
                return _eval_norm(m, x)
            assert self._real is not None and m.momentum is not None
            at = name if self._sets is None else self._sets.get(id(m.running_mean), name)
            # a set moved earlier in this step moves on from there, as the loop's in-place update does
            rm, rv, tracked = (self._new.get(f"{at}.{s}", self._stats[f"{at}.{s}"]) for s in _STATS)
            xf = x.to(torch.promote_types(x.dtype, torch.float32))
            dims = [0, *range(2, x.dim())]
            shape = [1, -1] + [1] * (x.dim() - 2)
            real = self._real.to(xf.dtype).view(-1, *[1] * (x.dim() - 1))
            count = self._real.to(xf.dtype).sum() * (xf[0, 0].numel())  # values per channel in the real rows
            mean = (xf * real).sum(dims) / count
            var = ((xf - mean.view(shape)).square() * real).sum(dims) / count
            single = count <= 1  # `SafeBatchNorm`: normalized with the running statistics, which stay
            use_mean = torch.where(single, rm.to(xf.dtype), mean)
            use_var = torch.where(single, rv.to(xf.dtype), var)
            y = _normalized(m, xf, use_mean, use_var)
            mom = float(m.momentum)
            unbiased = var.detach() * count / (count - 1).clamp(min=1)
            moved_mean = (1 - mom) * rm.to(xf.dtype) + mom * mean.detach()
            moved_var = (1 - mom) * rv.to(xf.dtype) + mom * unbiased
            self._new[f"{at}.running_mean"] = torch.where(single, rm, moved_mean.to(rm.dtype))
            self._new[f"{at}.running_var"] = torch.where(single, rv, moved_var.to(rv.dtype))
            self._new[f"{at}.num_batches_tracked"] = tracked + (~single).to(tracked.dtype)
            return y.to(x.dtype)

        return forward


def _normalized(m: _BatchNorm, xf: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """`xf` normalized with per-channel `mean` and `var`, then scaled and shifted by the layer's weight and bias,
    in `xf`'s dtype."""
    shape = [1, -1] + [1] * (xf.dim() - 2)
    y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + m.eps)
    return y * m.weight.to(xf.dtype).view(shape) + m.bias.to(xf.dtype).view(shape)


def _eval_norm(m: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """BatchNorm in eval mode, computed as the training forward above is (float32 at least), with the running
    statistics the forward was given (`functional_call`'s, else the layer's own), which it leaves as they are."""
    assert m.running_mean is not None and m.running_var is not None
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return _normalized(m, xf, m.running_mean.to(xf.dtype), m.running_var.to(xf.dtype)).to(x.dtype)
