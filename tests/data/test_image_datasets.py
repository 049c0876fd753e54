"""Tiny ImageNet and miniImageNet called directly (`load_tinyimagenet`, `load_miniimagenet`): their own defaults,
what their listings accept and refuse, the exact one-line errors, and that a file changed on disk is read again.

`test_loaders` covers their happy paths through `load_dataset`; the fixtures are `tests/data_formats.py`'s.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pflbed.data.miniimagenet import find_miniimagenet, load_miniimagenet
from pflbed.data.tinyimagenet import HOW_TO_GET as TINY_HOW
from pflbed.data.tinyimagenet import find_tinyimagenet, load_tinyimagenet
from pflbed.errors import DataError

from .. import data_formats as fx


def raw(x: torch.Tensor) -> np.ndarray:
    """[-1, 1] inputs back to 0–255 pixels, [N, C, H, W]."""
    return np.rint((x.numpy() * 0.5 + 0.5) * 255).astype(np.int64)


def refused(load, path: Path, named: Path) -> str:
    """The one-line DataError `load(path)` raises; it must start with `named`. Returns the rest."""
    with pytest.raises(DataError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"{named}: ") and "\n" not in message, message
    return message.removeprefix(f"{named}: ")


def touch_later(path: Path) -> None:
    """Move `path`'s mtime a second on, so a rewrite is visible whatever the filesystem's timestamp resolution."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


# --- Tiny ImageNet: defaults, image_size, look-up ----------------------------------------------------------------


def test_tinyimagenet_defaults_native_size_and_never_downloads_unasked(env: Path, no_download: list) -> None:
    """Unset, `image_size` is the native 64 and `download` is off: a missing copy is the not-found error, naming
    where it looked and how to get it, and nothing is fetched."""
    d = fx.make_tinyimagenet(env / "t", size=8)
    source = load_tinyimagenet(d)
    assert source.input_shape == (3, 64, 64) and source.train.x.dtype == torch.float32
    assert source.train.y.dtype == torch.int64 and source.test.y.dtype == torch.int64
    missing = env / "nothing"
    with pytest.raises(DataError) as info:
        load_tinyimagenet(missing)
    assert str(info.value) == f"dataset tinyimagenet (Tiny ImageNet) not found (looked in {missing}); {TINY_HOW}"
    assert no_download == []


def test_find_tinyimagenet_looks_in_the_given_path(env: Path) -> None:
    d = fx.make_tinyimagenet(env / "t", size=8)
    assert find_tinyimagenet(env / "t") == d and find_tinyimagenet(env / "elsewhere") is None


@pytest.mark.parametrize("size", [0, -1, True, 2.5, "8"])
def test_tinyimagenet_image_size_must_be_a_positive_integer(env: Path, size) -> None:
    d = fx.make_tinyimagenet(env / "t", size=8)
    with pytest.raises(DataError, match=rf"^dataset\.image_size: a positive integer, got {re.escape(repr(size))}$"):
        load_tinyimagenet(d, image_size=size)


def test_tinyimagenet_image_size_one_is_accepted(env: Path) -> None:
    d = fx.make_tinyimagenet(env / "t", size=8)
    assert load_tinyimagenet(d, image_size=1).train.x.shape == (18, 3, 1, 1)


def test_tinyimagenet_keeps_float32_under_another_default_dtype(env: Path) -> None:
    """x is float32 as documented even in a process that set torch's default dtype to float64."""
    d = fx.make_tinyimagenet(env / "t", size=8)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        source = load_tinyimagenet(d, image_size=8)
    finally:
        torch.set_default_dtype(old)
    assert source.train.x.dtype == torch.float32 and source.test.x.dtype == torch.float32


# --- Tiny ImageNet: decoding -------------------------------------------------------------------------------------


def test_tinyimagenet_resizes_with_bilinear_filtering(env: Path) -> None:
    """A resized image is exactly Pillow's bilinear resize of the file (not its bicubic default)."""
    d = fx.make_tinyimagenet(env / "t", size=16)
    path = d / "train" / "n01" / "images" / "n01_1.JPEG"
    noise = np.random.default_rng(3).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path, format="PNG")
    with Image.open(path) as img:
        bilinear = np.array(img.convert("RGB").resize((6, 6), Image.Resampling.BILINEAR)).transpose(2, 0, 1)
        bicubic = np.array(img.convert("RGB").resize((6, 6), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
    assert not np.array_equal(bilinear, bicubic)  # the image tells the two filters apart
    x = load_tinyimagenet(d, image_size=6).train.x
    assert np.array_equal(raw(x[1:2])[0], bilinear)


def test_tinyimagenet_unreadable_image_is_named_with_pillow_s_reason(env: Path) -> None:
    d = fx.make_tinyimagenet(env / "t", size=8)
    bad = d / "train" / "n02" / "images" / "n02_3.JPEG"
    bad.write_bytes(b"not an image at all")
    rest = refused(lambda p: load_tinyimagenet(p, image_size=8), d, bad)
    assert rest == f"cannot read image (cannot identify image file {str(bad)!r})"


# --- Tiny ImageNet: the listing ------------------------------------------------------------------------------------


def test_tinyimagenet_ignores_hidden_and_non_image_files_in_image_folders(env: Path) -> None:
    """Only visible files with an image suffix are images: an AppleDouble `._x.JPEG`, a `.DS_Store`, a `notes.txt`
    or a `Thumbs.db` in `images/` is not decoded (each would fail to decode)."""
    d = fx.make_tinyimagenet(env / "t", size=8)
    images = d / "train" / "n01" / "images"
    for name in ("._n01_0.JPEG", ".DS_Store", "notes.txt", "Thumbs.db"):
        (images / name).write_bytes(b"\0\5 not an image")
    (d / "val" / "images" / ".hidden.JPEG").write_bytes(b"junk")
    source = load_tinyimagenet(d, image_size=8)
    assert (len(source.train), len(source.test)) == (18, 9)
    assert source.train.y.tolist() == [0] * 6 + [1] * 6 + [2] * 6


def test_tinyimagenet_wnids_must_be_distinct_and_not_empty(env: Path) -> None:
    d = fx.make_tinyimagenet(env / "t", size=8)
    wnids = d / "wnids.txt"
    for text in ("n01\nn02\nn03\nn01\n", "\n  \n"):
        wnids.write_text(text)
        assert refused(load_tinyimagenet, d, wnids) == "needs one or more distinct class ids, one a line"


def test_tinyimagenet_class_folder_not_in_wnids_is_refused(env: Path) -> None:
    """A train class folder that wnids.txt does not list would silently lose its images: refused, naming it."""
    d = fx.make_tinyimagenet(env / "t", size=8)
    (d / "train" / "n09" / "images").mkdir(parents=True)
    (d / "train" / "n00_notes.txt").write_text("a file, not a class folder: fine")
    rest = refused(load_tinyimagenet, d, d / "train" / "n09")
    assert rest == f"class folder not listed in {d / 'wnids.txt'}"


def test_tinyimagenet_missing_or_empty_class_images(env: Path) -> None:
    """No `train/` at all, or a listed class without its images folder, or with an empty one: named, one line."""
    d = fx.make_tinyimagenet(env / "t", size=8)
    images = d / "train" / "n02" / "images"
    for p in images.iterdir():
        p.unlink()
    assert refused(load_tinyimagenet, d, images) == "no images"
    images.rmdir()
    assert refused(load_tinyimagenet, d, images) == "no such folder: the Tiny ImageNet copy is incomplete"
    os.rename(d / "train", d / "train.old")
    assert refused(load_tinyimagenet, d, d / "train" / "n01" / "images") == ("no such folder: the Tiny ImageNet copy "
                                                                            "is incomplete")  # fmt: skip


def test_tinyimagenet_val_annotations_missing_or_not_utf8(env: Path) -> None:
    d = fx.make_tinyimagenet(env / "t", size=8)
    annotations = d / "val" / "val_annotations.txt"
    annotations.write_bytes(b"val_0.JPEG\t\xff\xfe\n")
    rest = refused(load_tinyimagenet, d, annotations)
    assert rest.startswith("cannot read ('utf-8' codec can't decode byte 0xff in position 11")
    annotations.unlink()
    assert (
        refused(load_tinyimagenet, d, annotations) == f"no such file: the Tiny ImageNet copy in {d / 'val'} is "
        "incomplete"
    )


def test_tinyimagenet_val_annotation_lines(env: Path) -> None:
    """Fields are split on tabs only (a file name may hold a space); blank and whitespace-only lines anywhere are
    skipped, not the end of the file; two fields (no bounding box) are enough."""
    d = fx.make_tinyimagenet(env / "t", size=8)
    os.rename(d / "val" / "images" / "val_0.JPEG", d / "val" / "images" / "val 0.JPEG")
    annotations = d / "val" / "val_annotations.txt"
    lines = annotations.read_text().splitlines()
    lines[0] = lines[0].replace("val_0.JPEG", "val 0.JPEG")
    lines[4] = "\t".join(lines[4].split("\t")[:2])  # file and wnid only
    annotations.write_text("\n".join([*lines[:3], "", "  \t ", *lines[3:]]) + "\n")
    source = load_tinyimagenet(d, image_size=8)
    assert len(source.test) == 9 and sorted(source.test.y.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_tinyimagenet_only_blank_val_annotations_give_an_empty_int64_test_split(env: Path) -> None:
    d = fx.make_tinyimagenet(env / "t", size=8)
    (d / "val" / "val_annotations.txt").write_text("\n\n")
    test = load_tinyimagenet(d, image_size=8).test
    assert test.x.shape == (0, 3, 8, 8) and test.x.dtype == torch.float32
    assert test.y.shape == (0,) and test.y.dtype == torch.int64


@pytest.mark.parametrize("bad", ["val_1.JPEG", "val_1.JPEG\tn77\t0\t0\t7\t7", "val_1.JPEG n01 0 0 7 7",
                                 "val_1.JPEG\tn77\t" + "x" * 100])  # fmt: skip
def test_tinyimagenet_bad_val_annotation_line_names_file_and_line(env: Path, bad: str) -> None:
    """One field, an unlisted wnid or spaces for tabs: the message names the 1-based line and quotes at most the
    line's first 80 characters."""
    d = fx.make_tinyimagenet(env / "t", size=8)
    annotations = d / "val" / "val_annotations.txt"
    lines = annotations.read_text().splitlines()
    annotations.write_text("\n".join([lines[0], bad, *lines[1:]]) + "\n")
    with pytest.raises(DataError) as info:
        load_tinyimagenet(d, image_size=8)
    assert str(info.value) == (f"{annotations}:2: expected <file>\\t<wnid listed in wnids.txt>…, "
                               f"got {bad[:80]!r}")  # fmt: skip


@pytest.mark.parametrize("name", ["../../train/n01/images/n01_0.JPEG", "/abs/val_1.JPEG", "..", ".", "sub/"])
def test_tinyimagenet_val_annotation_image_must_be_a_file_name_in_val_images(env: Path, name: str) -> None:
    """A val line naming a path (`../../train/…`, an absolute path) would put a file from outside val/images/ — a
    training image, say — into the test split without a word: refused, naming file and line, as FLICKR-AES does."""
    d = fx.make_tinyimagenet(env / "t", size=8)
    annotations = d / "val" / "val_annotations.txt"
    lines = annotations.read_text().splitlines()
    annotations.write_text("\n".join([lines[0], f"{name}\tn01\t0\t0\t7\t7", *lines[1:]]) + "\n")
    with pytest.raises(DataError) as info:
        load_tinyimagenet(d, image_size=8)
    assert str(info.value) == f"{annotations}:2: the image must be a file name in val/images/, got {name!r}"


# --- Tiny ImageNet: the cache ------------------------------------------------------------------------------------


def test_tinyimagenet_file_changed_on_disk_is_read_again(env: Path) -> None:
    d = fx.make_tinyimagenet(env / "t", size=8)
    first = load_tinyimagenet(d, image_size=8)
    assert load_tinyimagenet(d, image_size=8) is first  # unchanged: the cached object
    path = d / "train" / "n01" / "images" / "n01_2.JPEG"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(path, format="PNG")
    touch_later(path)
    second = load_tinyimagenet(d, image_size=8)
    assert second is not first
    assert raw(second.train.x[2:3])[0, :, 4, 4].tolist() == [1, 2, 3]
    assert raw(first.train.x[2:3])[0, :, 4, 4].tolist() != [1, 2, 3]


# --- miniImageNet --------------------------------------------------------------------------------------------------


def mini_how() -> str:
    from pflbed.data.miniimagenet import HOW_TO_GET

    return HOW_TO_GET


def test_miniimagenet_not_found_never_downloads_unasked(env: Path, no_download: list) -> None:
    """`download` is off unless asked; asked, it says there is no official archive (and fetches nothing either)."""
    missing = env / "nothing"
    with pytest.raises(DataError) as info:
        load_miniimagenet(missing)
    assert str(info.value) == f"dataset miniimagenet (miniImageNet) not found (looked in {missing}); {mini_how()}"
    with pytest.raises(DataError) as info:
        load_miniimagenet(missing, download=True)
    assert str(info.value) == ("dataset miniimagenet (miniImageNet) not found and has no official archive to "
                               f"download; {mini_how()}")  # fmt: skip
    assert no_download == []


def test_find_miniimagenet_looks_in_the_given_path(env: Path) -> None:
    root = fx.make_miniimagenet(env / "m", classes_per_split=1, per_class=6, side=4)
    assert find_miniimagenet(root) == root and find_miniimagenet(env / "elsewhere") is None


def test_miniimagenet_incomplete_copy_names_the_missing_file(env: Path) -> None:
    root = fx.make_miniimagenet(env / "m", classes_per_split=1, per_class=6, side=4)
    missing = root / "mini-imagenet-cache-val.pkl"
    missing.unlink()
    assert refused(load_miniimagenet, root, missing) == f"no such file: the miniImageNet copy in {root} is incomplete"


def test_miniimagenet_pickle_errors_name_the_dataset(env: Path) -> None:
    """A cache pickle that is not a dict, or that would call a function, is refused naming the file and the
    miniImageNet format."""
    root = fx.make_miniimagenet(env / "m", classes_per_split=1, per_class=6, side=4)
    path = root / "mini-imagenet-cache-test.pkl"
    path.write_bytes(pickle.dumps([1, 2, 3], protocol=4))
    assert refused(load_miniimagenet, root, path) == "expected a dict in a miniImageNet pickle, got list"
    path.write_bytes(fx.evil_pickle("true"))
    assert "which a miniImageNet file never holds" in refused(load_miniimagenet, root, path)


def test_miniimagenet_file_changed_on_disk_is_read_again(env: Path) -> None:
    root = fx.make_miniimagenet(env / "m", classes_per_split=1, per_class=6, side=4)
    first = load_miniimagenet(root)
    assert load_miniimagenet(root) is first  # unchanged: the cached object
    path = root / "mini-imagenet-cache-train.pkl"
    blob = pickle.loads(path.read_bytes())
    blob["image_data"][..., 2] = 99  # blue was 7
    path.write_bytes(pickle.dumps(blob, protocol=4))
    touch_later(path)
    second = load_miniimagenet(root)
    assert second is not first
    assert raw(second.train.x[:1])[0, 2, 1, 1] == 99 and raw(first.train.x[:1])[0, 2, 1, 1] == 7
