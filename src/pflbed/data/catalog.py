"""`pflbed data list` rows for the file-backed datasets (and digits): where each was found, its sizes where a header
or a listing gives them cheaply, or the one line that says how to get it. Never downloads, never decodes pixels."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pflbed.data import (
    cifar,
    cifar10c,
    digits,
    emnist,
    femnist,
    flickr_aes,
    miniimagenet,
    mnist,
    named_folders,
    tinyimagenet,
)
from pflbed.data.tinyimagenet import scan as scan_tiny

PathArg = str | os.PathLike[str] | None


def _digits(path: PathArg) -> dict[str, Any]:
    """Digits' split sizes without loading them: importing scikit-learn alone takes seconds, most of a listing."""
    del path  # bundled: no files to look for
    test = digits.NUM_CLASSES * digits.TEST_PER_CLASS
    return {"location": digits.ORIGIN, "train": digits.SAMPLES - test, "test": test}


def _row(found: Path | None, how: str, **sizes: Any) -> dict[str, Any]:
    if found is None:
        return {"location": f"not found: {how}"}
    return {"location": str(found), **sizes}


def _cifar(name: str, path: PathArg) -> dict[str, Any]:
    return _row(cifar.find_cifar(name, path), cifar.how_to_get(name))


def _cifar10c(path: PathArg) -> dict[str, Any]:
    found = cifar10c.find_cifar10c(path)
    if found is None:
        return _row(None, cifar10c.HOW_TO_GET)
    n = cifar10c.sizes(found)
    present = [c for c in cifar10c.CORRUPTIONS if (found / f"{c}.npy").is_file()]
    domains = f"{len(present)} of {len(cifar10c.CORRUPTIONS)} corruptions (one severity of 1–5 per run)"
    return _row(found, "", train=n * len(present), test=0, domains=domains)


def _mnist(path: PathArg) -> dict[str, Any]:
    found = mnist.find_mnist(path)
    if found is None:
        return _row(None, mnist.HOW_TO_GET)
    train, test = mnist.idx_sizes(found, mnist.FILES, mnist.TITLE)
    return _row(found, "", train=train, test=test)


def _emnist(path: PathArg) -> dict[str, Any]:
    splits = list(emnist.SPLITS)
    found = next((d for s in splits if (d := emnist.find_emnist(path, s)) is not None), None)
    if found is None:
        return _row(None, emnist.HOW_TO_GET)
    here = [s for s in splits if emnist._holds(s)(found)]
    split = "balanced" if "balanced" in here else here[0]
    train, test = emnist.sizes(found, split)
    return _row(found, "", train=train, test=test, domains=f"sizes of split {split}; splits here: {', '.join(here)}")


def _femnist(path: PathArg) -> dict[str, Any]:
    found = femnist.find_femnist(path)
    if found is None:
        return _row(None, femnist.HOW_TO_GET)
    shards = femnist.shards(found) or {}
    layout = "LEAF train/ + test/" if "train" in shards else "LEAF all_data/"
    return _row(found, "", domains=f"{layout}, {sum(len(v) for v in shards.values())} shards")


def _tiny(path: PathArg) -> dict[str, Any]:
    found = tinyimagenet.find_tinyimagenet(path)
    if found is None:
        return _row(None, tinyimagenet.HOW_TO_GET)
    _, train, val = scan_tiny(found)
    return _row(found, "", train=len(train), test=len(val))


def _flickr(path: PathArg) -> dict[str, Any]:
    """Where the ratings file is, how many ratings and workers the loader keeps, and how many rated images `40K/`
    lacks (the published archive lacks some); no image is opened."""
    found = flickr_aes.find_flickr_aes(path)
    if found is None:
        return _row(None, flickr_aes.HOW_TO_GET)
    rows, missing = flickr_aes.present(found, flickr_aes.selected(flickr_aes.read_ratings(found)))
    workers = len({w for w, _, _ in rows})
    lacking = f"; {len(missing)} rated images missing from {flickr_aes.IMAGES}/" if missing else ""
    return _row(found, "", domains=f"{len(rows)} ratings by {workers} workers with {flickr_aes.MIN_RATINGS}–"
                f"{flickr_aes.MAX_RATINGS} ratings (users){lacking}")  # fmt: skip


def _mini(path: PathArg) -> dict[str, Any]:
    return _row(miniimagenet.find_miniimagenet(path), miniimagenet.HOW_TO_GET)


def _named(name: str, path: PathArg) -> dict[str, Any]:
    found = named_folders.find_named(name, path)
    if found is None:
        return _row(None, named_folders.how_to_get(name))
    tree = named_folders.check_tree(name, found)
    return _row(found, "", train=tree["total"], test=0, domains=", ".join(tree["domains"]))


DESCRIBE: dict[str, Callable[[PathArg], dict[str, Any]]] = {
    "digits": _digits,
    "cifar10": partial(_cifar, "cifar10"),  # partials, not closures: the row's code runs when a listing calls it
    "cifar100": partial(_cifar, "cifar100"),
    "cifar10c": _cifar10c,
    "mnist": _mnist,
    "emnist": _emnist,
    "femnist": _femnist,
    "tinyimagenet": _tiny,
    "miniimagenet": _mini,
    "flickr-aes": _flickr,
    **{name: partial(_named, name) for name in named_folders.BENCHMARKS},
}
