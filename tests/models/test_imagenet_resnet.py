"""`resnet18_imagenet` (the ImageNet ResNet-18 as named blocks) and `model.init_from` with torchvision / timm
ResNet-18 state dicts: every tensor lands where the ImageNet network has it, so the loaded body computes what the
torchvision network computes; the 1000-class classifier is replaced by the run's."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError
from pflbed.models import build_model

WIDTHS = (64, 128, 256, 512)
REPEATS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}  # basic blocks per stage


def _torchvision():
    """torchvision's `resnet18`, or None where torchvision is missing or does not load beside this torch."""
    try:
        from torchvision.models import resnet18
    except Exception:  # noqa: BLE001 — a wheel built for another torch fails in many ways on import
        return None
    return resnet18


def _randomize_bn(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Distinct random BN affine parameters and statistics everywhere, so any two BN entries trade places visibly."""
    for k, v in state.items():
        if k.endswith("running_var"):
            v.copy_(torch.rand(v.shape, generator=gen) + 0.5)
        elif k.endswith(("running_mean", "bn1.bias", "bn2.bias", "downsample.1.bias")):
            v.copy_(torch.randn(v.shape, generator=gen) * 0.2)
        elif k.endswith(("bn1.weight", "bn2.weight", "downsample.1.weight")):
            v.copy_(torch.rand(v.shape, generator=gen) + 0.5)


def imagenet_layout(seed: int = 0, by_hand: bool = False, depth: int = 18) -> dict[str, torch.Tensor]:
    """A ResNet-18 (or -34) ImageNet state dict in torchvision's key layout (timm's is the same): torchvision's own
    `resnet18()` when it loads, else the layout written out here from the architecture."""
    gen = torch.Generator().manual_seed(seed)
    tv = None if by_hand or depth != 18 else _torchvision()
    if tv is not None:
        torch.manual_seed(seed)
        state = {k: v.clone() for k, v in tv().state_dict().items()}
    else:
        state = {}

        def conv(name: str, cout: int, cin: int, k: int) -> None:
            state[f"{name}.weight"] = torch.randn(cout, cin, k, k, generator=gen) * (2 / (cin * k * k)) ** 0.5

        def bn(name: str, c: int) -> None:
            state.update({f"{name}.weight": torch.ones(c), f"{name}.bias": torch.zeros(c),
                          f"{name}.running_mean": torch.zeros(c), f"{name}.running_var": torch.ones(c),
                          f"{name}.num_batches_tracked": torch.tensor(0)})  # fmt: skip

        conv("conv1", 64, 3, 7)
        bn("bn1", 64)
        cin = 64
        for i, (w, n) in enumerate(zip(WIDTHS, REPEATS[depth], strict=True), start=1):
            for j in range(n):
                p = f"layer{i}.{j}"
                conv(f"{p}.conv1", w, cin if j == 0 else w, 3)
                bn(f"{p}.bn1", w)
                conv(f"{p}.conv2", w, w, 3)
                bn(f"{p}.bn2", w)
                if j == 0 and i > 1:
                    conv(f"{p}.downsample.0", w, cin, 1)
                    bn(f"{p}.downsample.1", w)
            cin = w
        state["fc.weight"] = torch.randn(1000, 512, generator=gen) * 0.01
        state["fc.bias"] = torch.zeros(1000)
    _randomize_bn(state, gen)
    return state


def reference_features(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The ImageNet ResNet-18's pooled features (inference), computed straight from a torchvision-layout state dict."""

    def bn(p: str, z: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(z, state[f"{p}.running_mean"], state[f"{p}.running_var"], state[f"{p}.weight"],
                            state[f"{p}.bias"], False, 0.0, 1e-5)  # fmt: skip

    z = F.max_pool2d(F.relu(bn("bn1", F.conv2d(x, state["conv1.weight"], stride=2, padding=3))), 3, 2, 1)
    for i in range(1, 5):
        for j in range(sum(k.startswith(f"layer{i}.") and k.endswith(".conv1.weight") for k in state)):
            p, s = f"layer{i}.{j}", 2 if i > 1 and j == 0 else 1
            out = F.relu(bn(f"{p}.bn1", F.conv2d(z, state[f"{p}.conv1.weight"], stride=s, padding=1)))
            out = bn(f"{p}.bn2", F.conv2d(out, state[f"{p}.conv2.weight"], padding=1))
            short = z
            if f"{p}.downsample.0.weight" in state:
                short = bn(f"{p}.downsample.1", F.conv2d(z, state[f"{p}.downsample.0.weight"], stride=s))
            z = F.relu(out + short)
    return z.mean(dim=(2, 3))


def expected_key(ours: str) -> str:
    """Where torchvision keeps what our key holds (the spec the mapping is checked against)."""
    parts = ours.split(".")[1:]  # drop "blocks"
    if parts[0] == "stem":
        return {"0": "conv1", "1": "bn1"}[parts[1]] + "." + parts[2]
    if parts[0] == "classifier":
        return "fc." + parts[1]
    return ".".join("downsample" if p == "shortcut" else p for p in parts)


def _cfg(tmp_path, state=None, **model):
    if state is not None:
        torch.save(state, tmp_path / "resnet18.pth")
        model = {"init_from": str(tmp_path / "resnet18.pth"), **model}
    return validate_config({
        "dataset": {"name": "synthetic", "synthetic": {"shape": [3, 16, 16], "n_train": 200, "n_test": 40}},
        "model": {"name": "resnet18_imagenet", **model}, "federation": {"clients": 2}, "train": {"rounds": 1},
        "eval": {"finetune": []}, "executor": {"threads": 1},
    })  # fmt: skip


def test_resnet18_imagenet_layout_and_parameter_count():
    m = build_model("resnet18_imagenet", (3, 224, 224), 1000)
    assert m.block_names() == ["stem", "layer1", "layer2", "layer3", "layer4", "pool", "classifier"]
    assert m.head_blocks() == ["classifier"]
    assert sum(p.numel() for p in m.parameters()) == 11_689_512  # torchvision's resnet18
    assert sum(p.numel() for p in build_model("resnet18_imagenet", (3, 64, 64), 10).parameters()) == 11_181_642
    stem = m.blocks["stem"]
    assert (stem[0].kernel_size, stem[0].stride, stem[0].padding) == ((7, 7), (2, 2), (3, 3))
    assert isinstance(stem[3], nn.MaxPool2d) and (stem[3].kernel_size, stem[3].stride, stem[3].padding) == (3, 2, 1)
    sizes = {}

    def record(name):
        def hook(_module, _inputs, out):
            sizes[name] = tuple(out.shape[1:])

        return hook

    hooks = [m.blocks[b].register_forward_hook(record(b)) for b in m.block_names()]
    m.eval()
    with torch.no_grad():
        assert m(torch.zeros(1, 3, 224, 224)).shape == (1, 1000)
    for h in hooks:
        h.remove()
    assert sizes["stem"] == (64, 56, 56) and sizes["layer1"] == (64, 56, 56) and sizes["layer4"] == (512, 7, 7)
    assert sizes["pool"] == (512,)
    small = build_model("resnet18_imagenet", (3, 64, 64), 10)
    assert small.features(torch.zeros(2, 3, 64, 64)).shape == (2, 512)  # 2×2 maps at layer4, pooled


@pytest.mark.parametrize("by_hand", [False, True])
def test_a_torchvision_state_dict_lands_key_for_key_and_computes_torchvision_features(tmp_path, by_hand):
    state = imagenet_layout(1, by_hand=by_hand)
    random = prepare(_cfg(tmp_path)).ctx
    ctx = prepare(_cfg(tmp_path, state)).ctx
    model, params = ctx.model, ctx.initial_params
    head = set(model.state_keys(model.head_blocks()))
    for k in params:
        if k in head:  # the run's own classifier, as the seed drew it: 10 classes, not ImageNet's 1000
            assert torch.equal(params[k], random.initial_params[k]) and params[k].shape[0] == 10
        else:
            assert torch.equal(params[k], state[expected_key(k)]), k
    assert len(params) == len(state) and {expected_key(k) for k in params} == set(state)
    x = torch.randn(3, 3, 40, 40, generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        ours = model.features(x)
        assert torch.allclose(ours, reference_features(state, x), rtol=1e-4, atol=1e-5)
        swapped = dict(state)  # the check sees a wrong mapping: two BN entries traded
        swapped["layer2.1.bn1.running_var"], swapped["layer2.1.bn2.running_var"] = (
            state["layer2.1.bn2.running_var"], state["layer2.1.bn1.running_var"])  # fmt: skip
        assert not torch.allclose(ours, reference_features(swapped, x), rtol=1e-4, atol=1e-5)
        tv = _torchvision()
        if tv is not None and not by_hand:  # and the torchvision network itself agrees
            net = tv()
            net.load_state_dict(state)
            net.fc = nn.Identity()
            assert torch.allclose(ours, net.eval()(x), rtol=1e-4, atol=1e-5)


def test_wrapped_prefixed_and_counterless_checkpoints_load(tmp_path):
    state = imagenet_layout(3, by_hand=True)
    old = {f"module.{k}": v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    params = prepare(_cfg(tmp_path, {"state_dict": old, "epoch": torch.tensor(90)})).ctx.initial_params
    assert torch.equal(params["blocks.layer3.0.shortcut.1.running_mean"], state["layer3.0.downsample.1.running_mean"])
    assert int(params["blocks.stem.1.num_batches_tracked"]) == 0
    del old["module.layer2.1.bn1.bias"]  # an error about the unwrapped state still names the file given
    with pytest.raises(ConfigError, match=rf"^model\.init_from: {re.escape(str(tmp_path / 'resnet18.pth'))} has no "
                                          r"'layer2\.1\.bn1\.bias' \(a torchvision/timm ResNet-18 key"):  # fmt: skip
        prepare(_cfg(tmp_path, old))


def test_safetensors_weights_load_as_timm_publishes_them(tmp_path):
    """timm's published ResNet-18 weights are `model.safetensors` (torchvision's key layout): read as a file and as
    a downloaded hub snapshot directory; a damaged one is a one-line error."""
    from safetensors.torch import save_file

    state = imagenet_layout(5, by_hand=True)
    (tmp_path / "snapshot").mkdir()
    save_file(state, tmp_path / "snapshot" / "model.safetensors")
    for where in (tmp_path / "snapshot" / "model.safetensors", tmp_path / "snapshot"):
        params = prepare(_cfg(tmp_path, init_from=str(where))).ctx.initial_params
        assert torch.equal(params["blocks.layer2.0.shortcut.0.weight"], state["layer2.0.downsample.0.weight"])
        assert torch.equal(params["blocks.stem.1.running_var"], state["bn1.running_var"])
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes((tmp_path / "snapshot" / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ConfigError, match=r"model\.init_from: .*broken\.safetensors is not a safetensors file"):
        prepare(_cfg(tmp_path, init_from=str(broken)))


def test_body_only_and_errors(tmp_path):
    state = imagenet_layout(4, by_hand=True)
    params = prepare(_cfg(tmp_path, state, init_blocks=["stem"])).ctx.initial_params
    assert torch.equal(params["blocks.stem.0.weight"], state["conv1.weight"])
    assert not torch.equal(params["blocks.layer1.0.conv1.weight"], state["layer1.0.conv1.weight"])
    with pytest.raises(ConfigError, match=r"init_blocks: \['classifier'\] selects only the classifier"):
        prepare(_cfg(tmp_path, state, init_blocks=["classifier"]))
    with pytest.raises(ConfigError, match="holds neither a resnet18_imagenet state dict .* nor a torchvision/timm"):
        prepare(_cfg(tmp_path, {"features.0.weight": torch.zeros(3), "classifier.1.weight": torch.zeros(2)}))
    deeper = {**state, "layer1.2.conv1.weight": torch.zeros(64, 64, 3, 3)}  # a ResNet-34's third block
    with pytest.raises(ConfigError, match="not ResNet-18's: unexpected key 'layer1.2.conv1.weight'"):
        prepare(_cfg(tmp_path, deeper))
    with pytest.raises(ConfigError, match="has no 'layer4.1.bn2.running_var'"):
        prepare(_cfg(tmp_path, {k: v for k, v in state.items() if k != "layer4.1.bn2.running_var"}))
    with pytest.raises(ConfigError, match="loads into model.name resnet18_imagenet or resnet34_imagenet; the run's is "
                                          "resnet18"):  # fmt: skip
        prepare(_cfg(tmp_path, state, name="resnet18"))
    grey = _cfg(tmp_path, state).model_dump()
    grey["dataset"]["synthetic"]["shape"] = [1, 16, 16]
    with pytest.raises(ConfigError, match=r"'conv1.weight' has shape \[64, 3, 7, 7\] .* 'blocks.stem.0.weight' is "
                                          r"\[64, 1, 7, 7\]"):  # fmt: skip
        prepare(validate_config(grey))


def test_our_own_resnet18_imagenet_state_dict_still_loads(tmp_path):
    torch.manual_seed(5)
    saved = build_model("resnet18_imagenet", (3, 16, 16), 10).state_dict()
    params = prepare(_cfg(tmp_path, saved)).ctx.initial_params
    assert all(torch.equal(params[k], v) for k, v in saved.items())


def test_folder_images_with_imagenet_normalization(tmp_path):
    from pflbed.data.folders import IMAGENET_MEAN, IMAGENET_STD, load_domain_folders

    from ..data.test_folders import CLASSES, COLOURS, make_tree

    root = make_tree(tmp_path / "pacs")
    plain = load_domain_folders(root, image_size=8)
    source = load_domain_folders(root, image_size=8, normalize="imagenet")
    assert source is not plain and source is load_domain_folders(root, image_size=8, normalize="imagenet")
    mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
    for c, name in enumerate(CLASSES):
        expected = (torch.tensor(COLOURS[name], dtype=torch.float32) / 255 - mean) / std
        png = source.train.x[c * 3 + 1]  # b.PNG: exact colours
        torch.testing.assert_close(png.mean(dim=(1, 2)), expected, atol=1e-6, rtol=0)
    raw = (source.train.x[:4] * std.view(3, 1, 1) + mean.view(3, 1, 1)) * 255  # what `pflbed personalize` reads
    torch.testing.assert_close(source.inputs(raw.permute(0, 2, 3, 1).numpy()), source.train.x[:4], atol=1e-5,
                               rtol=0)  # fmt: skip
    assert source.pixel_norm == (IMAGENET_MEAN, IMAGENET_STD) and plain.pixel_norm == (0.5, 0.5)


def test_dataset_normalize_is_for_folder_datasets():
    from pflbed.data import load_source
    from pflbed.errors import DataError

    cfg = validate_config({"dataset": {"name": "digits", "normalize": "imagenet"}})
    with pytest.raises(DataError, match="dataset.normalize: imagenet applies to folder datasets"):
        load_source(cfg.dataset)
    with pytest.raises(ConfigError, match="dataset.normalize"):
        validate_config({"dataset": {"normalize": "cifar"}})


def test_inference_rows_are_bounded_on_the_cpu_only():
    from pflbed.models.inference import inference_rows

    m = build_model("resnet18_imagenet", (3, 224, 224), 10)
    assert inference_rows(m, "forward", torch.empty(4, 3, 224, 224, device="meta"), 256) == 256  # a GPU's rows
    assert inference_rows(m, "forward", torch.zeros(4, 3, 224, 224), 256) == 2  # 8 MiB / 64×112×112 floats


def test_resnet34_imagenet_is_torchvision_s_resnet34_one_block_per_basic_block():
    m = build_model("resnet34_imagenet", (3, 224, 224), 1000)
    names = [f"layer{i}_{k}" for i, n in enumerate(REPEATS[34], start=1) for k in range(1, n + 1)]
    assert m.block_names() == ["stem", *names, "classifier"] and m.top_blocks(2) == ["layer4_3", "classifier"]
    assert sum(p.numel() for p in m.parameters()) == 21_797_672  # torchvision's resnet34
    stem = m.blocks["stem"]
    assert (stem[0].kernel_size, stem[0].stride) == ((7, 7), (2, 2)) and isinstance(stem[3], nn.MaxPool2d)
    m.eval()
    with torch.no_grad():
        assert m.features(torch.zeros(1, 3, 224, 224)).shape == (1, 512)


def _cfg34(tmp_path, state, **model):
    torch.save(state, tmp_path / "resnet34.pth")
    return validate_config({
        "dataset": {"name": "synthetic", "synthetic": {"shape": [3, 16, 16], "n_train": 200, "n_test": 40}},
        "model": {"name": "resnet34_imagenet", "init_from": str(tmp_path / "resnet34.pth"), **model},
        "federation": {"clients": 2}, "train": {"rounds": 1}, "eval": {"finetune": []}, "executor": {"threads": 1},
    })  # fmt: skip


def test_a_torchvision_resnet34_lands_key_for_key_and_computes_its_features(tmp_path):
    """Every key of a torchvision-layout ResNet-34 but `fc` lands where the ImageNet network has it (block
    `layerI_K` ↔ `layerI.<K − 1>`, the last one inside its pooled wrapper), and the body computes the network's
    features; ResNet-18 and ResNet-34 weights are each refused by the other's model, naming the key."""
    state = imagenet_layout(7, by_hand=True, depth=34)
    ctx = prepare(_cfg34(tmp_path, state)).ctx
    model, params = ctx.model, ctx.initial_params
    head = set(model.state_keys(model.head_blocks()))
    mapped = {k: k.removeprefix("blocks.") for k in params if k not in head}
    for k, ours in mapped.items():
        block, rest = ours.split(".", 1)
        if block.startswith("layer"):
            stage, nth = block.removeprefix("layer").split("_")
            rest = rest.removeprefix("0.") if block == "layer4_3" else rest
            theirs = f"layer{stage}.{int(nth) - 1}.{rest}".replace(".shortcut.", ".downsample.")
        else:
            theirs = {"0": "conv1", "1": "bn1"}[rest.split(".")[0]] + "." + rest.split(".", 1)[1]
        assert torch.equal(params[k], state[theirs]), k
    assert len(mapped) == len(state) - 2  # all but fc.weight and fc.bias
    x = torch.randn(2, 3, 40, 40, generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model.features(x), reference_features(state, x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match=r"has no 'layer1\.2\.conv1\.weight' \(a torchvision/timm ResNet-34 key, "
                                          r"loaded into 'blocks\.layer1_3\.conv1\.weight'\)"):  # fmt: skip
        prepare(_cfg34(tmp_path, imagenet_layout(1, by_hand=True)))
    with pytest.raises(ConfigError, match="not ResNet-18's: unexpected key 'layer1.2.conv1.weight'"):
        prepare(_cfg(tmp_path, state))
    with pytest.raises(ConfigError, match="loads into model.name resnet18_imagenet or resnet34_imagenet; the run's "
                                          "is resnet34"):  # fmt: skip
        prepare(_cfg34(tmp_path, state, name="resnet34"))
