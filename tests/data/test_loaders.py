"""File-format loaders (CIFAR, CIFAR-10-C, MNIST, EMNIST, FEMNIST, FLICKR-AES, Tiny ImageNet, miniImageNet,
Office-Home / PACS / DomainNet) on small files written in each published format (`tests/data_formats.py`).

The fixtures' pixels encode what they are (label, row, column, channel, severity, writer), so a loader that
swaps channels, transposes, mislabels or shifts a split fails here. Downloads go to `file://` mirrors only.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pflbed.cli import main
from pflbed.data import (
    DATASETS,
    cifar,
    cifar10c,
    describe_datasets,
    emnist,
    load_dataset,
    store,
    tinyimagenet,
)
from pflbed.data.arrays import DataSource, held_out
from pflbed.data.catalog import DESCRIBE
from pflbed.data.safepickle import load_pickle
from pflbed.errors import ConfigError, DataError

from .. import data_formats as fx


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache and no PFLBED_DATA: look-ups see only what a test writes."""
    monkeypatch.delenv("PFLBED_DATA", raising=False)
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path / "cache"))
    return tmp_path


def raw(source: DataSource, x: torch.Tensor) -> np.ndarray:
    """Model inputs back to 0–255 pixels (rounded), [N, C, H, W]."""
    mean, std = source.pixel_norm
    return np.rint((x.numpy() * std + mean) * source.raw_scale).astype(np.int64)


def one_line_naming(exc: pytest.ExceptionInfo, path: Path | str) -> str:
    message = str(exc.value)
    assert str(path) in message and "\n" not in message, message
    return message


# --- CIFAR -----------------------------------------------------------------------------------------------------


def test_cifar10_channels_orientation_labels_and_order(env: Path) -> None:
    d = fx.make_cifar10(env / "c10", per_batch=20, n_test=20)
    source = load_dataset("cifar10", path=d)
    assert source.name == "cifar10" and source.num_classes == 10 and source.origin == str(d)
    assert source.train.x.shape == (100, 3, 32, 32) and source.test.x.shape == (20, 3, 32, 32)
    # batch b (0-based) holds labels (j + b) % 10, in file order data_batch_1 … 5
    expected = np.concatenate([(np.arange(20) + b) % 10 for b in range(5)])
    assert np.array_equal(source.train.y.numpy(), expected)
    assert np.array_equal(source.test.y.numpy(), (np.arange(20) + 5) % 10)
    px = raw(source, source.train.x)
    assert np.array_equal(px[:, 0], np.broadcast_to(expected[:, None, None], (100, 32, 32)))  # red = label
    assert np.array_equal(px[7, 1], np.broadcast_to((np.arange(32) * 4)[:, None], (32, 32)))  # green = row
    assert np.array_equal(px[7, 2], np.broadcast_to((np.arange(32) * 8 + 7)[None, :], (32, 32)))  # blue = column
    assert load_dataset("cifar10", path=d) is source  # cached per unchanged files


def test_cifar100_fine_and_coarse_labels(env: Path) -> None:
    fx.make_cifar100(env, n_train=200, n_test=100)
    fine = load_dataset("cifar100", path=env / "cifar-100-python")
    coarse = load_dataset("cifar100", path=env, label="coarse")  # the archive's folder is found inside path
    assert (fine.num_classes, coarse.num_classes, coarse.name) == (100, 20, "cifar100-coarse")
    assert np.array_equal(fine.train.y.numpy(), np.arange(200) % 100)
    assert np.array_equal(coarse.train.y.numpy(), np.arange(200) % 100 // 5)
    assert np.array_equal(raw(fine, fine.test.x)[:, 0, 5, 5], np.arange(100))
    assert torch.equal(fine.train.x, coarse.train.x)
    with pytest.raises(DataError, match="cifar100 has labels fine or coarse"):
        load_dataset("cifar100", path=env, label="middle")


def test_malicious_pickle_is_refused_and_never_run(env: Path) -> None:
    d = fx.make_cifar10(env / "c10")
    marker = env / "owned"
    (d / "data_batch_2").write_bytes(fx.evil_pickle(f"touch {marker}"))
    with pytest.raises(DataError, match="refused: the pickle calls (posix|os|nt).system") as info:
        load_dataset("cifar10", path=d)
    one_line_naming(info, d / "data_batch_2")
    assert not marker.exists()
    assert main(["data", "show", "--set", "dataset.name=cifar10", "--set", f"dataset.path={d}"]) == 2


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_cifar_truncated_or_missing_batch_is_named(env: Path, capsys, damage: str) -> None:
    d = fx.make_cifar10(env / "c10")
    victim = d / "data_batch_3"
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:5000])
    else:
        victim.unlink()
    expected = "truncated or corrupt pickle" if damage == "truncate" else "no such file"
    with pytest.raises(DataError, match=expected) as i:
        load_dataset("cifar10", path=d)
    one_line_naming(i, victim)
    assert main(["data", "show", "--set", "dataset.name=cifar10", "--set", f"dataset.path={d}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pflbed: error: ") and str(victim) in err and expected in err and "\n" not in err


def test_safepickle_reads_numpy_pickles_of_today(tmp_path: Path) -> None:
    """Protocol 2 to 5 pickles of arrays (as Python 3 writes them: miniImageNet's cache) load; the values match."""
    import pickle

    blob = {"image_data": np.arange(24, dtype=np.uint8).reshape(2, 2, 2, 3), "class_dict": {"n1": [0, 1]}}
    for protocol in (2, 4, 5):
        path = tmp_path / f"p{protocol}.pkl"
        path.write_bytes(pickle.dumps(blob, protocol=protocol))
        got = load_pickle(path, "test")
        assert np.array_equal(got["image_data"], blob["image_data"]) and got["class_dict"] == {"n1": [0, 1]}


# --- downloads (file:// mirrors) --------------------------------------------------------------------------------


def _mirror_cifar10(env: Path, monkeypatch: pytest.MonkeyPatch, digest: str | None = None, cut: int = 0) -> Path:
    src = fx.make_cifar10(env / "src")
    (env / "mirror").mkdir()
    archive = fx.tar_gz(src, env / "mirror" / "cifar-10-python.tar.gz")
    if cut:
        archive.write_bytes(archive.read_bytes()[:-cut])
    md5 = digest or hashlib.md5(archive.read_bytes()).hexdigest()
    spec = {**cifar.SPECS["cifar10"], "remote": store.Remote(archive.as_uri(), f"md5:{md5}")}
    monkeypatch.setitem(cifar.SPECS, "cifar10", spec)
    return archive


def test_download_fetches_verifies_unpacks_once(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _mirror_cifar10(env, monkeypatch)
    calls: list[str] = []
    real = store._download
    monkeypatch.setattr(store, "_download", lambda url, *a, **k: calls.append(url) or real(url, *a, **k))
    source = load_dataset("cifar10", download=True)
    cache = env / "cache" / "cifar10"
    assert source.origin == str(cache / "cifar-10-batches-py") and len(source.train) == 100
    assert sorted(p.name for p in cache.iterdir()) == ["cifar-10-batches-py"]  # the archive is gone once unpacked
    assert load_dataset("cifar10", download=True) is source and len(calls) == 1  # found: not fetched again


@pytest.mark.parametrize("fault", ["checksum", "truncated"])
def test_bad_download_leaves_nothing_and_exits_2(env: Path, monkeypatch: pytest.MonkeyPatch, capfd, fault: str):
    """(`capfd`: what reaches the terminal, also from a library's log handler bound to the stream at its import.)"""
    if fault == "checksum":
        archive = _mirror_cifar10(env, monkeypatch, digest="0" * 32)
        expected = "MD5 checksum mismatch"
    else:  # a pinned digest that matches a truncated archive: unpacking must still fail cleanly
        archive = _mirror_cifar10(env, monkeypatch, cut=3000)
        expected = "truncated or corrupt archive"
    with pytest.raises(DataError, match=expected) as info:
        load_dataset("cifar10", download=True)
    one_line_naming(info, archive.name)
    assert not (env / "cache" / "cifar10").exists()  # no archive, no temporary file, no half-unpacked folder
    capfd.readouterr()
    rc = main(["data", "show", "--set", "dataset.name=cifar10", "--set", "dataset.download=true"])
    err = capfd.readouterr().err.strip()
    assert rc == 2 and expected in err and archive.name in err and "\n" not in err
    assert not (env / "cache" / "cifar10").exists()


def test_download_of_a_zip_into_path(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = fx.make_tinyimagenet(env / "src", size=8)
    archive = fx.zip_dir(src, env / "tiny-imagenet-200.zip")
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    monkeypatch.setattr(tinyimagenet, "REMOTE", store.Remote(archive.as_uri(), f"md5:{md5}"))
    source = load_dataset("tinyimagenet", path=env / "dest", download=True, image_size=8)
    assert source.origin == str(env / "dest" / "tiny-imagenet-200") and len(source.train) == 18


def test_no_official_archive_says_how_to_get_it(env: Path) -> None:
    with pytest.raises(DataError, match="no official archive.*LEAF"):
        load_dataset("femnist", download=True)


# --- look-up ----------------------------------------------------------------------------------------------------


def test_lookup_order_path_then_env_then_cache(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fx.make_mnist(env / "cache" / "mnist", n_train=10)
    assert load_dataset("mnist").origin == str(env / "cache" / "mnist")
    fx.make_mnist(env / "data" / "mnist" / "MNIST" / "raw", n_train=20)
    monkeypatch.setenv("PFLBED_DATA", str(env / "data"))
    assert len(load_dataset("mnist").train) == 20
    fx.make_mnist(env / "mine", n_train=30)
    assert len(load_dataset("mnist", path=env / "mine").train) == 30
    with pytest.raises(DataError, match="dataset mnist .*not found .*looked in .*nowhere.*download=true"):
        load_dataset("mnist", path=env / "nowhere")


# --- CIFAR-10-C -------------------------------------------------------------------------------------------------


def test_cifar10c_domains_severity_pixels(env: Path) -> None:
    d = fx.make_cifar10c(env, per_severity=20, corruptions=("fog", "snow", "brightness"))
    source = load_dataset("cifar10c", path=d, corruptions=["snow", "fog"], severity=2)
    assert source.domain_names == ("snow", "fog") and source.num_classes == 10 and len(source.test) == 0
    assert source.train.x.shape == (40, 3, 32, 32)
    assert np.array_equal(source.train.domain.numpy(), np.repeat([0, 1], 20))
    px = raw(source, source.train.x)
    corruption = np.repeat([fx.CORRUPTIONS.index("snow"), fx.CORRUPTIONS.index("fog")], 20)
    assert np.array_equal(px[:, 0, 0, 0], corruption)  # red: which file
    assert (px[:, 1, 0, 0] == 2).all()  # green: the severity-2 block, not another
    assert np.array_equal(px[:, 2, 0, 0], source.train.y.numpy())  # blue: the image's own label
    assert np.array_equal(source.train.y.numpy(), np.tile(np.arange(20) % 10, 2))
    assert (px[:, :, 1, 0] == 200).all() and (px[:, :, 0, 1] == 100).all()  # upright, channels last → first


def test_cifar10c_options_and_damage(env: Path) -> None:
    d = fx.make_cifar10c(env, per_severity=5, corruptions=("fog",))
    with pytest.raises(DataError, match="dataset.corruptions: unknown \\['smog'\\]"):
        load_dataset("cifar10c", path=d, corruptions=["smog"])
    with pytest.raises(DataError, match="dataset.severity"):
        load_dataset("cifar10c", path=d, corruptions=["fog"], severity=6)
    with pytest.raises(DataError, match="no such file") as info:
        load_dataset("cifar10c", path=d, corruptions=["fog", "snow"])
    one_line_naming(info, d / "snow.npy")
    (d / "fog.npy").write_bytes((d / "fog.npy").read_bytes()[:1000])
    with pytest.raises(DataError, match="truncated") as info:
        load_dataset("cifar10c", path=d, corruptions=["fog"])
    one_line_naming(info, d / "fog.npy")


def test_cifar10c_runs_the_pflbed_protocol(env: Path, capsys) -> None:
    d = fx.make_cifar10c(env, per_severity=200, corruptions=("fog", "snow"))
    args = ["--set", "dataset.name=cifar10c", "--set", f"dataset.path={d}", "--set", "dataset.corruptions=[fog, snow]",
            "--set", "federation.protocol=pflbed", "--set", "federation.pflbed.clients_per_domain=2",
            "--set", "federation.pflbed.new_clients_per_domain=0", "--set", "federation.min_size=2",
            "--set", "model.name=mlp", "--set", "train.rounds=1", "--set", "eval.finetune=[]"]  # fmt: skip
    assert main(["data", "show", *args]) == 0
    out = capsys.readouterr().out
    assert "fog" in out and "snow" in out
    assert main(["run", *args, "--out", str(env / "run"), "--no-progress"]) == 0
    assert (env / "run" / "summary.json").is_file()


# --- MNIST / EMNIST ---------------------------------------------------------------------------------------------


def test_mnist_upright_and_labelled(env: Path) -> None:
    source = load_dataset("mnist", path=fx.make_mnist(env / "m", n_train=40, n_test=20))
    assert source.train.x.shape == (40, 1, 28, 28) and np.array_equal(source.test.y.numpy(), np.arange(20) % 10)
    px = raw(source, source.train.x)[:, 0]
    assert (px[:, 0, :] == 255).all() and (px[:, 1:27, 0] == 100).all()


def test_emnist_images_upright_and_letters_from_zero(env: Path) -> None:
    """EMNIST stores each image transposed; the loader must return it upright (bright top row, dim left column),
    and letters' labels 1..26 must come back as 0..25."""
    d = fx.make_emnist(env, split="letters", n_train=60, n_test=30)
    source = load_dataset("emnist", path=env, split="letters")
    assert source.origin == str(d) and source.name == "emnist-letters" and source.num_classes == 26
    px = raw(source, source.train.x)[:, 0]
    assert (px[:, 0, :27] == 255).all() and (px[:, 1:27, 0] == 100).all() and (px[:, 1:27, 1:27] == 0).all()
    assert np.array_equal(px[:, 27, 27], np.arange(60) % 250)  # the images stay in file order
    assert np.array_equal(source.train.y.numpy(), np.arange(60) % 26)
    assert int(source.test.y.min()) == 0 and int(source.test.y.max()) == 25


@pytest.mark.parametrize(("split", "k"), [("byclass", 62), ("bymerge", 47), ("balanced", 47), ("digits", 10),
                                          ("mnist", 10)])  # fmt: skip
def test_emnist_splits(env: Path, split: str, k: int) -> None:
    fx.make_emnist(env, split=split, n_train=70, n_test=10)
    source = load_dataset("emnist", path=env, split=split)
    assert source.num_classes == k and int(source.train.y.max()) == min(k, 70) - 1


def test_emnist_has_its_own_normalization_per_split(env: Path) -> None:
    """EMNIST's pixels are not MNIST's (another conversion): each split has its own (mean, std), not 0.1307 / 0.3081,
    and x = (pixel / 255 − mean) / std with them."""
    for split in ("balanced", "letters"):
        fx.make_emnist(env / split, split=split, n_train=30, n_test=10)
        source = load_dataset("emnist", path=env / split, split=split)
        mean, std = source.pixel_norm
        assert 0.17 < mean < 0.18 and 0.33 < std < 0.34, (split, mean, std)
        assert torch.allclose(source.train.x[:, 0, 0, :27], torch.full((30, 27), (1 - mean) / std))  # 255s: top row


def test_emnist_bad_split_and_label_out_of_range(env: Path) -> None:
    d = fx.make_emnist(env, split="letters")
    with pytest.raises(DataError, match="dataset.split"):
        emnist.load_emnist(env, split="words")
    fx.write_idx_gz(d / "emnist-letters-test-labels-idx1-ubyte.gz", np.zeros(30, dtype=np.uint8))
    with pytest.raises(DataError, match="label 0 out of range 1..26") as info:
        load_dataset("emnist", path=env, split="letters")
    one_line_naming(info, d / "emnist-letters-test-labels-idx1-ubyte.gz")


# --- FEMNIST ----------------------------------------------------------------------------------------------------


def test_femnist_all_data_keeps_writers_and_splits_each(env: Path) -> None:
    fx.make_femnist_all_data(env, users=6, per_user=12, files=2)
    source = load_dataset("femnist", path=env)
    names = tuple(f"f{u:04d}_{u:02d}" for u in range(6))
    assert source.user_names == names and source.num_classes == 62
    assert (len(source.train), len(source.test)) == (6 * 11, 6 * 1)  # round(10 % of 12) = 1 test sample per writer
    for split in (source.train, source.test):
        px = split.x.numpy()[:, 0] * 0.5 + 0.5
        users = split.user.numpy()
        assert np.allclose(px[:, 0, 0], users / 100) and np.allclose(px[:, 0, 1], 1)  # writer u's own images, upright
        assert np.isin(split.y.numpy() - users, np.arange(12)).all()  # labels (u + j) % 62 of writer u
    assert source.train.user.dtype == torch.int64
    assert load_dataset("femnist", path=env) is source


def test_femnist_writers_are_the_clients_of_a_natural_partition(env: Path) -> None:
    from pflbed.config import FederationConfig
    from pflbed.federation import build_federation

    fx.make_femnist_all_data(env, users=6, per_user=12, files=2)
    source = load_dataset("femnist", path=env)
    fed = build_federation(source, FederationConfig(partition="natural", clients=6, min_samples=5), seed=0)
    user = source.train.user
    owners = [set(user[torch.cat([c.train, c.val, c.test])].tolist()) for c in fed.clients]
    assert owners == [{u} for u in range(6)]  # client k holds exactly writer k's samples


def test_femnist_leaf_train_test_layout(env: Path) -> None:
    train = {"w2": fx.femnist_user_data(2, 5), "w1": fx.femnist_user_data(1, 4)}
    fx.write_leaf_json(env / "train" / "a_train.json", train)
    fx.write_leaf_json(env / "test" / "a_test.json", {"w1": fx.femnist_user_data(1, 2)})
    source = load_dataset("femnist", path=env)
    assert source.user_names == ("w1", "w2") and (len(source.train), len(source.test)) == (9, 2)
    assert np.array_equal(source.train.user.numpy(), [0] * 4 + [1] * 5) and (source.test.user.numpy() == 0).all()
    assert np.array_equal(source.train.y.numpy(), [1, 2, 3, 4, 2, 3, 4, 5, 6])


def test_femnist_a_writer_in_shards_of_two_leaf_runs_is_one_line(env: Path) -> None:
    """LEAF writes each writer to one shard of a split and names shards after the run's options; a second run's
    shards left beside the first's would double a writer's samples: refused, naming both shards."""
    fx.write_leaf_json(env / "train" / "all_data_0_niid_05_keep_0_train_9.json", {"w1": fx.femnist_user_data(1, 4)})
    fx.write_leaf_json(env / "train" / "all_data_0_niid_1_keep_64_train_9.json", {"w1": fx.femnist_user_data(1, 3),
                                                                                 "w2": fx.femnist_user_data(2, 3)})
    fx.write_leaf_json(env / "test" / "all_data_0_niid_05_keep_0_test_9.json", {"w1": fx.femnist_user_data(1, 2)})
    second = env / "train" / "all_data_0_niid_1_keep_64_train_9.json"
    with pytest.raises(DataError, match="writer 'w1' is also in all_data_0_niid_05_keep_0_train_9.json: shards of "
                       "two LEAF runs\\? keep one run's shards in the folder$") as info:  # fmt: skip
        load_dataset("femnist", path=env)
    one_line_naming(info, second)
    second.unlink()
    assert load_dataset("femnist", path=env).user_names == ("w1",)


@pytest.mark.parametrize(("pixel", "span"), [(255.0, "0..255"), (1.01, "0..1.01"), (-0.5, "-0.5..1")])
def test_femnist_pixels_outside_zero_one_are_one_line(env: Path, pixel: float, span: str) -> None:
    """LEAF writes pixels as floats in [0, 1]; a copy rescaled to 0–255 would load as a white image: refused, as is
    any pixel outside [0, 1]."""
    data = fx.femnist_user_data(1, 3)
    data["x"][1][5] = pixel
    shard = fx.write_leaf_json(env / "all_data" / "all_data_0.json", {"w1": data})
    with pytest.raises(DataError, match=r"user 'w1': pixel values must lie in \[0, 1\], as LEAF writes them; "
                       rf"got {re.escape(span)} \(a copy rescaled to 0–255\?\)$") as info:  # fmt: skip
        load_dataset("femnist", path=env)
    one_line_naming(info, shard)


def test_femnist_truncated_shard_is_named(env: Path) -> None:
    d = fx.make_femnist_all_data(env, users=2, per_user=3, files=1)
    shard = d / "all_data_0.json"
    shard.write_text(shard.read_text()[:-40])
    with pytest.raises(DataError, match="truncated") as info:
        load_dataset("femnist", path=env)
    one_line_naming(info, shard)


# --- FLICKR-AES ------------------------------------------------------------------------------------------------


def _flickr_ratings() -> dict[str, list[tuple[int, int]]]:
    """Four workers at and just past FedPer's bounds (60 and 290 ratings kept; 59 and 291 left out) over a pool of
    300 images, so images are shared and rated differently: worker k scores image i (k + i) % 5 + 1. W60 rates
    image 0 a second time, last, with another score: a repeated rating is no new sample, and the first one counts."""
    counts = {"W60": 60, "A290": 290, "B59": 59, "Z291": 291}
    rank = {"A290": 0, "B59": 1, "W60": 2, "Z291": 3}
    ratings = {w: [(i, (rank[w] + i) % 5 + 1) for i in range(n)] for w, n in counts.items()}
    ratings["W60"].append((0, 5))
    return ratings


def test_flickr_aes_samples_are_ratings_of_the_workers_with_60_to_290(env: Path) -> None:
    """Each kept rating is one sample: the image (its own pixels, upright), its rater's score − 1, its rater as the
    user; workers outside 60–290 ratings are left out; 10 % of each worker's ratings (seeded) form `test`."""
    fx.make_flickr_aes(env, _flickr_ratings())
    source = load_dataset("flickr-aes", path=env, image_size=4)
    assert source.user_names == ("A290", "W60") and source.num_classes == 5
    assert source.input_shape == (3, 4, 4)
    splits = (source.train, source.test)
    sizes = {u: [int((s.user == k).sum()) for s in splits] for k, u in enumerate(source.user_names)}
    assert sizes == {"A290": [261, 29], "W60": [54, 6]}  # round(10 %) of each worker's ratings held out
    for split in (source.train, source.test):
        px = raw(source, split.x)
        image = px[:, 0, 0, 0].astype(np.int64) + 256 * px[:, 1, 0, 0].astype(np.int64)
        assert (px[:, 2] == 77).all() and (px == px[:, :, :1, :1]).all()  # each sample one flat image
        rank = np.where(split.user.numpy() == 0, 0, 2)  # A290 scores with rank 0, W60 with rank 2
        assert np.array_equal(split.y.numpy(), (rank + image) % 5)  # its own worker's score of that image − 1
    for k, n in ((0, 290), (1, 60)):  # every rating of a kept worker, each once
        mine = [raw(source, s.x[s.user == k])[:, :2, 0, 0].astype(np.int64) for s in (source.train, source.test)]
        seen = np.concatenate(mine) @ np.array([1, 256])
        assert sorted(seen.tolist()) == list(range(n))
    for k, n in ((0, 290), (1, 60)):  # held out: the worker's own seeded draw (its rank's stream), by file order
        px = raw(source, source.test.x[source.test.user == k])[:, :2, 0, 0].astype(np.int64)
        assert sorted((px @ np.array([1, 256])).tolist()) == np.flatnonzero(held_out(n, 0.1, 0, k)).tolist()
    assert not np.array_equal(np.flatnonzero(held_out(290, 0.1, 0, 0)), np.arange(29))  # at random, not the first
    assert load_dataset("flickr-aes", path=env, image_size=4) is source


def test_flickr_aes_workers_are_the_clients_of_a_natural_partition(env: Path) -> None:
    from pflbed.config import FederationConfig
    from pflbed.federation import build_federation

    fx.make_flickr_aes(env, _flickr_ratings())
    source = load_dataset("flickr-aes", path=env, image_size=4)
    fed = build_federation(source, FederationConfig(partition="natural", clients=2, test_fraction=0.2), seed=0)
    owners = [set(source.train.user[torch.cat([c.train, c.val, c.test])].tolist()) for c in fed.clients]
    assert owners == [{0}, {1}]
    assert all(abs(len(c.test) - 0.2 * n) <= 1 for c, n in zip(fed.clients, (261, 54), strict=True))  # FedPer's 20 %


def test_flickr_aes_images_only_left_out_workers_rated_are_never_opened(env: Path) -> None:
    ratings = _flickr_ratings()
    ratings["Z291"][-1] = (999, 3)
    fx.make_flickr_aes(env, ratings)
    (env / "40K" / "farm1_999_flickr.jpg").write_bytes(b"not an image")
    assert len(load_dataset("flickr-aes", path=env, image_size=4).train) == 261 + 54


@pytest.mark.parametrize("name", ["flickr-aes", "tinyimagenet", "pacs"])
def test_an_image_size_whose_decoded_images_exceed_the_memory_is_refused_before_decoding(env: Path, monkeypatch,
                                                                                         name) -> None:  # fmt: skip
    """Every decoding loader checks the bytes `dataset.image_size` asks for before allocating them (a 4096-px
    request raised from inside torch, or was filled until the process was killed); no image is opened first."""
    from pflbed import memory
    from pflbed.data import flickr_aes, folders

    writers = {"flickr-aes": lambda: fx.make_flickr_aes(env, _flickr_ratings()),
               "tinyimagenet": lambda: fx.make_tinyimagenet(env, size=8),
               "pacs": lambda: make_named_tree(env / "PACS", ("photo", "sketch"), 7)}  # fmt: skip
    writers[name]()
    # FLICKR-AES: one byte short of its 290 distinct images plus its 350 ratings' copies; the others: 0.1 MB
    limit = (290 + 350) * 3 * 64 * 64 * 4 - 1 if name == "flickr-aes" else 10**5
    monkeypatch.setattr(memory, "device_memory", lambda device: limit)
    opened = []
    for module in (flickr_aes, folders, tinyimagenet):
        monkeypatch.setattr(module, "decode_image" if module is not tinyimagenet else "_decode",
                            lambda *a: opened.append(a), raising=True)  # fmt: skip
    what = {"flickr-aes": "FLICKR-AES's 290 images as 350 ratings", "tinyimagenet": "Tiny ImageNet's 27 images",
            "pacs": rf"the 14 images of {re.escape(str(env / 'PACS'))}"}[name]  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^dataset\.image_size: {what} at 64 px would take [\d.]+ MB, more than "
                       r"this machine's [\d.]+ MB of memory; at most \d+ px here$"):  # fmt: skip
        load_dataset(name, path=env, image_size=64)
    assert opened == []


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace("worker, imagePair, score", "worker,image,score"), r":1: expected the header worker, "),
    (lambda t: t.replace("W60, farm1_0_flickr.jpg, 3", "W60, farm1_0_flickr.jpg, 6"), r":2: score must be an "
     "integer 1–5, got '6'$"),
    (lambda t: t.replace("W60, farm1_1_flickr.jpg, 4", "W60, farm1_1_flickr.jpg, 3.5"), r":3: score must be an "
     "integer 1–5, got '3.5'$"),
    (lambda t: t.replace("W60, farm1_0_flickr.jpg, 3", "W60, .., 3"), r":2: the image must be a file name in 40K/, "
     r"got '\.\.'$"),
    (lambda t: t.replace("W60, farm1_0_flickr.jpg, 3", ", farm1_0_flickr.jpg, 3"), r":2: expected <worker>, <image>, "
     r"<score>, got ', farm1_0_flickr\.jpg, 3'$"),
    (lambda t: t.replace("W60, farm1_0_flickr.jpg, 3", "W60, , 3"), r":2: expected <worker>, "),
    (lambda t: "", r":1: expected the header worker, imagePair, score, got ''$"),
    (lambda t: t.replace("W60, farm1_0_flickr.jpg, 3", "W60, farm1_0_flickr.jpg, \xff"), r":2: score must be"),
    (lambda t: t.replace("W60, farm1_0_flickr.jpg, 3", "W60, ../farm1_0_flickr.jpg, 3"), r":\d+: the image must be "
     r"a file name in 40K/, got '\.\./farm1_0_flickr\.jpg'"),
    (lambda t: t.replace("W60, farm1_0_flickr.jpg, 3", "W60, farm1_0_flickr.jpg"), r":\d+: expected <worker>, "),
])  # fmt: skip
def test_flickr_aes_bad_ratings_file_is_one_line_naming_file_and_line(env: Path, edit, message) -> None:
    fx.make_flickr_aes(env, _flickr_ratings())
    csv_file = env / "FLICKR-AES_image_labeled_by_each_worker.csv"
    csv_file.write_text(edit(csv_file.read_text()))
    with pytest.raises(DataError, match=message) as info:
        load_dataset("flickr-aes", path=env, image_size=4)
    one_line_naming(info, csv_file)


def test_flickr_aes_file_details(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte-order mark and blank lines (a spreadsheet's export) read as the published file; a file of other bytes
    and one longer than `MAX_ROWS` rows are one line; the load is cached until a file changes; where it was found,
    and the raw layout `pflbed personalize` reads (H × W × 3, 0–255); the default size 32."""
    from pflbed.data import flickr_aes

    fx.make_flickr_aes(env, _flickr_ratings())
    csv_file = env / "FLICKR-AES_image_labeled_by_each_worker.csv"
    lines = csv_file.read_text().splitlines()
    csv_file.write_text("\ufeff" + "\n".join([*lines[:100], "", " ", *lines[100:]]) + "\n", encoding="utf-8")
    source = load_dataset("flickr-aes", path=env)
    assert len(source.train) + len(source.test) == 350 and source.input_shape == (3, 32, 32)
    assert source.origin == str(env) and source.raw_shape == (32, 32, 3) and flickr_aes.find_flickr_aes(env) == env
    monkeypatch.setattr(flickr_aes, "MAX_ROWS", 701)  # the data rows, each counted once: blank lines are no rows
    assert len(flickr_aes.read_ratings(env)) == 701
    monkeypatch.setattr(flickr_aes, "MAX_ROWS", 700)
    with pytest.raises(DataError, match=r": more than 700 rows; the published file has 193,208$") as info:
        flickr_aes.read_ratings(env)
    one_line_naming(info, csv_file)
    monkeypatch.undo()
    csv_file.write_text(csv_file.read_text(encoding="utf-8").replace(", 3\n", ", 4\n"), encoding="utf-8")
    changed = load_dataset("flickr-aes", path=env)
    assert changed is not source and not torch.equal(changed.train.y, source.train.y)
    csv_file.write_bytes(b"worker, imagePair, score\n\xff\xfe, x.jpg, 3\n")
    with pytest.raises(DataError, match=r": cannot read \(.*codec can't decode") as info:
        load_dataset("flickr-aes", path=env)
    one_line_naming(info, csv_file)


@pytest.mark.parametrize("size, ok", [(1, True), (0, False), (True, False)])
def test_flickr_aes_image_size_is_a_positive_integer(env: Path, size, ok) -> None:
    fx.make_flickr_aes(env, _flickr_ratings())
    if ok:
        assert load_dataset("flickr-aes", path=env, image_size=size).input_shape == (3, 1, 1)
        return
    with pytest.raises(DataError, match=rf"^dataset\.image_size: a positive integer, got {size!r}$"):
        load_dataset("flickr-aes", path=env, image_size=size)


def test_flickr_aes_not_found_says_how_to_get_it_and_that_nothing_downloads(env: Path) -> None:
    fx.make_flickr_aes(env / "only-csv", {"W60": _flickr_ratings()["W60"]})
    shutil.rmtree(env / "only-csv" / "40K")  # the ratings without their images: not a copy
    for options, words in (({}, r"not found \(looked in "), ({"download": True}, "not found and has no official "
                                                                                 "archive to download; download ")):
        with pytest.raises(DataError, match=rf"^dataset flickr-aes \(FLICKR-AES\) {words}") as info:
            load_dataset("flickr-aes", path=env / "only-csv", **options)
        assert "40K/ sits beside the csv" in one_line_naming(info, "flickr-aes")


def test_flickr_aes_ratings_of_images_the_archive_lacks_are_left_out_after_choosing_the_workers(
        env: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """The published `40K/` lacks some rated images: their ratings are left out with one warning line, and the
    workers are still chosen by their ratings in the file, so W60 (60 rated, one image gone) stays, with 59."""
    fx.make_flickr_aes(env, _flickr_ratings())
    for i in (7, 290):  # 7: rated by every worker; 290: only by Z291, whom the loader leaves out anyway
        (env / "40K" / f"farm1_{i}_flickr.jpg").unlink()
    source = load_dataset("flickr-aes", path=env, image_size=4)
    assert source.user_names == ("A290", "W60")
    seen = {u: [] for u in source.user_names}
    for split in (source.train, source.test):
        px = raw(source, split.x)[:, :2, 0, 0].astype(np.int64) @ np.array([1, 256])
        for k, u in enumerate(source.user_names):
            seen[u] += px[split.user.numpy() == k].tolist()
    assert {u: sorted(v) for u, v in seen.items()} == {"A290": [i for i in range(290) if i != 7],
                                                       "W60": [i for i in range(60) if i != 7]}  # fmt: skip
    err = capsys.readouterr().err
    assert err == (f"pflbed: warning: {env / '40K'}: 1 rated image(s) missing, their 2 rating(s) left out, "
                   "e.g. farm1_7_flickr.jpg\n")  # fmt: skip
    assert load_dataset("flickr-aes", path=env, image_size=4) is source and capsys.readouterr().err == ""


def test_flickr_aes_a_rewritten_ratings_file_or_image_is_read_again(env: Path) -> None:
    """The load is cached per unchanged files: a ratings file rewritten with another score, or an image replaced,
    is read again."""
    fx.make_flickr_aes(env, _flickr_ratings())
    first = load_dataset("flickr-aes", path=env, image_size=4)
    csv_file = env / "FLICKR-AES_image_labeled_by_each_worker.csv"
    csv_file.write_text(csv_file.read_text().replace("W60, farm1_0_flickr.jpg, 3", "W60, farm1_0_flickr.jpg, 1"))
    second = load_dataset("flickr-aes", path=env, image_size=4)
    changed = int((second.train.y != first.train.y).sum() + (second.test.y != first.test.y).sum())
    assert second is not first and changed == 1  # W60's one rating of image 0, now score 1
    (env / "40K" / "farm1_3_flickr.jpg").write_bytes(fx.png_bytes((9, 9, 9), size=4))
    assert load_dataset("flickr-aes", path=env, image_size=4) is not second


def test_flickr_aes_no_rated_image_or_no_worker_in_range_is_one_line(env: Path) -> None:
    fx.make_flickr_aes(env, _flickr_ratings())
    for image in (env / "40K").iterdir():  # 40K/ unzipped one folder too deep: none of the rated images is there
        image.rename(env / image.name)
    with pytest.raises(DataError, match="no such file, nor any other image the chosen workers rated in") as info:
        load_dataset("flickr-aes", path=env, image_size=4)
    one_line_naming(info, env / "40K" / "farm1_0_flickr.jpg")
    shutil.rmtree(env / "40K")
    fx.make_flickr_aes(env, {"B59": _flickr_ratings()["B59"]})
    with pytest.raises(DataError, match="no worker has 60 to 290 ratings") as info:
        load_dataset("flickr-aes", path=env, image_size=4)
    one_line_naming(info, env / "FLICKR-AES_image_labeled_by_each_worker.csv")


# --- Tiny ImageNet, miniImageNet --------------------------------------------------------------------------------


def test_tinyimagenet_classes_val_annotations_and_pixels(env: Path) -> None:
    d = fx.make_tinyimagenet(env, wnids=("n03", "n01", "n02"), per_class=6, val_per_class=3, size=16)
    source = load_dataset("tinyimagenet", path=env, image_size=16)
    assert source.origin == str(d) and source.num_classes == 3 and source.input_shape == (3, 16, 16)
    assert (len(source.train), len(source.test)) == (18, 9)
    px = raw(source, source.train.x)
    assert np.array_equal(source.train.y.numpy(), np.repeat([0, 1, 2], 6))  # sorted wnids: n01, n02, n03
    assert np.array_equal(px[1:, 0, 5, 5], 40 * source.train.y.numpy()[1:])  # red = 40 · class (0: greyscale)
    assert (px[1:, 2, 5, 5] == 200).all() and (px[1:, :, 15, 0] == 255).all()  # blue; bottom-left marker: upright
    assert len(set(px[0, :, 5, 5])) == 1  # the greyscale JPEG came back as three equal channels
    # val: file val_k belongs to wnid k % 3 of wnids.txt's order (n03, n01, n02) -> sorted classes 2, 0, 1
    assert sorted(source.test.y.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert np.array_equal(raw(source, source.test.x)[:, 0, 5, 5], 40 * source.test.y.numpy())


def test_tinyimagenet_takes_image_size_from_the_config(env: Path) -> None:
    """`dataset.image_size` reaches the Tiny ImageNet loader as it reaches the folder datasets; unset, the images
    stay at their native 64×64 (the files here are 16×16, so 64 is visibly a resize too)."""
    from pflbed.config import DatasetConfig
    from pflbed.data import load_source

    d = fx.make_tinyimagenet(env, size=16)
    asked = DatasetConfig(name="tinyimagenet", path=str(d), image_size=24)
    assert load_source(asked).input_shape == (3, 24, 24)
    unset = DatasetConfig(name="tinyimagenet", path=str(d))  # the config writes 64: a reloaded run reads the same
    assert unset.image_size == 64 and DatasetConfig(name="pacs").image_size == 32
    assert load_source(unset).input_shape == (3, 64, 64)


def test_tinyimagenet_missing_val_image_is_named(env: Path) -> None:
    d = fx.make_tinyimagenet(env, size=8)
    (d / "val" / "images" / "val_4.JPEG").unlink()
    with pytest.raises(DataError, match="no such file") as info:
        load_dataset("tinyimagenet", path=d)
    one_line_naming(info, d / "val" / "images" / "val_4.JPEG")


def test_miniimagenet_pools_classes_and_holds_out_a_sixth(env: Path) -> None:
    fx.make_miniimagenet(env, classes_per_split=2, per_class=12, side=10)
    source = load_dataset("miniimagenet", path=env)
    assert source.num_classes == 6 and (len(source.train), len(source.test)) == (60, 12)
    px = raw(source, source.train.x)
    assert np.array_equal(px[:, 0, 3, 3], 10 * source.train.y.numpy())  # red = 10 · class
    assert np.array_equal(px[:10, 1, 3, 3], np.arange(10))  # class 0's first 10 rows train, in class_dict order
    assert np.array_equal(raw(source, source.test.x)[:2, 1, 3, 3], [10, 11])  # its last 2 rows test
    assert (px[:, 2, 3, 3] == 7).all() and (px[:, :, 9, 0] == 255).all()  # blue; bottom-left marker


def test_miniimagenet_reads_the_validation_split_under_either_published_name(env: Path) -> None:
    """learn2learn and Zenodo serve the validation pickle as `-validation.pkl`, the cache's first release and most
    copies as `-val.pkl`: the same data under either name loads the same source."""
    first = load_dataset("miniimagenet", path=fx.make_miniimagenet(env / "val", classes_per_split=2, per_class=6,
                                                                   side=6))  # fmt: skip
    other = load_dataset("miniimagenet", path=fx.make_miniimagenet(env / "validation", classes_per_split=2, per_class=6,
                                                                   side=6, val="validation"))  # fmt: skip
    assert first.num_classes == other.num_classes == 6
    for a, b in ((first.train, other.train), (first.test, other.test)):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)


def test_miniimagenet_refuses_malicious_pickle(env: Path) -> None:
    fx.make_miniimagenet(env, classes_per_split=1, per_class=6, side=4)
    marker = env / "owned"
    (env / "mini-imagenet-cache-val.pkl").write_bytes(fx.evil_pickle(f"touch {marker}"))
    with pytest.raises(DataError, match="refused") as info:
        load_dataset("miniimagenet", path=env)
    one_line_naming(info, env / "mini-imagenet-cache-val.pkl")
    assert not marker.exists()


# --- Office-Home, PACS, DomainNet -------------------------------------------------------------------------------


def make_named_tree(root: Path, domains: tuple[str, ...], classes: int, per_class: int = 1) -> Path:
    for d, domain in enumerate(domains):
        for c in range(classes):
            for i in range(per_class):
                path = root / domain / f"class_{c:03d}" / f"{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(fx.png_bytes((c % 256, 40 * d, i), size=4))  # distinct files: no copies
    return root


def test_pacs_by_name(env: Path) -> None:
    root = make_named_tree(env / "PACS", ("art_painting", "cartoon", "photo", "sketch"), 7, per_class=2)
    source = load_dataset("pacs", path=env, image_size=4)  # found in the PACS folder inside path
    assert source.name == "pacs" and source.num_classes == 7 and source.origin == str(root.resolve())
    assert source.domain_names == ("art_painting", "cartoon", "photo", "sketch") and len(source.train) == 56
    assert load_dataset("pacs", path=env, image_size=4) is source


def test_a_named_benchmark_passes_over_a_top_level_folder_without_folders_but_a_plain_tree_does_not(env: Path) -> None:
    """Some libraries keep an `image_list/` of `.txt` split files beside PACS's, Office-Home's or DomainNet's
    domains: no folder inside, so no domain; the named loader passes over it (the same pool as without it), while
    a tree of unknown layout (`folder`) still refuses it as a domain without class folders."""
    root = make_named_tree(env / "PACS", ("art_painting", "photo"), 7)
    plain = load_dataset("pacs", path=root, image_size=4)
    (root / "image_list").mkdir()
    (root / "image_list" / "photo_train_kfold.txt").write_text("photo/class_000/0.png 1\n")
    with_lists = load_dataset("pacs", path=root, image_size=4)
    assert with_lists.domain_names == ("art_painting", "photo") and torch.equal(with_lists.train.x, plain.train.x)
    assert DESCRIBE["pacs"](root)["domains"] == "art_painting, photo"  # `pflbed data list`'s row, the same tree
    with pytest.raises(DataError, match="domain folder has no class folders") as info:
        load_dataset("folder", path=root, image_size=4)
    one_line_naming(info, root.resolve() / "image_list")


def test_officehome_real_world_spelling_and_wrong_trees(env: Path) -> None:
    root = make_named_tree(env / "oh", ("Art", "Real_World"), 65)
    assert load_dataset("officehome", path=root, image_size=4).domain_names == ("Art", "Real_World")
    make_named_tree(env / "oh", ("Sketches",), 65)
    with pytest.raises(DataError, match="not a Office-Home domain folder") as info:
        load_dataset("officehome", path=root, image_size=4)
    one_line_naming(info, root.resolve() / "Sketches")
    small = make_named_tree(env / "dn", ("clipart", "real"), 3)
    with pytest.raises(DataError, match="3 class folders .* DomainNet has 345"):
        load_dataset("domainnet", path=small, image_size=4)


# --- listing ----------------------------------------------------------------------------------------------------


def test_data_list_finds_each_fixture_or_says_how_to_get_it(env: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(store, "_download", lambda *a, **k: pytest.fail("network used"))
    rows = {r["name"]: r for r in describe_datasets()}
    for name in ("cifar10", "cifar100", "cifar10c", "mnist", "emnist", "femnist", "tinyimagenet", "miniimagenet",
                 "officehome", "pacs", "domainnet", "flickr-aes"):  # fmt: skip
        assert rows[name]["location"].startswith("not found: ") and rows[name]["error"] is None, rows[name]
    assert "dataset.download=true" in rows["cifar10"]["location"] and "LEAF" in rows["femnist"]["location"]
    data = env / "data"
    fx.make_cifar10(data / "cifar10")
    fx.make_cifar10c(data, per_severity=4, corruptions=("fog",))
    fx.make_mnist(data / "mnist")
    fx.make_emnist(data / "emnist", split="balanced")
    fx.make_emnist(data / "emnist", split="letters", n_train=26, n_test=26)
    fx.make_femnist_all_data(data / "femnist")
    fx.make_tinyimagenet(data / "tinyimagenet", size=8)
    fx.make_miniimagenet(data / "miniimagenet", per_class=6, side=4)
    make_named_tree(data / "pacs" / "PACS", ("photo", "sketch"), 7)
    fx.make_flickr_aes(data / "flickr-aes" / "flickr", _flickr_ratings())
    monkeypatch.setenv("PFLBED_DATA", str(data))
    rows = {r["name"]: r for r in describe_datasets()}
    assert rows["cifar10"]["location"] == str(data / "cifar10" / "cifar-10-batches-py")
    assert rows["cifar10c"]["location"] == str(data / "CIFAR-10-C") and rows["cifar10c"]["train"] == 4
    assert rows["cifar10c"]["domains"].startswith("1 of 19 corruptions")
    assert (rows["mnist"]["train"], rows["mnist"]["test"]) == (40, 20)
    assert (rows["emnist"]["train"], rows["emnist"]["test"]) == (60, 30) and "balanced" in rows["emnist"]["domains"]
    assert (rows["tinyimagenet"]["train"], rows["tinyimagenet"]["test"]) == (18, 9)
    assert rows["pacs"]["domains"] == "photo, sketch" and rows["pacs"]["train"] == 14
    assert rows["flickr-aes"]["location"] == str(data / "flickr-aes" / "flickr")
    assert rows["flickr-aes"]["domains"] == "350 ratings by 2 workers with 60–290 ratings (users)"
    for name in ("femnist", "miniimagenet"):
        assert rows[name]["location"].startswith(str(data / name)), rows[name]
    assert set(rows) >= set(DATASETS)
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "CIFAR-10-C" in out and "cifar-10-batches-py" in out


def test_removing_a_fixture_copy_is_seen(env: Path) -> None:
    """The loaders' caches key on the files: a copy replaced on disk is read again."""
    d = fx.make_mnist(env / "m", n_train=10)
    first = load_dataset("mnist", path=d)
    shutil.rmtree(d)
    fx.make_mnist(d, n_train=30)
    assert len(load_dataset("mnist", path=d).train) == 30 and len(first.train) == 10
    assert cifar10c.CORRUPTIONS == fx.CORRUPTIONS
