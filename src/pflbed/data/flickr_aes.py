"""FLICKR-AES (Ren et al., "Personalized Image Aesthetics", ICCV 2017): Flickr photos rated 1–5 for aesthetics by
Amazon Mechanical Turk workers, each worker a client — FedPer's personalized task (Arivazhagan et al. 2019, §4.1,
Fig. 7, 8).

Layout, as the authors publish it (github.com/alanspike/personalizedImageAesthetics): the images, unzipped from
`FLICKR-AES-001.zip` into `40K/`, beside `FLICKR-AES_image_labeled_by_each_worker.csv`, whose header is
`worker, imagePair, score` and each row one worker's rating of one image (`<worker id>, <image file in 40K/>,
<1–5>`); fields are read with their surrounding spaces stripped (the published header has them).

What a sample is: one rating — the image, labelled with its rater's score (class score − 1, 5 classes), its user
that worker. An image rated by five workers is five samples with up to five labels: the task is each worker's own
taste, which one shared model cannot fit (FedPer's point).

Which workers (`MIN_RATINGS`, `MAX_RATINGS`): FedPer describes its users as having rated "between 60 and 290 images",
so the workers with 60 to 290 ratings (inclusive) are loaded; the others are left out, as in the paper's
description (and its Flower re-implementation, which finds about 60 such workers). This also bounds the memory:
every rating is an image of its own, and the full 193,000 ratings at 224 px would need 116 GB.

Rated images the archive lacks: the published `40K/` does not hold every image the ratings file names (reported on
the authors' repository, issue 2, and confirmed there by a second user). A worker is still chosen by its ratings in
the file, as the paper describes its users and as the Flower re-implementation counts them; then each rating whose
image is absent is left out, and loading prints one warning line with how many images and ratings that dropped and
an example, so a half-unzipped copy does not pass unnoticed. Where none of the chosen workers' images is present
(`40K/` empty or unzipped one folder too deep), loading stops with a one-line error naming one of them.
`federation.partition: natural` then makes each worker a client and `federation.clients` draws the paper's 30.

Splits: FedPer splits each user's ratings 80 / 20 into train and test, which here is the federation's per-client
split (`federation.test_fraction: 0.2`, P-FL on each client's own test split). The loader's `test` split, the G-FL
set, holds out `TEST_FRACTION` (10 %) of each worker's ratings with a fixed seed (`arrays.held_out`, as FEMNIST's),
the same on every machine. Images are squashed to `image_size` squares (the photos' aspect ratios vary; FedPer's
Flower re-implementation resizes to 224 × 224) and scaled to [−1, 1] with the fixed (0.5, 0.5).
"""

from __future__ import annotations

import csv
import os
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from pflbed.data import store
from pflbed.data.arrays import ArrayDataset, DataSource, held_out
from pflbed.data.folders import decode_image
from pflbed.errors import DataError
from pflbed.memory import check_decoded

NAME, TITLE = "flickr-aes", "FLICKR-AES"
RATINGS, IMAGES = "FLICKR-AES_image_labeled_by_each_worker.csv", "40K"
HEADER = ("worker", "imagePair", "score")
TOPS = ("flickr", "FLICKR-AES")
NUM_CLASSES = 5  # scores 1–5
MIN_RATINGS, MAX_RATINGS = 60, 290  # FedPer §4.1: each user "has rated between 60 and 290 images"
TEST_FRACTION, SPLIT_SEED = 0.1, 0
MEAN, STD = 0.5, 0.5
MAX_ROWS = 1_000_000  # the published file has 193,208: a longer one is not this dataset
HOW_TO_GET = ("download FLICKR-AES-001.zip and FLICKR-AES_image_labeled_by_each_worker.csv (links at "
              "github.com/alanspike/personalizedImageAesthetics), unzip the images so that 40K/ sits beside the "
              f"csv, and point dataset.path or $PFLBED_DATA/{NAME} at that folder")  # fmt: skip


def _holds(directory: Path) -> bool:
    return (directory / RATINGS).is_file() and (directory / IMAGES).is_dir()


def find_flickr_aes(path: str | os.PathLike[str] | None = None) -> Path | None:
    return store.find(NAME, path, TOPS, _holds)


def read_ratings(directory: Path) -> list[tuple[str, str, int]]:
    """(worker, image file name, score 1–5) per row of the ratings file, checked; errors name the file and line."""
    path = directory / RATINGS
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            rows = csv.reader(fh)
            header = tuple(f.strip() for f in next(rows, ()))
            if header != HEADER:
                raise DataError(f"{path}:1: expected the header {', '.join(HEADER)}, got {', '.join(header)!r}")
            out = []
            for n, row in enumerate(rows, 2):
                if not row or not "".join(row).strip():
                    continue
                if len(out) == MAX_ROWS:  # one data row more than allowed
                    raise DataError(f"{path}: more than {MAX_ROWS:,} rows; the published file has 193,208")
                fields = [f.strip() for f in row]
                if len(fields) != 3 or not fields[0] or not fields[1]:
                    raise DataError(f"{path}:{n}: expected <worker>, <image>, <score>, got {','.join(row)[:80]!r}")
                image = fields[1]
                if not store.is_file_name(image):
                    raise DataError(f"{path}:{n}: the image must be a file name in {IMAGES}/, got {image[:80]!r}")
                if fields[2] not in ("1", "2", "3", "4", "5"):
                    raise DataError(f"{path}:{n}: score must be an integer 1–5, got {fields[2][:20]!r}")
                out.append((fields[0], image, int(fields[2])))
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: cannot read ({store.one_line(exc)})") from None
    return out


def selected(ratings: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """The ratings of the workers with `MIN_RATINGS` to `MAX_RATINGS` of them, ordered by worker id, then by the
    file's order; a worker who rated an image twice keeps the first rating only (one label per rating sample)."""
    by_worker: dict[str, dict[str, int]] = {}
    for worker, image, score in ratings:
        by_worker.setdefault(worker, {}).setdefault(image, score)
    return [(w, image, score) for w in sorted(by_worker) if MIN_RATINGS <= len(by_worker[w]) <= MAX_RATINGS
            for image, score in by_worker[w].items()]  # fmt: skip


def present(directory: Path, rows: list[tuple[str, str, int]]) -> tuple[list[tuple[str, str, int]], tuple[str, ...]]:
    """The ratings whose image is in `40K/`, and the sorted names of the rated images that are not (see the module
    docstring: the published archive lacks some); each file is looked up once, however many workers rated it."""
    there = {image: (directory / IMAGES / image).is_file() for image in {i for _, i, _ in rows}}
    return [r for r in rows if there[r[1]]], tuple(sorted(i for i, ok in there.items() if not ok))


def missing_notice(directory: Path, missing: tuple[str, ...], dropped: int) -> str | None:
    """The warning line for rated images absent from `40K/` (None: none were)."""
    if not missing:
        return None
    return (f"pflbed: warning: {directory / IMAGES}: {len(missing):,} rated image(s) missing, their {dropped:,} "
            f"rating(s) left out, e.g. {missing[0]}")  # fmt: skip


def _build(directory: Path, rows: list[tuple[str, str, int]], image_size: int) -> DataSource:
    workers = tuple(sorted({w for w, _, _ in rows}))
    rank = {w: i for i, w in enumerate(workers)}
    images = sorted({image for _, image, _ in rows})
    slot = {image: i for i, image in enumerate(images)}
    check_decoded(len(images) + len(rows), image_size, f"{TITLE}'s {len(images):,} images as {len(rows):,} ratings")
    pixels = torch.empty((len(images), 3, image_size, image_size), dtype=torch.float32)
    for i, image in enumerate(images):  # each image decoded once, however many workers rated it
        pixels[i] = torch.from_numpy(decode_image(str(directory / IMAGES / image), image_size)).permute(2, 0, 1)
    pixels.div_(255.0).sub_(MEAN).div_(STD)
    user = np.array([rank[w] for w, _, _ in rows], dtype=np.int64)
    is_test = np.zeros(len(rows), dtype=bool)
    for r in range(len(workers)):
        mine = np.flatnonzero(user == r)
        is_test[mine] = held_out(len(mine), TEST_FRACTION, SPLIT_SEED, r)
    which = torch.tensor([slot[image] for _, image, _ in rows], dtype=torch.int64)
    y = torch.tensor([score - 1 for _, _, score in rows], dtype=torch.int64)

    def split(mask: np.ndarray) -> ArrayDataset:
        keep = torch.from_numpy(np.flatnonzero(mask))
        return ArrayDataset(x=pixels[which[keep]], y=y[keep], user=torch.from_numpy(user[mask]))

    return DataSource(name=NAME, train=split(~is_test), test=split(is_test), num_classes=NUM_CLASSES,
                      origin=str(directory), pixel_norm=(MEAN, STD), raw_scale=255.0, raw_channels_last=True,
                      user_names=workers)  # fmt: skip


@lru_cache(maxsize=2)
def _load_cached(directory: str, image_size: int, rows: tuple, stamp: tuple, notice: str | None) -> DataSource:
    del stamp  # only part of the cache key
    if notice:  # once per decoded copy: repeated loads hit the cache
        print(notice, file=sys.stderr, flush=True)
    return _build(Path(directory), list(rows), image_size)


def load_flickr_aes(
    path: str | os.PathLike[str] | None = None, download: bool = False, image_size: int = 32
) -> DataSource:
    """FLICKR-AES ratings of the workers with 60–290 of them, less those whose image `40K/` lacks: x float32
    [N, 3, S, S] (S = `image_size`), y int64 score − 1, `user` = worker index into `user_names`. There is no archive
    to download without the authors' links, so `download=True` only explains how to get it. Cached per unchanged
    files; read-only."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise DataError(f"dataset.image_size: a positive integer, got {image_size!r}")
    directory = store.locate(NAME, TITLE, path, TOPS, _holds, HOW_TO_GET, download)
    rows = selected(read_ratings(directory))
    if not rows:
        raise DataError(f"{directory / RATINGS}: no worker has {MIN_RATINGS} to {MAX_RATINGS} ratings")
    kept, missing = present(directory, rows)
    if not kept:
        raise DataError(f"{directory / IMAGES / missing[0]}: no such file, nor any other image the chosen workers "
                        f"rated in {directory / RATINGS}")  # fmt: skip
    notice = missing_notice(directory, missing, len(rows) - len(kept))
    files = [directory / RATINGS, *(directory / IMAGES / image for image in sorted({i for _, i, _ in kept}))]
    return _load_cached(str(directory), image_size, tuple(kept), store.stamp(files), notice)  # the file read once
