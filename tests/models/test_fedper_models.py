"""FedPer's model families (`resnet34`, `mobilenet_v1`): the papers' layouts, and FedPer's unit of personalization —
one block per basic block, the global pool inside the last one — so that K_P counts basic blocks as §4.3 does."""

import math

import pytest
import torch
from torch import nn

from pflbed.algorithms.fedper import FedPer
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.models import build_model
from pflbed.models.zoo import MOBILENET_V1_BLOCKS, BasicBlock, DepthwiseSeparable


def _convs(m: nn.Module) -> list[nn.Conv2d]:
    return [mod for mod in m.modules() if isinstance(mod, nn.Conv2d)]


def test_resnet34_is_3_4_6_3_basic_blocks_one_block_each():
    m = build_model("resnet34", (3, 32, 32), 10)
    stages = [("layer1", 3), ("layer2", 4), ("layer3", 6), ("layer4", 3)]
    names = [f"{s}_{j}" for s, n in stages for j in range(1, n + 1)]
    assert m.block_names() == ["stem", *names, "classifier"] and len(names) == 16  # the paper's 16 basic blocks
    assert m.head_blocks() == ["classifier"]
    units = [m.blocks[n] if isinstance(m.blocks[n], BasicBlock) else m.blocks[n][0] for n in names]
    assert all(isinstance(u, BasicBlock) for u in units)
    assert [u.conv1.stride[0] for u in units] == [1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 1, 1, 2, 1, 1]
    assert [u.conv2.out_channels for u in units] == [64] * 3 + [128] * 4 + [256] * 6 + [512] * 3
    assert [n for n, u in zip(names, units, strict=True) if not isinstance(u.shortcut, nn.Identity)] == [
        "layer2_1", "layer3_1", "layer4_1"]  # fmt: skip
    stem = _convs(m.blocks["stem"])[0]
    assert stem.kernel_size == (3, 3) and stem.stride == (1, 1)  # the CIFAR stem, no max-pool
    assert not any(isinstance(mod, nn.MaxPool2d) for mod in m.modules())
    assert sum(p.numel() for p in m.parameters()) == 21_282_122  # CIFAR ResNet-34, 10 classes
    assert m.features(torch.zeros(2, 3, 32, 32)).shape == (2, 512)  # pooled inside layer4_3


def test_mobilenet_v1_is_howards_table_1_one_block_per_depthwise_separable_block():
    m = build_model("mobilenet_v1", (3, 32, 32), 10)
    names = [f"block{i}" for i in range(1, 14)]
    assert m.block_names() == ["stem", *names, "classifier"]
    units = [m.blocks[n] if isinstance(m.blocks[n], DepthwiseSeparable) else m.blocks[n][0] for n in names]
    assert all(isinstance(u, DepthwiseSeparable) for u in units)
    dw, pw = [u.depthwise[0] for u in units], [u.pointwise[0] for u in units]
    assert all(c.groups == c.in_channels == c.out_channels and c.kernel_size == (3, 3) for c in dw)
    assert all(c.kernel_size == (1, 1) and c.groups == 1 for c in pw)
    assert [(c.out_channels, d.stride[0]) for c, d in zip(pw, dw, strict=True)] == list(MOBILENET_V1_BLOCKS)
    assert [c for c, _ in MOBILENET_V1_BLOCKS] == [64, 128, 128, 256, 256, 512, 512, 512, 512, 512, 512, 1024, 1024]
    assert all(c.bias is None for c in _convs(m))  # each conv feeds a BatchNorm
    assert _convs(m.blocks["stem"])[0].stride == (1, 1)
    assert sum(p.numel() for p in m.parameters()) == 3_217_226  # MobileNet-v1 ×1.0 at 3 channels, 10 classes
    assert m.features(torch.zeros(2, 3, 32, 32)).shape == (2, 1024)


@pytest.mark.parametrize(("model", "last"), [("resnet34", "layer4_3"), ("mobilenet_v1", "block13")])
def test_fedpers_k_p_2_is_the_classifier_and_the_basic_block_below_it(model, last):
    """§4.1: "the classifier layer and the immediately preceding basic block were used as personalization layers"
    (K_P = 2). A pool standing as a block of its own would take the second place and leave K_P = 2 the classifier
    alone; K_P = 3 adds the next basic block down."""
    def personal(k):
        cfg = validate_config({"dataset": {"name": "synthetic", "synthetic": {"shape": [3, 8, 8], "n_train": 60,
                                                                              "n_test": 20}},
                               "model": {"name": model}, "federation": {"clients": 2},
                               "algorithm": {"name": "fedper", "personal_blocks": k}})  # fmt: skip
        algo = prepare(cfg)
        assert isinstance(algo, FedPer)
        return algo, {k.split(".")[1] for k in algo.personal_keys}

    algo, two = personal(2)
    assert two == {last, "classifier"}
    m = algo.ctx.model
    own = {k for k in m.state_dict() if k.split(".")[1] in (last, "classifier")}
    assert set(algo.personal_keys) == own and any(".bn" in k or ".1.running_mean" in k for k in own)
    below = m.block_names()[-3]
    assert personal(3)[1] == {below, last, "classifier"}


@pytest.mark.parametrize("model", ["resnet34", "mobilenet_v1"])
def test_the_fedper_families_train_on_a_batch_of_one_at_8_px(model):
    """At 8 px the last blocks see 1×1 maps: a batch of one sample is normalized with the running statistics
    (`SafeBatchNorm2d`) and the step stays finite."""
    torch.manual_seed(0)
    m = build_model(model, (1, 8, 8), 10)
    loss = nn.functional.cross_entropy(m(torch.randn(1, 1, 8, 8)), torch.tensor([3]))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_mobilenet_v1_imagenet_is_table_1_at_224_px():
    """Howard et al.'s network as published: the stem at stride 2, so 224-px inputs reach block13 as 7×7 maps;
    4,231,976 parameters for 1000 classes. The blocks are `mobilenet_v1`'s."""
    m = build_model("mobilenet_v1_imagenet", (3, 224, 224), 1000)
    assert m.block_names() == build_model("mobilenet_v1", (3, 32, 32), 10).block_names()
    assert _convs(m.blocks["stem"])[0].stride == (2, 2)
    assert sum(p.numel() for p in m.parameters()) == 4_231_976
    seen = []
    m.blocks["block13"].register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape[1:])))
    m.eval()
    with torch.no_grad():
        assert m(torch.zeros(1, 3, 224, 224)).shape == (1, 1000)
    assert seen == [(1024, 7, 7)]


@pytest.mark.parametrize(("model", "network", "kept", "shape"), [
    ("resnet34_linear_base", "resnet34", "layer4_3", (512, 4, 4)),
    ("mobilenet_v1_linear_base", "mobilenet_v1", "block13", (1024, 2, 2)),
])  # fmt: skip
def test_fedpers_linear_base_is_one_linear_layer_under_the_networks_top_two_blocks(model, network, kept, shape):
    """§4.4 (Fig. 5, 6, 9): the base layers replaced by one linear layer, from the whole input to exactly what the
    kept blocks read; the kept blocks are the network's own; FedPer's K_P = 2 keeps them personal and shares the
    linear base alone."""
    m, full = build_model(model, (3, 32, 32), 10), build_model(network, (3, 32, 32), 10)
    assert m.block_names() == ["base", kept, "classifier"]
    linear = [mod for mod in m.blocks["base"].modules() if isinstance(mod, nn.Linear)]
    assert [(fc.in_features, fc.out_features) for fc in linear] == [(3 * 32 * 32, shape[0] * shape[1] * shape[2])]
    assert not any(isinstance(mod, nn.Conv2d | nn.BatchNorm2d) for mod in m.blocks["base"].modules())
    assert m.blocks["base"](torch.zeros(2, 3, 32, 32)).shape == (2, *shape)
    for b in (kept, "classifier"):  # the network's own blocks, parameter for parameter
        assert [(k, v.shape) for k, v in m.blocks[b].state_dict().items()] == [
            (k, v.shape) for k, v in full.blocks[b].state_dict().items()]  # fmt: skip
    own = sum(p.numel() for b in (kept, "classifier") for p in full.blocks[b].parameters())
    assert sum(p.numel() for p in m.parameters()) == 3 * 32 * 32 * math.prod(shape) + math.prod(shape) + own
    cfg = validate_config({"dataset": {"name": "synthetic", "synthetic": {"shape": [3, 8, 8], "n_train": 60,
                                                                          "n_test": 20}},
                           "model": {"name": model}, "federation": {"clients": 2},
                           "algorithm": {"name": "fedper", "personal_blocks": 2}})  # fmt: skip
    algo = prepare(cfg)
    assert algo.base_keys == ["blocks.base.1.weight", "blocks.base.1.bias"]
    assert {k.split(".")[1] for k in algo.personal_keys} == {kept, "classifier"}


def test_a_linear_base_past_the_machine_s_memory_is_refused_naming_the_model(monkeypatch):
    from pflbed import memory
    from pflbed.errors import ConfigError

    monkeypatch.setattr(memory, "device_memory", lambda device: 10**9)
    # (3 × 64 × 64 + 1) × (512 × 8 × 8): at 64 px layer4_3 reads 8×8 maps
    with pytest.raises(ConfigError, match=r"^model\.name: resnet34_linear_base's linear base on 3×64×64 inputs would "
                                          r"hold 402,685,952 parameters; .* of memory; smaller images "
                                          r"\(dataset\.image_size\) or another model$"):  # fmt: skip
        build_model("resnet34_linear_base", (3, 64, 64), 10)


@pytest.mark.parametrize("model", ["resnet34", "mobilenet_v1", "resnet34_imagenet", "mobilenet_v1_imagenet"])
def test_every_conv_is_followed_by_batchnorm_then_relu_and_the_stem_keeps_the_map_size_its_stride_says(model):
    """Conv → BN → ReLU in the stems and in both halves of a depthwise-separable block (a BasicBlock's second BN
    meets the shortcut before its ReLU, `BasicBlock.forward`); 3×3 stems padded by 1 (7×7 by 3), so a 32-px image
    leaves the stem at 32 / stride px (the ImageNet ResNet's max-pool halves it once more)."""
    m = build_model(model, (3, 32, 32), 10)
    kinds = {nn.Conv2d: "conv", nn.BatchNorm2d: "bn", nn.ReLU: "relu"}

    def order(module: nn.Module) -> list[str]:
        return [name for mod in module.modules() for kind, name in kinds.items() if isinstance(mod, kind)]

    assert order(m.blocks["stem"]) == ["conv", "bn", "relu"]
    if model.startswith("mobilenet"):
        units = [m.blocks[n] if isinstance(m.blocks[n], DepthwiseSeparable) else m.blocks[n][0]
                 for n in m.block_names() if n.startswith("block")]  # fmt: skip
        assert all(order(u.depthwise) == order(u.pointwise) == ["conv", "bn", "relu"] for u in units)
    side = {"resnet34": 32, "mobilenet_v1": 32, "resnet34_imagenet": 8, "mobilenet_v1_imagenet": 16}[model]
    m.eval()
    with torch.no_grad():
        assert m.blocks["stem"](torch.zeros(1, 3, 32, 32)).shape[2:] == (side, side)
