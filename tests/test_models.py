import pytest
import torch
from torch import nn

from pflbed.models import MODELS, BlockNet, build_model


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


def test_module_state_keys_selects_by_type_not_name():
    m = BlockNet([("a", nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))), ("weird_bn_name", nn.Linear(4, 2))])
    keys = m.module_state_keys((nn.BatchNorm1d,))
    assert keys == [f"blocks.a.1.{k}" for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
