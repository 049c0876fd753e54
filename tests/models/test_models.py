import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pflbed.models import MODELS, BlockNet, build_model, zoo
from pflbed.models.zoo import MaxPool2x2


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8)])
def test_models_build_for_both_input_sizes(name, shape):
    m = build_model(name, shape, 10)
    assert m(torch.zeros(3, *shape)).shape == (3, 10)
    assert m.head_blocks() == ["classifier"]
    assert m.classify(m.features(torch.zeros(2, *shape))).shape == (2, 10)


def test_fedavg_cnn_matches_the_paper_architecture():
    m = build_model("cnn", (1, 28, 28), 10)
    convs = [mod for mod in m.modules() if isinstance(mod, nn.Conv2d)]
    linears = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(32, (5, 5)), (64, (5, 5))]
    assert [(fc.in_features, fc.out_features) for fc in linears] == [(7 * 7 * 64, 512), (512, 10)]
    assert sum(p.numel() for p in m.parameters()) == 1_663_370


def test_block_selection_is_structural():
    m = build_model("lenet5", (1, 28, 28), 10)
    assert m.block_names() == ["conv1", "conv2", "fc1", "fc2", "classifier"]
    assert m.top_blocks(2) == ["fc2", "classifier"]
    assert m.state_keys(["classifier"]) == ["blocks.classifier.weight", "blocks.classifier.bias"]
    body = m.state_keys(m.body_blocks())
    assert set(body) | set(m.state_keys(m.head_blocks())) == set(m.state_dict())
    with pytest.raises(KeyError):
        m.state_keys(["nope"])


def _net(n: int, head: int) -> BlockNet:
    return BlockNet([(f"b{i}", nn.Linear(2, 2)) for i in range(n)], num_head_blocks=head)


def test_a_blocknet_needs_a_body_and_a_head_and_takes_every_top_count_from_none_to_all():
    """A head of every block leaves no body to share (FedPer, FedRep, … would share nothing): refused, as is none.
    `top_blocks` takes 0 (FedPer with K_P = 0 is FedAvg) up to every block, and nothing outside."""
    for head in (0, 3):
        with pytest.raises(ValueError, match=r"^a BlockNet needs at least one body block and one head block$"):
            _net(3, head)
    m = _net(3, 2)
    assert (m.body_blocks(), m.head_blocks()) == (["b0"], ["b1", "b2"])
    assert [m.top_blocks(k) for k in (0, 1, 3)] == [[], ["b2"], ["b0", "b1", "b2"]]
    for k in (-1, 4):
        with pytest.raises(ValueError, match=rf"^cannot take {k} top blocks of a 3-block model$"):
            m.top_blocks(k)
    with pytest.raises(KeyError, match=r"unknown blocks \['nope'\]; model has \['b0', 'b1', 'b2'\]"):
        m.state_keys(["b0", "nope"])


def test_module_state_keys_selects_by_type_not_name():
    m = BlockNet([("a", nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))), ("weird_bn_name", nn.Linear(4, 2))])
    keys = m.module_state_keys((nn.BatchNorm1d,))
    assert keys == [f"blocks.a.1.{k}" for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]


BN_KINDS = (nn.BatchNorm1d, nn.BatchNorm2d)
BN_ENTRIES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _owner(m: nn.Module, key: str) -> nn.Module:
    return m.get_submodule(key.rsplit(".", 1)[0])


@pytest.mark.parametrize(("name", "num_bn"), [("cnn_bn", 3), ("resnet18", 1 + 4 * 2 * 2 + 3)])
def test_bn_keys_are_every_batchnorm_entry_and_nothing_else(name, num_bn):
    m = build_model(name, (1, 8, 8), 10)
    keys = m.module_state_keys(BN_KINDS)
    expected = [k for k in m.state_dict() if isinstance(_owner(m, k), BN_KINDS)]
    assert keys == expected and len(keys) == 5 * num_bn
    assert {k.rsplit(".", 1)[1] for k in keys} == set(BN_ENTRIES)
    others = [k for k in m.state_dict() if k not in set(keys)]
    assert all(isinstance(_owner(m, k), nn.Conv2d | nn.Linear) for k in others)


def test_cnn_bn_layout():
    m = build_model("cnn_bn", (1, 28, 28), 10)
    assert m.block_names() == ["conv1", "conv2", "fc1", "classifier"] and m.head_blocks() == ["classifier"]
    names = {nn.Conv2d: "conv", nn.Linear: "fc", nn.ReLU: "relu", nn.BatchNorm1d: "bn", nn.BatchNorm2d: "bn"}
    order = [n for mod in m.modules() for kind, n in names.items() if isinstance(mod, kind)]
    assert order == ["conv", "bn", "relu", "conv", "bn", "relu", "fc", "bn", "relu", "fc"]  # BN before each ReLU
    assert sum(p.numel() for p in m.parameters()) == 1_663_978  # the cnn's 1,663,370 − 608 biases + 1,216 BN


def test_resnet18_layout_and_parameter_count():
    m = build_model("resnet18", (3, 8, 8), 10)
    assert m.block_names() == ["stem", "layer1", "layer2", "layer3", "layer4", "pool", "classifier"]
    assert m.head_blocks() == ["classifier"]
    assert sum(p.numel() for p in m.parameters()) == 11_173_962  # CIFAR ResNet-18, 10 classes
    convs = [mod for mod in m.modules() if isinstance(mod, nn.Conv2d)]
    assert len(convs) == 1 + 16 + 3 and convs[0].kernel_size == (3, 3) and convs[0].stride == (1, 1)
    assert not any(isinstance(mod, nn.MaxPool2d) for mod in m.modules())
    assert sum(p.numel() for p in build_model("resnet18", (1, 28, 28), 10).parameters()) == 11_173_962 - 2 * 64 * 9


@pytest.mark.parametrize("name", ["cnn_bn", "resnet18"])
@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8)])
def test_bn_models_train_on_tiny_batches(name, shape):
    """One SGD step in train mode, including a batch of one sample (1×1 maps / FC BatchNorm)."""
    torch.manual_seed(0)
    m = build_model(name, shape, 10)
    init = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for n in (4, 1):
        loss = nn.functional.cross_entropy(m(torch.randn(n, *shape)), torch.arange(n))
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = m.state_dict()
    bn = m.module_state_keys(BN_KINDS)
    assert all(not torch.equal(state[k], init[k]) for k in bn if k.endswith("running_mean"))
    m.eval()
    assert torch.isfinite(m(torch.randn(2, *shape))).all()


def test_safe_batchnorm_single_value_uses_running_statistics():
    m = build_model("cnn_bn", (1, 8, 8), 10)
    bn = m.blocks["fc1"][2]
    assert isinstance(bn, nn.BatchNorm1d)
    with torch.no_grad():
        bn.running_mean.fill_(1.0)
        bn.running_var.fill_(4.0)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    bn.train()
    out = bn(torch.full((1, 512), 3.0))
    assert torch.allclose(out, torch.full((1, 512), 1.0), atol=1e-4)  # (3 − 1) / √4, affine at identity
    assert all(torch.equal(before[k], v) for k, v in bn.state_dict().items())
    x = torch.randn(5, 512)
    assert torch.equal(bn(x), nn.functional.batch_norm(x, None, None, bn.weight, bn.bias, True))  # batch stats


def test_building_a_bn_model_leaves_initial_statistics_untouched():
    m = build_model("cnn_bn", (1, 28, 28), 10)
    assert m.training and all(mod.training for mod in m.modules())
    for k in m.module_state_keys(BN_KINDS):
        v = m.state_dict()[k]
        if k.endswith("running_mean") or k.endswith("num_batches_tracked"):
            assert not v.any(), k
        elif k.endswith("running_var"):
            assert torch.equal(v, torch.ones_like(v)), k


def test_alexnet_small_matches_the_kt_pfl_code_layout():
    m = build_model("alexnet_small", (1, 28, 28), 10)
    assert m.block_names() == ["conv1", "conv2", "conv3", "conv4", "conv5", "fc1", "fc2", "classifier"]
    convs = [mod for mod in m.modules() if isinstance(mod, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 192, 384, 256, 256] and convs[0].stride == (2, 2)
    linears = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    assert [(fc.in_features, fc.out_features) for fc in linears] == [(256, 4096), (4096, 4096), (4096, 10)]
    assert sum(p.numel() for p in m.parameters()) == 20_125_386
    m8 = build_model("alexnet_small", (1, 8, 8), 10)  # the last pool would shrink a 1×1 map: identity instead
    assert isinstance(m8.blocks["conv5"][-1], nn.Identity) and isinstance(m.blocks["conv5"][-1], nn.MaxPool2d)


def test_shufflenetv2_layout_and_parameter_count():
    from pflbed.models.zoo import ShuffleUnit

    m = build_model("shufflenetv2", (1, 28, 28), 10)
    assert m.block_names() == ["stem", "stage2", "stage3", "stage4", "conv5", "pool", "classifier"]
    assert [len(m.blocks[s]) for s in ("stage2", "stage3", "stage4")] == [4, 8, 4]
    assert all(isinstance(u, ShuffleUnit) for s in ("stage2", "stage3", "stage4") for u in m.blocks[s])
    assert [m.blocks[s][0].stride for s in ("stage2", "stage3", "stage4")] == [2, 2, 2]
    stem = m.blocks["stem"][0]
    assert stem.stride == (1, 1) and not any(isinstance(mod, nn.MaxPool2d) for mod in m.modules())
    x = torch.zeros(2, 1, 28, 28)
    for name in ("stem", "stage2", "stage3", "stage4"):
        x = m.blocks[name](x)
    assert x.shape == (2, 464, 4, 4)
    assert sum(p.numel() for p in m.parameters()) == 1_263_422
    assert sum(p.numel() for p in build_model("shufflenetv2", (3, 8, 8), 10).parameters()) == 1_263_854


def test_channel_shuffle_interleaves_the_two_branches():
    from pflbed.models.zoo import _channel_shuffle

    x = torch.arange(6.0).view(1, 6, 1, 1)
    assert _channel_shuffle(x, 2).flatten().tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]


@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8)])
def test_shufflenetv2_trains_on_a_batch_of_one(shape):
    torch.manual_seed(0)
    m = build_model("shufflenetv2", shape, 10)
    loss = nn.functional.cross_entropy(m(torch.randn(1, *shape)), torch.tensor([3]))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_reduced_width_variants_scale_every_layer():
    """The CPU-budget variants of KT-pFL's zoo: same depth and blocks, narrower layers."""
    for full, narrow, first in (("resnet18", "resnet18_x025", 16), ("alexnet_small", "alexnet_small_x025", 16),
                                ("shufflenetv2", "shufflenetv2_x05", 24)):  # fmt: skip
        a, b = build_model(full, (1, 28, 28), 10), build_model(narrow, (1, 28, 28), 10)
        assert a.block_names() == b.block_names()
        assert b.blocks[b.block_names()[0]][0].out_channels == first
        assert sum(p.numel() for p in b.parameters()) < sum(p.numel() for p in a.parameters()) / 3
    assert build_model("shufflenetv2_x05", (1, 28, 28), 10).blocks["stage4"][0].right[-2].num_features == 96
    assert build_model("alexnet_small_x025", (1, 28, 28), 10).blocks["classifier"].in_features == 1024
    with pytest.raises(ValueError, match="width 1.0 or 0.5"):
        zoo.shufflenetv2((1, 28, 28), 10, width=0.3)


@pytest.mark.parametrize("shape", [(3, 4, 6, 6), (2, 3, 7, 5), (1, 2, 2, 3)])
def test_max_pool_2x2_is_max_pool2d_bit_for_bit(shape):
    """Inference (no gradient) takes the strided-maximum path, training `max_pool2d`: outputs equal bit for bit
    on maps full of ties and with odd sizes (last row/column dropped), and the gradient goes where `max_pool2d`
    sends it (the first maximum of each window)."""
    x = torch.randint(-2, 3, shape).float()
    pool = MaxPool2x2()
    with torch.no_grad():
        assert torch.equal(pool(x), F.max_pool2d(x, 2))
    assert torch.equal(pool(x.contiguous(memory_format=torch.channels_last)), F.max_pool2d(x, 2))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(F.max_pool2d(x, 2).shape)
    pool(a).backward(g)
    F.max_pool2d(b, 2).backward(g)
    assert torch.equal(a.grad, b.grad)


def test_inference_rows_bound_the_widest_activation(monkeypatch):
    """Rows per inference call: `eval.batch_size`, unless the widest layer output of that many rows would pass
    `ACTIVATION_BYTES` (the CNN's first conv map: 32×28×28 float32 = 100,352 bytes a sample); measured per method,
    so the head alone (`classify` of 512 features) is not held back by the body's maps."""
    from pflbed.algorithms.base import Predictor
    from pflbed.models import inference

    cnn, mlp = build_model("cnn", (1, 28, 28), 10), build_model("mlp", (1, 28, 28), 10)
    x = torch.randn(5, 1, 28, 28)
    assert inference.inference_rows(cnn, "features", x, 256) == (1 << 23) // (32 * 28 * 28 * 4) == 83
    assert inference.inference_rows(cnn, "classify", torch.randn(5, 512), 256) == 256
    assert inference.inference_rows(mlp, "forward", x, 256) == 256
    assert inference.inference_rows(mlp, "forward", x[:0], 256) == 256  # nothing to measure: no forward
    monkeypatch.setattr(inference, "ACTIVATION_BYTES", 3 * 32 * 28 * 28 * 4)
    fresh = build_model("cnn", (1, 28, 28), 10)  # the cache lives on the model object
    sizes = []
    fresh.blocks["conv1"].register_forward_hook(lambda m, i, o: sizes.append(len(o)))
    pred = Predictor(fresh, {k: v.clone() for k, v in cnn.state_dict().items()})
    out = pred.logits(torch.randn(7, 1, 28, 28), batch_size=256)
    assert out.shape == (7, 10) and sizes == [1, 3, 3, 1]  # one measuring row, then 3 + 3 + 1


def test_inference_rows_are_measured_per_row_shape_on_batched_tensor_outputs_one_row_at_least(monkeypatch):
    """The bound counts each layer output's bytes a row — 1-D outputs (4 bytes a float row) and 1-byte rows included,
    a layer's tuple (an LSTM's) or scalar output skipped; it is measured per row shape (another width is another
    bound), applies to a single row too (only an empty input is not measured), and a row wider than the bound is
    evaluated alone."""
    from pflbed.models import inference

    class Odd(nn.Module):
        """A user's model: an LSTM (a tuple out) and a scalar beside a 1-D output of 4 bytes a row."""

        def __init__(self):
            super().__init__()
            self.lstm, self.total, self.first = nn.LSTM(1, 1, batch_first=True), _Sum(), _First()

        def forward(self, x):
            self.lstm(x[:, :1, None]), self.total(x)
            return self.first(x)

    class _Sum(nn.Module):
        def forward(self, x):
            return x.sum()

    class _First(nn.Module):
        def forward(self, x):
            return x[:, 0]

    monkeypatch.setattr(inference, "ACTIVATION_BYTES", 100)
    rows = inference.inference_rows
    assert rows(Odd(), "forward", torch.zeros(5, 3), 256) == 100 // 4  # lstm's 1×1 floats, x[:, 0]: 4 bytes a row
    ident = nn.Sequential(nn.Identity())  # hooks see its layers, not the model called by its method
    assert rows(ident, "forward", torch.zeros(5, 1, dtype=torch.uint8), 256) == 100  # 1 byte a row
    assert rows(ident, "forward", torch.zeros(5, 1, dtype=torch.uint8), 40) == 40  # never past the batch size
    assert rows(ident, "forward", torch.zeros(5, 2, 1), 256) == 100 // 8
    assert rows(ident, "forward", torch.zeros(5, 20, 1), 256) == 100 // 80  # same trailing shape, another row
    assert rows(ident, "forward", torch.zeros(5, 1000), 256) == 1  # wider than the bound: a row at a time
    assert rows(nn.Sequential(nn.Identity()), "forward", torch.zeros(1, 10), 256) == 100 // 40  # one row: measured


def test_the_zoo_dropout_draws_torchs_cpu_masks_and_nothing_in_eval():
    """`ReproducibleDropout`: on the CPU torch's own dropout, mask for mask and value for value under the same seed
    (so the zoo's CPU results did not change), and the identity in eval mode."""
    from pflbed.models.zoo import ReproducibleDropout

    x = torch.randn(6, 40, requires_grad=True)
    for p in (0.25, 0.5, 1.0):
        layer = ReproducibleDropout(p)
        torch.manual_seed(3)
        ours = layer(x)
        torch.manual_seed(3)
        assert torch.equal(ours, F.dropout(x, p, training=True)), p
    assert ReproducibleDropout(0.5).eval()(x) is x


def test_a_zoo_model_keeps_torch_s_layout_unless_asked_and_an_unknown_name_lists_the_zoo():
    from pflbed.models.zoo import MODELS

    conv = build_model("cnn", (1, 28, 28), 10).blocks["conv2"][0].weight  # 32 input channels: the layouts differ
    assert conv.is_contiguous() and not conv.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(KeyError) as e:
        build_model("nope", (1, 28, 28), 10)
    assert e.value.args == (f"unknown model 'nope'; known: {sorted(MODELS)}",)
