"""Domain-folder image datasets in the DomainBed layout `root/<domain>/<class>/<image>` (PACS, Office-Home, ...).

The whole tree is one pool: every image lands in `train` with its domain label and `test` is empty, because the
PFLBED protocol carves the shared per-domain test sets out of the pool itself (a fixed split here would force
one test set on every federation). Class indices are global, from the sorted union of class folder names over
all domains, so "dog" is the same label in every domain even when some domain lacks a class.

Everything that decides the result is sorted (domains, classes, file names), so two machines with the same
tree build identical tensors, and therefore identical federations, whatever order the filesystem lists in.

A class folder's files that are not images by extension (`IMAGE_EXTENSIONS`: a `notes.txt`, a `Thumbs.db`) are
skipped, as torchvision's `ImageFolder` skips them, and counted: loading prints one warning line with the count and
an example, and `describe_domain_folders` reports `skipped`, so a half-copied tree of, say, `.webp` exports does not
go unnoticed. Hidden entries (`.DS_Store`) are ignored outright; a folder inside a class folder is an error.

A file byte for byte identical to one before it in the same domain is left out of the pool, with one warning line
that counts them (`distinct`): the protocol cuts each domain's test set from the pool, where a copy on each side
would score a training sample as a test one. The listing (`describe_domain_folders`) counts files as found.

Truncated files raise like any corrupt image, unless the process has set Pillow's global
`ImageFile.LOAD_TRUNCATED_IMAGES`, which opts into padding them with grey; this module never sets it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.errors import DataError
from pflbed.memory import check_decoded

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif"})
_EXTS = ", ".join(sorted(IMAGE_EXTENSIONS))  # for error messages

# Fixed per-channel normalization rather than statistics of the loaded pixels: a subset of the domains, another
# copy of the dataset or a test fixture is then normalized exactly like the full dataset, and a model trained on
# one load means the same thing on another. `symmetric` (the default) maps pixels to [-1, 1]; `imagenet` is the
# ImageNet training set's channel mean and standard deviation, what ImageNet-pretrained weights (torchvision's,
# timm's ResNet-18 for `resnet18_imagenet`) expect (`dataset.normalize`).
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NORMALIZATIONS = {"symmetric": (MEAN, STD), "imagenet": (IMAGENET_MEAN, IMAGENET_STD)}

# What Pillow raises on a file it cannot decode: UnidentifiedImageError (an OSError) for an unknown format,
# OSError for truncated or broken data, SyntaxError/ValueError/EOFError from some format plugins, and
# DecompressionBombError for absurd dimensions.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError, UnidentifiedImageError)


@dataclass(frozen=True)
class _Tree:
    """A scanned tree: sorted domain and class names, in load order (domain, class, file path) triples, and the
    non-image files of its class folders that were skipped.

    Hashable on purpose: together with the file stamps it is the cache key, so a tree whose file list changed
    misses the cache without a second scan.
    """

    root: str
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    files: tuple[tuple[int, int, str], ...]
    skipped: tuple[str, ...] = ()


def _show(path: Path | str) -> str:
    """A path as it goes into an error message: verbatim unless a control character would break the line."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    """Non-hidden entries of `directory` sorted by name; a listing failure becomes a DataError naming it."""
    try:
        with os.scandir(directory) as it:
            entries = [e for e in it if not e.name.startswith(".")]
    except OSError as exc:
        raise DataError(f"{_show(directory)}: cannot list folder ({exc.strerror or _one_line(exc)})") from None
    return sorted(entries, key=lambda e: e.name)


def _subdirs(directory: Path) -> list[str]:
    return [e.name for e in _entries(directory) if e.is_dir()]


def _is_image(entry: os.DirEntry[str]) -> bool:
    return os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS and entry.is_file()


def _root(path: str | os.PathLike[str]) -> Path:
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"{_show(root)}: no such directory")
    if not root.is_dir():
        raise DataError(f"{_show(root)}: not a directory")
    return root.resolve()


def _scan(root: Path, skip_classless: bool = False) -> _Tree:
    """List the tree without opening any image, rejecting layouts that would silently lose a class or domain.
    `skip_classless`: a top-level folder without any folder inside is no domain and is passed over (a named
    benchmark's copy may carry one, e.g. the `image_list/` of `.txt` lists some libraries keep beside the domains);
    otherwise it is an error, as any folder may be a domain of a tree of unknown layout."""
    domains, per_domain = [], []
    for domain in _subdirs(root):
        classes = _subdirs(root / domain)
        if classes:
            domains.append(domain)
            per_domain.append(classes)
        elif not skip_classless:
            raise DataError(f"{_show(root / domain)}: domain folder has no class folders")
    if not domains:
        raise DataError(f"{_show(root)}: no domain folders (expected <root>/<domain>/<class>/<image>)")
    all_classes = sorted({c for classes in per_domain for c in classes})
    index = {name: i for i, name in enumerate(all_classes)}
    files: list[tuple[int, int, str]] = []
    skipped: list[str] = []
    for d, (domain, classes) in enumerate(zip(domains, per_domain, strict=True)):
        for name in classes:  # already sorted, and global indices follow the same order
            folder = root / domain / name
            entries = _entries(folder)
            nested = next((e for e in entries if e.is_dir()), None)
            if nested is not None:  # its images would be lost, or belong to another class
                raise DataError(f"{_show(nested.path)}: a folder inside a class folder; class folders hold images "
                                f"({_EXTS}): move it out of the tree")  # fmt: skip
            images = [e.path for e in entries if _is_image(e)]
            skipped.extend(e.path for e in entries if not _is_image(e))
            if not images:
                raise DataError(f"{_show(folder)}: class folder has no images ({_EXTS})")
            files.extend((d, index[name], p) for p in images)
    return _Tree(root=str(root), domains=tuple(domains), classes=tuple(all_classes), files=tuple(files),
                 skipped=tuple(skipped))  # fmt: skip


def skipped_notice(tree: _Tree) -> str | None:
    """The warning line for the non-image files `tree` skipped (None: none were)."""
    if not tree.skipped:
        return None
    return (f"pflbed: warning: {_show(tree.root)}: skipped {len(tree.skipped)} non-image file(s) in class folders "
            f"(images are {_EXTS}), e.g. {_show(tree.skipped[0])}")  # fmt: skip


def _stamp(tree: _Tree) -> tuple[tuple[int, int], ...]:
    """(mtime_ns, size) per file, parallel to `tree.files`: a rewritten image misses the cache, cheaply."""
    stamp: list[tuple[int, int]] = []
    for _, _, path in tree.files:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise DataError(f"{_show(path)}: cannot stat image ({exc.strerror or _one_line(exc)})") from None
        stamp.append((st.st_mtime_ns, st.st_size))
    return tuple(stamp)


def decode_image(path: str, size: int) -> np.ndarray:
    """One image as uint8 [size, size, 3]; `load()` inside the try so truncated data fails here, by name."""
    try:
        with Image.open(path) as img:
            img.load()  # open() only reads the header; decoding errors (truncation) surface here
            rgb = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
            return np.array(rgb, dtype=np.uint8)  # a writable copy: torch warns on read-only arrays
    except _DECODE_ERRORS as exc:
        raise DataError(f"{_show(path)}: cannot read image ({_one_line(exc)})") from None


def distinct(files: tuple[tuple[int, int, str], ...]) -> tuple[list[tuple[int, int, str]], list[str]]:
    """`files` less the byte-identical copies of a file earlier in load order within the same domain, and the paths
    left out. Why: the protocol carves each domain's test set out of the pool, and a copy on each side of that cut
    scores a memorized sample as a test one. DomainNet's archives hold such copies (DomainBed's download script
    deletes a list of 9,431 after unzipping). A copy whose bytes differ (re-encoded) is not detected."""
    seen: set[tuple[int, bytes]] = set()
    kept: list[tuple[int, int, str]] = []
    dropped: list[str] = []
    for d, c, path in files:
        try:
            digest = hashlib.blake2b(Path(path).read_bytes(), digest_size=16).digest()
        except OSError as exc:
            raise DataError(f"{_show(path)}: cannot read image ({exc.strerror or _one_line(exc)})") from None
        if (d, digest) in seen:
            dropped.append(path)
        else:
            seen.add((d, digest))
            kept.append((d, c, path))
    return kept, dropped


def copies_notice(root: str, dropped: list[str]) -> str | None:
    """The warning line for the byte-identical copies `distinct` left out (None: none were)."""
    if not dropped:
        return None
    return (f"pflbed: warning: {_show(root)}: left out {len(dropped)} image file(s) byte-identical to an earlier one "
            f"of their domain, e.g. {_show(dropped[0])}")  # fmt: skip


@lru_cache(maxsize=4)
def _load_cached(tree: _Tree, stamp: tuple[tuple[int, int], ...], image_size: int, normalize: str) -> DataSource:
    """Decode once per (tree, file identity, size, normalization); callers share the result and must not modify it."""
    del stamp  # only part of the cache key
    s = image_size
    check_decoded(len(tree.files), s, f"the {len(tree.files):,} images of {_show(tree.root)}")
    files, dropped = distinct(tree.files)
    for notice in (skipped_notice(tree), copies_notice(tree.root, dropped)):
        if notice:  # once per decoded tree: repeated loads hit the cache
            print(notice, file=sys.stderr, flush=True)
    # Preallocated and filled in place: for DomainNet-sized pools a list of per-image tensors plus a final
    # `torch.stack` would need twice the memory at the peak.
    x = torch.empty((len(files), 3, s, s), dtype=torch.float32)
    for i, (_, _, path) in enumerate(files):
        x[i] = torch.from_numpy(decode_image(path, s)).permute(2, 0, 1)
    means, stds = NORMALIZATIONS[normalize]
    mean = torch.tensor(means, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(stds, dtype=torch.float32).view(1, 3, 1, 1)
    x.div_(255.0).sub_(mean).div_(std)
    y = torch.tensor([c for _, c, _ in files], dtype=torch.int64)
    domain = torch.tensor([d for d, _, _ in files], dtype=torch.int64)
    empty = ArrayDataset(
        x=torch.empty((0, 3, s, s), dtype=torch.float32),
        y=torch.empty(0, dtype=torch.int64),
        domain=torch.empty(0, dtype=torch.int64),
    )
    return DataSource(
        name=f"folder:{Path(tree.root).name}",
        train=ArrayDataset(x=x, y=y, domain=domain),
        test=empty,
        num_classes=len(tree.classes),
        origin=tree.root,
        pixel_norm=(0.5, 0.5) if normalize == "symmetric" else (means, stds),
        raw_scale=255.0,
        raw_channels_last=True,
        domain_names=tuple(tree.domains),
    )


def load_domain_folders(
    path: str | os.PathLike[str], image_size: int = 32, normalize: str = "symmetric", skip_classless: bool = False
) -> DataSource:
    """Load `root/<domain>/<class>/<image>` as one pool: x float32 [N, 3, S, S] (`normalize`: `symmetric` in
    [-1, 1], `imagenet` standardized with ImageNet's channel mean and standard deviation), y and domain int64.

    Order is domain, class, file name (all sorted); domain `d` is the d-th sorted domain folder name and class
    `c` the c-th name of the sorted union of class folders. `test` is empty ([0, 3, S, S]): the protocol
    splits the pool itself. Repeated calls on an unchanged tree return the same object; treat it as read-only.
    `skip_classless`: pass over top-level folders that hold no folder (`_scan`).
    """
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise DataError(f"{_show(Path(path))}: image_size must be a positive integer, got {image_size!r}")
    if normalize not in NORMALIZATIONS:
        raise DataError(f"{_show(Path(path))}: normalize must be one of {', '.join(NORMALIZATIONS)}, got {normalize!r}")
    tree = _scan(_root(path), skip_classless)
    return _load_cached(tree, _stamp(tree), image_size, normalize)


def describe_domain_folders(path: str | os.PathLike[str], skip_classless: bool = False) -> dict[str, Any]:
    """Domains, classes, per-domain image counts and the number of skipped non-image files from the listing alone
    (no image is opened), for listings.

    Raises the same layout errors as `load_domain_folders`, so a listing flags a broken tree before a run does.
    """
    tree = _scan(_root(path), skip_classless)
    counts = dict.fromkeys(tree.domains, 0)
    for d, _, _ in tree.files:
        counts[tree.domains[d]] += 1
    return {
        "root": tree.root,
        "domains": list(tree.domains),
        "classes": list(tree.classes),
        "images": counts,
        "total": len(tree.files),
        "skipped": len(tree.skipped),
    }
