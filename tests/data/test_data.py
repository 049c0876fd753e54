"""Dataset layer tests: IDX parsing, Fashion-MNIST look-up and download checks, digits, synthetic.

Fashion-MNIST fixtures are tiny files written here in the real IDX format; the network is never used.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pflbed.data import DATASETS, DataSource, describe_datasets, fmnist, load_dataset, store, synthetic
from pflbed.data.digits import load_digits_source
from pflbed.data.domains import BUILTIN as BUILTIN_DOMAINS
from pflbed.data.fmnist import download_fmnist, load_fmnist
from pflbed.data.idx import read_idx, read_idx_shape
from pflbed.data.synthetic import make_synthetic
from pflbed.errors import DataError

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode `array` as IDX by hand, independently of the reader: magic, big-endian dims and data."""
    codes = {np.uint8: 0x08, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D}
    header = struct.pack(">HBB", 0, codes[array.dtype.type], array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def make_fmnist_dir(directory: Path, n_train: int = 20, n_test: int = 10, gz: bool = True) -> Path:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(directory / f"{split}-images-idx3-ubyte{suffix}", images)
        write_idx(directory / f"{split}-labels-idx1-ubyte{suffix}", labels)
    return directory


# --- IDX ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("shape", [(7, 28, 28), (7,)])
def test_idx_round_trip_uint8(tmp_path: Path, suffix: str, shape: tuple[int, ...]) -> None:
    array = np.random.default_rng(1).integers(0, 256, size=shape, dtype=np.uint8)
    path = write_idx(tmp_path / f"a-ubyte{suffix}", array)
    out = read_idx(path)
    assert out.dtype == np.uint8 and out.shape == shape
    np.testing.assert_array_equal(out, array)
    assert read_idx_shape(path) == shape


def test_idx_multibyte_types_are_big_endian(tmp_path: Path) -> None:
    arrays = (np.array([[1, -2], [300, 70000]], dtype=np.int32), np.array([0.5, -1.25], dtype=np.float32))
    for array in arrays:
        out = read_idx(write_idx(tmp_path / "m.idx", array))
        assert out.dtype.isnative and out.flags.writeable
        np.testing.assert_array_equal(out, array)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x00\x08\x01" + struct.pack(">I", 2) + b"ab", "bad IDX magic"),
        (b"\x00\x00\x07\x01" + struct.pack(">I", 2) + b"ab", "unknown IDX dtype"),
        (b"\x00\x00\x08\x00", "0 dimensions"),
        (b"\x00\x00", "too short"),
        (b"\x00\x00\x08\x02" + struct.pack(">I", 2), "truncated IDX header"),
        (b"\x00\x00\x08\x01" + struct.pack(">I", 5) + b"abc", "truncated"),
        (b"\x00\x00\x08\x01" + struct.pack(">I", 2) + b"abc", "trailing data"),
    ],
)
def test_idx_corrupt_raw(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad-ubyte"
    path.write_bytes(data)
    with pytest.raises(DataError, match=message) as info:
        read_idx(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_idx_bad_gzip_truncated_gzip_and_missing(tmp_path: Path) -> None:
    not_gzip = tmp_path / "x-ubyte.gz"
    not_gzip.write_bytes(idx_bytes(np.zeros(4, dtype=np.uint8)))
    cut = tmp_path / "cut-ubyte.gz"
    cut.write_bytes(gzip.compress(idx_bytes(np.arange(200, dtype=np.uint8)))[:-12])
    cases = ((not_gzip, "not a valid gzip"), (cut, "truncated gzip"), (tmp_path / "nope", "no such"))
    for path, message in cases:
        with pytest.raises(DataError, match=message) as info:
            read_idx(path)
        assert str(path) in str(info.value)


# --- Fashion-MNIST -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_fmnist_explicit_path(isolated_env: Path, gz: bool) -> None:
    directory = make_fmnist_dir(isolated_env / "fm", gz=gz)
    source = load_fmnist(str(directory))
    assert source.name == "fmnist" and source.num_classes == 10 and source.origin == str(directory)
    assert source.train.x.shape == (20, 1, 28, 28) and source.test.x.shape == (10, 1, 28, 28)
    assert source.train.x.dtype == torch.float32 and source.train.y.dtype == torch.int64
    lo, hi = (0 - fmnist.MEAN) / fmnist.STD, (1 - fmnist.MEAN) / fmnist.STD
    assert lo - 1e-5 <= float(source.train.x.min()) and float(source.train.x.max()) <= hi + 1e-5
    assert torch.equal(source.test.y, torch.arange(10))
    assert load_fmnist(str(directory)) is source  # cached: same files, same object


def test_fmnist_via_env_var_dir_and_subdir(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    direct = make_fmnist_dir(isolated_env / "direct")
    monkeypatch.setenv("PFLBED_DATA", str(direct))
    assert load_dataset("fmnist").origin == str(direct)
    root = isolated_env / "root"
    make_fmnist_dir(root / "fashion-mnist", n_train=30)
    monkeypatch.setenv("PFLBED_DATA", str(root))
    source = load_dataset("fmnist")
    assert source.origin == str(root / "fashion-mnist") and len(source.train) == 30


def test_fmnist_missing_names_places_and_remedy(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PFLBED_DATA", str(isolated_env / "elsewhere"))
    with pytest.raises(DataError) as info:
        load_fmnist()
    message = str(info.value)
    assert "\n" not in message and message.startswith("dataset fmnist (Fashion-MNIST) not found (looked in: ")
    remedies = ("apt-get install dataset-fashion-mnist", "PFLBED_DATA")
    for expected in ("elsewhere", "no-debian", "cache", *remedies):
        assert expected in message


def test_fmnist_count_mismatch(isolated_env: Path) -> None:
    directory = make_fmnist_dir(isolated_env / "fm")
    write_idx(directory / "t10k-labels-idx1-ubyte.gz", np.zeros(9, dtype=np.uint8))
    with pytest.raises(DataError, match="10 images but t10k-labels-idx1-ubyte.gz has 9 labels"):
        load_fmnist(directory)


def test_fmnist_listing_does_not_download(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "_download", lambda *a, **k: pytest.fail("network used"))
    rows = {row["name"]: row for row in describe_datasets()}
    assert set(rows) == set(DATASETS) | set(BUILTIN_DOMAINS)
    assert rows["fmnist"]["location"].startswith("not found: ") and rows["fmnist"]["train"] is None
    assert "dataset-fashion-mnist" in rows["fmnist"]["location"]  # the one line that says how to get it
    assert rows["digits"]["train"] == 1497 and rows["digits"]["test"] == 300
    directory = make_fmnist_dir(isolated_env / "fm")
    monkeypatch.setenv("PFLBED_DATA", str(directory))
    fm = next(row for row in describe_datasets() if row["name"] == "fmnist")
    assert (fm["location"], fm["train"], fm["test"]) == (str(directory), 20, 10)


def _mirror(directory: Path, payloads: dict[str, bytes]) -> str:
    """A local `file://` mirror holding `payloads`; its base URL."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in payloads.items():
        (directory / name).write_bytes(data)
    return directory.as_uri() + "/"


def test_download_rejects_wrong_checksum(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _mirror(isolated_env / "mirror", {name: b"not the dataset" for name in fmnist.SHA256})
    monkeypatch.setattr(fmnist, "BASE_URL", base)
    dest = isolated_env / "dl"
    with pytest.raises(DataError, match="SHA256 checksum mismatch") as info:
        download_fmnist(dest)
    assert "train-images-idx3-ubyte.gz" in str(info.value) and "\n" not in str(info.value)
    assert not dest.exists()  # neither the bad file, its temporary copy, nor the directory is left behind


def test_download_keeps_verified_files(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = {name: f"payload {name}".encode() for name in fmnist.SHA256}
    monkeypatch.setattr(fmnist, "SHA256", {n: hashlib.sha256(p).hexdigest() for n, p in payloads.items()})
    monkeypatch.setattr(fmnist, "BASE_URL", _mirror(isolated_env / "mirror", payloads))
    fetched: list[str] = []
    real = store._download

    def counting(url: str, *args: Any, **kwargs: Any) -> Any:
        fetched.append(url)
        return real(url, *args, **kwargs)

    monkeypatch.setattr(store, "_download", counting)
    dest = download_fmnist(isolated_env / "dl")
    assert sorted(p.name for p in dest.iterdir()) == sorted(payloads)
    assert len(fetched) == 4
    download_fmnist(dest)  # verified files already present are not fetched again
    assert len(fetched) == 4


# Gzip header fields Debian's packaging normalized: file name -> (mtime, MD5 from the upstream README).
UPSTREAM = {
    "train-images-idx3-ubyte.gz": (1504176606, "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
    "train-labels-idx1-ubyte.gz": (1504176606, "25c81989df183df01b3e8a0aad5dffbe"),
    "t10k-images-idx3-ubyte.gz": (1504176627, "bef4ecab320f06d8554ea6380940ec79"),
    "t10k-labels-idx1-ubyte.gz": (1504176627, "bb300cfdad3c16e7a12a480ee83cd310"),
}


@pytest.mark.skipif(not DEBIAN_DIR.is_dir(), reason="dataset-fashion-mnist not installed")
def test_pinned_sha256_match_upstream_files() -> None:
    """Provenance of `fmnist.SHA256`: restoring the gzip header fields Debian normalized (FNAME, MTIME)
    turns each packaged file back into the upstream one, proven by the README's MD5; its SHA-256 is pinned."""
    for name, (mtime, md5) in UPSTREAM.items():
        packaged = (DEBIAN_DIR / name).read_bytes()
        assert packaged[:4] == b"\x1f\x8b\x08\x00"  # gzip, deflate, no FNAME
        upstream = b"\x1f\x8b\x08\x08" + struct.pack("<I", mtime) + packaged[8:10]
        upstream += name.removesuffix(".gz").encode() + b"\0" + packaged[10:]
        assert hashlib.md5(upstream).hexdigest() == md5
        assert hashlib.sha256(upstream).hexdigest() == fmnist.SHA256[name]


@pytest.mark.skipif(not DEBIAN_DIR.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist() -> None:
    source = load_fmnist(DEBIAN_DIR)
    assert (len(source.train), len(source.test)) == (60000, 10000)
    assert source.input_shape == (1, 28, 28)
    assert torch.equal(torch.bincount(source.test.y, minlength=10), torch.full((10,), 1000))
    assert abs(float(source.train.x.mean())) < 1e-3 and abs(float(source.train.x.std()) - 1) < 1e-3


# --- digits and synthetic ----------------------------------------------------------------------------------


def test_digits_shapes_and_balanced_split() -> None:
    source = load_dataset("digits", test_per_class=20, seed=3)
    assert source.origin == "scikit-learn (bundled)" and source.num_classes == 10
    assert source.train.x.shape == (1797 - 200, 1, 8, 8) and source.test.x.shape == (200, 1, 8, 8)
    assert source.train.x.dtype == torch.float32 and source.test.y.dtype == torch.int64
    assert torch.equal(torch.bincount(source.test.y, minlength=10), torch.full((10,), 20))
    assert load_digits_source(20, 3) is source
    other = load_digits_source(test_per_class=20, seed=4)
    assert not torch.equal(other.test.x, source.test.x)
    with pytest.raises(DataError, match="test_per_class"):
        load_digits_source(test_per_class=500)


def test_digits_samples_are_scikit_learn_s_images_and_labels_normalized_by_the_stated_mean_and_std() -> None:
    """Every sample, mapped back through `pixel_norm` and `raw_scale`, is one of scikit-learn's 8×8 images (0…16)
    with its own label, each image once over the two splits; `inputs` maps a raw image as the loader did."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    source = load_digits_source(test_per_class=20, seed=3)
    mean, std = source.pixel_norm
    assert source.raw_scale == 16.0 and (mean, std) == (pytest.approx(0.3053), pytest.approx(0.3760))
    x = torch.cat([source.train.x, source.test.x])[:, 0].double()
    raw = (x * std + mean) * 16
    assert torch.allclose(raw, raw.round(), atol=1e-4)  # whole 0…16 values: the stated scale and normalization
    ours = {(img.round().to(torch.int64).numpy().tobytes(), int(y))
            for img, y in zip(raw, torch.cat([source.train.y, source.test.y]), strict=True)}
    theirs = {(np.asarray(img, np.int64).tobytes(), int(y)) for img, y in zip(bunch.images, bunch.target, strict=True)}
    assert len(x) == len(bunch.images) and ours == theirs
    assert torch.allclose(source.inputs(raw[:5].round().numpy()), source.train.x[:5], atol=1e-6)


def test_synthetic_shapes_balance_and_determinism() -> None:
    source = make_synthetic(num_classes=4, n_train=100, n_test=43, shape=[3, 5], seed=7)
    assert source.origin == "generated" and source.input_shape == (3, 5) and source.num_classes == 4
    assert len(source.train) == 100 and len(source.test) == 40
    assert torch.equal(torch.bincount(source.test.y), torch.full((4,), 10))
    assert source.train.x.dtype == torch.float32 and source.train.y.dtype == torch.int64
    assert load_dataset("synthetic", num_classes=4, n_train=100, n_test=43, shape=(3, 5), seed=7) is source
    fresh = regenerate_uncached(num_classes=4, n_train=100, n_test=43, shape=(3, 5), seed=7)
    assert fresh is not source
    assert torch.equal(fresh.train.x, source.train.x) and torch.equal(fresh.test.y, source.test.y)
    other = make_synthetic(num_classes=4, n_train=100, n_test=43, shape=(3, 5), seed=8)
    assert not torch.equal(other.train.x, source.train.x)


def test_synthetic_defaults_are_10_classes_of_2000_and_500_8x8_samples_from_seed_0() -> None:
    source = make_synthetic()
    assert (source.num_classes, len(source.train), len(source.test), source.input_shape) == (10, 2000, 500, (1, 8, 8))
    same = make_synthetic(num_classes=10, n_train=2000, n_test=500, shape=(1, 8, 8), seed=0, separation=2.0)
    assert torch.equal(same.train.x, source.train.x)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_classes": 1}, "num_classes must be at least 2, got 1"),
    ({"num_classes": 3, "n_train": 2}, r"n_train \(2\) must be at least num_classes \(3\)"),
    ({"num_classes": 3, "n_test": 2}, r"n_test \(2\) must be at least num_classes \(3\)"),
    ({"shape": ()}, r"shape must be non-empty positive sizes, got \[\]"),
    ({"shape": (1, 0, 8)}, r"shape must be non-empty positive sizes, got \[1, 0, 8\]"),
    ({"separation": -0.5}, "separation must be >= 0, got -0.5"),
])  # fmt: skip
def test_synthetic_refuses_what_cannot_be_generated_naming_the_argument(kwargs, message) -> None:
    with pytest.raises(DataError, match=f"^synthetic: {message}$"):
        make_synthetic(**kwargs)


def test_synthetic_takes_each_bound_itself() -> None:
    """Two classes, as many samples as classes, and classes that coincide (separation 0) are all generated."""
    source = make_synthetic(num_classes=2, n_train=2, n_test=2, shape=(1,), separation=0.0)
    assert sorted(source.train.y.tolist()) == [0, 1] and sorted(source.test.y.tolist()) == [0, 1]


def test_synthetic_samples_drawn_in_chunks_are_those_of_one_draw(monkeypatch) -> None:
    """`_dataset` draws a few rows at a time (its float64 working set bounded): chunks of one row, of three rows
    ending in a partial chunk, and one chunk of every row give the same samples, bit for bit."""
    kwargs = {"num_classes": 3, "n_train": 10, "n_test": 6, "shape": (2, 3), "seed": 4}
    monkeypatch.setattr(synthetic, "CHUNK_VALUES", 10**9)
    whole = regenerate_uncached(**kwargs)
    for values in (1, 18):  # 6 values a row: one row, three rows (10 = 3 + 3 + 3 + 1)
        monkeypatch.setattr(synthetic, "CHUNK_VALUES", values)
        chunked = regenerate_uncached(**kwargs)
        assert torch.equal(chunked.train.x, whole.train.x) and torch.equal(chunked.test.x, whole.test.x)
        assert torch.equal(chunked.train.y, whole.train.y)
    synthetic._generate.cache_clear()


def test_the_config_bounds_generated_data_at_4_gib_of_float32() -> None:
    """(n_train + n_test) × the shape's size may be 2**30 values, not one sample more, and the error names the
    field: `benchmarks/gpu.py`'s 64 px shape (62,500 + 1,000 samples of 3×64×64) is in bounds."""
    from pflbed.config import validate_config
    from pflbed.errors import ConfigError

    def cfg(n_train: int, shape: list[int]):
        return validate_config({"dataset": {"name": "synthetic",
                                            "synthetic": {"shape": shape, "n_train": n_train, "n_test": 500}}})

    assert cfg(2**15 - 500, [2, 2**14]).dataset.synthetic.n_train == 2**15 - 500
    cfg(63_000, [3, 64, 64])  # 62,500 + 1,000 samples, as 63,000 + 500
    with pytest.raises(ConfigError, match=r"^dataset.synthetic: \(n_train \+ n_test\) × the shape's size must be at "
                       r"most 1,073,741,824 values \(4 GiB of float32\)$"):  # fmt: skip
        cfg(2**15 - 500 + 1, [2, 2**14])


def regenerate_uncached(**kwargs: Any) -> DataSource:
    """Generate bypassing the in-process cache, to prove determinism comes from the seed, not the cache."""
    synthetic._generate.cache_clear()
    return make_synthetic(**kwargs)


def test_registry_errors() -> None:
    with pytest.raises(DataError, match="known datasets: .*digits, .*fmnist, folder, hf, .*synthetic"):
        load_dataset("kmnist")
    with pytest.raises(DataError, match="unknown option"):
        load_dataset("synthetic", classes=3)
    with pytest.raises(DataError, match="takes no path"):
        load_dataset("digits", path="/tmp")


@pytest.mark.parametrize(("n", "fraction", "held"), [(0, 0.1, 0), (1, 0.1, 0), (2, 0.1, 1), (3, 0.1, 1), (20, 0.1, 2),
                                                     (10, 0.99, 9), (10, 0.5, 5)])  # fmt: skip
def test_a_user_s_held_out_samples_are_a_rounded_fraction_at_least_one_never_all(n, fraction, held):
    """`arrays.held_out` (FEMNIST's and FLICKR-AES's per-user test split): round(fraction · n), at least one of two
    or more, never all; the same draw for the same (seed, rank), another for another rank."""
    from pflbed.data.arrays import held_out

    mask = held_out(n, fraction, 0, 3)
    assert mask.dtype == bool and mask.shape == (n,) and int(mask.sum()) == held
    assert np.array_equal(mask, held_out(n, fraction, 0, 3))
    if n == 20:
        assert not np.array_equal(mask, held_out(n, fraction, 0, 4))
