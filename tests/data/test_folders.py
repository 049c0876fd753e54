"""Domain-folder loader tests on real PNG/JPEG files written with Pillow into a temporary tree.

Images are solid colours per class, so after resizing and the fixed [-1, 1] normalization the expected pixel
values are known exactly (PNG) or within JPEG's small colour error.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pflbed.data.folders import describe_domain_folders, load_domain_folders
from pflbed.errors import DataError

# Class folder name -> RGB colour. Created in non-sorted order on purpose; sorted: blue, green, red.
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}
CLASSES = sorted(COLOURS)
DOMAINS = ["art", "photo"]
# (file name, size): mixed formats, an upper-case extension and two sizes.
FILES = [("c.png", (20, 30)), ("a.jpg", (40, 40)), ("b.PNG", (40, 40))]


def write_image(path: Path, colour: tuple[int, int, int], size: tuple[int, int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = "JPEG" if path.suffix.lower() in {".jpg", ".jpeg"} else "PNG"
    Image.new("RGB", size, colour).save(path, format=fmt)
    return path


def make_tree(root: Path, domains: dict[str, list[str]] | None = None) -> Path:
    """Write `domain/class/file` images; `domains` maps each domain to its classes (default: all of them)."""
    domains = domains or {d: list(COLOURS) for d in DOMAINS}
    for domain, classes in domains.items():
        for name in classes:
            for file, size in FILES:
                write_image(root / domain / name / file, COLOURS[name], size)
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = make_tree(tmp_path / "pacs")
    # Noise that must be ignored: hidden entries, stray files at the domain and root level.
    (root / ".hidden").mkdir()
    (root / "art" / ".DS_Store").write_bytes(b"\0")
    (root / "art" / "red" / ".thumb.png").write_bytes(b"garbage")
    (root / "README").write_text("readme")
    (root / "photo" / "index.csv").write_text("x")
    return root


def noisy_jpeg_bytes(size: int = 64) -> bytes:
    """A JPEG whose bytes are mostly entropy-coded scan data, so cutting it in half truncates the scan."""
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def assert_one_line_naming(exc: pytest.ExceptionInfo[DataError], path: Path) -> None:
    message = str(exc.value)
    assert str(path) in message
    assert "\n" not in message


def test_non_image_files_in_class_folders_are_skipped_and_counted(tree: Path, capsys) -> None:
    """As torchvision's ImageFolder: a stray notes.txt / Thumbs.db is skipped by extension, not an error; the load
    says how many in one warning line (once: a cached load says nothing again) and the listing counts them."""
    (tree / "art" / "red" / "notes.txt").write_text("not an image")
    (tree / "photo" / "blue" / "Thumbs.db").write_bytes(b"\0\1")
    (tree / "photo" / "blue" / ".DS_Store").write_bytes(b"\0")  # hidden: ignored, not counted
    source = load_domain_folders(tree, image_size=8)
    assert len(source.train) == 18 and source.train.y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] * 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pflbed: warning: ") and "skipped 2 non-image file(s)" in err and "\n" not in err, err
    assert str(tree.resolve() / "art" / "red" / "notes.txt") in err
    assert load_domain_folders(tree, image_size=8) is source and capsys.readouterr().err == ""
    assert describe_domain_folders(tree)["skipped"] == 2 and describe_domain_folders(tree)["total"] == 18


def test_a_folder_inside_a_class_folder_is_named(tree: Path) -> None:
    nested = tree / "art" / "red" / "more"
    write_image(nested / "d.png", COLOURS["red"], (8, 8))
    with pytest.raises(DataError, match="a folder inside a class folder") as exc:
        load_domain_folders(tree, image_size=8)
    assert_one_line_naming(exc, nested)


def test_shapes_labels_domains_and_order(tree: Path) -> None:
    source = load_domain_folders(tree, image_size=8)
    train = source.train
    assert train.x.shape == (18, 3, 8, 8) and train.x.dtype == torch.float32
    assert train.y.dtype == torch.int64 and train.domain is not None and train.domain.dtype == torch.int64
    # Domain-major, then class, 3 files each.
    assert train.domain.tolist() == [0] * 9 + [1] * 9
    assert train.y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] * 2
    assert source.num_classes == 3
    assert source.name == "folder:pacs"
    assert source.origin == str(tree.resolve())
    assert source.input_shape == (3, 8, 8)


def test_pixel_values_after_resize_and_normalization(tree: Path) -> None:
    x = load_domain_folders(tree, image_size=8).train.x
    for c, name in enumerate(CLASSES):
        expected = torch.tensor(COLOURS[name], dtype=torch.float32) / 255 * 2 - 1
        for d in range(2):
            # Sorted file names: a.jpg, b.PNG, c.png; the PNGs are exact, the JPEG within a few levels.
            start = d * 9 + c * 3
            for offset, tol in ((0, 0.1), (1, 1e-6), (2, 1e-6)):
                per_channel = x[start + offset].mean(dim=(1, 2))
                torch.testing.assert_close(per_channel, expected, atol=tol, rtol=0)
                assert float(x[start + offset].amin()) >= -1 and float(x[start + offset].amax()) <= 1


def test_files_sorted_by_name_within_class(tmp_path: Path) -> None:
    folder = tmp_path / "root" / "only" / "k"
    for name, grey in (("b.png", 100), ("c.bmp", 200), ("a.gif", 0)):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (5, 5), (grey, grey, grey)).save(path)
    x = load_domain_folders(tmp_path / "root", image_size=4).train.x
    greys = ((x[:, 0].mean(dim=(1, 2)) + 1) / 2 * 255).round().tolist()
    assert greys == [0, 100, 200]


def test_empty_test_split_and_image_size(tree: Path) -> None:
    source = load_domain_folders(tree, image_size=5)
    assert source.train.x.shape == (18, 3, 5, 5)
    test = source.test
    assert test.x.shape == (0, 3, 5, 5) and test.y.shape == (0,)
    assert test.domain is not None and test.domain.shape == (0,)
    assert len(test) == 0
    assert load_domain_folders(tree, image_size=12).train.x.shape == (18, 3, 12, 12)


def test_class_union_shared_across_domains(tmp_path: Path) -> None:
    # Domain "b" alone has "aardvark", which sorts first: it shifts every class index, in both domains.
    root = tmp_path / "mixed"
    make_tree(root, {"a": ["red", "green"], "b": ["red", "green"]})
    write_image(root / "b" / "aardvark" / "x.png", (10, 20, 30), (6, 6))
    source = load_domain_folders(root, image_size=4)
    assert source.num_classes == 3  # aardvark, green, red
    assert source.train.domain is not None
    assert source.train.domain.tolist() == [0] * 6 + [1] * 7
    assert source.train.y.tolist() == [1, 1, 1, 2, 2, 2] + [0] + [1, 1, 1, 2, 2, 2]
    info = describe_domain_folders(root)
    assert info["classes"] == ["aardvark", "green", "red"]
    assert info["images"] == {"a": 6, "b": 7}


def test_describe_counts_without_decoding(tree: Path) -> None:
    # A corrupt file is still counted: describing only lists the tree.
    (tree / "photo" / "blue" / "zz.jpg").write_bytes(b"not a jpeg")
    info = describe_domain_folders(tree)
    assert info["domains"] == DOMAINS
    assert info["classes"] == CLASSES
    assert info["images"] == {"art": 9, "photo": 10}
    assert info["total"] == 19
    assert info["root"] == str(tree.resolve())


def test_cache_returns_same_object_and_sees_changes(tree: Path) -> None:
    first = load_domain_folders(tree, image_size=6)
    assert load_domain_folders(str(tree), image_size=6) is first
    assert load_domain_folders(tree, image_size=7) is not first
    # Rewriting a file with different content (and size) must miss the cache.
    write_image(tree / "art" / "red" / "c.png", (0, 0, 0), (33, 17))
    second = load_domain_folders(tree, image_size=6)
    assert second is not first
    assert float(second.train.x[CLASSES.index("red") * 3 + 2].max()) == -1.0


def test_empty_class_folder(tree: Path) -> None:
    empty = tree / "photo" / "green2"
    empty.mkdir()
    (empty / ".keep").write_text("hidden: ignored")
    with pytest.raises(DataError, match="no images") as exc:
        load_domain_folders(tree)
    assert_one_line_naming(exc, empty)
    with pytest.raises(DataError):
        describe_domain_folders(tree)


def test_corrupt_image(tree: Path) -> None:
    bad = tree / "art" / "green" / "broken.png"
    bad.write_bytes(b"\x00garbage bytes, not a PNG" * 10)
    with pytest.raises(DataError, match="cannot read image") as exc:
        load_domain_folders(tree, image_size=4)
    assert_one_line_naming(exc, bad)


def test_truncated_jpeg(tree: Path) -> None:
    data = noisy_jpeg_bytes()
    bad = tree / "photo" / "red" / "half.jpg"
    bad.write_bytes(data[: len(data) // 2])
    with Image.open(bad) as img:  # the header survives: only decoding can notice the truncation
        assert img.size == (64, 64)
    with pytest.raises(DataError, match="cannot read image") as exc:
        load_domain_folders(tree, image_size=4)
    assert_one_line_naming(exc, bad)


def test_missing_root(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="no such directory") as exc:
        load_domain_folders(missing)
    assert_one_line_naming(exc, missing)


def test_root_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "file.png"
    write_image(file, (1, 2, 3), (4, 4))
    with pytest.raises(DataError, match="not a directory") as exc:
        load_domain_folders(file)
    assert_one_line_naming(exc, file)


def test_no_domain_folders(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    write_image(root / "img.png", (1, 2, 3), (4, 4))
    (root / ".hidden_domain").mkdir()
    with pytest.raises(DataError, match="no domain folders") as exc:
        load_domain_folders(root)
    assert_one_line_naming(exc, root)


def test_domain_without_class_folders(tree: Path) -> None:
    bare = tree / "sketch"
    write_image(bare / "loose.png", (1, 2, 3), (4, 4))
    with pytest.raises(DataError, match="no class folders") as exc:
        load_domain_folders(tree)
    assert_one_line_naming(exc, bare)


@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_bad_image_size(tree: Path, size: object) -> None:
    with pytest.raises(DataError, match="image_size") as exc:
        load_domain_folders(tree, image_size=size)  # type: ignore[arg-type]
    assert_one_line_naming(exc, tree)
