"""The seed-paper configs (`benchmarks/configs/seeds/`): each validates as it is, and each runs one round end to end
on a small fixture written in its dataset's published on-disk format (`tests/data_formats.py`).

The configs are run as written except for what makes them small: the fixture's path, one round of one local epoch,
fewer clients, smaller images and a fake ImageNet ResNet-18 state dict (torchvision's key layout) where a config
starts from ImageNet weights. So a config that names an option, dataset, model, corruption or split that does not
exist fails here, at validation or when its data or model is built.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import pflbed
from pflbed.config import load_config
from pflbed.errors import ConfigError

from .. import data_formats as fx
from ..models.test_imagenet_resnet import imagenet_layout

SEEDS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "seeds"
CONFIGS = sorted(SEEDS.glob("*.yaml"))
EXPECTED = {
    "fedper_cifar10", "fedper_cifar100", "fedper_flickr_aes", "fedrod_cifar10_dir01", "fedrod_cifar10_dir03",
    "ktpfl_emnist", "ktpfl_cifar10", "fedselect_cifar10", "fedselect_cifar10c", "fedselect_miniimagenet",
    "fedselect_officehome", "fedbasis_pacs", "fedbasis_officehome",
}  # fmt: skip

# What every smoke run changes: one round, one epoch, evaluation and personalization budgets of one, on the CPU
# in this process.
SMALL = [
    "train.rounds=1", "train.local_epochs=1", "eval.every=1", "eval.ft_epochs=1", "eval.new_clients.epochs=1",
    "eval.new_clients.lrs=[0.01]", "executor.device=cpu", "executor.name=loop", "executor.threads=1",
]  # fmt: skip
# Per config: fewer clients (FedBasis keeps K = 4: its warm start clusters at least 4 clients), smaller images,
# less public data, one mini-batch per epoch where the model is 11 M parameters times five bases; the rest of the
# config as written.
SMALL_BASIS = ["dataset.image_size=8", "train.batch_size=512", "algorithm.alpha_epochs=1", "algorithm.basis_epochs=1",
               "federation.pflbed.new_clients_per_domain=1"]  # fmt: skip
# A quarter of the images for each class-balanced set, val and test (Office-Home's 4 per class: one each), the rest
# for the clients
HOLDOUT = ["federation.pflbed.val=0.25", "federation.pflbed.test=0.25"]
OVERRIDES = {
    "fedper_cifar10": ["federation.clients=4"],
    "fedper_cifar100": ["federation.clients=4"],
    "fedper_flickr_aes": ["federation.clients=2", "dataset.image_size=8"],
    "fedrod_cifar10_dir01": ["federation.clients=4"],
    "fedrod_cifar10_dir03": ["federation.clients=4"],
    "ktpfl_emnist": ["federation.clients=4", "federation.public=8", "algorithm.public_batch=8"],
    "ktpfl_cifar10": ["federation.clients=4", "federation.public=8", "algorithm.public_batch=8"],
    "fedselect_cifar10": ["federation.clients=4"],
    "fedselect_cifar10c": ["federation.pflbed.clients_per_domain=2"],
    "fedselect_miniimagenet": ["federation.clients=2"],
    "fedselect_officehome": ["dataset.image_size=8", *HOLDOUT, "federation.pflbed.participated=0.5"],
    "fedbasis_pacs": [*SMALL_BASIS, *HOLDOUT, "federation.pflbed.participated=0.3",
                      "federation.pflbed.clients_per_domain=2"],
    "fedbasis_officehome": [*SMALL_BASIS, *HOLDOUT, "federation.pflbed.participated=0.3",
                            "federation.pflbed.clients_per_domain=4"],
}
# The same network at a quarter of the width (same blocks, so the same personal layers): a CIFAR ResNet-18 step is
# most of a second on one CPU thread.
NARROWER = {"resnet18": "resnet18_x025"}


def _cifar10c(root: Path, cfg) -> Path:
    # 400 images per corruption: the PFLBED split's class-balanced val (5 %) and test (15 %) sets need ≥ 200
    names = tuple(c for c in cfg.dataset.corruptions or fx.CORRUPTIONS if c in fx.CORRUPTIONS)
    fx.make_cifar10c(root, per_severity=400, corruptions=names)
    return root


# dataset name → writer of a small copy under a directory (returns what dataset.path names)
WRITERS = {
    "cifar10": lambda root, cfg: fx.make_cifar10(root, per_batch=20, n_test=20).parent,
    "cifar100": lambda root, cfg: fx.make_cifar100(root, n_train=200, n_test=100).parent,
    "emnist": lambda root, cfg: (
        fx.make_emnist(root, split=cfg.dataset.split or "balanced", n_train=260, n_test=30).parent
    ),
    "cifar10c": _cifar10c,
    "miniimagenet": lambda root, cfg: fx.make_miniimagenet(root, classes_per_split=4, per_class=6, side=16),
    # the PFLBED val and test sets (class-balanced, HOLDOUT) take a quarter each; 30 % of PACS's 84 images per domain
    # give its two clients their 10 samples each
    "officehome": lambda root, cfg: fx.make_domain_tree(root, ("Art",), 65, per_class=4),
    "pacs": lambda root, cfg: fx.make_domain_tree(root, ("art_painting", "photo"), 7, per_class=12),
    # three workers of 60, 75 and 90 ratings (kept) and one of 59 (left out) over 120 images
    "flickr-aes": lambda root, cfg: fx.make_flickr_aes(root, {f"W{n}": [(i, i % 5 + 1) for i in range(n)]
                                                              for n in (59, 60, 75, 90)}),  # fmt: skip
}


@pytest.fixture(scope="module")
def fake_imagenet_weights(tmp_path_factory) -> Path:
    """A ResNet-18 state dict in torchvision's key layout, with its 1000-class `fc`."""
    path = tmp_path_factory.mktemp("weights") / "resnet18-imagenet.pth"
    torch.save(imagenet_layout(seed=3, by_hand=True), path)
    return path


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """One small copy per dataset, written on first use and shared by the configs that read it."""
    made: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("seed-data")

    def get(cfg) -> Path:
        name = cfg.dataset.name
        if name not in made:
            made[name] = WRITERS[name](base / name, cfg)
        return made[name]

    return get


def test_every_seed_table_has_its_config():
    assert {p.stem for p in CONFIGS} == EXPECTED
    assert set(OVERRIDES) == EXPECTED


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_seed_config_validates_and_documents_itself(path: Path):
    cfg = load_config(path)
    assert cfg.dataset.name in WRITERS and cfg.executor.device == "auto"
    header = path.read_text(encoding="utf-8").split("\nseed:")[0]
    for part in ("Paper's figure:", "Paper's budget:", "Deviations", "Data:", "Estimated time on one GPU:",
                 "benchmarks/results/gpu_h100.txt", f"pflbed run -c benchmarks/configs/seeds/{path.name}"):  # fmt: skip
        assert part in header, f"{path.name}: its comment block lacks {part!r}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_seed_config_runs_one_round(path: Path, data_root, fake_imagenet_weights):
    cfg = load_config(path)
    sets = [f"dataset.path={data_root(cfg)}", *SMALL, *OVERRIDES[path.stem]]
    if cfg.model.init_from is not None:
        sets.append(f"model.init_from={fake_imagenet_weights}")
    if cfg.model.name in NARROWER:
        sets.append(f"model.name={NARROWER[cfg.model.name]}")
    small = load_config(path, sets)
    changed = {k for k in small.to_dict() if small.to_dict()[k] != cfg.to_dict()[k]}
    assert changed <= {"dataset", "model", "federation", "train", "eval", "executor", "algorithm"}
    assert (small.algorithm.name, small.dataset.name) == (cfg.algorithm.name, cfg.dataset.name)
    assert small.model.name == NARROWER.get(cfg.model.name, cfg.model.name)
    result = pflbed.run(small, write=False)
    final = result.summary["final"]
    assert result.summary["rounds"] == 1 and 0 <= final["pfl_acc"] <= 1
    if small.federation.protocol == "pflbed" and small.federation.pflbed.new_clients_per_domain:
        assert result.summary["new_clients"]["clients"]


def test_a_misspelt_option_model_or_dataset_in_a_seed_config_is_refused(tmp_path: Path):
    tree = yaml.safe_load((SEEDS / "fedper_cifar10.yaml").read_text(encoding="utf-8"))
    bad = {
        "algorithm option": {**tree, "algorithm": {**tree["algorithm"], "personal_block": 1}},
        "model": {**tree, "model": {**tree["model"], "name": "resnet19"}},
        "dataset": {**tree, "dataset": {**tree["dataset"], "name": "cifar11"}},
        "key": {**tree, "train": {**tree["train"], "epochs": 4}},
    }
    for what, broken in bad.items():
        path = tmp_path / f"{what}.yaml"
        path.write_text(yaml.safe_dump(broken), encoding="utf-8")
        with pytest.raises(ConfigError):
            load_config(path)
