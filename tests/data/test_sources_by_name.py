"""Datasets by name (`pflbed.data`): a config's `dataset` section to its loader's arguments, the one-line refusals
of a name or option no loader takes, what a pretraining source's disjointness is checked on, and the rows of
`pflbed data list`.

The plumbing is checked with a recording loader put in place of a real one: each branch must hand its loader
exactly the options the section asks for, and nothing else."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import pflbed.data as data
from pflbed.config.dataset import OWN_DATA, DatasetConfig
from pflbed.data import DATASETS, base_dataset, describe_datasets, load_dataset, load_source, make_synthetic
from pflbed.data.folders import IMAGENET_MEAN, IMAGENET_STD
from pflbed.errors import DataError

from .. import data_formats as fx


def recorder(monkeypatch: pytest.MonkeyPatch, name: str) -> list[dict[str, Any]]:
    """Put a loader with `name`'s signature that records its arguments and returns small generated data."""
    calls: list[dict[str, Any]] = []
    signature = inspect.signature(DATASETS[name])

    def loader(**kwargs: Any):
        calls.append(kwargs)
        return make_synthetic(shape=[1, 4, 4], n_train=40, n_test=20)

    loader.__signature__ = signature  # type: ignore[attr-defined]
    monkeypatch.setitem(DATASETS, name, loader)
    return calls


def test_an_unknown_dataset_is_one_line_listing_the_known_the_nearest_and_how_to_use_your_own():
    with pytest.raises(DataError) as exc:
        load_dataset("fmnst")
    assert str(exc.value) == (f"unknown dataset 'fmnst'; known datasets: {', '.join(sorted(DATASETS))}; did you mean "
                              f"fmnist? {OWN_DATA[0].upper()}{OWN_DATA[1:]}")  # fmt: skip


def test_a_path_or_an_option_the_loader_does_not_take_is_refused_naming_what_it_takes(monkeypatch):
    with pytest.raises(DataError) as exc:
        load_dataset("digits", path="/some/where")
    assert str(exc.value) == "dataset 'digits' reads no files, so it takes no path (got '/some/where')"
    with pytest.raises(DataError) as exc:
        load_dataset("cifar10c", path="/x", severity=2, sevrity=3, label="fine")
    assert str(exc.value) == ("dataset 'cifar10c': unknown option(s) label, sevrity; accepted: download, corruptions, "
                              "severity")
    monkeypatch.setitem(DATASETS, "bare", lambda path: None)
    with pytest.raises(DataError) as exc:
        load_dataset("bare", path="/x", seed=1)
    assert str(exc.value) == "dataset 'bare': unknown option(s) seed; accepted: none"


@pytest.mark.parametrize(("section", "name", "passed"), [
    ({"name": "folder", "path": "/f"}, "folder", {"path": "/f", "normalize": "symmetric", "image_size": 32}),
    ({"name": "folder", "path": "/f", "normalize": "imagenet", "image_size": 8}, "folder",
     {"path": "/f", "normalize": "imagenet", "image_size": 8}),
    ({"name": "pacs", "path": "/p", "normalize": "imagenet", "download": True}, "pacs",
     {"path": "/p", "normalize": "imagenet", "image_size": 32, "download": True}),
    ({"name": "tinyimagenet", "image_size": 16}, "tinyimagenet", {"image_size": 16}),
    ({"name": "cifar10", "image_size": 16}, "cifar10", {}),  # a fixed-size dataset: no size passed
    ({"name": "cifar10c", "corruptions": ["fog"], "severity": 2}, "cifar10c", {"corruptions": ["fog"], "severity": 2}),
    ({"name": "cifar100", "label": "coarse"}, "cifar100", {"label": "coarse"}),
    ({"name": "emnist", "split": "letters"}, "emnist", {"split": "letters"}),
    ({"name": "synthetic", "synthetic": {"shape": [1, 4, 4], "n_train": 40, "n_test": 20, "num_classes": 3}},
     "synthetic", {"shape": [1, 4, 4], "n_train": 40, "n_test": 20, "num_classes": 3, "separation": 2.0}),
    ({"name": "hf", "hf": {"id": "someone/data"}}, "hf",
     {"id": "someone/data", "subset": None, "splits": ["train", "test"], "image_column": "image",
      "label_column": "label", "user_column": None, "image_size": None, "normalize": [0.5, 0.5]}),
])  # fmt: skip
def test_a_section_hands_its_loader_exactly_the_options_it_asks_for(monkeypatch, section, name, passed):
    calls = recorder(monkeypatch, name)
    load_source(DatasetConfig(**section))
    assert calls == [passed]


def test_the_folder_dataset_needs_its_path_and_a_normalization_is_only_the_folders(monkeypatch):
    calls = recorder(monkeypatch, "folder")
    with pytest.raises(DataError) as exc:
        load_source(DatasetConfig(name="folder"))
    assert str(exc.value) == "dataset.path: the folder dataset needs the root of a <domain>/<class>/<image> tree"
    with pytest.raises(DataError) as exc:
        load_source(DatasetConfig(name="digits", normalize="imagenet"))
    assert str(exc.value) == "dataset.normalize: imagenet applies to folder datasets; digits has its own normalization"
    assert calls == []


def test_a_folder_section_s_normalization_reaches_the_pixels(tmp_path):
    """The real loaders, end to end: `normalize: imagenet` gives ImageNet's statistics, for a folder tree and a named
    benchmark alike; unset, the symmetric [-1, 1]."""
    root = fx.make_domain_tree(tmp_path / "PACS", ("photo",), 7, size=4)
    for name in ("folder", "pacs"):
        imagenet = load_source(DatasetConfig(name=name, path=str(root), normalize="imagenet", image_size=4))
        assert imagenet.pixel_norm == (IMAGENET_MEAN, IMAGENET_STD), name
        assert load_source(DatasetConfig(name=name, path=str(root), image_size=4)).pixel_norm == (0.5, 0.5), name


def test_a_built_in_domain_name_keeps_its_name_and_declared_domains_name_the_transforms():
    named = load_source(DatasetConfig(name="digits-rot4"))
    assert named.name == "digits-rot4" and named.domain_names == ("rot0", "rot90", "rot180", "rot270")
    declared = load_source(DatasetConfig(name="digits", domains=["rot0", "rot180"]))
    assert declared.name == "digits[rot0,rot180]" and declared.domain_names == ("rot0", "rot180")
    assert load_source(DatasetConfig(name="digits")).train.domain is None


def test_what_a_pretraining_source_s_disjointness_is_checked_on(tmp_path, monkeypatch):
    """Transform domains draw on their base's samples; a folder tree and a local Hugging Face copy are named by their
    resolved place, so two spellings of one directory are one source."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tree").mkdir()
    assert [base_dataset(DatasetConfig(name=n)) for n in ("fmnist-rot4", "digits-rot4", "cifar10")] == [
        "fmnist", "digits", "cifar10"]
    assert base_dataset(DatasetConfig(name="folder", path="./tree/../tree")) == f"folder:{tmp_path / 'tree'}"
    assert base_dataset(DatasetConfig(name="folder")) == "folder"
    hub = {"id": "someone/data", "subset": "small", "splits": ["train"]}
    assert base_dataset(DatasetConfig(name="hf", hf=hub)) == "hf:someone/data:small:train"
    assert base_dataset(DatasetConfig(name="hf", hf={**hub, "id": "tree"})) == f"hf:{tmp_path / 'tree'}:small:train"
    local = DatasetConfig(name="hf", path="tree", hf={"id": "x/y"})
    assert base_dataset(local) == f"hf:{tmp_path / 'tree'}::train,test"


def _row(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(r for r in rows if r["name"] == name)


def test_data_list_rows_say_where_each_dataset_is_and_how_big(isolated_env, monkeypatch):
    rows = describe_datasets()
    assert [r["name"] for r in rows] == [*DATASETS, "fmnist-rot4", "digits-rot4"]
    assert _row(rows, "folder") == {"name": "folder", "location": "dataset.path (a <domain>/<class>/<image> tree)",
                                    "train": None, "test": None, "error": None, "domains": ""}  # fmt: skip
    assert _row(rows, "hf") == {"name": "hf", "location": "dataset.hf.id or dataset.path (a Hugging Face dataset, "
                                "offline)", "train": None, "test": None, "error": None, "domains": ""}  # fmt: skip
    digits = load_dataset("digits")
    assert _row(rows, "digits") == {"name": "digits", "location": digits.origin, "train": len(digits.train),
                                    "test": len(digits.test), "error": None, "domains": ""}  # fmt: skip
    assert _row(rows, "digits-rot4") == {**_row(rows, "digits"), "name": "digits-rot4",
                                         "domains": "rot0, rot90, rot180, rot270"}  # fmt: skip
    synthetic = make_synthetic()
    assert _row(rows, "synthetic") == {"name": "synthetic", "location": "generated", "train": len(synthetic.train),
                                       "test": len(synthetic.test), "error": None, "domains": ""}  # fmt: skip
    fmnist = _row(rows, "fmnist")
    assert fmnist["location"] == f"not found: {data.FMNIST_HOW_TO_GET}" and fmnist["train"] is None
    assert _row(rows, "fmnist-rot4")["domains"] == "rot0, rot90, rot180, rot270"


def test_data_list_with_a_path_describes_the_tree_there_and_names_a_damaged_copy(isolated_env):
    root = fx.make_domain_tree(isolated_env / "mine", ("art", "photo"), 3, per_class=2, size=4)
    rows = describe_datasets(root)
    assert _row(rows, "folder") == {"name": "folder", "location": str(root.resolve()), "train": 12, "test": 0,
                                    "error": None, "domains": "art, photo"}  # fmt: skip
    broken = isolated_env / "broken"
    broken.write_text("not a directory")
    folder = _row(describe_datasets(broken), "folder")
    assert folder["error"] == str(pytest.raises(DataError, data.describe_domain_folders, broken).value)
    assert folder["location"] == "dataset.path (a <domain>/<class>/<image> tree)" and folder["train"] is None


def test_data_list_with_a_path_finds_the_file_backed_datasets_there(isolated_env):
    from .test_data import make_fmnist_dir

    copy = make_fmnist_dir(isolated_env / "idx", n_train=20, n_test=10)
    rows = describe_datasets(copy)
    for name in ("fmnist", "mnist"):  # Fashion-MNIST and MNIST share the IDX file names
        assert {k: _row(rows, name)[k] for k in ("location", "train", "test", "error")} == {
            "location": str(copy), "train": 20, "test": 10, "error": None}, name


def test_a_row_whose_description_fails_is_listed_not_found_with_its_error(isolated_env, monkeypatch):
    def damaged(path):
        raise DataError("mnist: a damaged header")

    monkeypatch.setitem(data.DESCRIBE, "mnist", damaged)
    assert _row(describe_datasets(), "mnist") == {"name": "mnist", "location": "not found", "train": None,
                                                   "test": None, "error": "mnist: a damaged header", "domains": ""}
