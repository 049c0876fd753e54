"""Real data through the Hugging Face, natural-partition and manifest paths: Fashion-MNIST (Debian's files), turned
here into a Hugging Face dataset on disk, runs exactly like `dataset.name: fmnist`; users encoding an exported
Dirichlet partition give back its clients; a run on its exported manifest is the original run."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

datasets = pytest.importorskip("datasets")

from pflbed.cli import main  # noqa: E402
from pflbed.config import validate_config  # noqa: E402
from pflbed.data import load_source  # noqa: E402
from pflbed.data.fmnist import MEAN, STD  # noqa: E402
from pflbed.data.idx import read_idx  # noqa: E402
from pflbed.federation import build_federation  # noqa: E402

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
pytestmark = [pytest.mark.skipif(not DEBIAN_DIR.is_dir(), reason="dataset-fashion-mnist not installed"),
              pytest.mark.xdist_group("fmnist-hf")]  # one worker builds the module's fixtures, once

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
# A small run: 4 clients of at most 100 training samples, 1 round, the MLP; fine-tuning and one new client included.
RUN = {"dataset": {"name": "fmnist"}, "model": {"name": "mlp"},
       "federation": {"clients": 4, "partition": "dirichlet", "alpha": 0.5, "new_clients": 1, "train_per_client": 100},
       "train": {"rounds": 1, "batch_size": 32}, "executor": {"strict": True},
       "eval": {"every": 1, "finetune": ["ft"], "new_clients": {"epochs": 1, "lrs": [0.05]}}}  # fmt: skip
# The partition the user column encodes (every training sample in some client: no cap, no public data).
DIRICHLET = {"dataset": {"name": "fmnist"}, "federation": {"clients": 6, "partition": "dirichlet", "alpha": 0.3,
                                                           "new_clients": 2, "min_size": 10}}  # fmt: skip
HF = {"name": "hf", "hf": {"normalize": [MEAN, STD]}}  # Fashion-MNIST's own normalization


def _files(split):
    stem = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}[split]  # fmt: skip
    return tuple(read_idx(DEBIAN_DIR / f"{s}.gz") for s in stem)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The Dirichlet manifest, then Fashion-MNIST as a Hugging Face DatasetDict on disk (uint8 28×28 arrays, a
    ClassLabel, and a user column holding each training sample's client in that manifest)."""
    root = tmp_path_factory.mktemp("fmnist-hf")
    (root / "dirichlet.yaml").write_text(yaml.safe_dump(DIRICHLET))
    assert main(["data", "export", str(root / "dirichlet.json"), "-c", str(root / "dirichlet.yaml")]) == 0
    manifest = json.loads((root / "dirichlet.json").read_text())
    images, labels = _files("train")
    users = np.full(len(labels), -1, dtype=np.int64)
    for cid, c in enumerate(manifest["clients"]):
        users[c["train"] + c["val"] + c["test"]] = cid
    assert (users >= 0).all()
    features = datasets.Features({"image": datasets.Array2D((28, 28), "uint8"),
                                  "label": datasets.ClassLabel(names=CLASSES), "user": datasets.Value("int64")})
    test_images, test_labels = _files("test")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"image": images, "label": labels, "user": users}, features=features),
        "test": datasets.Dataset.from_dict({"image": test_images, "label": test_labels,
                                            "user": np.zeros(len(test_labels), dtype=np.int64)}, features=features),
    }).save_to_disk(str(root / "hf"))  # fmt: skip
    return root


def _run(root, name, tree, *sets):
    cfg = root / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    out = root / name
    assert main(["run", "-c", str(cfg), "--out", str(out), "--no-progress", *[a for s in sets for a in ("--set", s)]]) \
        == 0  # fmt: skip
    return json.loads((out / "summary.json").read_text()), (out / "metrics.jsonl").read_text()


def _figures(summary):
    return {k: v for k, v in summary.items() if k not in ("timing", "provenance", "dataset")}


@pytest.fixture(scope="module")
def fmnist_run(work):
    return _run(work, "fmnist", RUN)


def test_fashion_mnist_as_a_hugging_face_dataset_runs_exactly_like_fmnist(work, fmnist_run):
    """dataset.name hf on the converted files: the same tensors, and a summary.json identical to fmnist's (but for
    the dataset's name and the timing)."""
    hf = load_source(validate_config({**RUN, "dataset": {**HF, "path": str(work / "hf")}}).dataset)
    fm = load_source(validate_config(RUN).dataset)
    for a, b in ((hf.train, fm.train), (hf.test, fm.test)):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    summary, metrics = _run(work, "hf-run", {**RUN, "dataset": {**HF, "path": str(work / "hf")}})
    assert summary["dataset"] == "hf" and fmnist_run[0]["dataset"] == "fmnist"
    assert _figures(summary) == _figures(fmnist_run[0]) and summary["new_clients"] is not None
    assert metrics == fmnist_run[1]


def test_natural_partition_of_users_encoding_an_exported_dirichlet_partition_gives_its_clients(work):
    """Users = the clients of an exported Dirichlet(0.3) federation: `partition: natural` gives back exactly its
    clients — client k holds client k's samples, with the same class prior and the same per-class train / val /
    test counts (the local split is stratified); the same number of held-out new clients."""
    manifest = json.loads((work / "dirichlet.json").read_text())
    tree = {"dataset": {**HF, "path": str(work / "hf"), "hf": {**HF["hf"], "user_column": "user"}},
            "federation": {**DIRICHLET["federation"], "partition": "natural", "min_samples": 1}}  # fmt: skip
    cfg = validate_config(tree)
    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    labels = source.train.y.numpy()
    assert len(fed.clients) == len(manifest["clients"]) == 6
    for cid, (ours, theirs) in enumerate(zip(fed.clients, manifest["clients"], strict=True)):
        held = torch.cat([ours.train, ours.val, ours.test]).sort().values.tolist()
        assert held == sorted(theirs["train"] + theirs["val"] + theirs["test"]), cid
        assert ours.prior.tolist() == theirs["prior"], cid
        for split in ("train", "val", "test"):
            counts = np.bincount(labels[getattr(ours, split).numpy()], minlength=10)
            assert counts.tolist() == np.bincount(labels[theirs[split]], minlength=10).tolist(), (cid, split)
    assert len(fed.new) == len(manifest["new"]) == 2 and len(fed.participated) == len(manifest["participated"])


def test_fashion_mnist_run_on_its_exported_manifest_is_the_original_run(work, fmnist_run):
    """data export of the run's config, then the run with federation.manifest: the same summary and metrics."""
    out = work / "run.json"
    assert main(["data", "export", str(out), "-c", str(work / "fmnist.yaml")]) == 0
    summary, metrics = _run(work, "from-manifest", RUN, f"federation.manifest={out}")
    assert summary["dataset"] == "fmnist" and _figures(summary) == _figures(fmnist_run[0])
    assert metrics == fmnist_run[1]
