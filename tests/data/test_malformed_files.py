"""A file in a published format but with wrong content is refused in one line naming the file and what is wrong.

The loaders' happy paths are `test_loaders` / `test_data`. Here each check of what a CIFAR batch, a LEAF (FEMNIST)
shard and the Fashion-MNIST IDX pair must hold gets the one fault it exists for — at its boundary (a label equal to
the class count, one byte short of a row) — and the message must say which file, which entry and which value, since
a user with a damaged download has only that line to go on. A check that let the fault through would hand the run
wrong data (a label past the classifier's outputs, images misread) or end it in a traceback.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from pflbed.cli import main
from pflbed.data import load_dataset
from pflbed.errors import DataError

from .. import data_formats as fx
from .test_data import make_fmnist_dir, write_idx


def refused(name: str, path: Path, victim: Path, **kw) -> str:
    """The one-line message `load_dataset` refuses the files with; it names the damaged file."""
    with pytest.raises(DataError) as info:
        load_dataset(name, path=path, **kw)
    message = str(info.value)
    assert message.startswith(f"{victim}: ") and "\n" not in message, message
    return message.removeprefix(f"{victim}: ")


# --- CIFAR: a batch's keys, data and labels ---------------------------------------------------------------------


def _cifar_batch(path: Path, **entries) -> None:
    """Batch 2 of a CIFAR-10 fixture (20 images, labels (j + 1) % 10) with `entries` replacing (None: removing) its
    own; the other entries are the format's. Pickled by today's Python and NumPy (which the loader reads too), since
    the Python 2 pickler of the fixtures writes only the format's own uint8 data."""
    images = fx.cifar_pattern(20, (np.arange(20) + 1) % 10)
    obj = {"batch_label": b"training batch 2 of 5", "labels": [int(v) for v in (np.arange(20) + 1) % 10],
           "data": images.transpose(0, 3, 1, 2).reshape(20, 3072)}  # fmt: skip
    obj.update(entries)
    path.write_bytes(pickle.dumps({k: v for k, v in obj.items() if v is not None}, protocol=2))


@pytest.mark.parametrize(("entries", "message"), [
    ({"labels": None}, "no labels in this CIFAR-10 batch (keys: ['batch_label', 'data'])"),
    ({"data": None}, "no data in this CIFAR-10 batch (keys: ['batch_label', 'labels'])"),
    ({"data": None, "labels": None}, "no data or labels in this CIFAR-10 batch (keys: ['batch_label'])"),
    ({"data": np.zeros((20, 3072), dtype=np.int16)}, "data must be uint8 [N, 3072] (3 planes of 32×32), "
                                                      "got int16 [20, 3072]"),
    ({"data": np.zeros((20, 3071), dtype=np.uint8)}, "data must be uint8 [N, 3072] (3 planes of 32×32), "
                                                      "got uint8 [20, 3071]"),
    ({"data": np.zeros((20, 3072, 1), dtype=np.uint8)}, "data must be uint8 [N, 3072] (3 planes of 32×32), "
                                                         "got uint8 [20, 3072, 1]"),
    ({"data": [0] * 3072}, "data must be uint8 [N, 3072] (3 planes of 32×32), got list"),
    ({"labels": [b"cat"] * 20}, "labels is not a list of integers"),
    ({"labels": list(range(10)) * 2 + [3]}, "20 images but 21 labels"),
    ({"labels": [0] * 19 + [10]}, "labels value 10 out of range 0..9"),
    ({"labels": [-1] + [0] * 19}, "labels value -1 out of range 0..9"),
])  # fmt: skip
def test_a_cifar_batch_without_the_format_s_data_or_labels_is_refused_naming_it(env: Path, entries, message) -> None:
    d = fx.make_cifar10(env / "c10")
    _cifar_batch(d / "data_batch_2", **entries)
    assert refused("cifar10", d, d / "data_batch_2") == message
    assert main(["data", "show", "--set", "dataset.name=cifar10", "--set", f"dataset.path={d}"]) == 2


def test_a_cifar_batch_that_is_no_dict_or_calls_code_is_refused_naming_it_and_the_dataset(env: Path) -> None:
    """A batch file is a pickled dict of data only; the line says which file and which dataset's format it broke."""
    d = fx.make_cifar10(env / "c10")
    (d / "data_batch_2").write_bytes(pickle.dumps([1, 2], protocol=2))
    assert refused("cifar10", d, d / "data_batch_2") == "expected a dict in a CIFAR-10 pickle, got list"
    (d / "data_batch_2").write_bytes(fx.evil_pickle(f"touch {env / 'owned'}"))
    assert re.fullmatch(r"refused: the pickle calls \S+\.system, which a CIFAR-10 file never holds "
                        r"\(not loaded: unpickling it could run code\)", refused("cifar10", d, d / "data_batch_2"))
    assert not (env / "owned").exists()


def test_a_cifar100_coarse_label_past_its_20_classes_is_refused(env: Path) -> None:
    d = fx.make_cifar100(env, n_train=200, n_test=100)
    fx.cifar_batch(d / "test", fx.cifar_pattern(100, np.arange(100)),
                   {"fine_labels": list(range(100)), "coarse_labels": [i // 5 for i in range(99)] + [20]})  # fmt: skip
    assert load_dataset("cifar100", path=d).test.y.max() == 99  # the fine labels are within their 100 classes
    assert refused("cifar100", d, d / "test", label="coarse") == "coarse_labels value 20 out of range 0..19"


def test_a_cifar_batch_replaced_on_disk_is_read_again(env: Path) -> None:
    """The decoded data are cached per file identity (size and time): a batch rewritten with other labels is read
    again, not served stale from the cache."""
    d = fx.make_cifar10(env / "c10")
    first = load_dataset("cifar10", path=d)
    _cifar_batch(d / "data_batch_2", labels=[7] * 20)
    again = load_dataset("cifar10", path=d)
    assert again is not first and (again.train.y[20:40] == 7).all() and not (first.train.y[20:40] == 7).all()


# --- FEMNIST: a LEAF shard's users, samples and labels ----------------------------------------------------------


def _shard(env: Path, blob: dict) -> Path:
    path = env / "all_data" / "all_data_0.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(blob))
    return path


def _good(n: int = 3) -> dict:
    return {"users": ["w0"], "num_samples": [n], "user_data": {"w0": fx.femnist_user_data(0, n)}}


def _with(user_data: dict | None = None, **blob) -> dict:
    good = _good()
    if user_data is not None:
        good["user_data"] = {"w0": {**good["user_data"]["w0"], **user_data}}
    return {**good, **blob}


@pytest.mark.parametrize(("blob", "message"), [
    ({"users": ["w0"]}, 'a LEAF shard needs "users" (a list) and "user_data" (a mapping)'),
    ({"users": "w0", "user_data": {}}, 'a LEAF shard needs "users" (a list) and "user_data" (a mapping)'),
    ({"users": ["w0"], "user_data": []}, 'a LEAF shard needs "users" (a list) and "user_data" (a mapping)'),
    ({"users": ["w0"], "user_data": {}}, "user 'w0' is listed but has no user_data with x and y"),
    ({"users": ["w0"], "user_data": {"w0": {"x": [[0.0] * 784]}}},
     "user 'w0' is listed but has no user_data with x and y"),
    ({"users": ["w0"], "user_data": {"w0": {"y": [1]}}}, "user 'w0' is listed but has no user_data with x and y"),
    (_with({"x": [["a"] * 784] * 3}), "user 'w0': x must be rows of 784 numbers, y integers"),
    (_with({"x": [[0.0] * 783] * 3}), "user 'w0': x [3, 783] and y [3]; expected [n, 784] and [n]"),
    (_with({"x": [0.0] * 784}), "user 'w0': x [784] and y [3]; expected [n, 784] and [n]"),
    (_with({"y": [1, 2]}), "user 'w0': x [3, 784] and y [2]; expected [n, 784] and [n]"),
    (_with(num_samples=[4]), "user 'w0': num_samples says 4, user_data holds 3"),
    (_with({"y": [0, 1, 62]}), "user 'w0': label 62 out of range 0..61"),
    (_with({"y": [-1, 1, 2]}), "user 'w0': label -1 out of range 0..61"),
    (_with({"x": [[0.0] * 783 + [float("nan")]] * 3}), "user 'w0': x holds NaN or infinite values"),
])  # fmt: skip
def test_a_leaf_shard_without_the_format_s_users_or_samples_is_refused_naming_it(env: Path, blob, message) -> None:
    shard = _shard(env, blob)
    assert refused("femnist", env, shard) == message


def test_a_leaf_shard_s_num_samples_checks_only_the_users_it_counts(env: Path) -> None:
    """`num_samples` is the shard's own count, parallel to `users`; a shorter list (none in LEAF's files, but JSON
    allows it) checks the users it has a count for, and the rest are read as they are, not a traceback."""
    blob = _good(4)
    blob["users"].append("w1")
    blob["user_data"]["w1"] = fx.femnist_user_data(1, 5)
    _shard(env, blob)
    assert load_dataset("femnist", path=env).user_names == ("w0", "w1")


# --- Fashion-MNIST: the IDX pair's types, shapes and labels -----------------------------------------------------


@pytest.mark.parametrize(("stem", "array", "message"), [
    ("train-images-idx3-ubyte", np.zeros((20, 28, 28), dtype=np.int16),
     "expected uint8 images of shape [N, 28, 28], got int16 [20, 28, 28]"),
    ("train-images-idx3-ubyte", np.zeros((20, 28, 27), dtype=np.uint8),
     "expected uint8 images of shape [N, 28, 28], got uint8 [20, 28, 27]"),
    ("train-images-idx3-ubyte", np.zeros((20, 784), dtype=np.uint8),
     "expected uint8 images of shape [N, 28, 28], got uint8 [20, 784]"),
    ("t10k-labels-idx1-ubyte", np.zeros(10, dtype=np.int16), "expected 1-D uint8 labels, got int16 [10]"),
    ("t10k-labels-idx1-ubyte", np.zeros((10, 1), dtype=np.uint8), "expected 1-D uint8 labels, got uint8 [10, 1]"),
    ("t10k-labels-idx1-ubyte", np.array([0] * 9 + [10], dtype=np.uint8), "label 10 out of range 0..9"),
])  # fmt: skip
def test_a_fashion_mnist_idx_file_of_another_type_or_shape_is_refused_naming_it(env: Path, stem, array, message):
    directory = make_fmnist_dir(env / "fm")
    victim = write_idx(directory / f"{stem}.gz", array)
    assert refused("fmnist", directory, victim) == message


# --- MNIST (and EMNIST): the IDX pair read by `read_idx_pair` -----------------------------------------------------


@pytest.mark.parametrize(("stem", "array", "message"), [
    ("t10k-images-idx3-ubyte", np.zeros((20, 28, 28), dtype=np.int16),
     "expected uint8 images [N, 28, 28], got int16 [20, 28, 28]"),
    ("t10k-images-idx3-ubyte", np.zeros((20, 27, 28), dtype=np.uint8),
     "expected uint8 images [N, 28, 28], got uint8 [20, 27, 28]"),
    ("t10k-labels-idx1-ubyte", np.zeros(20, dtype=np.int16), "expected 1-D uint8 labels, got int16 [20]"),
    ("t10k-labels-idx1-ubyte", np.zeros((20, 2), dtype=np.uint8), "expected 1-D uint8 labels, got uint8 [20, 2]"),
    ("t10k-labels-idx1-ubyte", np.zeros(19, dtype=np.uint8), "20 images but t10k-labels-idx1-ubyte.gz has 19 labels"),
    ("t10k-labels-idx1-ubyte", np.array([3] * 19 + [10], dtype=np.uint8), "label 10 out of range 0..9"),
])  # fmt: skip
def test_an_mnist_idx_file_of_another_type_shape_or_count_is_refused_naming_it(env: Path, stem, array, message):
    fx.make_mnist(env / "mnist")
    victim = write_idx(env / "mnist" / f"{stem}.gz", array)
    named = env / "mnist" / "t10k-images-idx3-ubyte.gz" if "images but" in message else victim
    assert refused("mnist", env / "mnist", named) == message


def test_an_idx_header_too_short_for_its_dims_is_refused_where_only_the_shape_is_read(tmp_path: Path) -> None:
    from pflbed.data.idx import read_idx_shape

    good = write_idx(tmp_path / "a-idx3-ubyte", np.zeros((3, 2, 5), dtype=np.uint8))
    assert read_idx_shape(good) == (3, 2, 5)
    for name, data in (("short", b"\x00\x00"), ("dims", good.read_bytes()[:10])):
        (tmp_path / name).write_bytes(data)
        expected = "file too short for an IDX header" if name == "short" else "truncated IDX header"
        with pytest.raises(DataError, match=f"^{tmp_path / name}: {expected}"):
            read_idx_shape(tmp_path / name)


# --- miniImageNet: a cache pickle's images and class rows -------------------------------------------------------


def _mini_rows(env: Path, **entries) -> Path:
    """The train cache of a miniImageNet fixture (2 classes × 10 rows) with `entries` replacing its own."""
    root = fx.make_miniimagenet(env / "mini", side=8)
    path = root / "mini-imagenet-cache-train.pkl"
    blob = pickle.loads(path.read_bytes())
    blob.update(entries)
    path.write_bytes(pickle.dumps(blob, protocol=4))
    return path


@pytest.mark.parametrize(("entries", "message"), [
    ({"image_data": np.zeros((20, 8, 8, 3), dtype=np.int16)}, "image_data must be uint8 [N, H, W, 3], got int16 "
                                                              "[20, 8, 8, 3]"),
    ({"image_data": np.zeros((20, 8, 8), dtype=np.uint8)}, "image_data must be uint8 [N, H, W, 3], got uint8 "
                                                           "[20, 8, 8]"),
    ({"image_data": np.zeros((20, 8, 8, 1), dtype=np.uint8)}, "image_data must be uint8 [N, H, W, 3], got uint8 "
                                                              "[20, 8, 8, 1]"),
    ({"image_data": [0] * 20}, "image_data must be uint8 [N, H, W, 3], got list"),
    ({"image_data": np.zeros((20, 8, 9, 3), dtype=np.uint8)}, "image_data must hold square images, got [8, 9]"),
    ({"class_dict": {}}, "class_dict must map each wnid to its rows of image_data"),
    ({"class_dict": [list(range(10))]}, "class_dict must map each wnid to its rows of image_data"),
    ({"class_dict": {"n0000": "0-9", "n0001": list(range(10, 20))}}, "class_dict['n0000'] is not a list of row "
                                                                      "indices"),
    ({"class_dict": {"n0000": list(range(10)), "n0001": list(range(11, 21))}}, "class_dict['n0001'] points past "
                                                                               "image_data's 20 rows"),
    ({"class_dict": {"n0000": [-1, *range(1, 10)], "n0001": list(range(10, 20))}}, "class_dict['n0000'] points past "
                                                                                   "image_data's 20 rows"),
    ({"class_dict": {"n0000": list(range(10)), "n0001": list(range(9, 19))}}, "class_dict['n0001'] shares rows with "
                                                                              "another class"),
])  # fmt: skip
def test_a_miniimagenet_cache_without_the_format_s_images_or_rows_is_refused_naming_it(env: Path, entries, message):
    path = _mini_rows(env, **entries)
    assert refused("miniimagenet", path.parent, path) == message
