"""A site's `.npz` of 2-D samples ([N, H, W], e.g. sklearn's digits as a user saves them) in a site-local run: the
shape `pflbed flower local --site-data` infers, the server's model and a site's batches must agree. Unit level: the
functions a deployment calls, without Flower."""

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
