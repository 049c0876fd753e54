"""`dataset.name: hf`: Hugging Face datasets read offline with `datasets`, on datasets saved to disk here with known
pixel patterns, labels and users; their runs, `pflbed data show`, and one-line errors."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")

from PIL import Image  # noqa: E402

from pflbed.cli import main  # noqa: E402
from pflbed.config import load_config  # noqa: E402
from pflbed.data import load_dataset, load_source  # noqa: E402
from pflbed.errors import DataError  # noqa: E402

H, W = 4, 5  # not square: a transposed image would not fit
LABEL_NAMES = ["cat", "ant", "bee"]  # a ClassLabel's ids stay its own, not re-sorted by name


def pattern(i: int) -> np.ndarray:
    """Image i: pixel (r, c) = 10·r + c + i (mod 256), distinct at every position."""
    r, c = np.mgrid[0:H, 0:W]
    return ((10 * r + c + i) % 256).astype(np.uint8)


def writer(i: int) -> str:
    return ["w3", "w1", "w2"][i % 3]


def fixture_split(n: int, offset: int):
    idx = range(offset, offset + n)
    return datasets.Dataset.from_dict(
        {"image": [Image.fromarray(pattern(i)) for i in idx], "label": [i % 3 for i in idx],
         "writer": [writer(i) for i in idx]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=LABEL_NAMES),
                                    "writer": datasets.Value("string")}),
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A DatasetDict on disk: 90 train and 30 test grey images with known pixels, ClassLabel labels, string users."""
    path = tmp_path_factory.mktemp("hf") / "tiny"
    datasets.DatasetDict({"train": fixture_split(90, 0), "test": fixture_split(30, 1000)}).save_to_disk(str(path))
    return path


def test_pixels_labels_and_users_of_a_saved_dataset(hf_dir):
    """Images → float32 [N, 1, H, W] with x = (p/255 − mean)/std, sample order kept; ClassLabel ids kept; string users
    numbered in sorted order (w1 → 0, w2 → 1, w3 → 2); the test split is the global test split."""
    s = load_dataset("hf", path=hf_dir, user_column="writer")
    assert s.train.x.dtype == torch.float32 and s.train.x.shape == (90, 1, H, W) and s.test.x.shape == (30, 1, H, W)
    for split, offset in ((s.train, 0), (s.test, 1000)):
        for j in (0, 1, 7, len(split) - 1):
            want = (torch.from_numpy(pattern(offset + j)).float() / 255 - 0.5) / 0.5
            assert torch.equal(split.x[j, 0], want), j
    assert s.train.y.tolist() == [i % 3 for i in range(90)] and s.num_classes == 3
    assert s.train.user.tolist() == [{"w1": 0, "w2": 1, "w3": 2}[writer(i)] for i in range(90)]
    assert s.train.user.dtype == torch.int64 and s.train.domain is None
    assert s.pixel_norm == (0.5, 0.5) and s.raw_scale == 255.0 and s.raw_shape == (H, W)
    # normalize: (mean, std) of the user's choice; raw samples map like the loader's own (personalize's inputs)
    t = load_dataset("hf", path=hf_dir, normalize=[0.25, 2.0])
    assert torch.equal(t.train.x[3, 0], (torch.from_numpy(pattern(3)).float() / 255 - 0.25) / 2.0)
    assert torch.equal(t.inputs(pattern(3)[None]), t.train.x[3:4]) and t.train.user is None


def test_labels_as_strings_or_integers_and_a_train_split_only(tmp_path):
    """String labels are numbered in sorted order over both splits (a class only in the test split included);
    integer labels are used as they are; one split name: no test split."""
    def split(labels):
        return datasets.Dataset.from_dict({"image": [pattern(i) for i in range(len(labels))], "label": labels})

    path = tmp_path / "s"
    datasets.DatasetDict({"train": split(["dog", "cat", "dog"]), "test": split(["emu", "cat"])}).save_to_disk(str(path))
    s = load_dataset("hf", path=path)
    assert s.train.y.tolist() == [1, 0, 1] and s.test.y.tolist() == [2, 0] and s.num_classes == 3
    ints = tmp_path / "i"
    datasets.DatasetDict({"train": split([4, 0, 2]), "test": split([1, 1])}).save_to_disk(str(ints))
    s = load_dataset("hf", path=ints)
    assert s.train.y.tolist() == [4, 0, 2] and s.num_classes == 5
    only = load_dataset("hf", path=ints, splits=["test"])
    assert only.train.y.tolist() == [1, 1] and len(only.test) == 0 and only.test.x.shape[1:] == only.train.x.shape[1:]


def test_colour_images_and_pixel_arrays(tmp_path):
    """RGB images → [N, 3, H, W] with the channels in order; the same pixels as arrays [N, H, W, 3] give the same
    tensor; float arrays are taken as already in [0, 1] (no division by 255)."""
    rgb = [np.stack([pattern(i), pattern(i + 50), pattern(i + 100)], axis=-1) for i in range(6)]
    labels = [0, 1, 0, 1, 0, 1]
    datasets.Dataset.from_dict({"image": [Image.fromarray(a) for a in rgb], "label": labels}).save_to_disk(
        str(tmp_path / "img"))
    datasets.Dataset.from_dict({"image": np.stack(rgb), "label": labels}).save_to_disk(str(tmp_path / "arr"))
    floats = np.stack([p.astype(np.float32) / 255 for p in map(pattern, range(6))])
    datasets.Dataset.from_dict({"image": floats, "label": labels}).save_to_disk(str(tmp_path / "f"))
    img = load_dataset("hf", path=tmp_path / "img", splits=["train"])
    assert img.train.x.shape == (6, 3, H, W) and img.raw_channels_last and img.raw_shape == (H, W, 3)
    assert torch.equal(img.train.x[2, 1], (torch.from_numpy(pattern(52)).float() / 255 - 0.5) / 0.5)  # G = channel 1
    arr = load_dataset("hf", path=tmp_path / "arr", splits=["train"])
    assert torch.equal(arr.train.x, img.train.x)
    f = load_dataset("hf", path=tmp_path / "f", splits=["train"], normalize=[0.0, 1.0])
    assert f.raw_scale == 1.0 and torch.allclose(f.train.x[:, 0], torch.from_numpy(floats), atol=0)


def test_float_and_16_bit_images_keep_their_values(tmp_path):
    """PIL images of mode F (floats in [0, 1]) and I;16 (0–65535) are read by their range, as arrays are: not through
    8-bit "L", which made the floats 0 and clipped 16-bit values at 255. Resizing keeps the range too; 32-bit integer
    images must lie in 0…255, and one split cannot mix ranges (one line each)."""
    labels = [0, 1, 0, 1]
    floats = [pattern(i).astype(np.float32) / 255 for i in range(4)]
    wide = [(pattern(i).astype(np.uint16) * 257) for i in range(4)]  # 0…65535: x = p·257 / 65535 = p / 255
    want = torch.stack([torch.from_numpy(pattern(i)).float() / 255 for i in range(4)])
    for name, images in (("f", floats), ("i16", wide)):
        pil = [Image.fromarray(a) for a in images]
        assert {im.mode for im in pil} == ({"F"} if name == "f" else {"I;16"})
        datasets.Dataset.from_dict({"image": pil, "label": labels}).save_to_disk(str(tmp_path / name))
        s = load_dataset("hf", path=tmp_path / name, splits=["train"], normalize=[0.0, 1.0])
        assert s.train.x.shape == (4, 1, H, W) and s.raw_scale == (1.0 if name == "f" else 65535.0), name
        assert torch.allclose(s.train.x[:, 0], want, atol=1e-6), name
        big = load_dataset("hf", path=tmp_path / name, splits=["train"], normalize=[0.0, 1.0], image_size=8)
        top = float(want.max())  # 37 / 255: upsampled bilinearly, the brightest value stays about where it was
        assert top - 0.02 < float(big.train.x.max()) <= top + 1e-6, name
    wide32 = [Image.fromarray(np.full((4, 4), v, np.int32)) for v in (3, 300)]
    datasets.Dataset.from_dict({"image": wide32, "label": [0, 1]}).save_to_disk(str(tmp_path / "i32"))
    with pytest.raises(DataError, match=r"dataset\.hf\.image_column: 32-bit integer image 1 of .* spans 300…300; "
                                        r"need 0…255 \(store 16-bit images as I;16\)$"):
        load_dataset("hf", path=tmp_path / "i32", splits=["train"])
    mixed = [Image.fromarray(floats[0]), Image.fromarray(pattern(1))]
    datasets.Dataset.from_dict({"image": mixed, "label": [0, 1]}).save_to_disk(str(tmp_path / "mixed"))
    with pytest.raises(DataError, match=r"hf\.image_column: the images of .* mix pixel ranges \(modes F and L\)"):
        load_dataset("hf", path=tmp_path / "mixed", splits=["train"])


def test_images_of_different_sizes_need_image_size(tmp_path):
    imgs = [Image.fromarray(np.full((4, 5), 10, np.uint8)), Image.fromarray(np.full((6, 3), 200, np.uint8))]
    datasets.Dataset.from_dict({"image": imgs, "label": [0, 1]}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(DataError, match=r"dataset\.hf\.image_column: images of .*d's train split differ in size "
                                        r"\(5×4 and 3×6\); set dataset\.hf\.image_size to resize them$"):
        load_dataset("hf", path=tmp_path / "d", splits=["train"])
    s = load_dataset("hf", path=tmp_path / "d", splits=["train"], image_size=8)
    assert s.train.x.shape == (2, 1, 8, 8) and s.train.x[1].eq((200 / 255 - 0.5) / 0.5).all()


def test_reads_a_dataset_from_the_hugging_face_cache_offline(tmp_path, monkeypatch):
    """`dataset.hf.id` as a Hub id: read from the Hugging Face cache (never the network), as `datasets` left it."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    for split, n in (("train", 6), ("test", 4)):
        datasets.Dataset.from_dict({"image": [pattern(i) for i in range(n)], "label": [i % 2 for i in range(n)]}
                                   ).to_parquet(str(tmp_path / f"{split}.parquet"))  # fmt: skip
    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    files = DataFilesDict.from_patterns({s: [str(tmp_path / f"{s}.parquet")] for s in ("train", "test")})
    Parquet(cache_dir=str(cache), dataset_name="tiny", data_files=files, hash="0").download_and_prepare()
    (built,) = cache.glob("tiny/*/*/0")  # what a download of `tester/tiny` leaves: <namespace>___<name>/default/…
    target = cache / "tester___tiny" / "default" / "0.0.0" / "0"
    target.parent.mkdir(parents=True)
    built.rename(target)
    import huggingface_hub.constants as hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    try:
        datasets.load_dataset("tester/tiny")
    except Exception:  # noqa: BLE001
        pytest.skip("this version of datasets lays out its cache differently")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # the loader switches the Hub off by itself
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    s = load_dataset("hf", id="tester/tiny")
    assert len(s.train) == 6 and len(s.test) == 4 and torch.equal(s.train.x[5, 0], (torch.from_numpy(pattern(5))
                                                                                    .float() / 255 - 0.5) / 0.5)
    with pytest.raises(DataError, match=r"^dataset\.hf\.id: cannot read 'tester/other' offline .*save_to_disk"):
        load_dataset("hf", id="tester/other")


@pytest.mark.parametrize("sets, message", [
    (["dataset.hf.image_column=img"], "dataset.hf.image_column: no column 'img' in .*'s train split; its columns: "
                                      "image, label, writer"),
    (["dataset.hf.label_column=writer", "dataset.hf.image_column=label"],
     "dataset.hf.image_column: 'label' .*not pixels"),
    (["dataset.hf.splits=[train, validation]"], "dataset.hf.splits: .* has no split 'validation'; its splits: train, "
                                                "test"),
    (["dataset.hf.user_column=user", "federation.partition=natural"], "dataset.hf.user_column: no column 'user'"),
    (["federation.partition=natural"], "federation.partition: natural needs per-sample users"),
    (["federation.partition=natural", "dataset.hf.user_column=writer"], "federation.clients: 4 clients, but "
     "federation.partition natural finds 3 users"),
    (["dataset.path=/nonexistent/hf"], r"dataset.path: /nonexistent/hf: no such directory \(a save_to_disk "
                                       r"directory of a Hugging Face dataset\)$"),
])  # fmt: skip
def test_bad_columns_splits_and_paths_are_one_line_exit_2_nothing_written(hf_dir, tmp_path, capsys, sets, message):
    out = tmp_path / "run"
    args = ["run", "--set", "dataset.name=hf", "--set", f"dataset.path={hf_dir}", "--set", "federation.clients=4",
            "--set", "train.rounds=1", "--no-progress", "--out", str(out)]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err
    assert not out.exists()


def test_missing_id_and_missing_extra_are_config_errors(monkeypatch, capsys):
    assert main(["run", "--set", "dataset.name=hf", "--no-progress"]) == 2
    assert "dataset.name hf needs dataset.hf.id" in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    assert main(["config", "--set", "dataset.name=hf", "--set", "dataset.hf.id=x/y"]) == 2
    assert "pip install 'pflbed[hf]'" in capsys.readouterr().err


def test_labels_outside_the_classes_are_refused(tmp_path):
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.Dataset.from_dict({"image": [Image.fromarray(pattern(0))] * 2, "label": [0, -1]}, features=feats
                               ).save_to_disk(str(tmp_path / "d"))  # fmt: skip
    with pytest.raises(DataError, match=r"label -1 in .* is outside 0…1 \(−1: no label\)"):
        load_dataset("hf", path=tmp_path / "d", splits=["train"])


def test_run_and_data_show_on_a_saved_dataset(hf_dir, tmp_path, capsys):
    """One round of `pflbed run` on the fixture with a natural partition (one client per writer) and a new client,
    then `pflbed data show` of the same config."""
    cfg = tmp_path / "hf.yaml"
    cfg.write_text(f"dataset: {{name: hf, path: {hf_dir}, hf: {{user_column: writer}}}}\nmodel: {{name: mlp}}\n"
                   "federation: {clients: 3, partition: natural, new_clients: 1}\n"
                   "train: {rounds: 1, batch_size: 8}\neval: {every: 1, finetune: [ft], new_clients: {epochs: 1, "
                   "lrs: [0.05]}}\nexecutor: {strict: true}\n")  # fmt: skip
    out = tmp_path / "run"
    assert main(["run", "-c", str(cfg), "--out", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["dataset"] == "hf" and s["clients"] == {"participated": 2, "new": 1} and 0 <= s["final"]["pfl_acc"] <= 1
    capsys.readouterr()
    assert main(["data", "show", "-c", str(cfg)]) == 0
    shown = capsys.readouterr().out
    assert "hf: 2 participated + 1 new clients" in shown
    source = load_source(load_config(cfg).dataset)
    assert source.origin.startswith(str(hf_dir))


def _arrays(tmp_path, name, image, labels=None):
    """A train-only dataset on disk whose image column holds `image` (an array per sample, or a list)."""
    labels = labels if labels is not None else [i % 2 for i in range(len(image))]
    datasets.Dataset.from_dict({"image": image, "label": labels}).save_to_disk(str(tmp_path / name))
    return tmp_path / name


def test_pixel_arrays_in_every_layout_give_the_images_pixels(tmp_path):
    """An array column's layout is read from its shape: [H, W], [H, W, 1] and [1, H, W] are grey; [H, W, 3] and
    [C, H, W] with C = 3 colour, channels in order; [D] a vector. Integers are 0…255 pixels (raw scale 255), booleans
    and floats already in [0, 1] (raw scale 1)."""
    grey = np.stack([pattern(i) for i in range(4)])  # [4, H, W]
    rgb = np.stack([np.stack([pattern(i), pattern(i + 50), pattern(i + 100)], axis=-1) for i in range(4)])
    want_grey = torch.from_numpy(grey).float()[:, None] / 255
    want_rgb = torch.from_numpy(rgb).float().permute(0, 3, 1, 2) / 255
    for name, image, want in (("hw", grey, want_grey), ("hw1", grey[..., None], want_grey),
                              ("1hw", grey[:, None], want_grey), ("hwc", rgb, want_rgb),
                              ("chw", rgb.transpose(0, 3, 1, 2), want_rgb),
                              ("int16", grey.astype(np.int16), want_grey)):  # fmt: skip
        s = load_dataset("hf", path=_arrays(tmp_path, name, image), splits=["train"], normalize=[0.0, 1.0])
        assert s.raw_scale == 255.0 and s.raw_channels_last == (want.shape[1] == 3), name
        assert s.train.x.shape == want.shape and torch.allclose(s.train.x, want, atol=1e-6), name
    vectors = np.arange(12, dtype=np.float32).reshape(4, 3) / 11
    s = load_dataset("hf", path=_arrays(tmp_path, "vec", vectors), splits=["train"], normalize=[0.0, 1.0])
    assert s.raw_scale == 1.0 and s.train.x.shape == (4, 3) and torch.allclose(s.train.x, torch.from_numpy(vectors))
    mask = grey > 20
    s = load_dataset("hf", path=_arrays(tmp_path, "bool", mask), splits=["train"], normalize=[0.0, 1.0])
    assert s.raw_scale == 1.0 and torch.equal(s.train.x[:, 0], torch.from_numpy(mask).float())


@pytest.mark.parametrize("name, image, message", [
    ("c2", np.zeros((2, H, W, 2), np.uint8), r"arrays of shape \[4, 5, 2\] in .*: need \[H, W\], \[H, W, C\] or "
                                             r"\[C, H, W\] with 1 or 3 channels"),
    ("5d", np.zeros((2, 1, H, W, 1), np.uint8), r"arrays of shape \[1, 4, 5, 1\] in .*: need \[H, W\], \[H, W, C\], "
                                                r"\[C, H, W\] or a vector"),
    ("number", np.arange(2, dtype=np.uint8), r"'image' of .* holds one number per sample, not pixels"),
    ("neg", np.full((2, H, W), -1, np.int16), r"integer pixels of .* span -1…-1; need 0…255 \(or floats in "
                                              r"\[0, 1\]\)$"),
    ("wide", np.full((2, H, W), 256, np.int16), r"integer pixels of .* span 256…256; need 0…255 \(or floats in "
                                                r"\[0, 1\]\)$"),
    ("nan", np.full((2, H, W), np.nan, np.float32), r"'image' of .* holds non-finite values"),
    ("ragged", [[1, 2], [3]], r"the arrays of .* differ in shape; store them as images and set "
                              r"dataset\.hf\.image_size to resize them"),
])  # fmt: skip
def test_pixel_arrays_of_no_image_layout_or_range_are_refused_naming_the_column(tmp_path, name, image, message):
    with pytest.raises(DataError, match=r"^dataset\.hf\.image_column: " + message) as info:
        load_dataset("hf", path=_arrays(tmp_path, name, image, labels=[0, 1]), splits=["train"])
    assert "\n" not in str(info.value)


def _dict(tmp_path, name, train, test=None):
    """A DatasetDict on disk with a train (and a test) split, each a dict of columns."""
    parts = {"train": datasets.Dataset.from_dict(train)}
    if test is not None:
        parts["test"] = datasets.Dataset.from_dict(test)
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / name))
    return tmp_path / name


def _fake_load_dataset(monkeypatch, has_trust_remote_code, answer=None, error=None):
    """`datasets.load_dataset` replaced by a recording fake, with or without a `trust_remote_code` parameter (as in
    `datasets` 3 and 4+): each call's (path, name, options, Hub offline?) is recorded; it returns `answer`, a small
    DatasetDict of grey arrays by default, or raises `error`."""
    calls = []

    def record(path, name, options):
        import huggingface_hub.constants as hub

        calls.append((path, name, options, datasets.config.HF_HUB_OFFLINE and hub.HF_HUB_OFFLINE))
        if error is not None:
            raise error
        if answer is not None:
            return answer
        split = {"image": [pattern(i) for i in range(4)], "label": [0, 1, 0, 1]}
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict(split),
                                     "test": datasets.Dataset.from_dict(split)})  # fmt: skip

    if has_trust_remote_code:
        def fake(path, name=None, trust_remote_code="not given"):
            return record(path, name, {"trust_remote_code": trust_remote_code})
    else:
        def fake(path, name=None):
            return record(path, name, {})
    monkeypatch.setattr(datasets, "load_dataset", fake)
    return calls


@pytest.mark.parametrize("has_parameter", [True, False])
def test_a_hub_dataset_is_read_offline_with_its_subset_and_never_its_own_code(monkeypatch, has_parameter):
    """Security: a dataset's own loading code is never run. Where `load_dataset` takes `trust_remote_code` (datasets
    3) it is passed False, explicitly; where it does not (4+, which cannot run such code) nothing extra is passed,
    which would be a TypeError. The subset reaches `load_dataset` as its config name, with the Hub switched off."""
    calls = _fake_load_dataset(monkeypatch, has_parameter)
    s = load_dataset("hf", id=f"tester/remote-{has_parameter}", subset="small", splits=["train"])
    assert len(s.train) == 4 and torch.equal(s.train.x[1, 0], (torch.from_numpy(pattern(1)).float() / 255 - .5) / .5)
    want = {"trust_remote_code": False} if has_parameter else {}
    assert calls == [(f"tester/remote-{has_parameter}", "small", want, True)]
    assert calls[0][2].get("trust_remote_code", False) is False
    assert s.origin == f"tester/remote-{has_parameter} (Hugging Face, small)"


def test_data_files_in_a_local_directory_named_by_id(tmp_path, monkeypatch):
    """`dataset.hf.id` naming a local directory that is not a save_to_disk one: its data files are read with
    `load_dataset(directory, subset)` (Parquet here: split names from the file names), offline."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    files = tmp_path / "files"
    files.mkdir()
    for split, n in (("train", 6), ("test", 4)):
        datasets.Dataset.from_dict({"image": [pattern(i) for i in range(n)], "label": [i % 2 for i in range(n)]}
                                   ).to_parquet(str(files / f"{split}.parquet"))  # fmt: skip
    s = load_dataset("hf", id=str(files))
    assert len(s.train) == 6 and len(s.test) == 4 and s.test.y.tolist() == [0, 1, 0, 1]
    assert torch.equal(s.train.x[5, 0], (torch.from_numpy(pattern(5)).float() / 255 - 0.5) / 0.5)
    assert s.origin == f"{files} (Hugging Face)"
    calls = _fake_load_dataset(monkeypatch, False)  # the subset goes along to `datasets`
    load_dataset("hf", id=str(files), subset="wide", splits=["test"])
    assert calls == [(str(files), "wide", {}, True)]


def test_a_changed_dataset_on_disk_is_read_again(tmp_path, monkeypatch):
    """Repeated loads are cached only while the files are unchanged: a dataset saved anew in the same directory
    (given as dataset.path or as dataset.hf.id), or data files renamed (same times and sizes, other splits), is read
    again, not served from the cache."""
    def saved(offset):
        return datasets.Dataset.from_dict({"image": [pattern(offset + i) for i in range(4)], "label": [0, 1, 0, 1]})

    for how in ("path", "id"):
        d = tmp_path / how
        saved(0).save_to_disk(str(d))
        first = load_dataset("hf", **{how: str(d)}, splits=["train"])
        assert first is load_dataset("hf", **{how: str(d)}, splits=["train"])  # unchanged: the same object
        saved(100).save_to_disk(str(tmp_path / "new"))
        shutil.rmtree(d)
        (tmp_path / "new").rename(d)
        again = load_dataset("hf", **{how: str(d)}, splits=["train"])
        assert torch.equal(again.train.x[0, 0], (torch.from_numpy(pattern(100)).float() / 255 - 0.5) / 0.5), how
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    files = tmp_path / "files"
    files.mkdir()
    saved(0).to_parquet(str(files / "train.parquet"))
    assert len(load_dataset("hf", id=str(files), splits=["train"]).train) == 4
    (files / "train.parquet").rename(files / "test.parquet")
    with pytest.raises(DataError, match=r"dataset\.hf\.splits: .* has no split 'train'; its splits: test$"):
        load_dataset("hf", id=str(files), splits=["train"])


def test_a_saved_split_keeps_its_name_and_one_without_a_name_is_train(tmp_path):
    """A single saved Dataset is the split it was saved as (here `test`); one saved without a split is `train`."""
    datasets.Dataset.from_dict({"image": [pattern(i) for i in range(4)], "label": [0, 1, 0, 1]},
                               split="test").save_to_disk(str(tmp_path / "t"))  # fmt: skip
    s = load_dataset("hf", path=tmp_path / "t", splits=["test"])
    assert len(s.train) == 4 and len(s.test) == 0
    with pytest.raises(DataError, match=r"dataset\.hf\.splits: .* has no split 'train'; its splits: test$"):
        load_dataset("hf", path=tmp_path / "t", splits=["train"])


def test_where_the_dataset_is_and_what_cannot_be_read_are_one_line_errors(tmp_path, monkeypatch):
    """No path and no id; a dataset.path that is no save_to_disk directory (with or without another id); a damaged
    save_to_disk directory, with what `datasets` said on one line."""
    with pytest.raises(DataError, match=r"^dataset\.hf\.id: name a Hugging Face dataset \(a Hub id or a local "
                                        r"directory\), or set dataset\.path to a save_to_disk directory$"):
        load_dataset("hf")
    empty = tmp_path / "empty"
    empty.mkdir()
    message = (rf"^dataset\.path: {re.escape(str(empty))} is not a save_to_disk directory \(no dataset_dict\.json or "
               r"state\.json\); give data files with dataset\.hf\.id$")
    for kwargs in ({}, {"id": "tester/elsewhere"}):
        with pytest.raises(DataError, match=message):
            load_dataset("hf", path=empty, **kwargs)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "state.json").write_text("{not json")
    with pytest.raises(DataError, match=rf"^{re.escape(str(damaged))}: not a readable save_to_disk directory \(.+\)$"):
        load_dataset("hf", path=damaged)

    def broken(path):
        raise OSError("arrow file\n   truncated")

    monkeypatch.setattr(datasets, "load_from_disk", broken)
    (damaged / "state.json").write_text("{}")
    with pytest.raises(DataError, match=r"not a readable save_to_disk directory \(arrow file truncated\)$"):
        load_dataset("hf", path=damaged)


@pytest.mark.parametrize("error, said", [
    (ValueError("not in\n   the cache"), "not in the cache"),
    (ValueError(), "ValueError"),
    (ValueError("x" * 400), "x" * 300),
])  # fmt: skip
def test_what_datasets_said_when_a_hub_dataset_cannot_be_read(monkeypatch, error, said):
    """The error of `load_dataset` is quoted on one line (its type when it says nothing), at most 300 characters."""
    _fake_load_dataset(monkeypatch, False, error=error)
    with pytest.raises(DataError, match=rf"^dataset\.hf\.id: cannot read 'tester/gone' offline \({said}\); download "
                                        r"it once with datasets\.load_dataset\('tester/gone'\)\.save_to_disk\(DIR\) "
                                        r"and set dataset\.path=DIR$"):
        load_dataset("hf", id="tester/gone")


def test_integer_and_string_user_ids_and_ids_of_neither(tmp_path):
    """Integer user ids are used as they are (int64); strings are numbered; anything else (booleans, floats) is a
    one-line error naming the column."""
    def users(ids):
        name = f"u{len(list(tmp_path.iterdir()))}"
        image = [pattern(i) for i in range(len(ids))]
        return _dict(tmp_path, name, {"image": image, "label": [i % 2 for i in range(len(ids))], "who": ids})

    s = load_dataset("hf", path=users([7, 3, 7, 12]), splits=["train"], user_column="who")
    assert s.train.user.tolist() == [7, 3, 7, 12] and s.train.user.dtype == torch.int64
    s = load_dataset("hf", path=users(["b", "a", "b", "c"]), splits=["train"], user_column="who")
    assert s.train.user.tolist() == [1, 0, 1, 2] and s.train.user.dtype == torch.int64
    for bad in ([True, False, True, False], [1.0, 2.0, 1.0, 2.0]):
        with pytest.raises(DataError, match=r"^dataset\.hf\.user_column: 'who' must hold integers or strings for "
                                            r"every sample$"):
            load_dataset("hf", path=users(bad), splits=["train"], user_column="who")


def test_labels_missing_of_no_label_type_outside_the_classes_or_of_one_class(tmp_path):
    """Labels: a sample without one, floats, a ClassLabel id at or past its number of classes, and a single class
    (integers, strings or a ClassLabel alike) are one-line errors naming the column."""
    images = [pattern(i) for i in range(4)]
    path = _dict(tmp_path, "none", {"image": images, "label": [0, 1, None, 1]})
    with pytest.raises(DataError, match=rf"^dataset\.hf\.label_column: 'label' of {re.escape(str(path))} has samples "
                                        "without a label$"):
        load_dataset("hf", path=path, splits=["train"])
    path = _dict(tmp_path, "float", {"image": images, "label": [0.0, 1.0, 0.5, 1.0]})
    with pytest.raises(DataError, match=r"^dataset\.hf\.label_column: 'label' of .* holds .*float.*; labels must be a "
                                        r"ClassLabel, integers or strings$"):
        load_dataset("hf", path=path, splits=["train"])
    two = datasets.Dataset.from_dict({"image": images, "label": [0, 1, 2, 0]}).cast_column(
        "label", datasets.ClassLabel(names=["a", "b"]))
    datasets.DatasetDict({"train": two}).save_to_disk(str(tmp_path / "past"))
    with pytest.raises(DataError, match=r"^dataset\.hf\.label_column: label 2 in .*past's train split is outside "
                                        r"0…1$"):
        load_dataset("hf", path=tmp_path / "past", splits=["train"])
    for name, labels in (("int", [0, 0, 0, 0]), ("str", ["cat"] * 4)):
        path = _dict(tmp_path, name, {"image": images, "label": labels})
        with pytest.raises(DataError, match=r"^dataset\.hf\.label_column: 'label' of .* has 1 class; need at least "
                                            r"2$"):
            load_dataset("hf", path=path, splits=["train"])


def test_a_split_of_one_sample_and_an_empty_split(tmp_path, monkeypatch):
    """A split of one sample is a split; an empty one (which `datasets` may hand over, though it cannot save one) is a
    one-line error naming it."""
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    image = [Image.fromarray(pattern(i)) for i in range(3)]
    train = datasets.Dataset.from_dict({"image": image[:2], "label": [0, 1]}, features=feats)
    one = datasets.Dataset.from_dict({"image": image[2:], "label": [1]}, features=feats)
    datasets.DatasetDict({"train": train, "test": one}).save_to_disk(str(tmp_path / "one"))
    s = load_dataset("hf", path=tmp_path / "one")
    assert len(s.test) == 1 and torch.equal(s.test.x[0, 0], (torch.from_numpy(pattern(2)).float() / 255 - 0.5) / 0.5)
    empty = datasets.Dataset.from_dict({"image": [], "label": []}, features=feats)
    _fake_load_dataset(monkeypatch, False, answer=datasets.DatasetDict({"train": train, "test": empty}))
    with pytest.raises(DataError, match=r"^dataset\.hf\.splits: tester/empty's test split has no samples$"):
        load_dataset("hf", id="tester/empty")


def test_image_modes_become_grey_or_rgb_and_a_split_mixing_them_is_rgb(tmp_path):
    """Bilevel ("1") and grey+alpha ("LA") images are grey, 0 or 255 / the grey value; RGBA is RGB (alpha dropped);
    a split with colour and grey images is all RGB, each grey image's value in all three channels."""
    grey = pattern(0)
    rgb = np.stack([pattern(1), pattern(51), pattern(101)], axis=-1)
    cases = {
        "1": ([Image.fromarray(grey > 20)] * 2, torch.from_numpy(grey > 20).float()[None] * 255),
        "LA": ([Image.fromarray(np.stack([grey, grey * 0 + 9], axis=-1), mode="LA")] * 2,
               torch.from_numpy(grey).float()[None]),
        "RGBA": ([Image.fromarray(np.concatenate([rgb, rgb[..., :1] * 0 + 7], axis=-1), mode="RGBA")] * 2,
                 torch.from_numpy(rgb).float().permute(2, 0, 1)),
    }  # fmt: skip
    for mode, (images, want) in cases.items():
        assert images[0].mode == mode
        datasets.Dataset.from_dict({"image": images, "label": [0, 1]}).save_to_disk(str(tmp_path / mode))
        s = load_dataset("hf", path=tmp_path / mode, splits=["train"], normalize=[0.0, 1.0])
        assert s.train.x.shape == (2, *want.shape) and torch.equal(s.train.x[1], want / 255), mode
    mixed = [Image.fromarray(rgb), Image.fromarray(grey)]
    datasets.Dataset.from_dict({"image": mixed, "label": [0, 1]}).save_to_disk(str(tmp_path / "mixed"))
    s = load_dataset("hf", path=tmp_path / "mixed", splits=["train"], normalize=[0.0, 1.0])
    assert s.train.x.shape == (2, 3, H, W) and s.raw_channels_last
    assert torch.equal(s.train.x[0], torch.from_numpy(rgb).float().permute(2, 0, 1) / 255)
    assert all(torch.equal(s.train.x[1, c], torch.from_numpy(grey).float() / 255) for c in range(3))


def test_full_range_pixels_are_kept_and_a_pixel_past_it_refused(tmp_path):
    """0 and 255 are pixels (x = −1 and 1), as integer arrays and as 32-bit integer ("I") images; 256 in an "I" image
    is refused."""
    full = np.zeros((H, W), np.uint8)
    full[0, 0], full[1, 1] = 255, 0
    full[2] = 128
    want = (torch.from_numpy(full).float() / 255 - 0.5) / 0.5
    s = load_dataset("hf", path=_arrays(tmp_path, "u8", np.stack([full, full])), splits=["train"])
    assert torch.equal(s.train.x[1, 0], want) and s.train.x.max() == 1 and s.train.x.min() == -1
    images = [Image.fromarray(full.astype(np.int32)), Image.fromarray(full.astype(np.int32))]
    assert images[0].mode == "I"
    datasets.Dataset.from_dict({"image": images, "label": [0, 1]}).save_to_disk(str(tmp_path / "i"))
    s = load_dataset("hf", path=tmp_path / "i", splits=["train"])
    assert s.raw_scale == 255.0 and torch.allclose(s.train.x[0, 0], want, atol=1e-6)
    past = [Image.fromarray(np.full((H, W), v, np.int32)) for v in (0, 256)]
    datasets.Dataset.from_dict({"image": past, "label": [0, 1]}).save_to_disk(str(tmp_path / "past"))
    with pytest.raises(DataError, match=r"32-bit integer image 1 of .* spans 256…256; need 0…255"):
        load_dataset("hf", path=tmp_path / "past", splits=["train"])


def test_images_missing_or_not_finite_and_columns_of_no_pixels(tmp_path):
    """A sample without an image, a float image holding NaN, a column of dates, and an image column whose images
    cannot be decoded are one-line errors naming the split; a column other than the chosen one is never decoded."""
    import datetime

    what = re.escape(str(tmp_path / "none")) + "'s train split"
    datasets.Dataset.from_dict({"image": [Image.fromarray(pattern(0)), None], "label": [0, 1]},
                               features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
                               ).save_to_disk(str(tmp_path / "none"))  # fmt: skip
    with pytest.raises(DataError, match=rf"^dataset\.hf\.image_column: sample 1 of {what} has no image$"):
        load_dataset("hf", path=tmp_path / "none", splits=["train"])
    nan = np.full((H, W), 0.5, np.float32)
    nan[1, 2] = np.nan
    floats = [Image.fromarray(np.full((H, W), 0.25, np.float32)), Image.fromarray(nan)]
    datasets.Dataset.from_dict({"image": floats, "label": [0, 1]}).save_to_disk(str(tmp_path / "nan"))
    with pytest.raises(DataError, match=r"^dataset\.hf\.image_column: image 1 of .*nan's train split holds non-finite "
                                        r"values$"):
        load_dataset("hf", path=tmp_path / "nan", splits=["train"])
    day = datetime.datetime(2020, 1, 1)
    path = _arrays(tmp_path, "dates", [[day, day], [day, day]])
    with pytest.raises(DataError, match=r"^dataset\.hf\.image_column: 'image' of .*dates's train split holds "
                                        r"datetime64.*, not pixels$"):
        load_dataset("hf", path=path, splits=["train"])
    junk = [[{"bytes": b"not an image", "path": None}]] * 2
    feats = datasets.Features({"image": datasets.Array2D((H, W), "uint8"), "junk": datasets.Sequence(datasets.Image()),
                               "label": datasets.Value("int64")})  # fmt: skip
    datasets.Dataset.from_dict({"image": [pattern(0), pattern(1)], "junk": junk, "label": [0, 1]}, features=feats
                               ).save_to_disk(str(tmp_path / "junk"))  # fmt: skip
    s = load_dataset("hf", path=tmp_path / "junk", splits=["train"])  # the junk column is not read
    assert torch.equal(s.train.x[1, 0], (torch.from_numpy(pattern(1)).float() / 255 - 0.5) / 0.5)
    with pytest.raises(DataError, match=r"^dataset\.hf\.image_column: 'junk' of .*junk's train split is not an array "
                                        r"per sample \(cannot identify image file .*\)$"):
        load_dataset("hf", path=tmp_path / "junk", splits=["train"], image_column="junk")
