"""The array datasets' loaders (CIFAR, CIFAR-10-C, MNIST, EMNIST, FEMNIST, Fashion-MNIST, IDX, digits) at the edges
the happy-path tests in `test_loaders` / `test_data` leave open.

- Defaults: a loader called without `download` never downloads (a missing dataset is the not-found line, with
  where it looked and how to get it); `download=True` reaches the fetch with the dataset's own remotes and
  destination; EMNIST's split is `balanced`, digits' seed 0, CIFAR-10-C's corruptions all 19.
- Caches: each loader caches the decoded data per file identity, so a copy rewritten on disk is read again.
- Options and files: CIFAR-10-C's severities 1..5 and distinct corruptions; a labels file not 5 severities × N;
  a `.npy` that is a pickle (never unpickled: it could run code) or a `.npz`; IDX headers, payload sizes and the
  header-only shape read; FEMNIST's LEAF layouts and labels; each refusal one line naming the file or option.
"""

from __future__ import annotations

import gzip
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pflbed.data import cifar, cifar10c, emnist, femnist, fmnist, idx, mnist, store
from pflbed.data.digits import TEST_PER_CLASS, load_digits_source
from pflbed.errors import DataError

from .. import data_formats as fx
from .test_data import make_fmnist_dir, write_idx
from .test_loaders import raw


@pytest.fixture
def no_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any download attempt fails the test."""
    monkeypatch.setattr(store, "fetch", lambda *a, **k: pytest.fail(f"a download was attempted: {a}"))


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- downloads: never by default, and with download=True the dataset's own remotes into `path` ---------------------

NOT_FOUND = {  # loader, title, how to get it
    "cifar10": (cifar.load_cifar10, "CIFAR-10", cifar.how_to_get("cifar10")),
    "cifar100": (cifar.load_cifar100, "CIFAR-100", cifar.how_to_get("cifar100")),
    "cifar10c": (cifar10c.load_cifar10c, "CIFAR-10-C", cifar10c.HOW_TO_GET),
    "mnist": (mnist.load_mnist, "MNIST", mnist.HOW_TO_GET),
    "emnist": (emnist.load_emnist, "EMNIST", emnist.HOW_TO_GET),
    "femnist": (femnist.load_femnist, "FEMNIST", femnist.HOW_TO_GET),
}


@pytest.mark.parametrize("name", NOT_FOUND)
def test_a_missing_dataset_is_not_downloaded_by_default_and_the_error_says_where_and_how(env, no_fetch, name):
    """Without `download` a loader must not fetch gigabytes: the one line names the dataset, where it looked and the
    manual route (which ends with the opt-in: dataset.download=true, for those that have an archive)."""
    load, title, how = NOT_FOUND[name]
    nowhere = env / "nowhere"
    with pytest.raises(DataError) as info:
        load(nowhere)
    assert _one_line(info) == f"dataset {name} ({title}) not found (looked in {nowhere}); {how}"
    assert (name == "femnist") != bool(re.search(r", or set dataset\.download=true( \(\d\.\d GB\))?$", how))


def test_a_missing_fashion_mnist_is_not_downloaded_by_default_and_each_place_says_what_it_holds(env, no_fetch):
    """Fashion-MNIST's not-found line lists each directory tried (`path`, its fashion-mnist/ and FashionMNIST/raw/)
    with what it held: no such directory, or how many of the four files."""
    partial = env / "partial"
    partial.mkdir()
    write_idx(partial / "train-images-idx3-ubyte.gz", np.zeros((2, 28, 28), np.uint8))
    write_idx(partial / "train-labels-idx1-ubyte", np.zeros(2, np.uint8))
    write_idx(partial / "t10k-labels-idx1-ubyte.gz", np.zeros(2, np.uint8))
    how = fmnist.HOW_TO_GET
    for path, first in ((env / "nowhere", "no such directory"), (partial, "3 of 4 files")):
        with pytest.raises(DataError) as info:
            fmnist.load_fmnist(path)
        assert _one_line(info) == (f"dataset fmnist (Fashion-MNIST) not found (looked in: {path} ({first}); "
                                   f"{path / 'fashion-mnist'} (no such directory); {path / 'FashionMNIST' / 'raw'} "
                                   f"(no such directory)); {how}")  # fmt: skip


def _fake_fetch(monkeypatch: pytest.MonkeyPatch, build) -> list[tuple[tuple, Path]]:
    """`store.fetch` replaced by one that writes a fixture copy with `build(dest)`; the calls it got."""
    calls: list[tuple[tuple, Path]] = []

    def fetch(remotes, dest):
        calls.append((tuple(remotes), Path(dest)))
        build(Path(dest))
        return Path(dest)

    monkeypatch.setattr(store, "fetch", fetch)
    return calls


DOWNLOADS = {  # name: (load with download=True, fixture into dest, the remotes, where the copy lands under dest)
    "cifar10": (lambda p: cifar.load_cifar10(p, download=True), fx.make_cifar10,
                (cifar.SPECS["cifar10"]["remote"],), "cifar-10-batches-py"),
    "cifar100": (lambda p: cifar.load_cifar100(p, download=True), fx.make_cifar100,
                 (cifar.SPECS["cifar100"]["remote"],), "cifar-100-python"),
    "cifar10c": (lambda p: cifar10c.load_cifar10c(p, download=True, corruptions=["fog"]),
                 lambda d: fx.make_cifar10c(d, per_severity=2, corruptions=("fog",)), (cifar10c.REMOTE,), "CIFAR-10-C"),
    "mnist": (lambda p: mnist.load_mnist(p, download=True), fx.make_mnist, mnist.remotes(), ""),
    "emnist": (lambda p: emnist.load_emnist(p, download=True), lambda d: fx.make_emnist(d, split="balanced"),
               (emnist.REMOTE,), "gzip"),
    "fmnist": (lambda p: fmnist.load_fmnist(p, download=True), make_fmnist_dir, tuple(fmnist.remotes()), ""),
}  # fmt: skip


@pytest.mark.parametrize("name", DOWNLOADS)
def test_download_true_fetches_the_dataset_s_remotes_into_path_and_loads_them(env, monkeypatch, name):
    """`download=True` with nothing found fetches the dataset's pinned remotes, once, into `path`, and the load is
    of that copy."""
    load, build, remotes, top = DOWNLOADS[name]
    calls = _fake_fetch(monkeypatch, build)
    source = load(env / "dl")
    assert calls == [(remotes, env / "dl")]
    assert source.origin == str(env / "dl" / top if top else env / "dl") and len(source.train) > 0


def test_mnist_remotes_are_the_mirror_s_files_with_their_sha256() -> None:
    mirror = "https://ossci-datasets.s3.amazonaws.com/mnist/"
    assert mnist.remotes() == tuple(store.Remote(mirror + n, f"sha256:{d}") for n, d in mnist.SHA256.items())
    assert [r.name for r in mnist.remotes()] == [f"{s}.gz" for pair in mnist.FILES.values() for s in pair]


def test_fashion_mnist_download_failure_is_one_line_with_the_manual_route(env, monkeypatch) -> None:
    """A failed download names the dataset and the cause, and offers the manual route without the download that
    just failed."""

    def failing(remotes, dest):
        raise DataError("train-images-idx3-ubyte.gz: download failed (boom)")

    monkeypatch.setattr(store, "fetch", failing)
    with pytest.raises(DataError) as info:
        fmnist.load_fmnist(env / "dl", download=True)
    manual = fmnist.HOW_TO_GET.removesuffix(", or load with download=True")
    assert _one_line(info) == ("dataset fmnist (Fashion-MNIST): train-images-idx3-ubyte.gz: download failed (boom); "
                               f"instead, {manual}")  # fmt: skip
    assert "download=True" not in manual


def test_fashion_mnist_downloads_go_to_dest_dir_or_the_cache(env, monkeypatch) -> None:
    """`download_fmnist(dest_dir)` fetches the four pinned files into `dest_dir` (`~` expanded), and without one into
    `cache_dir()`: `$PFLBED_CACHE/fashion-mnist`, else `~/.cache/pflbed/fashion-mnist`."""
    calls = _fake_fetch(monkeypatch, lambda d: None)
    monkeypatch.setenv("HOME", str(env / "home"))
    assert fmnist.download_fmnist(env / "dl") == env / "dl"
    assert fmnist.download_fmnist("~/there") == env / "home" / "there"
    monkeypatch.setenv("PFLBED_CACHE", str(env / "c"))
    assert fmnist.cache_dir() == env / "c" / "fashion-mnist" == fmnist.download_fmnist()
    monkeypatch.setenv("PFLBED_CACHE", "~/c2")
    assert fmnist.cache_dir() == env / "home" / "c2" / "fashion-mnist"
    for unset in (lambda: monkeypatch.delenv("PFLBED_CACHE"), lambda: monkeypatch.setenv("PFLBED_CACHE", "")):
        unset()
        assert fmnist.cache_dir() == env / "home" / ".cache" / "pflbed" / "fashion-mnist"
    assert [dest for _, dest in calls] == [env / "dl", env / "home" / "there", env / "c" / "fashion-mnist"]
    assert all(remotes == tuple(fmnist.remotes()) for remotes, _ in calls)


# --- caches: a file rewritten on disk is read again --------------------------------------------------------------


def test_a_cifar10c_copy_rewritten_on_disk_is_read_again(env: Path) -> None:
    d = fx.make_cifar10c(env, per_severity=5, corruptions=("fog",))
    first = cifar10c.load_cifar10c(d, corruptions=["fog"])
    fx.make_cifar10c(env, per_severity=7, corruptions=("fog",))
    again = cifar10c.load_cifar10c(d, corruptions=["fog"])
    assert (len(first.train), len(again.train)) == (5, 7)


def test_an_emnist_copy_rewritten_on_disk_is_read_again(env: Path) -> None:
    fx.make_emnist(env, split="balanced", n_train=20, n_test=10)
    first = emnist.load_emnist(env)
    fx.make_emnist(env, split="balanced", n_train=30, n_test=10)
    assert (len(first.train), len(emnist.load_emnist(env).train)) == (20, 30)


def test_a_femnist_copy_rewritten_on_disk_is_read_again(env: Path) -> None:
    fx.make_femnist_all_data(env, users=2, per_user=3, files=1)
    first = femnist.load_femnist(env)
    fx.make_femnist_all_data(env, users=3, per_user=3, files=1)
    assert (len(first.user_names), len(femnist.load_femnist(env).user_names)) == (2, 3)


def test_a_fashion_mnist_copy_rewritten_or_with_files_swapped_is_read_again(env: Path) -> None:
    """The cache key holds each file's own size and time: rewriting a file, or swapping the train and test files
    (renames keep their times and sizes, so only which name has which tells), is seen."""
    d = make_fmnist_dir(env / "fm", n_train=20, n_test=10)
    assert len(fmnist.load_fmnist(d).train) == 20
    make_fmnist_dir(d, n_train=30, n_test=10)
    assert len(fmnist.load_fmnist(d).train) == 30
    for kind in ("images-idx3", "labels-idx1"):
        train, test, tmp = (d / f"{s}-{kind}-ubyte.gz" for s in ("train", "t10k", "tmp"))
        os.replace(train, tmp)
        os.replace(test, train)
        os.replace(tmp, test)
    swapped = fmnist.load_fmnist(d)
    assert (len(swapped.train), len(swapped.test)) == (10, 30)


def test_fashion_mnist_sizes_and_a_copy_that_vanishes_while_loading(env, monkeypatch) -> None:
    d = make_fmnist_dir(env / "fm")
    assert fmnist.fmnist_sizes(d) == (20, 10)
    (d / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match=f"^{re.escape(str(d))}: not a complete Fashion-MNIST directory$"):
        fmnist.fmnist_sizes(d)
    monkeypatch.setattr(fmnist, "find_fmnist", lambda path: d)  # found complete, a file gone before the load
    with pytest.raises(DataError, match=f"^{re.escape(str(d))}: Fashion-MNIST files disappeared while loading$"):
        fmnist.load_fmnist(d)


# --- CIFAR ---------------------------------------------------------------------------------------------------------


def test_cifar_find_takes_path_and_a_missing_batch_is_named(env: Path) -> None:
    d = fx.make_cifar10(env)
    assert cifar.find_cifar("cifar10", env) == d and cifar.find_cifar("cifar10", env / "other") is None
    (d / "data_batch_3").rename(d / "data_batch_3.gz")  # a gzipped batch is not the format's
    with pytest.raises(DataError) as info:
        cifar.load_cifar10(env)
    assert _one_line(info) == f"{d / 'data_batch_3'}: no such file: the CIFAR-10 copy in {d} is incomplete"


def test_cifar_images_are_float32_whatever_torch_s_default_dtype(env: Path) -> None:
    """The documented x float32 must not follow a float64 default dtype a caller has set (twice the memory)."""
    d = fx.make_cifar10(env, per_batch=2, n_test=2)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        source = cifar.load_cifar10(d)
    finally:
        torch.set_default_dtype(before)
    assert source.train.x.dtype == source.test.x.dtype == torch.float32


# --- CIFAR-10-C ----------------------------------------------------------------------------------------------------


def test_cifar10c_without_corruptions_is_the_benchmark_s_15_in_order_and_the_4_extra_only_when_named(env: Path) -> None:
    """Hendrycks & Dietterich report 15 corruptions and keep gaussian_blur, saturate, spatter and speckle_noise
    apart (for validation): the default is the 15, in the files' order; all 19 when named."""
    d = fx.make_cifar10c(env, per_severity=2)
    assert cifar10c.find_cifar10c(env) == d and cifar10c.find_cifar10c(env / "other") is None
    source = cifar10c.load_cifar10c(d)
    extra = {"gaussian_blur", "saturate", "spatter", "speckle_noise"}
    benchmark = tuple(c for c in fx.CORRUPTIONS if c not in extra)
    assert source.name == "cifar10c" and source.domain_names == benchmark and len(source.train) == 30
    files = [fx.CORRUPTIONS.index(c) for c in benchmark]  # red: the file each image came from
    assert np.array_equal(raw(source, source.train.x)[:, 0, 0, 0], np.repeat(files, 2))
    every = cifar10c.load_cifar10c(d, corruptions=list(fx.CORRUPTIONS))
    assert every.domain_names == fx.CORRUPTIONS and len(every.train) == 38 and every.name.startswith("cifar10c[")
    assert np.array_equal(raw(every, every.train.x)[:, 0, 0, 0], np.repeat(np.arange(19), 2))


def test_cifar10c_severity_is_an_integer_1_to_5(env: Path) -> None:
    d = fx.make_cifar10c(env, per_severity=2, corruptions=("fog",))
    for severity in (1, 5):
        source = cifar10c.load_cifar10c(d, corruptions=["fog"], severity=severity)
        assert (raw(source, source.train.x)[:, 1, 0, 0] == severity).all()  # green: the severity's own block
    for bad in (0, 6, True, 2.0, "3"):
        with pytest.raises(DataError) as info:
            cifar10c.load_cifar10c(d, corruptions=["fog"], severity=bad)
        assert _one_line(info) == f"dataset.severity: CIFAR-10-C severities are 1..5, got {bad!r}"


@pytest.mark.parametrize("chosen", [["fog", "fog"], []])
def test_cifar10c_corruptions_must_be_one_or_more_distinct(env: Path, chosen) -> None:
    d = fx.make_cifar10c(env, per_severity=2, corruptions=("fog",))
    with pytest.raises(DataError) as info:
        cifar10c.load_cifar10c(d, corruptions=chosen)
    assert _one_line(info) == (f"dataset.corruptions: need one or more distinct corruptions, got {chosen}; "
                               f"CIFAR-10-C has {', '.join(fx.CORRUPTIONS)}")  # fmt: skip


@pytest.mark.parametrize("labels", [np.zeros(12, np.uint8), np.zeros((10, 2), np.uint8)])
def test_cifar10c_labels_not_5_severities_of_n_are_refused(env: Path, labels) -> None:
    d = fx.make_cifar10c(env, per_severity=2, corruptions=("fog",))
    np.save(d / "labels.npy", labels)
    for call in (lambda: cifar10c.sizes(d), lambda: cifar10c.load_cifar10c(d, corruptions=["fog"])):
        with pytest.raises(DataError) as info:
            call()
        assert _one_line(info) == (f"{d / 'labels.npy'}: expected 1-D labels, 5 severities × N, "
                                   f"got {list(labels.shape)}")  # fmt: skip


def test_a_cifar10c_npy_that_is_a_pickle_is_never_unpickled(env: Path) -> None:
    """`.npy` files hold plain arrays; one that is a pickle must be refused, naming it, not unpickled: even one
    holding just the right labels, and one whose unpickling would run a command must not run it."""
    d = fx.make_cifar10c(env, per_severity=2, corruptions=("fog",))
    labels = np.load(d / "labels.npy")
    (d / "labels.npy").write_bytes(pickle.dumps(labels))
    with pytest.raises(DataError) as info:
        cifar10c.load_cifar10c(d, corruptions=["fog"])
    message = _one_line(info)
    assert message.startswith(f"{d / 'labels.npy'}: not a readable .npy file, truncated? (") and "pickle" in message
    np.save(d / "labels.npy", labels)
    marker = env / "owned"
    (d / "fog.npy").write_bytes(fx.evil_pickle(f"touch {marker}"))
    with pytest.raises(DataError, match=f"^{re.escape(str(d / 'fog.npy'))}: not a readable .npy file"):
        cifar10c.load_cifar10c(d, corruptions=["fog"])
    assert not marker.exists()


def test_a_cifar10c_npy_that_is_an_npz_archive_is_refused_naming_it(env: Path) -> None:
    """np.load opens a zip archive whatever its name: an `.npz` saved as `labels.npy` is one line, not a traceback."""
    d = fx.make_cifar10c(env, per_severity=2, corruptions=("fog",))
    with (d / "labels.npy").open("wb") as fh:
        np.savez(fh, labels=np.load(d / "fog.npy")[:, 0, 0, 2])
    with pytest.raises(DataError) as info:
        cifar10c.load_cifar10c(d, corruptions=["fog"])
    assert _one_line(info) == f"{d / 'labels.npy'}: an .npz archive, not the .npy array CIFAR-10-C ships"


# --- MNIST / EMNIST -----------------------------------------------------------------------------------------------


def test_mnist_find_sizes_and_a_missing_file_is_named(env: Path) -> None:
    d = fx.make_mnist(env / "MNIST" / "raw", n_train=40, n_test=20)
    assert mnist.find_mnist(env) == d and mnist.find_mnist(env / "other") is None
    assert mnist.idx_sizes(d, mnist.FILES, "MNIST") == (40, 20)
    assert mnist.load_mnist(env).train.y.dtype == torch.int64
    (d / "t10k-labels-idx1-ubyte.gz").unlink()
    stem = d / "t10k-labels-idx1-ubyte"
    incomplete = f"{stem}: no such file (nor t10k-labels-idx1-ubyte.gz): the MNIST copy in {d} is incomplete"
    for call in (lambda: mnist.idx_sizes(d, mnist.FILES, "MNIST"), lambda: mnist.load_mnist(env)):
        with pytest.raises(DataError) as info:
            call()
        assert _one_line(info) == incomplete


def test_emnist_defaults_to_balanced_and_a_missing_file_is_named(env: Path) -> None:
    d = fx.make_emnist(env, split="balanced", n_train=20, n_test=10)
    assert emnist.find_emnist(env) == d and emnist.sizes(d) == (20, 10)
    source = emnist.load_emnist(env)
    assert source.name == "emnist-balanced" and source.num_classes == 47
    assert source.train.y.dtype == source.test.y.dtype == torch.int64
    (d / "emnist-balanced-test-labels-idx1-ubyte.gz").unlink()
    stem = d / "emnist-balanced-test-labels-idx1-ubyte"
    for call, title in ((lambda: emnist.sizes(d), "EMNIST"), (lambda: emnist.load_emnist(env), "EMNIST balanced")):
        with pytest.raises(DataError) as info:
            call()
        assert _one_line(info) == (f"{stem}: no such file (nor {stem.name}.gz): the {title} copy in {d} "
                                   "is incomplete")  # fmt: skip


def test_idx_files_under_the_dotted_names_unpackers_restore_are_found(env: Path) -> None:
    """MNIST's `.gz` files store `train-images.idx3-ubyte` inside, the name 7-Zip and desktop unpackers restore:
    each IDX loader finds its files under that spelling too, the same arrays as under the archive's names."""
    loaders = (("mnist", fx.make_mnist, mnist.load_mnist), ("fmnist", make_fmnist_dir, fmnist.load_fmnist),
               ("emnist", lambda d: fx.make_emnist(d, split="balanced"), emnist.load_emnist))  # fmt: skip
    for name, make, load in loaders:
        src = make(env / name / "as-published")
        ref = load(env / name / "as-published")
        dotted = env / name / "unpacked"
        dotted.mkdir(parents=True)
        for f in src.iterdir():
            raw = gzip.decompress(f.read_bytes())
            (dotted / f.name.removesuffix(".gz").replace("-idx", ".idx")).write_bytes(raw)
        assert all(".idx" in f.name and "-idx" not in f.name for f in dotted.iterdir())
        got = load(dotted)
        assert got.origin == str(dotted), name
        assert torch.equal(got.train.x, ref.train.x) and torch.equal(got.test.y, ref.test.y), name


def test_emnist_and_fashion_mnist_are_found_in_torchvision_s_folders(env: Path) -> None:
    """torchvision keeps EMNIST's unpacked files in `<root>/EMNIST/raw/` and Fashion-MNIST's in
    `<root>/FashionMNIST/raw/` (MNIST's `MNIST/raw/` is tested above): `dataset.path=<root>` finds both."""
    gz = fx.make_emnist(env / "tmp", split="balanced", n_train=20, n_test=10)
    (env / "EMNIST").mkdir()
    gz.rename(env / "EMNIST" / "raw")
    assert emnist.find_emnist(env) == env / "EMNIST" / "raw" and len(emnist.load_emnist(env).train) == 20
    d = make_fmnist_dir(env / "tv" / "FashionMNIST" / "raw", gz=False)
    assert fmnist.find_fmnist(env / "tv") == d and fmnist.load_fmnist(env / "tv").origin == str(d)


def test_emnist_unknown_split_lists_the_splits(env: Path) -> None:
    with pytest.raises(DataError) as info:
        emnist.load_emnist(env, split="words")
    splits = "byclass, bymerge, balanced, letters, digits, mnist"
    assert _one_line(info) == f"dataset.split: EMNIST splits are {splits}; got 'words'"


@pytest.mark.parametrize(("labels", "bad"), [([0, 5, 26], 0), ([1, 5, 27], 27)])
def test_an_out_of_range_label_is_the_one_named(env: Path, labels, bad) -> None:
    """The message names the offending label: one below the range (letters start at 1) or one past it, also when
    the smallest label is the range's own first."""
    d = fx.make_emnist(env, split="letters", n_train=6, n_test=3)
    victim = write_idx(d / "emnist-letters-test-labels-idx1-ubyte.gz", np.array(labels, np.uint8))
    with pytest.raises(DataError) as info:
        emnist.load_emnist(env, split="letters")
    assert _one_line(info) == f"{victim}: label {bad} out of range 1..26"


# --- FEMNIST -------------------------------------------------------------------------------------------------------


def test_femnist_find_takes_path_and_an_empty_test_split_keeps_its_types(env: Path) -> None:
    """LEAF's layout with a test shard of no writers: the test split is empty but shaped and typed like train."""
    fx.write_leaf_json(env / "train" / "a.json", {"w1": fx.femnist_user_data(1, 3)})
    fx.write_leaf_json(env / "test" / "a.json", {})
    assert femnist.find_femnist(env) == env and femnist.find_femnist(env / "other") is None
    test = femnist.load_femnist(env).test
    assert test.x.shape == (0, 1, 28, 28) and test.x.dtype == torch.float32
    assert test.y.shape == test.user.shape == (0,) and test.y.dtype == test.user.dtype == torch.int64


def test_femnist_train_without_test_is_not_leaf_s_split(env: Path, no_fetch) -> None:
    """`train/` alone is not LEAF's split: with `all_data/` beside it, all_data is used; without, nothing is found."""
    fx.write_leaf_json(env / "train" / "a.json", {"w1": fx.femnist_user_data(1, 10)})
    assert femnist.shards(env) is None
    with pytest.raises(DataError, match=f"^dataset femnist \\(FEMNIST\\) not found \\(looked in {re.escape(str(env))}"):
        femnist.load_femnist(env)
    fx.make_femnist_all_data(env, users=2, per_user=10, files=1)
    assert femnist.shards(env) == {"all": [env / "all_data" / "all_data_0.json"]}
    source = femnist.load_femnist(env)
    assert source.user_names == ("f0000_00", "f0001_01") and (len(source.train), len(source.test)) == (18, 2)


def test_femnist_labels_are_whole_numbers(env: Path) -> None:
    """JSON does not tell 1 from 1.0: whole numbers are labels (int64), but 1.5 or "3" must be refused, not cast."""
    data = fx.femnist_user_data(1, 3)
    fx.write_leaf_json(env / "all_data" / "all_data_0.json", {"w1": {**data, "y": [1.0, 2.0, 3.0]}})
    source = femnist.load_femnist(env)
    assert source.train.y.dtype == torch.int64 and sorted(torch.cat([source.train.y, source.test.y]).tolist()) == [
        1, 2, 3]  # fmt: skip
    for y in ([1.5, 2, 3], ["3", 2, 1]):
        shard = fx.write_leaf_json(env / "all_data" / "all_data_0.json", {"w1": {**data, "y": y}})
        with pytest.raises(DataError) as info:
            femnist.load_femnist(env)
        assert _one_line(info) == f"{shard}: user 'w1': x must be rows of 784 numbers, y integers"


def test_a_femnist_shard_missing_or_cut_is_named_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"^{re.escape(str(tmp_path / 'gone.json'))}: no such file$"):
        femnist._read_shard(tmp_path / "gone.json")
    cut = tmp_path / "cut.json"
    cut.write_text('{"users": [')
    with pytest.raises(DataError) as info:
        femnist._read_shard(cut)
    assert _one_line(info) == (f"{cut}: not a readable LEAF JSON shard, truncated? "
                               "(Expecting value: line 1 column 12 (char 11))")  # fmt: skip


# --- IDX ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "message"), [
    (b"\x01\x00\x08\x01\x00\x00\x00\x02ab", "bad IDX magic 0x01000801 (expected 0x0000 + dtype + ndim)"),
    (b"\x00\x00\x88\x01\x00\x00\x00\x02ab", "unknown IDX dtype code 0x88"),
    (b"\x00\x00\x08\xc8\x00\x00\x00\x02ab", "truncated IDX header (10 of 804 bytes)"),
    (fx.idx_header(0x08, (5,)) + b"abc", "truncated: payload is 3 bytes, header dims (5,) need 5"),
    (fx.idx_header(0x0B, (2,)) + b"abcde", "trailing data: payload is 5 bytes, header dims (2,) need 4"),
])  # fmt: skip
def test_an_idx_file_s_header_and_payload_faults_are_spelled_out(tmp_path: Path, data: bytes, message: str) -> None:
    """The header's bytes are unsigned (a dtype code 0x88 or 200 dimensions is not a negative number) and the message
    says exactly what is wrong."""
    path = tmp_path / "bad-ubyte"
    path.write_bytes(data)
    with pytest.raises(DataError) as info:
        idx.read_idx(path)
    assert _one_line(info) == f"{path}: {message}"


def test_an_idx_uint8_array_is_writable_and_owns_its_data(tmp_path: Path) -> None:
    array = np.arange(6, dtype=np.uint8).reshape(2, 3)
    out = idx.read_idx(write_idx(tmp_path / "a-ubyte", array))
    assert out.flags.writeable and out.flags.owndata and np.array_equal(out, array)


def test_idx_read_errors_carry_the_cause(tmp_path: Path) -> None:
    not_gzip = tmp_path / "x-ubyte.gz"
    not_gzip.write_bytes(fx.idx_header(0x08, (1,)) + b"a")
    with pytest.raises(DataError) as info:
        idx.read_idx(not_gzip)
    assert _one_line(info) == f"{not_gzip}: not a valid gzip file (Not a gzipped file (b'\\x00\\x00'))"
    assert idx._one_line(OSError("two\n  lines")) == "two lines" and idx._one_line(EOFError()) == "EOFError"


def test_idx_shape_reads_the_header_alone(tmp_path: Path) -> None:
    """Listings read only the header: a gzipped file cut in its payload still reports its dims, and a missing file
    is named."""
    payload = np.random.default_rng(0).integers(0, 256, size=(40, 28, 28), dtype=np.uint8)
    whole = gzip.compress(fx.idx_header(0x08, payload.shape) + payload.tobytes())
    cut = tmp_path / "cut-idx3-ubyte.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    assert idx.read_idx_shape(cut) == (40, 28, 28)
    with pytest.raises(DataError, match="truncated gzip"):
        idx.read_idx(cut)
    with pytest.raises(DataError, match=f"^{re.escape(str(tmp_path / 'gone'))}: no such file$"):
        idx.read_idx_shape(tmp_path / "gone")


# --- digits -------------------------------------------------------------------------------------------------------


def test_digits_default_split_is_seed_0() -> None:
    assert load_digits_source() is load_digits_source(TEST_PER_CLASS, 0)
