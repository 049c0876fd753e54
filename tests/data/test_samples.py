"""A user's own samples (`pflbed personalize --data`, `data.samples`): an image folder is decoded to the run's
dataset's raw sample shape (grey or colour, Pillow's bilinear resize, 0–255), labelled by its class folders; a
file is an `.npz` of `x` and `y`. Everything else is one line naming the path.

`test_trained` runs these files through the CLI; here each rule of the reader is checked on its own.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from pflbed.data.samples import read_samples
from pflbed.errors import DataError

GREY = SimpleNamespace(name="digits", raw_shape=(8, 8), num_classes=10)  # what the reader uses of a DataSource
COLOUR = SimpleNamespace(name="cifar10", raw_shape=(6, 4, 3), num_classes=10)  # an oblong H×W to catch a swap


def _image(path: Path, size: tuple[int, int], seed: int) -> np.ndarray:
    """An RGB image of random pixels (width, height = size), saved as PNG; returns its pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return pixels


def _expected(pixels: np.ndarray, mode: str, hw: tuple[int, int]) -> np.ndarray:
    resized = Image.fromarray(pixels).convert(mode).resize((hw[1], hw[0]), Image.Resampling.BILINEAR)
    return np.asarray(resized)


@pytest.mark.parametrize(("source", "mode"), [(GREY, "L"), (COLOUR, "RGB")])
def test_an_image_folder_is_the_dataset_s_raw_samples_labelled_by_class_folder(tmp_path, source, mode) -> None:
    a = _image(tmp_path / "7" / "b.png", (12, 10), 0)
    (tmp_path / "7" / "a.txt").write_text("not an image: skipped, and the images after it still read")
    b = _image(tmp_path / "7" / "c.PNG", (5, 9), 1)
    c = _image(tmp_path / "2" / "z.png", (16, 16), 2)
    x, y, scale = read_samples(tmp_path, source)
    hw = source.raw_shape[:2]
    assert x.dtype == np.uint8 and x.shape == (3, *source.raw_shape) and scale == 255.0
    assert y.dtype == np.int64 and y.tolist() == [2, 7, 7]  # class folders in order, files in order
    for got, pixels in zip(x, (c, a, b), strict=True):
        assert np.array_equal(got, _expected(pixels, mode, hw))


def test_class_folders_must_be_the_dataset_s_labels(tmp_path) -> None:
    _image(tmp_path / "9" / "a.png", (8, 8), 0)  # the last label: taken
    _image(tmp_path / "10" / "a.png", (8, 8), 0)  # one past it: refused
    with pytest.raises(DataError, match=rf"^{tmp_path}: needs class sub-folders named 0…9; found \['10'\]$"):
        read_samples(tmp_path, GREY)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=rf"^{empty}: needs class sub-folders named 0…9; found none$"):
        read_samples(empty, GREY)


def test_folders_without_images_unreadable_images_and_no_path_are_one_line_naming_it(tmp_path) -> None:
    (tmp_path / "none" / "3").mkdir(parents=True)
    (tmp_path / "none" / "3" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'none'}: no images in its class sub-folders$"):
        read_samples(tmp_path / "none", GREY)
    bad = tmp_path / "bad" / "1" / "broken.png"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match=rf"^{bad}: cannot read image \(.+\)$"):
        read_samples(tmp_path / "bad", GREY)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'gone'}: no such file or folder$"):
        read_samples(tmp_path / "gone", GREY)


@pytest.mark.parametrize("raw_shape", [(64,), (2, 2, 2, 2)])
def test_an_image_folder_for_a_dataset_of_no_images_is_refused(tmp_path, raw_shape) -> None:
    _image(tmp_path / "0" / "a.png", (4, 4), 0)
    source = SimpleNamespace(name="synthetic", raw_shape=raw_shape, num_classes=2)
    with pytest.raises(DataError, match=rf"^{tmp_path}: synthetic samples are not images; give an \.npz file with x "
                                        "and y$"):  # fmt: skip
        read_samples(tmp_path, source)


def test_an_npz_of_pickled_objects_is_refused_not_unpickled(tmp_path) -> None:
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    with pytest.raises(DataError, match=rf"^{tmp_path / 'obj.npz'}: not a readable \.npz file \(.*pickle"):
        read_samples(tmp_path / "obj.npz", GREY)
