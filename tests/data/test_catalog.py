"""`pflbed data list`'s row for each file-backed dataset (`data.catalog.DESCRIBE`): where the copy is and its sizes
read from headers and listings, or the dataset's own how-to-get line when there is no copy at the path given.

Each row is checked whole, on small copies in the published formats (`tests/data_formats.py`), so a row that looks
elsewhere than the path given, counts the wrong split or names the wrong dataset's remedy goes red.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pflbed.data import cifar, cifar10c, emnist, femnist, flickr_aes, miniimagenet, mnist, named_folders, tinyimagenet
from pflbed.data.catalog import DESCRIBE

from .. import data_formats as fx

HOW = {  # the remedy each row shows when nothing is found
    "cifar10": cifar.how_to_get("cifar10"),
    "cifar100": cifar.how_to_get("cifar100"),
    "cifar10c": cifar10c.HOW_TO_GET,
    "mnist": mnist.HOW_TO_GET,
    "emnist": emnist.HOW_TO_GET,
    "femnist": femnist.HOW_TO_GET,
    "tinyimagenet": tinyimagenet.HOW_TO_GET,
    "miniimagenet": miniimagenet.HOW_TO_GET,
    "flickr-aes": flickr_aes.HOW_TO_GET,
    **{name: named_folders.how_to_get(name) for name in named_folders.BENCHMARKS},
}


def test_every_file_backed_dataset_has_a_row_and_a_remedy() -> None:
    assert set(DESCRIBE) == {"digits", *HOW}


@pytest.mark.parametrize("name", sorted(HOW))
def test_no_copy_at_the_path_is_the_dataset_s_own_remedy(env: Path, name: str) -> None:
    assert DESCRIBE[name](env / "nothing") == {"location": f"not found: {HOW[name]}"}


def test_cifar_and_miniimagenet_rows_are_where_the_copy_is(env: Path) -> None:
    """These formats have no cheap header to size, so the row is the location alone."""
    found = fx.make_cifar10(env / "c10")
    assert DESCRIBE["cifar10"](found) == {"location": str(found)}
    found = fx.make_miniimagenet(env / "mini")
    assert DESCRIBE["miniimagenet"](found) == {"location": str(found)}


def test_cifar10c_counts_the_corruptions_present_times_one_severity(env: Path) -> None:
    found = fx.make_cifar10c(env / "c", per_severity=20, corruptions=("fog", "snow", "frost"))
    assert DESCRIBE["cifar10c"](found) == {"location": str(found), "train": 60, "test": 0,
                                           "domains": "3 of 19 corruptions (one severity of 1–5 per run)"}  # fmt: skip


def test_mnist_sizes_come_from_the_label_headers(env: Path) -> None:
    found = fx.make_mnist(env / "m", n_train=40, n_test=20)
    assert DESCRIBE["mnist"](found) == {"location": str(found), "train": 40, "test": 20}


def test_emnist_sizes_are_balanced_s_where_present_else_the_first_split_here(env: Path) -> None:
    found = fx.make_emnist(env / "e", "letters", n_train=60, n_test=30)
    assert DESCRIBE["emnist"](found) == {"location": str(found), "train": 60, "test": 30,
                                         "domains": "sizes of split letters; splits here: letters"}  # fmt: skip
    fx.make_emnist(env / "e", "digits", n_train=50, n_test=10)
    fx.make_emnist(env / "e", "balanced", n_train=47, n_test=47)
    fx.make_emnist(env / "e", "bymerge", n_train=94, n_test=47)  # listed before balanced: balanced is still chosen
    here = "sizes of split balanced; splits here: bymerge, balanced, letters, digits"
    assert DESCRIBE["emnist"](found) == {"location": str(found), "train": 47, "test": 47, "domains": here}


def test_femnist_row_names_the_leaf_layout_and_counts_its_shards(env: Path) -> None:
    found = fx.make_femnist_all_data(env / "f", users=6, files=3).parent
    assert DESCRIBE["femnist"](found) == {"location": str(found), "domains": "LEAF all_data/, 3 shards"}
    split = env / "s"
    for part, k in (("train", 2), ("test", 2), ("train", 3)):
        fx.write_leaf_json(split / part / f"{part}_{k}.json", {f"u{k}": fx.femnist_user_data(k, 2)})
    assert DESCRIBE["femnist"](split) == {"location": str(split), "domains": "LEAF train/ + test/, 3 shards"}


def test_tinyimagenet_row_counts_training_and_labelled_val_images(env: Path) -> None:
    found = fx.make_tinyimagenet(env / "t", per_class=6, val_per_class=3, size=8)
    assert DESCRIBE["tinyimagenet"](found) == {"location": str(found), "train": 18, "test": 9}


def test_flickr_aes_row_counts_the_ratings_and_workers_the_loader_keeps(env: Path) -> None:
    keep = {f"w{w}": [(i, 1 + i % 5) for i in range(flickr_aes.MIN_RATINGS)] for w in range(2)}
    few = {"w9": [(0, 3)]}  # fewer than MIN_RATINGS: the loader drops this worker, so the row does too
    found = fx.make_flickr_aes(env / "fa", {**keep, **few})
    n = 2 * flickr_aes.MIN_RATINGS
    assert DESCRIBE["flickr-aes"](found) == {
        "location": str(found), "domains": f"{n} ratings by 2 workers with {flickr_aes.MIN_RATINGS}–"
        f"{flickr_aes.MAX_RATINGS} ratings (users)"}  # fmt: skip
    (found / "40K" / "farm1_3_flickr.jpg").unlink()  # the published archive lacks some rated images
    assert DESCRIBE["flickr-aes"](found)["domains"] == (
        f"{n - 2} ratings by 2 workers with {flickr_aes.MIN_RATINGS}–{flickr_aes.MAX_RATINGS} ratings (users); "
        "1 rated images missing from 40K/")


@pytest.mark.parametrize("name", sorted(named_folders.BENCHMARKS))
def test_a_named_benchmark_s_row_counts_its_images_and_lists_the_domains_present(env: Path, name: str) -> None:
    """A subset of the benchmark's domains is a valid copy: the row lists those present and counts their images."""
    b = named_folders.BENCHMARKS[name]
    present = b.domains[:2]
    found = fx.make_domain_tree(env / name, present, b.num_classes, per_class=1, size=2)
    row = DESCRIBE[name](found)
    assert row == {"location": str(found), "train": 2 * b.num_classes, "test": 0, "domains": ", ".join(present)}
