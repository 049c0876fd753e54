"""The model zoo: small classifiers sized from the data's input shape.

Fully connected sizes are computed by a dummy forward so every model works on 28×28 (Fashion-MNIST) and 8×8
(digits) inputs alike.

BatchNorm models (`cnn_bn`, `resnet18`, `resnet18_imagenet`, …) use `SafeBatchNorm1d`/`SafeBatchNorm2d`,
subclasses of torch's layers (so selection by type, `BlockNet.module_state_keys((nn.BatchNorm1d, nn.BatchNorm2d))`,
finds them). Deviation from plain BatchNorm: in training mode, a batch holding a single value per channel (a last
mini-batch of one sample reaching a fully connected BN or a 1×1 feature map) cannot be normalized by its own
statistics — torch raises an error — so such a batch is normalized with the running statistics, which it leaves
unchanged. Every other batch is handled exactly as by torch's BatchNorm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import AfterValidator
from torch import nn

from pflbed import plugins
from pflbed.errors import ConfigError
from pflbed.memory import check_fits
from pflbed.models.blocks import BlockNet


def _flat_size(layers: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Output size of `layers` for one sample; run in eval mode so no BatchNorm statistic is touched."""
    was_training = layers.training
    layers.eval()
    try:
        with torch.no_grad():
            return int(layers(torch.zeros(1, *input_shape)).numel())
    finally:
        layers.train(was_training)


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 200) -> BlockNet:
    """Two hidden layers of 200 units (the MLP of McMahan et al. 2017)."""
    d = math.prod(input_shape)
    return BlockNet(
        [
            ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(d, hidden), nn.ReLU())),
            ("fc2", nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())),
            ("classifier", nn.Linear(hidden, num_classes)),
        ]
    )


class MaxPool2x2(nn.MaxPool2d):
    """`nn.MaxPool2d(2)` whose inference on NCHW maps is the maximum of the four strided quarter-maps.

    Why: torch's CPU kernel for NCHW max-pooling is 8–10× slower on one thread than those three elementwise
    maxima (it is fast only channels-last), which made pooling as costly as the convolutions when evaluating
    10,000 clients. A maximum is exact, so the output is bit-for-bit `max_pool2d`'s (odd sizes drop the last row
    and column, as `max_pool2d` does); when a gradient is needed, `max_pool2d` runs as before, so training and
    its tie rule (the gradient goes to the first maximum of a window) are untouched.
    """

    def __init__(self) -> None:
        super().__init__(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and x.requires_grad) or not x.is_contiguous():
            return super().forward(x)
        x = x[..., : x.shape[-2] // 2 * 2, : x.shape[-1] // 2 * 2]
        top = torch.maximum(x[..., 0::2, 0::2], x[..., 0::2, 1::2])
        return torch.maximum(top, torch.maximum(x[..., 1::2, 0::2], x[..., 1::2, 1::2]))


def _conv_block(cin: int, cout: int, k: int, pad: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=pad), nn.ReLU(), MaxPool2x2())


def fedavg_cnn(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """The CNN of McMahan et al. 2017: conv5×5(32) → pool → conv5×5(64) → pool → FC 512 → FC classes."""
    c = input_shape[0]
    conv1, conv2 = _conv_block(c, 32, 5, 2), _conv_block(32, 64, 5, 2)
    flat = _flat_size(nn.Sequential(conv1, conv2), input_shape)
    return BlockNet(
        [
            ("conv1", conv1),
            ("conv2", conv2),
            ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(flat, 512), nn.ReLU())),
            ("classifier", nn.Linear(512, num_classes)),
        ]
    )


def lenet5(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """LeNet-5 (LeCun et al. 1998): conv6 → pool → conv16 → pool → FC120 → FC84 → classes."""
    c = input_shape[0]
    conv1, conv2 = _conv_block(c, 6, 5, 2), _conv_block(6, 16, 5, 0 if input_shape[-1] >= 16 else 2)
    flat = _flat_size(nn.Sequential(conv1, conv2), input_shape)
    return BlockNet(
        [
            ("conv1", conv1),
            ("conv2", conv2),
            ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(flat, 120), nn.ReLU())),
            ("fc2", nn.Sequential(nn.Linear(120, 84), nn.ReLU())),
            ("classifier", nn.Linear(84, num_classes)),
        ]
    )


# --- BatchNorm models --------------------------------------------------------------------------------------------
class _SingleValueSafe:
    """Mixin for torch BatchNorm layers: see the module docstring (single-value batches use running statistics)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn: nn.modules.batchnorm._BatchNorm = self  # type: ignore[assignment]
        if bn.training and bn.track_running_stats and x.numel() <= x.shape[1]:
            return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
        return super().forward(x)  # type: ignore[misc]


class ReproducibleDropout(nn.Dropout):
    """`nn.Dropout` drawing its mask as torch does on the CPU — `bernoulli_(1 − p)` from the generator of the
    input's device, scaled by 1/(1 − p) — on every device.

    Why: on a GPU torch fuses dropout into one kernel whose random stream no other call reproduces, so batched
    clients (`engine.batched`), which draw each client's masks from that client's own generator outside the
    vmapped step, could not draw the masks the client-by-client loop draws. On the CPU this is torch's dropout op
    for op (the same masks, the same values)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * torch.zeros_like(x)
        return x * torch.empty_like(x).bernoulli_(1.0 - self.p).div_(1.0 - self.p)


class SafeBatchNorm1d(_SingleValueSafe, nn.BatchNorm1d):
    """`nn.BatchNorm1d` that accepts a training batch of one sample (normalized with the running statistics)."""


class SafeBatchNorm2d(_SingleValueSafe, nn.BatchNorm2d):
    """`nn.BatchNorm2d` that accepts a training batch of one 1×1 map (normalized with the running statistics)."""


def _conv_bn_block(cin: int, cout: int, k: int, pad: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=pad, bias=False), SafeBatchNorm2d(cout), nn.ReLU(),
                         MaxPool2x2())  # fmt: skip


def fedavg_cnn_bn(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """The CNN of McMahan et al. 2017 (`cnn`) with BatchNorm (Ioffe & Szegedy 2015), the model FedBN needs.

    conv5×5(32) → BN → ReLU → pool → conv5×5(64) → BN → ReLU → pool → FC 512 → BN → ReLU → FC classes; blocks
    conv1, conv2, fc1, classifier (head: classifier). Deviations from `cnn`: a BatchNorm after each conv and after
    FC-512, before the ReLU; those convs and FC-512 have no bias (a bias right before BatchNorm is cancelled by its
    mean subtraction), so the model has 1,663,978 parameters on 1×28×28 inputs with 10 classes (`cnn`: 1,663,370).
    """
    c = input_shape[0]
    conv1, conv2 = _conv_bn_block(c, 32, 5, 2), _conv_bn_block(32, 64, 5, 2)
    flat = _flat_size(nn.Sequential(conv1, conv2), input_shape)
    return BlockNet(
        [
            ("conv1", conv1),
            ("conv2", conv2),
            ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(flat, 512, bias=False), SafeBatchNorm1d(512), nn.ReLU())),
            ("classifier", nn.Linear(512, num_classes)),
        ]
    )


def lenet5_bn(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """`lenet5` with BatchNorm after each conv and hidden FC layer (before the ReLU; those layers have no bias).

    A small BN model, ~9× cheaper than `cnn_bn` on CPU, so BN-dependent methods (FedBN) can be compared with the
    rest on the same architecture in multi-seed sweeps.
    """
    c = input_shape[0]
    conv1, conv2 = _conv_bn_block(c, 6, 5, 2), _conv_bn_block(6, 16, 5, 0 if input_shape[-1] >= 16 else 2)
    flat = _flat_size(nn.Sequential(conv1, conv2), input_shape)

    def fc(i: int, o: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(i, o, bias=False), SafeBatchNorm1d(o), nn.ReLU())

    return BlockNet(
        [
            ("conv1", conv1),
            ("conv2", conv2),
            ("fc1", nn.Sequential(nn.Flatten(), fc(flat, 120))),
            ("fc2", fc(120, 84)),
            ("classifier", nn.Linear(84, num_classes)),
        ]
    )


class BasicBlock(nn.Module):
    """The two-conv residual block of ResNet-18/34 (He et al. 2016, Fig. 2 left).

    conv3×3(stride) → BN → ReLU → conv3×3 → BN, plus the shortcut, then ReLU. The shortcut is the identity, or a
    1×1 conv (stride) → BN projection where the shape changes (the paper's option B).
    """

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = SafeBatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = SafeBatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), SafeBatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet18(input_shape: tuple[int, ...], num_classes: int, width: float = 1.0) -> BlockNet:
    """ResNet-18, CIFAR variant (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016, §4.2).

    stem conv3×3(64, stride 1) → BN → ReLU (no max-pool) → layer1..layer4, two `BasicBlock`s each, with
    64/128/256/512 channels and first-block strides 1/2/2/2 → global average pool → linear classifier. Blocks:
    stem, layer1, layer2, layer3, layer4, pool (adaptive average pool + flatten), classifier (the head).
    11,173,962 parameters for 3-channel inputs and 10 classes.

    Deviations: the stem takes the data's channel count (1 for grey images) instead of 3; the paper's CIFAR
    networks are the 6n+2 family, and this ImageNet-depth ResNet-18 with a CIFAR stem is the common adaptation.
    Any input size works: stride 2 with padding 1 maps 1×1 to 1×1, so 8×8 inputs reach layer4 as 1×1 maps.
    `width` multiplies every channel count (`resnet18_x025`: 16/32/64/128, 1/16 of the compute, for CPU budgets).
    """
    c = input_shape[0]
    widths, strides = tuple(_scaled(w, width) for w in (64, 128, 256, 512)), (1, 2, 2, 2)
    blocks: list[tuple[str, nn.Module]] = [
        ("stem", nn.Sequential(nn.Conv2d(c, widths[0], 3, padding=1, bias=False), SafeBatchNorm2d(widths[0]),
                               nn.ReLU()))  # fmt: skip
    ]
    return BlockNet(blocks + _resnet_stages(widths, strides, num_classes))


def _resnet_stages(widths: tuple[int, ...], strides: tuple[int, ...], num_classes: int) -> list[tuple[str, nn.Module]]:
    """ResNet-18's layer1..layer4 (two `BasicBlock`s each) after a stem of `widths[0]` channels, then the global
    average pool and the linear classifier: what the CIFAR and the ImageNet variants share."""
    blocks, cin = [], widths[0]
    for i, (w, s) in enumerate(zip(widths, strides, strict=True), start=1):
        blocks.append((f"layer{i}", nn.Sequential(BasicBlock(cin, w, s), BasicBlock(w, w, 1))))
        cin = w
    pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return [*blocks, ("pool", pool), ("classifier", nn.Linear(cin, num_classes))]


def resnet18_imagenet(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """ResNet-18, ImageNet variant (He et al., CVPR 2016, Table 1): the network of torchvision's and timm's
    ImageNet-pretrained ResNet-18 weights, which `model.init_from` loads (`models.pretrained`).

    stem conv7×7(64, stride 2, padding 3) → BN → ReLU → max-pool 3×3 (stride 2, padding 1) → layer1..layer4, two
    `BasicBlock`s each, 64/128/256/512 channels, first-block strides 1/2/2/2 (1×1 conv → BN projection shortcuts
    where the shape changes) → global average pool → linear classifier. Blocks: stem, layer1, layer2, layer3, layer4,
    pool, classifier (the head), as in `resnet18`. 11,689,512 parameters for 3 channels and 1000 classes (the
    ImageNet network), 11,181,642 for 10 classes.

    Made for 224×224 inputs (7×7 maps reach the pool); the adaptive pool takes any size: 64×64 inputs reach it as
    2×2 maps, inputs of 32 px or less as 1×1. Deviations: the stem takes the data's channel count (ImageNet weights
    need 3); initialization is torch's default, as for the zoo's other models (torchvision draws convs Kaiming-normal
    in fan-out mode), which a pretrained start replaces.
    """
    widths, strides = (64, 128, 256, 512), (1, 2, 2, 2)
    return BlockNet([("stem", _imagenet_stem(input_shape[0])), *_resnet_stages(widths, strides, num_classes)])


def _imagenet_stem(channels: int) -> nn.Sequential:
    """The ImageNet ResNets' stem: conv7×7(64, stride 2, padding 3) → BN → ReLU → max-pool 3×3 (stride 2, padding 1),
    the layout torchvision's and timm's weights have (`conv1`, `bn1`)."""
    return nn.Sequential(nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False), SafeBatchNorm2d(64), nn.ReLU(),
                         nn.MaxPool2d(3, stride=2, padding=1))  # fmt: skip


# --- FedPer's model families, in its unit of personalization (one block per basic block) ---------------------------
def _pooled(module: nn.Module) -> nn.Sequential:
    """`module` followed by the global average pool and the flattening, as one block.

    Why the pool joins the last basic block rather than standing alone (as in `resnet18`): FedPer counts K_P in basic
    blocks from the top (K_P = 2 is the classifier and the basic block below it), and `BlockNet.top_blocks` counts
    blocks; a parameter-free pool block would take one of those places. The body's output (`BlockNet.features`)
    stays the pooled feature vector."""
    return nn.Sequential(module, nn.AdaptiveAvgPool2d(1), nn.Flatten())


def resnet34(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """ResNet-34, CIFAR variant (He et al., CVPR 2016, Table 1's 34-layer network with the CIFAR stem of `resnet18`),
    one of FedPer's two model families (Arivazhagan et al. 2019, §4.1).

    stem conv3×3(64, stride 1) → BN → ReLU (no max-pool) → 3, 4, 6, 3 `BasicBlock`s of 64/128/256/512 channels, the
    first of each stage after the first at stride 2 (1×1 conv → BN projection shortcut) → global average pool →
    linear classifier. 21,282,122 parameters for 3-channel inputs and 10 classes.

    Blocks, in FedPer's unit: stem, layer1_1 … layer1_3, layer2_1 … layer2_4, layer3_1 … layer3_6, layer4_1 …
    layer4_3 (the 16 basic blocks the paper counts; layer4_3 ends with the global average pool, `_pooled`),
    classifier (the head). So `algorithm.personal_blocks` K_P = 2 is the paper's "classifier and the immediately
    preceding basic block" — unlike `resnet18`, whose blocks are whole stages.

    Deviations: the stem takes the data's channel count; the paper does not say which stem it used on CIFAR
    (torchvision's ImageNet network, with its 7×7 stride-2 stem and max-pool, leaves 1×1 maps at layer4 on 32-px
    images); this is the common CIFAR adaptation, as in `resnet18`.
    """
    stem = nn.Sequential(nn.Conv2d(input_shape[0], 64, 3, padding=1, bias=False), SafeBatchNorm2d(64), nn.ReLU())
    return BlockNet([("stem", stem), *_basic_blocks((3, 4, 6, 3), num_classes)])


def resnet34_imagenet(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """ResNet-34, ImageNet variant (He et al., CVPR 2016, Table 1): `resnet34`'s 16 basic blocks, one block each,
    behind the ImageNet stem of `resnet18_imagenet` (`_imagenet_stem`); the network of torchvision's and timm's
    ImageNet-pretrained ResNet-34 weights, which `model.init_from` loads (`models.pretrained`). 21,797,672
    parameters for 3 channels and 1000 classes (torchvision's `resnet34`).

    Made for 224-px inputs (FedPer's FLICKR-AES photos, as its Flower re-implementation resizes them): 7×7 maps reach
    the pool; smaller inputs work (64 px: 2×2). Deviations: the stem takes the data's channel count; initialization
    is torch's default, which a pretrained start replaces.
    """
    return BlockNet([("stem", _imagenet_stem(input_shape[0])), *_basic_blocks((3, 4, 6, 3), num_classes)])


def _basic_blocks(repeats: tuple[int, ...], num_classes: int) -> list[tuple[str, nn.Module]]:
    """Stages of `repeats` `BasicBlock`s (64/128/256/512 channels, the first of each stage after the first at stride
    2), one block per basic block (`layer<stage>_<k>`, k from 1), the last ending with the global pool (`_pooled`),
    then the classifier: what the ResNet-34s share, in FedPer's unit of personalization."""
    blocks: list[tuple[str, nn.Module]] = []
    cin = 64
    for i, (w, n) in enumerate(zip((64, 128, 256, 512), repeats, strict=True), start=1):
        for j in range(1, n + 1):
            blocks.append((f"layer{i}_{j}", BasicBlock(cin, w, 2 if i > 1 and j == 1 else 1)))
            cin = w
    blocks[-1] = (blocks[-1][0], _pooled(blocks[-1][1]))
    return [*blocks, ("classifier", nn.Linear(cin, num_classes))]


class DepthwiseSeparable(nn.Module):
    """MobileNet-v1's basic block (Howard et al., "MobileNets", arXiv:1704.04861, 2017, Fig. 3 right): a depthwise
    3×3 conv (stride s) → BN → ReLU, then a pointwise 1×1 conv → BN → ReLU. Convs before BatchNorm have no bias."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.depthwise = nn.Sequential(nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False),
                                       SafeBatchNorm2d(cin), nn.ReLU())  # fmt: skip
        self.pointwise = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), SafeBatchNorm2d(cout), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(x))


# Howard et al. 2017, Table 1: each depthwise-separable block's output channels and stride.
MOBILENET_V1_BLOCKS = ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), *[(512, 1)] * 5, (1024, 2),
                       (1024, 1))  # fmt: skip


def mobilenet_v1(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """MobileNet-v1 ×1.0, CIFAR variant (Howard et al. 2017, Table 1), FedPer's other model family (§4.1).

    stem conv3×3(32, stride 1) → BN → ReLU → 13 `DepthwiseSeparable` blocks (`MOBILENET_V1_BLOCKS`: 64, 128, 128,
    256, 256, 512, 512 ×5, 1024, 1024 channels; stride 2 at the 2nd, 4th, 6th and 12th) → global average pool →
    linear classifier. 3,217,226 parameters for 3-channel inputs and 10 classes.

    Blocks, in FedPer's unit: stem, block1 … block13 (block13 ends with the global average pool, `_pooled`),
    classifier (the head): `algorithm.personal_blocks` K_P = 2 is the classifier and the last basic block.

    Deviations: the stem has stride 1 (the paper's 224-px network starts at stride 2; on 32-px images that would
    leave 1×1 maps for the last two blocks), so 32-px inputs reach block13 as 2×2 maps; the stem takes the data's
    channel count. FedPer says MobileNet-v1 has 11 basic blocks; Howard et al.'s Table 1 has 13 depthwise-separable
    blocks, which this follows (the paper's count is not explained).
    """
    return _mobilenet_v1(input_shape[0], num_classes, stem_stride=1)


def mobilenet_v1_imagenet(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """MobileNet-v1 ×1.0 as Howard et al. 2017's Table 1 has it, for 224-px inputs: `mobilenet_v1` with its stem at
    stride 2 (7×7 maps reach the pool at 224 px). 4,231,976 parameters for 3 channels and 1000 classes. Deviation:
    the stem takes the data's channel count."""
    return _mobilenet_v1(input_shape[0], num_classes, stem_stride=2)


def _mobilenet_v1(channels: int, num_classes: int, stem_stride: int) -> BlockNet:
    """stem conv3×3(32, `stem_stride`) → BN → ReLU → the 13 `MOBILENET_V1_BLOCKS`, the last pooled → classifier."""
    stem = nn.Sequential(nn.Conv2d(channels, 32, 3, stride=stem_stride, padding=1, bias=False), SafeBatchNorm2d(32),
                         nn.ReLU())  # fmt: skip
    blocks: list[tuple[str, nn.Module]] = [("stem", stem)]
    cin = 32
    for i, (cout, stride) in enumerate(MOBILENET_V1_BLOCKS, start=1):
        blocks.append((f"block{i}", DepthwiseSeparable(cin, cout, stride)))
        cin = cout
    blocks[-1] = (blocks[-1][0], _pooled(blocks[-1][1]))
    return BlockNet([*blocks, ("classifier", nn.Linear(cin, num_classes))])


# --- FedPer §4.4: the base replaced by one linear layer ---------------------------------------------------------
LINEAR_BASE_KEEP = 2  # the blocks kept: FedPer's K_P = 2, the classifier and the basic block below it


def linear_base(network: Callable[[tuple[int, ...], int], BlockNet], input_shape: tuple[int, ...], num_classes: int,
                name: str) -> BlockNet:  # fmt: skip
    """`network` with every block below its top `LINEAR_BASE_KEEP` replaced by one linear layer (FedPer §4.4,
    Fig. 5, 6 and 9: "we replace the base layers at each client with a linear fully connected layer", to see whether
    the base learns anything). Blocks: base (flatten → linear map of the whole input to the shape the kept blocks
    read → that shape), then the kept blocks as in `network` (for `resnet34`: layer4_3 with the pool, classifier),
    so `algorithm.personal_blocks: 2` keeps them personal and shares the linear base.

    The linear map's size is the input's size times the kept blocks' input size (at 32 px 3,072 × 8,192 for
    ResNet-34, 3,072 × 4,096 for MobileNet-v1); both grow with the image's pixel count, the layer with its square,
    so a size past the machine's memory is refused before it is allocated (`memory.check_fits`, naming
    `model.name`). Deviation: the paper does not say how the linear layer meets the kept blocks' input; here it
    produces that input exactly."""
    full = network(input_shape, num_classes)
    keep = full.top_blocks(LINEAR_BASE_KEEP)
    body = nn.Sequential(*(full.blocks[b] for b in full.block_names()[: -LINEAR_BASE_KEEP]))
    was = body.training
    body.eval()
    with torch.no_grad():
        shape = tuple(body(torch.zeros(1, *input_shape)).shape[1:])
    body.train(was)
    d_in, d_out = math.prod(input_shape), math.prod(shape)
    check_fits((d_in + 1) * d_out, torch.device("cpu"), f"{name}'s linear base on {'×'.join(map(str, input_shape))} "
               "inputs", "model.name", "smaller images (dataset.image_size) or another model")  # fmt: skip
    base = nn.Sequential(nn.Flatten(), nn.Linear(d_in, d_out), nn.Unflatten(1, shape))
    return BlockNet([("base", base), *((b, full.blocks[b]) for b in keep)])


# --- KT-pFL's heterogeneous zoo ----------------------------------------------------------------------------------
def _pool_if_room(size: int) -> tuple[nn.Module, int]:
    """A 2×2 max-pool, or the identity where the map is already 1×1 (so 8×8 inputs survive every pool)."""
    return (MaxPool2x2(), size // 2) if size >= 2 else (nn.Identity(), size)


def alexnet_small(input_shape: tuple[int, ...], num_classes: int, width: float = 1.0) -> BlockNet:
    """The small AlexNet of the KT-pFL code (Zhang et al., NeurIPS 2021) for 28×28 grey images.

    AlexNet's five-conv/three-FC layout (Krizhevsky et al. 2012) shrunk to small inputs: conv3×3(64, stride 2) →
    ReLU → pool → conv3×3(192) → ReLU → pool → conv3×3(384) → ReLU → conv3×3(256) → ReLU → conv3×3(256) → ReLU →
    pool → dropout → FC 4096 → ReLU → dropout → FC 4096 → ReLU → FC classes (all convs padding 1, pools 2×2,
    dropout 0.5). On 1×28×28 the maps are 14 → 7 → 3 → 1, so the flattened body is 256 features, as in the
    authors' code; 20,125,386 parameters for 1 channel and 10 classes (the two 4096-wide FC layers hold 17.8 M).
    Blocks: conv1, conv2, conv3, conv4, conv5, fc1, fc2, classifier (the head).

    Deviations: the stem takes the data's channel count (the authors replicate grey images to 3 channels); a pool
    that would shrink a 1×1 map is the identity (only inputs ≤ 8 px reach that), so tiny inputs work.
    `width` multiplies every conv and FC width (`alexnet_small_x025`: 16/48/96/64/64 channels, FC 1024).
    """
    c, size = input_shape[0], input_shape[-1]
    ch = [_scaled(w, width) for w in (64, 192, 384, 256, 256)]
    fc = _scaled(4096, width)
    size = (size + 1) // 2  # the stride-2 stem
    pool1, size = _pool_if_room(size)
    pool2, size = _pool_if_room(size)
    pool5, size = _pool_if_room(size)

    def conv(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.ReLU()]

    convs = [
        ("conv1", nn.Sequential(*conv(c, ch[0], 2), pool1)),
        ("conv2", nn.Sequential(*conv(ch[0], ch[1]), pool2)),
        ("conv3", nn.Sequential(*conv(ch[1], ch[2]))),
        ("conv4", nn.Sequential(*conv(ch[2], ch[3]))),
        ("conv5", nn.Sequential(*conv(ch[3], ch[4]), pool5)),
    ]
    flat = _flat_size(nn.Sequential(*(m for _, m in convs)), input_shape)
    return BlockNet(
        [
            *convs,
            ("fc1", nn.Sequential(nn.Flatten(), ReproducibleDropout(0.5), nn.Linear(flat, fc), nn.ReLU())),
            ("fc2", nn.Sequential(ReproducibleDropout(0.5), nn.Linear(fc, fc), nn.ReLU())),
            ("classifier", nn.Linear(fc, num_classes)),
        ]
    )


def _channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Interleave the channels of `groups` groups, so the next unit's split mixes both branches' outputs."""
    n, ch, h, w = x.shape
    return x.view(n, groups, ch // groups, h, w).transpose(1, 2).reshape(n, ch, h, w)


class ShuffleUnit(nn.Module):
    """The ShuffleNet V2 building block (Ma et al., ECCV 2018, Fig. 3 (c) and (d)).

    Stride 1 (c): the input's channels are split in half; one half passes unchanged, the other goes through
    1×1 conv → BN → ReLU → depthwise 3×3 → BN → 1×1 conv → BN → ReLU; concatenate, shuffle (2 groups).
    Stride 2 (d): no split; both branches see the whole input — left: depthwise 3×3 (stride 2) → BN → 1×1 conv →
    BN → ReLU; right: as in (c) with the depthwise conv at stride 2 — each producing half the output channels.
    """

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        if stride == 1 and cin != cout:
            raise ValueError("a stride-1 ShuffleNet V2 unit keeps its channel count")
        self.stride = stride
        half = cout // 2
        right_in = cin if stride == 2 else half

        def dw(ch: int) -> list[nn.Module]:
            return [nn.Conv2d(ch, ch, 3, stride=stride, padding=1, groups=ch, bias=False), SafeBatchNorm2d(ch)]

        def pw(i: int, o: int) -> list[nn.Module]:
            return [nn.Conv2d(i, o, 1, bias=False), SafeBatchNorm2d(o), nn.ReLU()]

        self.left: nn.Module = nn.Sequential(*dw(cin), *pw(cin, half)) if stride == 2 else nn.Identity()
        self.right = nn.Sequential(*pw(right_in, half), *dw(half), *pw(half, half))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            a, b = x.chunk(2, dim=1)
            out = torch.cat([a, self.right(b)], dim=1)
        else:
            out = torch.cat([self.left(x), self.right(x)], dim=1)
        return _channel_shuffle(out, 2)


def shufflenetv2(input_shape: tuple[int, ...], num_classes: int, width: float = 1.0) -> BlockNet:
    """ShuffleNet V2 ×1.0 (Ma et al., "ShuffleNet V2: Practical Guidelines for Efficient CNN Architecture Design",
    ECCV 2018, Table 5), adapted to small images as in the KT-pFL code.

    stem conv3×3(24) → BN → ReLU → stage2 (116 ch), stage3 (232), stage4 (464) of 4, 8, 4 `ShuffleUnit`s, the
    first of each at stride 2 → conv5 1×1(1024) → BN → ReLU → global average pool → linear classifier. Blocks:
    stem, stage2, stage3, stage4, conv5, pool, classifier (the head). 1,263,422 parameters for 1 channel and 10
    classes.

    Deviations (small inputs, ≤ 32 px): the stem conv has stride 1 and there is no initial max-pool (the paper's
    224-px network downsamples 4× before stage2), so 28×28 inputs reach stage4 as 4×4 maps and 8×8 ones as 1×1;
    the stem takes the data's channel count. Convs before BatchNorm have no bias (the paper does not say; torchvision
    does the same). `width` = 0.5 is the paper's ShuffleNet V2 ×0.5 (stages 48/96/192, conv5 still 1024).
    """
    c = input_shape[0]
    widths = {1.0: (116, 232, 464), 0.5: (48, 96, 192)}.get(width)
    if widths is None:
        raise ValueError("shufflenetv2: width 1.0 or 0.5 (the paper's ×1.0 / ×0.5)")
    repeats = (4, 8, 4)
    blocks: list[tuple[str, nn.Module]] = [
        ("stem", nn.Sequential(nn.Conv2d(c, 24, 3, padding=1, bias=False), SafeBatchNorm2d(24), nn.ReLU()))
    ]
    cin = 24
    for i, (w, r) in enumerate(zip(widths, repeats, strict=True), start=2):
        units = [ShuffleUnit(cin, w, 2)] + [ShuffleUnit(w, w, 1) for _ in range(r - 1)]
        blocks.append((f"stage{i}", nn.Sequential(*units)))
        cin = w
    blocks += [
        ("conv5", nn.Sequential(nn.Conv2d(cin, 1024, 1, bias=False), SafeBatchNorm2d(1024), nn.ReLU())),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())),
        ("classifier", nn.Linear(1024, num_classes)),
    ]
    return BlockNet(blocks)


def _scaled(channels: int, width: float) -> int:
    return max(1, round(channels * width))


MODELS: dict[str, Callable[[tuple[int, ...], int], BlockNet]] = {
    "mlp": mlp,
    "cnn": fedavg_cnn,
    "lenet5": lenet5,
    "cnn_bn": fedavg_cnn_bn,
    "lenet5_bn": lenet5_bn,
    "resnet18": resnet18,
    "resnet18_imagenet": resnet18_imagenet,
    "resnet34": resnet34,
    "resnet34_imagenet": resnet34_imagenet,
    "mobilenet_v1": mobilenet_v1,
    "mobilenet_v1_imagenet": mobilenet_v1_imagenet,
    # FedPer §4.4: the base replaced by one linear layer
    "resnet34_linear_base": partial(linear_base, resnet34, name="resnet34_linear_base"),
    "mobilenet_v1_linear_base": partial(linear_base, mobilenet_v1, name="mobilenet_v1_linear_base"),
    "alexnet_small": alexnet_small,
    "shufflenetv2": shufflenetv2,
    # reduced-width variants of KT-pFL's zoo, for heterogeneous federations on CPU budgets
    "resnet18_x025": partial(resnet18, width=0.25),
    "alexnet_small_x025": partial(alexnet_small, width=0.25),
    "shufflenetv2_x05": partial(shufflenetv2, width=0.5),
}


def _plugin_problem(name: str, obj: object) -> str | None:
    """What is wrong with a plugin declared as model `name`, or None (what it builds is checked by `build_model`)."""
    return None if callable(obj) else f"is {plugins.what(obj)}, not a function of (input_shape, num_classes)"


_with_plugins = False


def models() -> dict[str, Callable[[tuple[int, ...], int], BlockNet]]:
    """`MODELS`, the installed plugins' models added on the first call (`pflbed.plugins`).

    Not as this module is imported: a plugin module may import pflbed's algorithms, whose base module imports this
    one, and would then find it half imported."""
    global _with_plugins
    if not _with_plugins:
        _with_plugins = True
        MODELS.update(plugins.load(plugins.MODELS, MODELS, _plugin_problem))  # type: ignore[arg-type]
    return MODELS


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    device: torch.device | str = "cpu",
    channels_last: bool = False,
) -> BlockNet:
    """Build a zoo model on `device`; its initial weights come from torch's global CPU RNG, which the caller seeds.

    The model is built on the CPU whatever the target device (and whatever torch's default device is), then moved:
    initial weights are then the same numbers on every device for one seed, and CPU runs stay bit-identical.

    `channels_last` (`model.channels_last`): 4-D weights stored NHWC. Convolutions then run in that layout whatever
    the input's (torch picks the layout from input or weight), measured 1.2× per training step and 1.6–2.2× per
    evaluation forward on CPU for `lenet5` / `cnn`; the values are the same, the float results of later steps
    differ by rounding, hence opt-in. Parameters keep the layout through loading, copying and checkpoints.
    """
    try:
        factory = models()[name]
    except KeyError:
        if (why := plugins.problem(plugins.MODELS, name)) is not None:
            raise ConfigError(f"model.name: {why}") from None
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
    with torch.device("cpu"):
        model = factory(input_shape, num_classes)
    if not isinstance(model, BlockNet):  # a model of another package's: the algorithms split models by its blocks
        raise ConfigError(f"model.name: {name} built a {type(model).__name__}, not a pflbed.models.blocks.BlockNet "
                          "(its blocks are what the algorithms split into body and head)")  # fmt: skip
    model.zoo_name = name  # what rebuilds it (a saved personal model: `results.trained.load_model`)
    model = model.to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _known(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in models()]
    if unknown:
        raise ValueError(f"unknown models {unknown}; known: {sorted(MODELS)}")
    return names


ModelNames = Annotated[list[str], AfterValidator(_known)]
"""An option listing zoo models (e.g. `architectures`): names outside the zoo fail config validation."""
