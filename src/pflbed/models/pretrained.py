"""Starting weights for a run (`model.init_from`, `model.init_blocks`) and the file `pflbed pretrain` writes.

Why a module of its own: a pretrained start is how the FedBasis paper (an ImageNet ResNet-18) and most practitioners
begin, and loading it must be strict. A silently skipped key, a body loaded where the head was asked for, or a
model pretrained on the very samples a client is scored on would each make a table wrong without any error. So:
every requested key must exist with the model's shape (one-line error naming the field and key otherwise), only
the requested blocks are written, and a file that records its training source (`pflbed pretrain` writes one)
carries the sample indices it was trained on, so a run can check they are disjoint from its federation
(`federation.check_disjoint`).

Accepted files:
- a `pflbed pretrain` output directory or its `model.pt`, and a model saved by `pflbed personalize --out`: a dict
  with `state_dict`, `architecture`, `input_shape`, `num_classes` (and `source` for pretrain outputs);
- a plain state dict (`torch.save(model.state_dict(), path)`), keys as in the zoo model;
- a `.safetensors` file (how timm and the Hugging Face hub publish weights): a flat state dict, read with the
  `safetensors` package, which holds tensors only and runs no code; a directory without `model.pt` but with
  `model.safetensors` (a downloaded hub snapshot) is read through that file;
- for `resnet18_imagenet` and `resnet34_imagenet`: a torchvision or timm ResNet-18 / ResNet-34 state dict (their
  ImageNet weights, `.pt` / `.pth` / `.safetensors`, also under a `state_dict` entry or with DataParallel's `module.`
  prefix). Its keys are mapped to the zoo's (`torchvision_resnet_key`: conv1/bn1 → the stem, layerI.J.* → the same
  residual block, downsample → shortcut); its 1000-class `fc` is dropped, so the classifier stays the run's own,
  freshly initialized for its classes. BN counters (`num_batches_tracked`) that old checkpoints lack keep the
  model's value.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pflbed.errors import ConfigError
from pflbed.models.blocks import BlockNet

MODEL_FILE = "model.pt"
SAFETENSORS_FILE = "model.safetensors"  # the name timm and the Hugging Face hub give published weights


@dataclass
class Weights:
    """Loaded starting weights: the state dict, the architecture it was saved from (None: plain state dict) and the
    training source a pretrain output recorded (None: unknown). The run's summary hashes the file itself."""

    state: dict[str, torch.Tensor]
    path: Path
    architecture: str | None = None
    source: dict[str, Any] | None = None


def model_file(path: str | Path) -> Path:
    """The weights file `path` names: the file itself, or `model.pt` inside a directory (`model.safetensors` where
    the directory holds that and no `model.pt`)."""
    p = Path(path)
    if not p.is_dir():
        return p
    published = not (p / MODEL_FILE).exists() and (p / SAFETENSORS_FILE).is_file()
    return p / (SAFETENSORS_FILE if published else MODEL_FILE)


def load_tensors(f: Path) -> Any:
    """`torch.load` of tensors and plain values only (no unpickling of what the file names), on the CPU, without
    torch's warning of a file pickled elsewhere: the caller's one line on a file it refuses says it all."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(f, map_location="cpu", weights_only=True)


def load_weights(path: str | Path, what: str = "model.init_from") -> Weights:
    f = model_file(path)
    if not f.is_file():
        hint = f" (a directory needs {MODEL_FILE} or {SAFETENSORS_FILE})" if Path(path).is_dir() else ""
        raise ConfigError(f"{what}: no such file {f}{hint}")
    safetensors = f.suffix == ".safetensors"
    try:
        if safetensors:
            from safetensors.torch import load_file

            blob = load_file(f, device="cpu")
        else:
            blob = load_tensors(f)
    except Exception as e:  # noqa: BLE001 — any unreadable file is the user's input error, said in one line
        kind = "safetensors" if safetensors else "torch weights"
        raise ConfigError(f"{what}: {f} is not a {kind} file ({type(e).__name__})") from None
    if isinstance(blob, dict) and isinstance(blob.get("state_dict"), dict):
        weights = Weights(dict(blob["state_dict"]), f, blob.get("architecture"), blob.get("source"))
    elif isinstance(blob, dict) and blob and all(isinstance(k, str) and torch.is_tensor(v) for k, v in blob.items()):
        weights = Weights(dict(blob), f)
    else:
        raise ConfigError(f"{what}: {f} holds neither a state dict nor a pflbed model file")
    for k, v in weights.state.items():  # NaN weights would surface rounds later as a divergence blaming the lr
        if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ConfigError(f"{what}: {f}: {k!r} holds non-finite values (NaN or inf); no run can start from it")
    return weights


IMAGENET_RESNETS = {"resnet18_imagenet": "ResNet-18", "resnet34_imagenet": "ResNet-34"}  # zoo name → network
_TV_STEM = {"stem.0.": "conv1.", "stem.1.": "bn1."}
_TV_MARKERS = ("conv1.weight", "bn1.weight", "layer1.0.conv1.weight")
_PER_BLOCK = re.compile(r"layer(\d)_(\d+)\.(?:0\.)?")  # resnet34_imagenet's block, and the pooled last one's wrapper


def torchvision_resnet_key(key: str) -> str:
    """The torchvision / timm ResNet state-dict key of the `resnet18_imagenet` or `resnet34_imagenet` key `key`.

    `blocks.stem.0.*` (the 7×7 conv) ↔ `conv1.*`, `blocks.stem.1.*` (its BN) ↔ `bn1.*`, the projection `shortcut` ↔
    `downsample`; a residual block: `blocks.layerI.J.*` (ResNet-18's stages) ↔ `layerI.J.*`, and `blocks.layerI_K.*`
    (ResNet-34's blocks, K from 1; the last one's `0.` is its wrapper with the pool, `models.zoo._pooled`) ↔
    `layerI.<K − 1>.*`. The classifier is never asked for: the file's 1000-class `fc` is dropped, the run keeps its
    own.
    """
    k = key.removeprefix("blocks.")
    for ours, theirs in _TV_STEM.items():
        if k.startswith(ours):
            return theirs + k[len(ours) :]
    if m := _PER_BLOCK.match(k):
        k = f"layer{m.group(1)}.{int(m.group(2)) - 1}." + k[m.end() :]
    return k.replace(".shortcut.", ".downsample.")


def is_torchvision_resnet(state: dict[str, torch.Tensor]) -> bool:
    """Whether `state` has the key layout of a torchvision / timm ResNet (any depth)."""
    return all(k in state for k in _TV_MARKERS)


def _strip_module_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DataParallel / DistributedDataParallel checkpoints prefix every key with `module.`."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module.") :]: v for k, v in state.items()}
    return state


def from_torchvision_resnet(model: BlockNet, weights: Weights, architecture: str) -> Weights:
    """`weights` (a torchvision / timm ResNet state dict) with the keys of the zoo's `architecture`, without the
    classifier.

    Strict: every mapped key but the classifier's must be there with the model's shape (a missing BN counter keeps
    the model's), and no other key may be (a deeper ResNet's blocks, a ResNet-D stem); errors name the file's key.
    """
    state, own, net = weights.state, model.state_dict(), IMAGENET_RESNETS[architecture]
    head = set(model.state_keys(model.head_blocks()))
    mapped = {torchvision_resnet_key(k): k for k in own if k not in head}
    extra = [k for k in state if k not in mapped and not k.startswith("fc.")]
    if extra:
        raise ConfigError(f"model.init_from: {weights.path} is a torchvision/timm ResNet state dict but not "
                          f"{net}'s: unexpected key {extra[0]!r} ({len(extra)} in all)")  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for theirs, ours in mapped.items():
        if theirs not in state:
            if theirs.endswith("num_batches_tracked"):
                out[ours] = own[ours].detach().clone()
                continue
            raise ConfigError(f"model.init_from: {weights.path} has no {theirs!r} (a torchvision/timm {net} "
                              f"key, loaded into {ours!r})")  # fmt: skip
        if tuple(state[theirs].shape) != tuple(own[ours].shape):
            raise ConfigError(f"model.init_from: {theirs!r} has shape {list(state[theirs].shape)} in {weights.path}, "
                              f"the model's {ours!r} is {list(own[ours].shape)}")  # fmt: skip
        out[ours] = state[theirs]
    return Weights(out, weights.path, architecture, weights.source)


def _imagenet_start(model: BlockNet, weights: Weights, architecture: str) -> tuple[Weights, bool]:
    """(weights with the zoo's keys, whether they came from a torchvision / timm ResNet). Plain state dicts for
    `resnet18_imagenet` / `resnet34_imagenet`: the zoo's own keys as they are, torchvision / timm ones mapped,
    anything else refused in one line. Other models: a torchvision / timm ResNet is refused by name."""
    if weights.architecture is not None:
        return weights, False
    state = _strip_module_prefix(weights.state)
    weights = Weights(state, weights.path, None, weights.source) if state is not weights.state else weights
    tv = is_torchvision_resnet(state)
    if architecture not in IMAGENET_RESNETS:
        if tv:
            raise ConfigError(f"model.init_from: {weights.path} holds a torchvision/timm ResNet state dict, which "
                              f"loads into model.name {' or '.join(IMAGENET_RESNETS)}; the run's is "
                              f"{architecture}")  # fmt: skip
        return weights, False
    if tv:
        return from_torchvision_resnet(model, weights, architecture), True
    if not any(k in state for k in model.state_dict()):
        raise ConfigError(f"model.init_from: {weights.path} holds neither a {architecture} state dict (keys "
                          f"'blocks.stem.0.weight', …) nor a torchvision/timm {IMAGENET_RESNETS[architecture]} one "
                          "(keys 'conv1.weight', 'bn1.weight', 'layer1.0.conv1.weight', …)")  # fmt: skip
    return weights, False


def block_selection(model: BlockNet, blocks: list[str], what: str = "model.init_blocks") -> list[str]:
    """The blocks named by `blocks`: [all], [body], [head], or block names of `model`."""
    if blocks == ["all"]:
        return model.block_names()
    if blocks == ["body"]:
        return model.body_blocks()
    if blocks == ["head"]:
        return model.head_blocks()
    unknown = [b for b in blocks if b not in model.block_names()]
    if unknown or len(set(blocks)) != len(blocks):
        raise ConfigError(f"{what}: {blocks} — use [all], [body], [head] or distinct blocks of "
                          f"{model.block_names()}")  # fmt: skip
    return list(blocks)


def apply_weights(model: BlockNet, weights: Weights, blocks: list[str], architecture: str) -> list[str]:
    """Write the selected blocks' parameters and buffers from `weights` into `model` (in place, on its device);
    returns the keys written. Refuses another architecture, missing keys and shape mismatches."""
    if weights.architecture is not None and weights.architecture != architecture:
        raise ConfigError(f"model.init_from: {weights.path} holds a {weights.architecture} model, the run's "
                          f"model.name is {architecture}")  # fmt: skip
    weights, imagenet = _imagenet_start(model, weights, architecture)
    keys = model.state_keys(block_selection(model, blocks))
    if imagenet:  # the file's 1000-class classifier is dropped: the run keeps its own
        head = set(model.state_keys(model.head_blocks()))
        keys = [k for k in keys if k not in head]
        if not keys:
            raise ConfigError(f"model.init_blocks: {blocks} selects only the classifier, which a torchvision/timm "
                              "ResNet state dict does not provide (its fc is replaced by the run's)")  # fmt: skip
    own = model.state_dict()
    missing = [k for k in keys if k not in weights.state]
    if missing:
        raise ConfigError(f"model.init_from: {weights.path} has no {missing[0]!r} ({len(missing)} of the "
                          f"{len(keys)} keys of blocks {blocks} missing)")  # fmt: skip
    for k in keys:
        if tuple(weights.state[k].shape) != tuple(own[k].shape):
            raise ConfigError(f"model.init_from: {k!r} has shape {list(weights.state[k].shape)} in "
                              f"{weights.path}, the model's is {list(own[k].shape)}")  # fmt: skip
    with torch.no_grad():
        for k in keys:
            own[k].copy_(weights.state[k].to(dtype=own[k].dtype))
    return keys


def save_model(model: torch.nn.Module, out: Path, architecture: str | None, input_shape: tuple[int, ...],
               num_classes: int, source: dict[str, Any] | None = None) -> Path:  # fmt: skip
    """`out/model.pt` in the format `load_weights` (and `pflbed.results.trained.load_model`) read."""
    blob: dict[str, Any] = {"state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                            "architecture": architecture, "input_shape": list(input_shape),
                            "num_classes": int(num_classes)}  # fmt: skip
    if source is not None:
        blob["source"] = source
    out.mkdir(parents=True, exist_ok=True)
    torch.save(blob, out / MODEL_FILE)
    return out / MODEL_FILE
