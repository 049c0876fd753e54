"""A site's `.npz` of 2-D samples ([N, H, W], e.g. sklearn's digits as a user saves them) in a site-local run: the
shape `pflbed flower local --site-data` infers, the server's model and a site's batches must agree. Unit level: the
functions a deployment calls, without Flower."""

import re

import numpy as np
import pytest
import torch

from pflbed.config import validate_config
from pflbed.flower.sites import (
    SiteError,
    check_report,
    describe_sites,
    read_site,
    report,
    server_algorithm,
    site_algorithm,
)


def _digits_site(tmp_path) -> tuple:
    """A site directory whose train.npz holds x [60, 8, 8] in 0–16 and y 0–9, as `np.savez` of sklearn's digits."""
    gen = np.random.default_rng(0)
    d = tmp_path / "site-0"
    d.mkdir()
    np.savez(d / "train.npz", x=gen.integers(0, 17, (60, 8, 8)).astype(np.float64), y=np.arange(60) % 10)
    return d


def _cfg(shape, classes=10):
    return validate_config({
        "dataset": {"name": "digits"}, "model": {"name": "cnn"}, "federation": {"clients": 1},
        "train": {"rounds": 1, "batch_size": 8}, "eval": {"finetune": []},
        "executor": {"name": "flower", "threads": 1},
        "sites": {"local": True, "input_shape": list(shape), "num_classes": classes},
    })  # fmt: skip


def test_two_d_samples_are_one_channel_on_the_server_and_on_the_site(tmp_path):
    d = _digits_site(tmp_path)
    shape, classes = describe_sites([d])
    assert (shape, classes) == ((1, 8, 8), 10)  # [N, H, W] read as one channel, not H = 8 channels
    cfg = _cfg(shape, classes)
    files = read_site({"data": str(d)}, cfg)
    info = report(files, 1, cfg, 0)
    check_report(cfg, 0, info)  # what the server checks at start-up
    server = server_algorithm(cfg, [info["num_train"]])
    site = site_algorithm(cfg, files, 1, 0, [info["num_train"]])
    first = next(m for m in server.ctx.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert first.in_channels == 1 and site.ctx.model.state_dict().keys() == server.ctx.model.state_dict().keys()
    data = site.ctx.client_data(0)
    batch = data.x[data.train[:4]]
    assert batch.shape == (4, 1, 8, 8)
    assert server.ctx.model(batch).shape == (4, 10)  # the round-1 crash: 8-channel weights, 1-channel input


def test_a_run_that_asks_for_h_channels_is_refused_at_start_up_in_one_line(tmp_path):
    d = _digits_site(tmp_path)
    cfg = _cfg([8, 8])
    info = report(read_site({"data": str(d)}, cfg), 1, cfg, 0)
    with pytest.raises(SiteError, match=r"site 0: its samples have shape \[1, 8, 8\], the run's sites\.input_shape is "
                                        r"\[8, 8\] \(\[N, H, W\] files are read as one channel") as info_:
        check_report(cfg, 0, info)
    assert "\n" not in str(info_.value)


class _Planted:
    """An object whose unpickling makes a directory: what a pickled array in a site's file could run instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.marker),)


def test_a_site_s_file_is_read_without_unpickling_and_one_that_is_not_samples_is_refused_naming_it(tmp_path):
    """`read_npz`, which reads every site's files and the server's `sites.test`: an object array is refused, never
    unpickled; a file without x and y, of non-numbers or non-integer labels, or of shapes that do not pair a label
    with each sample, is refused in one line naming it. [N, features] and [N, C, H, W] are taken as they are,
    [N, H, W] as one channel."""
    from pflbed.flower.sites import read_npz

    marker = tmp_path / "ran"
    cases = {
        "pickled": ({"x": np.array([_Planted(marker)], dtype=object), "y": np.array([0])},
                    "not a readable .npz file (Object arrays cannot be loaded when allow_pickle=False)"),
        "no_y": ({"x": np.zeros((3, 2))}, "an .npz with arrays x (samples) and y (labels) is needed; it has x"),
        "no_x": ({"y": np.zeros(3, dtype=np.int64)}, "is needed; it has y"),
        "empty": ({}, "is needed; it has none"),
        "strings": ({"x": np.array([["a", "b"]]), "y": np.array([0])},
                    "x must be numbers and y integers (got <U1 and int64)"),
        "float_labels": ({"x": np.zeros((2, 3)), "y": np.zeros(2)}, "(got float64 and float64)"),
        "flat": ({"x": np.zeros(3), "y": np.zeros(3, dtype=np.int64)},
                 "x must be [N, *sample shape] and y [N] (got (3,) and (3,))"),
        "fewer_labels": ({"x": np.zeros((3, 2)), "y": np.zeros(2, dtype=np.int64)}, "(got (3, 2) and (2,))"),
    }  # fmt: skip
    for name, (arrays, message) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(SiteError) as e:
            read_npz(path, "data")
        assert not marker.exists()  # nothing was unpickled: the planted object never ran
        assert str(e.value).startswith(f"data {path}: ") and str(e.value).endswith(message), (name, str(e.value))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(SiteError, match=r"^sites.test .*junk.npz: not a readable .npz file \("):
        read_npz(tmp_path / "junk.npz", "sites.test")
    for shape, read in (((4, 5), [4, 5]), ((4, 8, 8), [4, 1, 8, 8]), ((4, 3, 8, 8), [4, 3, 8, 8])):
        np.savez(tmp_path / "ok.npz", x=np.ones(shape, dtype=np.uint8), y=np.arange(4))
        data = read_npz(tmp_path / "ok.npz", "data")
        assert list(data.x.shape) == read and data.x.dtype == torch.float32 and data.y.dtype == torch.int64


def test_a_site_s_images_become_the_run_s_inputs_channels_first_and_only_grey_or_rgb_shapes_are_taken():
    """`_image_source`: image folders need sites.input_shape [1 or 3, H, W]; an RGB image [H, W, 3] (as read from
    a file) becomes [3, H, W], each channel normalized by its own statistics (ImageNet's here)."""
    from pflbed.data.folders import NORMALIZATIONS
    from pflbed.flower.sites import _image_source

    for shape in ([2, 4, 4], [4, 4, 4], [3, 4], [1, 4, 4, 1]):
        with pytest.raises(SiteError, match=rf"^image folders need sites.input_shape \[1 or 3, H, W\], not "
                                            rf"{re.escape(str(shape))}$"):  # fmt: skip
            _image_source(_cfg(shape))
    cfg = _cfg([3, 4, 5])
    cfg = validate_config({**cfg.model_dump(mode="json"), "dataset": {**cfg.dataset.model_dump(mode="json"),
                                                                      "normalize": "imagenet"}})  # fmt: skip
    source = _image_source(cfg)
    raw = np.random.default_rng(0).integers(0, 256, (2, 4, 5, 3)).astype(np.uint8)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in NORMALIZATIONS["imagenet"])
    want = (torch.from_numpy(raw).float().permute(0, 3, 1, 2) / 255 - mean) / std
    assert torch.allclose(source.inputs(raw, 255.0), want, atol=1e-6)
    assert source.num_classes == 10 and _image_source(_cfg([1, 4, 5])).inputs(raw[..., 0], 255.0).shape == (2, 1, 4, 5)
