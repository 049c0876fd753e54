"""Datasets by name: the one entry point the engine and CLI use to get a `DataSource`.

Each loader caches its result per arguments (the engine asks for the same dataset once per run, sweep point
and evaluation), so `load_dataset` with equal arguments returns the same object; treat it as read-only.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.data.catalog import DESCRIBE
from pflbed.data.cifar import load_cifar10, load_cifar100
from pflbed.data.cifar10c import load_cifar10c
from pflbed.data.digits import load_digits_source
from pflbed.data.domains import BUILTIN as BUILTIN_DOMAINS
from pflbed.data.domains import with_domains
from pflbed.data.emnist import load_emnist
from pflbed.data.femnist import load_femnist
from pflbed.data.flickr_aes import load_flickr_aes
from pflbed.data.fmnist import HOW_TO_GET as FMNIST_HOW_TO_GET
from pflbed.data.fmnist import download_fmnist, find_fmnist, fmnist_sizes, load_fmnist
from pflbed.data.folders import describe_domain_folders, load_domain_folders
from pflbed.data.hf import load_hf
from pflbed.data.idx import read_idx
from pflbed.data.miniimagenet import load_miniimagenet
from pflbed.data.mnist import load_mnist
from pflbed.data.named_folders import BENCHMARKS as NAMED_FOLDERS
from pflbed.data.named_folders import load_domainnet, load_officehome, load_pacs
from pflbed.data.synthetic import make_synthetic
from pflbed.data.tinyimagenet import load_tinyimagenet
from pflbed.errors import DataError

__all__ = [
    "DATASETS",
    "ArrayDataset",
    "DataSource",
    "base_dataset",
    "describe_datasets",
    "download_fmnist",
    "load_dataset",
    "load_source",
    "load_digits_source",
    "load_fmnist",
    "make_synthetic",
    "read_idx",
]

DATASETS: dict[str, Callable[..., DataSource]] = {
    "fmnist": load_fmnist,
    "digits": load_digits_source,
    "synthetic": make_synthetic,
    "folder": load_domain_folders,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "cifar10c": load_cifar10c,
    "mnist": load_mnist,
    "emnist": load_emnist,
    "femnist": load_femnist,
    "tinyimagenet": load_tinyimagenet,
    "miniimagenet": load_miniimagenet,
    "officehome": load_officehome,
    "pacs": load_pacs,
    "domainnet": load_domainnet,
    "flickr-aes": load_flickr_aes,
    "hf": load_hf,
}

# `dataset` config fields passed to the loaders that take them (when set): dataset-specific options.
LOADER_OPTIONS = ("label", "corruptions", "severity", "split")
# Datasets whose images `dataset.image_size` resizes.
SIZED = ("folder", *NAMED_FOLDERS, "tinyimagenet", "flickr-aes")


def _check_name(name: str) -> Callable[..., DataSource]:
    if name not in DATASETS:
        from pflbed.config import OWN_DATA, did_you_mean, then

        known = f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}{did_you_mean(name, DATASETS)}"
        raise DataError(then(known, OWN_DATA))
    return DATASETS[name]


def load_dataset(name: str, path: str | os.PathLike[str] | None = None, **options: Any) -> DataSource:
    """Load dataset `name`; `path` only applies to file-backed datasets, `options` go to its loader.

    Arguments are checked against the loader's signature first, so a typo in a config gives a one-line
    `DataError` naming the accepted options instead of a `TypeError` traceback.
    """
    loader = _check_name(name)
    accepted = inspect.signature(loader).parameters
    if path is not None:
        if "path" not in accepted:
            raise DataError(f"dataset {name!r} reads no files, so it takes no path (got {os.fspath(path)!r})")
        options["path"] = path
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        allowed = ", ".join(p for p in accepted if p != "path") or "none"
        raise DataError(f"dataset {name!r}: unknown option(s) {', '.join(unknown)}; accepted: {allowed}")
    return loader(**options)


def describe_datasets(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """One row per dataset for `pflbed data list`: name, location (or "not found: <how to get it>"), sizes where a
    header or a listing gives them, domains.

    Never downloads and never decodes pixels. A damaged copy is still listed, with its `error`, so the user sees
    which directory to fix. The folder dataset is described only when `path` is given.
    """
    rows: list[dict[str, Any]] = []
    for name in [*DATASETS, *BUILTIN_DOMAINS]:
        base, domains = BUILTIN_DOMAINS.get(name, (name, ()))
        row: dict[str, Any] = {"name": name, "location": "not found", "train": None, "test": None, "error": None}
        row["domains"] = ", ".join(domains)
        try:
            if base == "fmnist":
                directory = find_fmnist(path)
                if directory is not None:
                    row["location"] = str(directory)
                    row["train"], row["test"] = fmnist_sizes(directory)
                else:
                    row["location"] = f"not found: {FMNIST_HOW_TO_GET}"
            elif base in DESCRIBE:
                row.update(DESCRIBE[base](path))
            elif base == "hf":
                row["location"] = "dataset.hf.id or dataset.path (a Hugging Face dataset, offline)"
            elif base == "folder":
                row["location"] = "dataset.path (a <domain>/<class>/<image> tree)"
                if path is not None:
                    tree = describe_domain_folders(path)
                    row.update(location=tree["root"], train=tree["total"], test=0, domains=", ".join(tree["domains"]))
            else:
                source = DATASETS[base]()
                row.update(location=source.origin, train=len(source.train), test=len(source.test))
        except DataError as exc:
            row["error"] = str(exc)
        rows.append(row)
    return rows


def base_dataset(dataset: Any) -> str:
    """The dataset whose samples a `dataset` config section draws on, whatever transform domains it adds
    (`fmnist-rot4` and `fmnist` with `domains` are Fashion-MNIST; sample i of a split is the same image in all of
    them): what a pretraining source's disjointness is checked on."""
    base = BUILTIN_DOMAINS.get(dataset.name, (dataset.name, ()))[0]
    if base == "hf":
        local = dataset.path or (dataset.hf.id if Path(dataset.hf.id).expanduser().is_dir() else None)
        where = Path(local).expanduser().resolve() if local else dataset.hf.id
        return f"hf:{where}:{dataset.hf.subset or ''}:{','.join(dataset.hf.splits)}"
    return f"folder:{Path(dataset.path).resolve()}" if base == "folder" and dataset.path else base


def load_source(dataset: Any) -> DataSource:
    """The data a run's `dataset` config section asks for: a base dataset plus declared transform domains.

    Built-in cross-domain names (`fmnist-rot4`, …) expand to their base dataset and rotation domains. Sources are
    built in host memory whatever torch's default device (a run moves them to its device: `DataSource.to`).
    """
    base, domains = BUILTIN_DOMAINS.get(dataset.name, (dataset.name, ()))
    options: dict[str, Any] = {"download": True} if dataset.download else {}
    if base == "folder":
        if dataset.path is None:
            raise DataError("dataset.path: the folder dataset needs the root of a <domain>/<class>/<image> tree")
        options["normalize"] = dataset.normalize
    elif base in NAMED_FOLDERS:
        options["normalize"] = dataset.normalize
    elif dataset.normalize != "symmetric":
        raise DataError(f"dataset.normalize: {dataset.normalize} applies to folder datasets; {dataset.name} has its "
                        "own normalization")  # fmt: skip
    elif base == "synthetic":
        options.update(dataset.synthetic.model_dump())
    elif base == "hf":
        options.update(dataset.hf.model_dump())
    if base in SIZED and dataset.image_size is not None:  # unset: the loader's own size (folders 32, Tiny ImageNet 64)
        options["image_size"] = dataset.image_size
    options.update({k: getattr(dataset, k) for k in LOADER_OPTIONS if getattr(dataset, k) is not None})
    with torch.device("cpu"):
        source = load_dataset(base, path=dataset.path, **options)
        domains = tuple(dataset.domains or domains)
        if domains:
            source = with_domains(source, domains, name=dataset.name if not dataset.domains else None)
    return source
