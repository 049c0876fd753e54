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

from pflbed.data.folders import IMAGENET_MEAN, IMAGENET_STD, describe_domain_folders, load_domain_folders
from pflbed.data.named_folders import BENCHMARKS, find_named, how_to_get, load_domainnet, load_officehome, load_pacs
from pflbed.errors import DataError

from .. import data_formats as fx

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


# --- decoding: colour modes, filter, Pillow's reason ---------------------------------------------------------------


def test_grey_and_palette_images_become_three_channels(tmp_path: Path) -> None:
    """Every image is converted to RGB: a greyscale PNG gives three equal channels, a palette PNG its colours."""
    folder = tmp_path / "root" / "only" / "k"
    folder.mkdir(parents=True)
    Image.new("L", (6, 6), 90).save(folder / "a.png")
    palette = Image.new("P", (6, 6), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.save(folder / "b.png")
    x = load_domain_folders(tmp_path / "root", image_size=4).train.x
    pixels = ((x + 1) / 2 * 255).round().to(torch.int64)
    assert pixels.shape == (2, 3, 4, 4)
    assert pixels[0].unique().tolist() == [90]
    assert [pixels[1, c].unique().tolist() for c in range(3)] == [[10], [200], [30]]


def test_resize_is_pillow_s_bilinear(tmp_path: Path) -> None:
    """A resized image is exactly Pillow's bilinear resize of the file, not its bicubic default."""
    path = tmp_path / "root" / "only" / "k" / "noise.png"
    path.parent.mkdir(parents=True)
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path)
    with Image.open(path) as img:
        bilinear = np.array(img.resize((6, 6), Image.Resampling.BILINEAR)).transpose(2, 0, 1)
        bicubic = np.array(img.resize((6, 6), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
    assert not np.array_equal(bilinear, bicubic)  # the image tells the two filters apart
    x = load_domain_folders(tmp_path / "root", image_size=6).train.x[0]
    assert np.array_equal(((x + 1) / 2 * 255).round().to(torch.int64).numpy(), bilinear)


def test_corrupt_image_message_carries_pillow_s_reason(tree: Path) -> None:
    bad = tree / "art" / "green" / "broken.png"
    bad.write_bytes(b"garbage")
    with pytest.raises(DataError) as exc:
        load_domain_folders(tree, image_size=4)
    assert str(exc.value) == f"{bad}: cannot read image (cannot identify image file {str(bad)!r})"


# --- arguments -----------------------------------------------------------------------------------------------------


def test_default_image_size_is_32_and_one_pixel_is_allowed(tree: Path) -> None:
    assert load_domain_folders(tree).input_shape == (3, 32, 32)
    assert load_domain_folders(tree, image_size=1).input_shape == (3, 1, 1)


def test_unknown_normalization_is_one_line_listing_the_choices(tree: Path) -> None:
    with pytest.raises(DataError) as exc:
        load_domain_folders(tree, image_size=4, normalize="Symmetric")
    assert str(exc.value) == f"{tree}: normalize must be one of symmetric, imagenet, got 'Symmetric'"


def test_skipped_files_warning_names_the_root(tree: Path, capsys) -> None:
    (tree / "art" / "red" / "notes.txt").write_text("not an image")
    load_domain_folders(tree, image_size=3)
    root = tree.resolve()
    assert capsys.readouterr().err == (
        f"pflbed: warning: {root}: skipped 1 non-image file(s) in class folders "
        f"(images are .bmp, .gif, .jpeg, .jpg, .png), e.g. {root / 'art' / 'red'}/notes.txt\n"
    )


# --- file-system failures: one line naming the path ----------------------------------------------------------------


def test_a_path_with_a_control_character_is_quoted_in_one_line(tmp_path: Path) -> None:
    """A newline in a folder name would split the error in two: such a path is shown as a quoted literal."""
    missing = tmp_path / "two\nlines"
    with pytest.raises(DataError) as exc:
        load_domain_folders(missing)
    assert str(exc.value) == f"{str(missing)!r}: no such directory"


@pytest.mark.parametrize(("error", "reason"), [
    (PermissionError(13, "Permission denied"), "Permission denied"),
    (OSError("device  went\naway"), "device went away"),
    (OSError(), "OSError"),
])  # fmt: skip
def test_a_folder_that_cannot_be_listed_is_named(tree: Path, monkeypatch, error: OSError, reason: str) -> None:
    """The reason is the OS's error text, else the exception's text on one line, else its type."""
    import os

    from pflbed.data import folders

    victim = tree.resolve() / "photo" / "green"
    real = os.scandir

    def scandir(path):
        if Path(path) == victim:
            raise error
        return real(path)

    monkeypatch.setattr(folders.os, "scandir", scandir)
    with pytest.raises(DataError) as exc:
        load_domain_folders(tree, image_size=4)
    assert str(exc.value) == f"{victim}: cannot list folder ({reason})"


def test_an_image_gone_between_listing_and_loading_is_named(tree: Path, monkeypatch) -> None:
    from pflbed.data import folders

    victim = tree.resolve() / "art" / "blue" / "b.PNG"
    real = folders._scan

    def scan_then_lose_one(root, skip_classless=False):
        listed = real(root, skip_classless)
        victim.unlink()
        return listed

    monkeypatch.setattr(folders, "_scan", scan_then_lose_one)
    with pytest.raises(DataError) as exc:
        load_domain_folders(tree, image_size=4)
    assert str(exc.value) == f"{victim}: cannot stat image (No such file or directory)"


def test_an_image_that_cannot_be_stat_ed_without_an_os_reason_is_named(tree: Path, monkeypatch) -> None:
    import os

    from pflbed.data import folders

    victim = str(tree.resolve() / "art" / "blue" / "b.PNG")
    real = os.stat

    def stat(path, *args, **kwargs):
        if str(path) == victim:
            raise OSError("stat  failed\nhere")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(folders.os, "stat", stat)
    with pytest.raises(DataError) as exc:
        load_domain_folders(tree, image_size=4)
    assert str(exc.value) == f"{victim}: cannot stat image (stat failed here)"


# --- the named benchmarks (Office-Home, PACS, DomainNet) -----------------------------------------------------------


NAMED = {  # loader, a domain folder of the benchmark, its class count
    "officehome": (load_officehome, "Clipart", 65),
    "pacs": (load_pacs, "sketch", 7),
    "domainnet": (load_domainnet, "real", 345),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_named_benchmark_defaults(env: Path, no_download: list, name: str) -> None:
    """Called with a path alone: 32-px images, the symmetric [-1, 1] normalization, the benchmark's name; a missing
    copy is the not-found error saying where to get it, and nothing is fetched unless asked (asked, there is no
    official archive to fetch)."""
    load, domain, classes = NAMED[name]
    title = BENCHMARKS[name].title
    root = fx.make_domain_tree(env / name, (domain,), classes, size=4)
    source = load(root)
    assert source.name == name and source.num_classes == classes and source.input_shape == (3, 32, 32)
    assert source.pixel_norm == (0.5, 0.5) and float(source.train.x.min()) >= -1
    missing = env / "nothing"
    with pytest.raises(DataError) as exc:
        load(missing)
    assert str(exc.value) == f"dataset {name} ({title}) not found (looked in {missing}); {how_to_get(name)}"
    with pytest.raises(DataError) as exc:
        load(missing, download=True)
    assert str(exc.value) == (f"dataset {name} ({title}) not found and has no official archive to download; "
                              f"{how_to_get(name)}")  # fmt: skip
    assert no_download == []


def test_how_to_get_lists_the_domains() -> None:
    assert how_to_get("officehome") == ("download it from hemanthdv.github.io/officehome-dataset and set dataset.path "
                                        "(or $PFLBED_DATA/officehome) to the folder holding Art, Clipart, Product, "
                                        "Real World")  # fmt: skip


def test_named_benchmark_passes_normalize_and_image_size(env: Path) -> None:
    """`normalize` and `image_size` reach the folder loader; each size is its own pool, not the first one cached."""
    root = fx.make_domain_tree(env / "PACS", ("photo",), 7, size=4)
    imagenet = load_pacs(root, image_size=3, normalize="imagenet")
    assert imagenet.pixel_norm == (IMAGENET_MEAN, IMAGENET_STD)
    symmetric = load_pacs(root, image_size=3)
    assert symmetric.pixel_norm == (0.5, 0.5) and symmetric is not imagenet
    assert load_pacs(root, image_size=5).input_shape == (3, 5, 5)
    assert load_pacs(root, image_size=3) is symmetric


def test_named_benchmarks_keep_at_most_four_pools_alive(env: Path) -> None:
    """As the folder loader's cache, the named loaders hold no more than 4 pools: the oldest of 5 is released."""
    import gc
    import weakref

    root = fx.make_domain_tree(env / "PACS", ("photo",), 7, size=4)
    oldest = weakref.ref(load_pacs(root, image_size=2))
    for size in (3, 4, 5):
        load_pacs(root, image_size=size)
    gc.collect()
    assert oldest() is not None  # four: all kept
    load_pacs(root, image_size=6)
    gc.collect()
    assert oldest() is None


def test_domain_folder_spellings_and_a_stray_domain(env: Path) -> None:
    """Case, runs of spaces, `_` and `-`, and a trailing separator do not matter; a folder that is no Office-Home
    domain is refused naming it and listing the benchmark's domains."""
    root = fx.make_domain_tree(env / "oh", ("ART", "real--World_", "Product "), 65, size=2)
    assert load_officehome(root, image_size=2).domain_names == ("ART", "Product ", "real--World_")
    fx.make_domain_tree(root, ("Sketch",), 65, size=2)
    with pytest.raises(DataError) as exc:
        load_officehome(root, image_size=2)
    assert str(exc.value) == (f"{root.resolve() / 'Sketch'}: not a Office-Home domain folder (Office-Home has Art, "
                              f"Clipart, Product, Real World); move it out of {root.resolve()}")  # fmt: skip


def test_find_named_looks_in_the_given_path(env: Path) -> None:
    root = fx.make_domain_tree(env / "data" / "PACS", ("photo",), 7, size=2)
    assert find_named("pacs", env / "data") == root
    assert find_named("pacs", env / "elsewhere") is None


def test_byte_identical_copies_within_a_domain_are_left_out_with_one_warning(tmp_path: Path, capsys) -> None:
    """A file byte for byte equal to one before it (load order: class, then name) in its domain is left out, in
    its own class or another; the same bytes in another domain stay (each domain's test set is cut from its own
    samples). The listing counts files as found; the load warns once."""
    root = tmp_path / "tree"
    files = (("art", "a", "0.png", (1, 2, 3)), ("art", "a", "1.png", (1, 2, 3)), ("art", "a", "2.png", (9, 9, 9)),
             ("art", "b", "0.png", (1, 2, 3)), ("art", "b", "5.png", (7, 7, 7)), ("photo", "a", "0.png", (1, 2, 3)))
    for domain, cls, name, colour in files:
        path = root / domain / cls / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(fx.png_bytes(colour, size=2))
    assert describe_domain_folders(root)["images"] == {"art": 5, "photo": 1}
    pool = load_domain_folders(root, image_size=2)
    px = np.rint((pool.train.x[:, :, 0, 0].numpy() * 0.5 + 0.5) * 255).astype(int).tolist()
    assert px == [[1, 2, 3], [9, 9, 9], [7, 7, 7], [1, 2, 3]]
    assert pool.train.y.tolist() == [0, 0, 1, 0] and pool.train.domain.tolist() == [0, 0, 0, 1]
    art = root.resolve() / "art"
    assert capsys.readouterr().err == (f"pflbed: warning: {root.resolve()}: left out 2 image file(s) byte-identical "
                                       f"to an earlier one of their domain, e.g. {art / 'a' / '1.png'}\n")  # fmt: skip
    assert load_domain_folders(root, image_size=2) is pool and capsys.readouterr().err == ""


@pytest.mark.parametrize(("error", "reason"), [(PermissionError(13, "Permission denied"), "Permission denied"),
                                               (OSError("read\nfailed"), "read failed")])  # fmt: skip
def test_a_file_unreadable_when_its_copies_are_looked_for_is_named(tree: Path, monkeypatch, error, reason) -> None:
    """Finding byte-identical copies reads every image once before decoding: a file that cannot be read then is a
    one-line error naming it with the system's reason (or the error's own text, on one line)."""
    victim = tree.resolve() / "art" / "blue" / "b.PNG"
    real = Path.read_bytes

    def read_bytes(self):
        if self == victim:
            raise error
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(DataError) as exc:
        load_domain_folders(tree, image_size=4)
    assert str(exc.value) == f"{victim}: cannot read image ({reason})"


def test_a_plain_tree_s_listing_refuses_a_top_level_folder_without_class_folders_as_its_load_does(tree: Path) -> None:
    """Only a named benchmark passes over such a folder (its domains are known); `folder`'s listing and load both
    refuse it, naming it."""
    (tree / "image_list").mkdir()
    (tree / "image_list" / "art.txt").write_text("art/blue/b.PNG 0\n")
    for call in (lambda: describe_domain_folders(tree), lambda: load_domain_folders(tree, image_size=4)):
        with pytest.raises(DataError) as exc:
            call()
        assert str(exc.value) == f"{tree.resolve() / 'image_list'}: domain folder has no class folders"
