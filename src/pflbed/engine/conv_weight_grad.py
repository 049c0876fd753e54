"""Batched clients' convolutions with their weight gradient as a matrix product (`executor.autotune`, on a GPU).

Why: a vmapped step runs a convolution of per-client weights as one grouped convolution, a group a client, and
cuDNN runs a grouped convolution's backward group after group (an H200's profile of FedAvg's batched CNN round:
1,600 backward kernels a round of each kind, one a client and step, the largest kind 45 % of the round's device
time). A client's weight gradient is a product whose output (out × in·k²) is small and whose inner dimension
(batch · height · width) is long: one at a time such products leave most of a large GPU idle. The same gradient
is a matrix product per client — the output gradient times the input's patches — which the vmapped step runs as
one batched product over all the clients.

`product_conv` is the convolution with that backward (`WeightGradAsProduct`): its value and input gradient as
before (one grouped convolution each), its weight gradient from one unfold of the client's batch laid out as a
single tall image, each sample padded (so no patch mixes two samples: the patches that straddle two are computed
and meet zero gradient rows), so no copy reorders them. Its backward is itself made of differentiable operations,
so second derivatives (a rule's Hessian-vector products) are exact too. The values are the convolution's exactly,
the gradients the same up to rounding; the product runs at matrix products' precision (`executor.tf32`: float32
by default, where cuDNN's convolutions run in TF32). torch.compile cannot trace a custom autograd function under
`vmap` (torch 2.13: dynamo's wrapper of it has no batching rule), so dynamo puts the call in its graph untraced
(`keep_in_graph`: `torch.compiler.allow_in_graph`), and AOT autograd, which runs it under the real `vmap`,
captures its forward and backward: compiled steps and CUDA graphs take it too. (A custom operator instead would
not run under `torch.func.grad`: pytorch/pytorch#168393.)

Which form pays depends on the GPU, the layer's shape and the number of clients, so it is timed, as cuDNN times
its own algorithms under `executor.autotune`: `chosen` times both forms of each eligible convolution (stride 1,
no dilation, one group, zero padding) at the step's shape, eagerly, and keeps the faster; the choice is
remembered per shape for the process. Like cuDNN's, the winner may differ from one process to the next, and with
it the rounding. Not under bf16 autocast, nor on a CPU, where grouped convolutions are native and the product
loses.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

Key = tuple[object, ...]
_CHOICES: dict[Key, bool] = {}  # per shape: whether the product form was the faster


class WeightGradAsProduct(torch.autograd.Function):
    """One client's stride-1 convolution `F.conv2d(x, w, padding=padding)` whose weight gradient is computed as a
    matrix product (`weight_grad`); each gradient only where asked for (a step's first layer takes none for its
    input, a frozen layer none for its weight). Written per client; under `vmap` its forward and input gradient
    are grouped convolutions and its product a batched one."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:  # type: ignore[override]
        return F.conv2d(x, w, None, 1, padding)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        x, w, padding = inputs
        ctx.save_for_backward(x, w)
        ctx.padding = padding

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # noqa: ANN001
        x, w = ctx.saved_tensors
        dx = torch.nn.grad.conv2d_input(x.shape, w, dy, padding=ctx.padding) if ctx.needs_input_grad[0] else None
        dw = weight_grad(x, dy, w.shape, ctx.padding) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def product_conv(x: torch.Tensor, w: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
    """`WeightGradAsProduct`, as a call torch.compile keeps in its graphs untraced (`keep_in_graph`)."""
    return WeightGradAsProduct.apply(x, w, padding)


def keep_in_graph() -> None:
    """Have torch.compile keep `product_conv` in its graphs untraced (see the module docstring). Called where a
    step is compiled (`batched.compiled`), not at import: importing torch's compiler costs every fresh process a
    second (`algorithms/sgd.py`)."""
    torch.compiler.allow_in_graph(product_conv)


def weight_grad(x: torch.Tensor, dy: torch.Tensor, shape: torch.Size, padding: tuple[int, int]) -> torch.Tensor:
    """The weight gradient of a stride-1 convolution of `x` [n, in, H, W] whose output's gradient is `dy`
    [n, out, H′, W′]: dy's rows times the patches of the samples stacked into one tall image, each padded by
    `padding`; the tall image's rows of patches that straddle two samples meet zero rows of gradient."""
    n, c, h, wd = x.shape
    o, _, kh, kw = shape
    ph, pw = padding
    hp, wp = h + 2 * ph, wd + 2 * pw
    ho, wo = hp - kh + 1, wp - kw + 1
    tall = F.pad(x, (pw, pw, ph, ph)).transpose(0, 1).reshape(1, c, n * hp, wp)
    patches = F.unfold(tall, (kh, kw))[0]  # [in·kh·kw, (n·hp − kh + 1)·wo]: every row of patches, in order
    rows = F.pad(dy.transpose(0, 1), (0, 0, 0, hp - ho))  # each sample's gradient at its rows of the tall image
    rows = rows.reshape(o, n * hp * wo)[:, : (n * hp - kh + 1) * wo]
    return (rows @ patches.T).view(shape)


def eligible(m: nn.Module) -> bool:
    """A convolution `product_conv` computes: 2-d, stride 1, no dilation, one group, zero padding given as
    numbers."""
    return (isinstance(m, nn.Conv2d) and m.stride == (1, 1) and m.dilation == (1, 1) and m.groups == 1
            and m.padding_mode == "zeros" and not isinstance(m.padding, str))  # fmt: skip


def chosen(
    model: nn.Module, sample: torch.Tensor, clients: int, batch: int, faster: Callable[[Key], bool] | None = None
) -> frozenset[str]:
    """The names of `model`'s convolutions whose weight gradient the batched step should compute as a product:
    those eligible for which `faster(key)` (default: `product_faster`, a timing on the model's device) says it
    beats the grouped convolution at `clients` clients × `batch` samples, each shape timed once per process.
    `sample`: one input of the model, whose forward gives each convolution's input shape. None under autocast."""
    if torch.is_autocast_enabled(sample.device.type):
        return frozenset()
    faster = faster or product_faster
    shapes = _input_shapes(model, sample)
    dtype = next(model.parameters()).dtype
    out = set()
    for name, (m, (c, h, w), first) in shapes.items():
        key = (str(sample.device), dtype, clients, batch, m.out_channels, c, h, w, m.kernel_size, m.padding, first)
        if key not in _CHOICES:
            _CHOICES[key] = faster(key)
        if _CHOICES[key]:
            out.add(name)
    return frozenset(out)


@contextlib.contextmanager
def patched(model: nn.Module, names: Collection[str]) -> Iterator[None]:
    """The convolutions `names` of `model` computed by `product_conv` for the duration (their own after)."""
    mods = {n: m for n, m in model.named_modules() if n in names}
    for m in mods.values():
        m.forward = _product_forward(m)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in mods.values():
            del m.forward


def _product_forward(m: nn.Conv2d) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = product_conv(x, m.weight, tuple(m.padding))
        return y if m.bias is None else y + m.bias.view(-1, 1, 1)

    return forward


def _input_shapes(model: nn.Module, sample: torch.Tensor) -> dict[str, tuple[nn.Conv2d, tuple[int, ...], bool]]:
    """Each eligible convolution's per-sample input shape, and whether its input is the model's own (whose
    gradient a step never takes), from one forward of `sample` in eval mode (no statistic moves, no mask drawn)."""
    seen: dict[str, tuple[nn.Conv2d, tuple[int, ...], bool]] = {}

    def record(name: str) -> Callable[[nn.Module, tuple], None]:
        def hook(m: nn.Module, args: tuple) -> None:
            seen.setdefault(name, (m, tuple(args[0].shape[1:]), args[0] is sample))  # type: ignore[arg-type]

        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules() if eligible(m)]
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            model(sample)
    finally:
        for m, training in modes.items():
            m.training = training
        for h in hooks:
            h.remove()
    return seen


def product_faster(key: Key, reps: int = 5) -> bool:
    """Whether the product form's forward and backward beat the grouped convolution's at `key`'s shape, timed on
    its device (the best of `reps` after a warm-up). The grouped one where the product's patches would take more
    than an eighth of the GPU's free memory (a round near the memory's ceiling — FedBasis's ResNet-18 at 100
    clients — would run out with them: 8 GB for one of its 64-channel layers), or where either form runs out."""
    device, dtype, clients, batch, out, c, h, w, k, padding, first = key
    device = torch.device(str(device))
    patches = clients * c * k[0] * k[1] * (batch * (h + 2 * padding[0]) - k[0] + 1) * (w + 2 * padding[1] - k[1] + 1)
    if not _fits(patches * dtype.itemsize, device):
        return False
    forms = [lambda x, wt: F.conv2d(x, wt, None, 1, padding), lambda x, wt: product_conv(x, wt, padding)]
    try:
        wt = torch.randn(clients, out, c, *k, device=device, dtype=dtype)
        x = torch.randn(clients, batch, c, h, w, device=device, dtype=dtype)
        grouped, product = (_seconds(vmap(grad(lambda wt, x, conv=conv: conv(x, wt).square().sum(),
                                                argnums=0 if first else (0, 1))), (wt, x), reps)
                            for conv in forms)  # fmt: skip
    except torch.OutOfMemoryError:
        return False
    return product < grouped


def _fits(nbytes: int, device: torch.device) -> bool:
    """Whether `nbytes` is at most an eighth of `device`'s free memory (a GPU's; any size on a CPU)."""
    return device.type != "cuda" or nbytes <= torch.cuda.mem_get_info(device)[0] / 8


def _seconds(step: Callable, args: tuple, reps: int) -> float:
    """The best of `reps` timed calls of `step(*args)`, after two untimed ones, waiting for the device."""
    device = args[0].device
    times = []
    for _ in range(reps + 2):
        _sync(device)
        t0 = time.perf_counter()
        step(*args)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times[2:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
