"""Writers of small files in the published on-disk formats of the datasets the loaders read.

Every writer encodes its format here, independently of the loader under test (its own pickle opcodes, IDX headers,
JSON keys), and the images carry known pixel patterns, so a test can tell a transposed image, swapped channels or
a shifted label map from the right one. `benchmarks/data_load.py` writes its CIFAR-sized set with `cifar_batch`.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

# --- Python 2 pickles, as the CIFAR "python version" files are written ---------------------------------------


def _py2_str(data: bytes) -> bytes:
    """A Python 2 `str`: SHORT_BINSTRING or BINSTRING."""
    if len(data) < 256:
        return b"U" + bytes([len(data)]) + data
    return b"T" + struct.pack("<I", len(data)) + data


def _py2_int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    return b"J" + struct.pack("<i", v)


def _py2_array(a: np.ndarray) -> bytes:
    """A NumPy 1 array pickled by Python 2: `_reconstruct(ndarray, (0,), 'b')`, then its state (1, shape, dtype,
    fortran, raw bytes); the dtype `dtype('u1', 0, 1)` with state (3, '|', None, None, None, -1, -1, 0)."""
    assert a.dtype == np.uint8
    out = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + _py2_int(0) + b"\x85" + _py2_str(b"b")
    out += b"\x87R("  # TUPLE3, REDUCE, MARK
    out += _py2_int(1) + b"(" + b"".join(_py2_int(d) for d in a.shape) + b"t"
    out += b"cnumpy\ndtype\n" + _py2_str(b"u1") + _py2_int(0) + _py2_int(1) + b"\x87R"
    out += b"(" + _py2_int(3) + _py2_str(b"|") + b"NNN" + b"J\xff\xff\xff\xffJ\xff\xff\xff\xff" + _py2_int(0) + b"tb"
    out += b"\x89" + _py2_str(np.ascontiguousarray(a).tobytes()) + b"tb"
    return out


def _py2_value(v: object) -> bytes:
    if isinstance(v, np.ndarray):
        return _py2_array(v)
    if isinstance(v, bytes):
        return _py2_str(v)
    if isinstance(v, int):
        return _py2_int(v)
    if isinstance(v, list):
        return b"](" + b"".join(_py2_value(x) for x in v) + b"e"
    if isinstance(v, dict):
        return b"}(" + b"".join(_py2_str(k.encode()) + _py2_value(x) for k, x in v.items()) + b"u"
    raise TypeError(type(v))


def py2_pickle(obj: dict) -> bytes:
    return b"\x80\x02" + _py2_value(obj) + b"."


# --- CIFAR ---------------------------------------------------------------------------------------------------


def cifar_pattern(n: int, labels: np.ndarray) -> np.ndarray:
    """uint8 [n, 32, 32, 3] images (H, W, C): red = label, green = row index × 4, blue = column index × 8 + (i % 8),
    so channel order, orientation and which image holds which label are all visible in the pixels."""
    img = np.zeros((n, 32, 32, 3), dtype=np.uint8)
    img[..., 0] = labels[:, None, None]
    img[..., 1] = (np.arange(32) * 4)[None, :, None]
    img[..., 2] = (np.arange(32) * 8)[None, None, :] + (np.arange(n) % 8)[:, None, None]
    return img


def cifar_batch(path: Path, images_hwc: np.ndarray, labels: dict[str, list[int]]) -> Path:
    """A CIFAR batch file: `data` rows are the R, G, B planes (each row-major) of each image; `labels` maps the
    label keys (`labels`, or `fine_labels` and `coarse_labels`) to their lists."""
    data = images_hwc.transpose(0, 3, 1, 2).reshape(len(images_hwc), 3072)
    obj = {"batch_label": b"training batch", **labels, "data": data,
           "filenames": [f"img_{i}.png".encode() for i in range(len(images_hwc))]}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(py2_pickle(obj))
    return path


def make_cifar10(root: Path, per_batch: int = 20, n_test: int = 20) -> Path:
    """`root/cifar-10-batches-py/` with 5 training batches of `per_batch` and a test batch; labels i % 10."""
    d = root / "cifar-10-batches-py"
    for i, name in enumerate([*(f"data_batch_{b}" for b in range(1, 6)), "test_batch"]):
        n = n_test if name == "test_batch" else per_batch
        labels = (np.arange(n) + i) % 10
        cifar_batch(d / name, cifar_pattern(n, labels), {"labels": [int(v) for v in labels]})
    (d / "batches.meta").write_bytes(py2_pickle({"label_names": [f"c{i}".encode() for i in range(10)]}))
    return d


def make_cifar100(root: Path, n_train: int = 200, n_test: int = 100) -> Path:
    """`root/cifar-100-python/{train,test,meta}`: fine label i % 100, coarse label fine // 5."""
    d = root / "cifar-100-python"
    for name, n in (("train", n_train), ("test", n_test)):
        fine = np.arange(n) % 100
        cifar_batch(d / name, cifar_pattern(n, fine),
                    {"fine_labels": [int(v) for v in fine], "coarse_labels": [int(v) // 5 for v in fine]})  # fmt: skip
    (d / "meta").write_bytes(py2_pickle({"fine_label_names": [b"f"] * 100, "coarse_label_names": [b"c"] * 20}))
    return d


class Evil:
    """Unpickling this calls `os.system`."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


def evil_pickle(command: str) -> bytes:
    return pickle.dumps({"data": Evil(command), "labels": []}, protocol=2)


# --- CIFAR-10-C ----------------------------------------------------------------------------------------------

CORRUPTIONS = ("brightness", "contrast", "defocus_blur", "elastic_transform", "fog", "frost", "gaussian_blur",
               "gaussian_noise", "glass_blur", "impulse_noise", "jpeg_compression", "motion_blur", "pixelate",
               "saturate", "shot_noise", "snow", "spatter", "speckle_noise", "zoom_blur")  # fmt: skip


def make_cifar10c(root: Path, per_severity: int = 20, corruptions: tuple[str, ...] = CORRUPTIONS) -> Path:
    """`root/CIFAR-10-C/<corruption>.npy` (uint8 [5 × n, 32, 32, 3], severities 1–5 in order) and `labels.npy`.

    Pixel (0, 0) of image j holds: red = corruption index, green = severity, blue = j % 10 = its label; (row 1,
    col 0) holds 200 and (row 0, col 1) holds 100 in every channel, so orientation and channel order show.
    """
    d = root / "CIFAR-10-C"
    d.mkdir(parents=True, exist_ok=True)
    n = per_severity
    labels = np.tile(np.arange(n) % 10, 5).astype(np.uint8)
    np.save(d / "labels.npy", labels)
    for name in corruptions:
        img = np.zeros((5 * n, 32, 32, 3), dtype=np.uint8)
        img[:, 1, 0, :] = 200
        img[:, 0, 1, :] = 100
        img[:, 0, 0, 0] = CORRUPTIONS.index(name)
        img[:, 0, 0, 1] = np.repeat(np.arange(1, 6), n)
        img[:, 0, 0, 2] = labels
        np.save(d / f"{name}.npy", img)
    return d


# --- IDX (MNIST, EMNIST) -------------------------------------------------------------------------------------


def idx_header(code: int, dims: tuple[int, ...]) -> bytes:
    """An IDX header: two zero bytes, the dtype code (0x08 = uint8), the number of dimensions, each big-endian."""
    return struct.pack(">HBB", 0, code, len(dims)) + struct.pack(f">{len(dims)}I", *dims)


def idx_bytes(array: np.ndarray) -> bytes:
    return idx_header(0x08, array.shape) + array.astype(np.uint8).tobytes()


def write_idx_gz(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(idx_bytes(array), mtime=0))
    return path


def upright_pattern(n: int) -> np.ndarray:
    """uint8 [n, 28, 28]: a bright top row (255) and a dimmer left column (100): transposing swaps them."""
    img = np.zeros((n, 28, 28), dtype=np.uint8)
    img[:, :, 0] = 100
    img[:, 0, :] = 255
    img[:, 27, 27] = (np.arange(n) % 250).astype(np.uint8)  # a per-image mark: which image is which
    return img


def make_mnist(root: Path, n_train: int = 40, n_test: int = 20) -> Path:
    for split, n in (("train", n_train), ("t10k", n_test)):
        write_idx_gz(root / f"{split}-images-idx3-ubyte.gz", upright_pattern(n))
        write_idx_gz(root / f"{split}-labels-idx1-ubyte.gz", (np.arange(n) % 10).astype(np.uint8))
    return root


EMNIST_LABELS = {"byclass": (0, 62), "bymerge": (0, 47), "balanced": (0, 47), "letters": (1, 27), "digits": (0, 10),
                 "mnist": (0, 10)}  # fmt: skip


def make_emnist(root: Path, split: str = "letters", n_train: int = 60, n_test: int = 30) -> Path:
    """`root/gzip/emnist-<split>-*.gz`, images stored transposed as in the official files (column-major)."""
    lo, hi = EMNIST_LABELS[split]
    d = root / "gzip"
    for part, n in (("train", n_train), ("test", n_test)):
        upright = upright_pattern(n)
        write_idx_gz(d / f"emnist-{split}-{part}-images-idx3-ubyte.gz", upright.transpose(0, 2, 1))
        labels = (lo + np.arange(n) % (hi - lo)).astype(np.uint8)
        write_idx_gz(d / f"emnist-{split}-{part}-labels-idx1-ubyte.gz", labels)
    return d


# --- FEMNIST (LEAF JSON) -------------------------------------------------------------------------------------


def femnist_user_data(user: int, n: int) -> dict:
    """n samples of writer `user`: pixel [0, 0] = user / 100, pixel [0, 1] = 1 (top row), label (user + j) % 62."""
    xs = []
    for _ in range(n):
        img = np.zeros((28, 28), dtype=np.float64)
        img[0, 0] = user / 100
        img[0, 1] = 1.0
        xs.append(img.reshape(-1).tolist())
    return {"x": xs, "y": [(user + j) % 62 for j in range(n)]}


def write_leaf_json(path: Path, users: dict[str, dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"users": list(users), "num_samples": [len(u["y"]) for u in users.values()], "user_data": users}
    path.write_text(json.dumps(blob))
    return path


def make_femnist_all_data(root: Path, users: int = 6, per_user: int = 12, files: int = 2) -> Path:
    """`root/all_data/all_data_<k>.json`: writers f0000_00 … spread over `files` shards."""
    d = root / "all_data"
    for k in range(files):
        shard = {f"f{u:04d}_{u % 100:02d}": femnist_user_data(u, per_user) for u in range(users) if u % files == k}
        write_leaf_json(d / f"all_data_{k}.json", shard)
    return d


# --- FLICKR-AES (the authors' ratings CSV and 40K/ image folder) ----------------------------------------------


def flickr_colour(image: int) -> tuple[int, int, int]:
    """Image `image`'s colour: its index in the red and green channels (up to 65,535 images)."""
    return (image % 256, image // 256, 77)


def make_flickr_aes(root: Path, ratings: dict[str, list[tuple[int, int]]], size: int = 4,
                    extra_images: tuple[int, ...] = ()) -> Path:  # fmt: skip
    """`root/FLICKR-AES_image_labeled_by_each_worker.csv` and `root/40K/`: `ratings` maps a worker id to its
    (image index, score) pairs; image i is `farm1_<i>_flickr.jpg`, one colour (`flickr_colour`), PNG bytes under the
    .jpg name (lossless: exact pixels; Pillow reads by content). The header and fields carry the published file's
    spaces after the commas."""
    images = root / "40K"
    images.mkdir(parents=True, exist_ok=True)
    lines = ["worker, imagePair, score"]
    for worker, pairs in ratings.items():
        lines += [f"{worker}, farm1_{i}_flickr.jpg, {score}" for i, score in pairs]
    (root / "FLICKR-AES_image_labeled_by_each_worker.csv").write_text("\n".join(lines) + "\n")
    for i in sorted({i for pairs in ratings.values() for i, _ in pairs} | set(extra_images)):
        Image.new("RGB", (size, size), flickr_colour(i)).save(images / f"farm1_{i}_flickr.jpg", format="PNG")
    return root


# --- Tiny ImageNet -------------------------------------------------------------------------------------------


def colour_of(class_index: int, image_index: int) -> tuple[int, int, int]:
    return (40 * class_index % 256, 30 + image_index, 200)


def _png(path: Path, colour: tuple[int, int, int], size: int, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", (size, size), colour)
    img.putpixel((0, size - 1), (255, 255, 255))  # bottom-left marker: orientation
    (img.convert(mode) if mode != "RGB" else img).save(path, format="PNG")


def make_tinyimagenet(root: Path, wnids: tuple[str, ...] = ("n03", "n01", "n02"), per_class: int = 6,
                      val_per_class: int = 3, size: int = 64) -> Path:  # fmt: skip
    """`root/tiny-imagenet-200/` in the official layout; images are PNG bytes under .JPEG names (lossless, so
    pixels are exact; Pillow reads by content). Class c (in sorted wnid order) has red 40·c."""
    d = root / "tiny-imagenet-200"
    d.mkdir(parents=True, exist_ok=True)
    (d / "wnids.txt").write_text("".join(f"{w}\n" for w in wnids))
    order = sorted(wnids)
    for w in wnids:
        c = order.index(w)
        boxes = []
        for i in range(per_class):
            mode = "L" if i == 0 and c == 0 else "RGB"  # one greyscale image, as the real set has some
            _png(d / "train" / w / "images" / f"{w}_{i}.JPEG", colour_of(c, i), size, mode)
            boxes.append(f"{w}_{i}.JPEG\t0\t0\t{size - 1}\t{size - 1}\n")
        (d / "train" / w / f"{w}_boxes.txt").write_text("".join(boxes))
    lines, k = [], 0
    for i in range(val_per_class):
        for w in wnids:
            c = order.index(w)
            _png(d / "val" / "images" / f"val_{k}.JPEG", colour_of(c, 100 + i), size)
            lines.append(f"val_{k}.JPEG\t{w}\t0\t0\t{size - 1}\t{size - 1}\n")
            k += 1
    (d / "val" / "val_annotations.txt").write_text("".join(lines))
    _png(d / "test" / "images" / "test_0.JPEG", (0, 0, 0), size)
    return d


# --- miniImageNet (the mini-imagenet-cache pickles) -----------------------------------------------------------


def make_miniimagenet(root: Path, classes_per_split: int = 2, per_class: int = 10, side: int = 84,
                      val: str = "val") -> Path:  # fmt: skip
    """`root/mini-imagenet-cache-{train,val,test}.pkl`: dicts `image_data` (uint8 [N, side, side, 3]) and
    `class_dict` (wnid -> list of row indices), pickled by Python 3 as the published files are. Class wnids are
    n0000 … in the order train, val, test; red = the class's global index × 10, green = index within class.
    `val`: the validation file's name, `val` (the cache's first release) or `validation` (learn2learn, Zenodo)."""
    root.mkdir(parents=True, exist_ok=True)
    g = 0
    for split in ("train", val, "test"):
        images, class_dict = [], {}
        for _ in range(classes_per_split):
            wnid = f"n{g:04d}"
            rows = []
            for i in range(per_class):
                img = np.zeros((side, side, 3), dtype=np.uint8)
                img[..., 0], img[..., 1], img[..., 2] = g * 10, i, 7
                img[side - 1, 0, :] = 255
                rows.append(len(images))
                images.append(img)
            # interleave classes in the file, as the published files' class order is not the row order
            class_dict[wnid] = rows
            g += 1
        blob = {"image_data": np.stack(images), "class_dict": class_dict}
        (root / f"mini-imagenet-cache-{split}.pkl").write_bytes(pickle.dumps(blob, protocol=4))
    return root


# --- DomainBed-layout image trees (PACS, Office-Home, DomainNet) ---------------------------------------------


def make_domain_tree(root: Path, domains: tuple[str, ...], classes: int, per_class: int = 1, size: int = 4) -> Path:
    """`root/<domain>/class_<c>/<i>.png`: `per_class` PNGs of `size` px per class and domain, red = class index,
    green = 40 × domain index (class folders sort in class order)."""
    for d, domain in enumerate(domains):
        for c in range(classes):
            folder = root / domain / f"class_{c:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                (folder / f"{i}.png").write_bytes(png_bytes((c % 256, 40 * d % 256, i % 256), size=size))
    return root


# --- archives ------------------------------------------------------------------------------------------------


def tar_gz(directory: Path, archive: Path, mode: str = "w:gz") -> Path:
    """`directory` (its folder name at the top) packed into `archive`."""
    with tarfile.open(archive, mode) as tf:
        tf.add(directory, arcname=directory.name)
    return archive


def zip_dir(directory: Path, archive: Path) -> Path:
    with zipfile.ZipFile(archive, "w") as zf:
        for p in sorted(directory.rglob("*")):
            zf.write(p, p.relative_to(directory.parent))
    return archive


def png_bytes(colour: tuple[int, int, int], size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()
