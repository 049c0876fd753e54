"""`federation.new_client`: a held-out client's samples as the raw files a new client would bring, in each dataset's
native format (`raw_samples` inverts `DataSource.inputs`), and the splits a run scores it on."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pflbed.config import validate_config
from pflbed.data import load_source
from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.errors import PflbedError
from pflbed.federation import build_federation
from pflbed.federation.new_client import client_indices, held_out, raw_samples, write_client

from ..tiny import TINY

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def _source(input_shape, scale=255.0, norm=(0.0, 1.0), channels_last=False) -> DataSource:
    split = ArrayDataset(torch.zeros(1, *input_shape), torch.zeros(1, dtype=torch.int64))
    return DataSource("t", split, split, 2, "generated", pixel_norm=norm, raw_scale=scale,
                      raw_channels_last=channels_last)  # fmt: skip


RNG = np.random.default_rng(0)
# case → (the dataset's input shape, raw_scale, pixel_norm, channels last, raw samples as its files hold them)
CASES = {
    "colour images, channels last, per-channel norm": (
        (3, 4, 5), 255.0, IMAGENET, True, RNG.integers(0, 256, (6, 4, 5, 3)).astype(np.uint8)),
    "one-channel images": ((1, 6, 6), 255.0, (0.5, 0.25), False, RNG.integers(0, 256, (6, 6, 6)).astype(np.uint8)),
    "colour images, channels first": ((3, 4, 4), 255.0, IMAGENET, False,
                                      RNG.integers(0, 256, (6, 3, 4, 4)).astype(np.uint8)),
    "integers beyond a byte": ((4,), 1000.0, (0.0, 1.0), False, RNG.integers(0, 1000, (6, 4)) + np.arange(4) * 300),
    "negative integers": ((4,), 1.0, (0.0, 1.0), False, RNG.integers(-5, 5, (6, 4))),
    "real values": ((4,), 1.0, (0.1, 2.0), False, RNG.normal(size=(6, 4)).astype(np.float32)),
    "no samples": ((3, 4, 5), 255.0, IMAGENET, True, np.zeros((0, 4, 5, 3), dtype=np.float32)),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_raw_samples_are_the_files_the_model_inputs_came_from(case):
    shape, scale, norm, last, raw = CASES[case]
    source = _source(shape, scale, norm, last)
    x = source.inputs(raw)
    assert tuple(x.shape[1:]) == shape
    back = raw_samples(source, x)
    assert back.dtype == (raw.dtype if raw.dtype != np.int64 or raw.max() > 255 or raw.min() < 0 else np.uint8)
    assert back.shape == raw.shape
    np.testing.assert_allclose(back, raw, rtol=0, atol=1e-5 if raw.dtype == np.float32 else 0)


def test_values_near_integers_are_rounded_and_others_kept():
    source = _source((2,), 1.0)
    near = raw_samples(source, torch.tensor([[3.0009, 255.0]], dtype=torch.float64))
    assert near.dtype == np.uint8 and near.tolist() == [[3, 255]]
    assert raw_samples(source, torch.tensor([[3.0, 256.0]])).dtype == np.int64  # past a byte
    off = raw_samples(source, torch.tensor([[3.002, 255.0]], dtype=torch.float64))
    assert off.dtype == np.float32 and off[0, 0] == np.float32(3.002)
    assert raw_samples(source, torch.tensor([[0.001, 255.0]], dtype=torch.float64)).dtype == np.float32  # 1e-3 off


def test_the_held_out_client_to_write_is_checked_and_named():
    cfg = validate_config({**TINY, "federation": {**TINY["federation"], "new_clients": 2}})
    fed = build_federation(load_source(cfg.dataset), cfg.federation, cfg.seed)
    assert held_out(fed, None, "run r") == fed.new[0] and held_out(fed, fed.new[1], "run r") == fed.new[1]
    listed = ", ".join(map(str, fed.new))
    for cid, why in ((fed.participated[0], "took part in training"), (len(fed.clients), "does not exist"),
                     (-1, "does not exist")):  # fmt: skip
        with pytest.raises(PflbedError) as e:
            held_out(fed, cid, "run r")
        assert str(e.value) == f"--client {cid}: client {cid} of run r {why}; its held-out clients are {listed}"
    with pytest.raises(PflbedError) as e:
        held_out(replace(fed, new=[]), None, "run r")
    assert str(e.value) == ("run r holds no new clients: every client trained (federation.new_clients is 0); run "
                            "with --set federation.new_clients=N to hold N of them out")  # fmt: skip


@pytest.mark.parametrize("pfl_test", ["global", "local"])
def test_a_held_out_client_is_scored_on_its_own_test_split_or_the_global_one_as_the_run(tmp_path, pfl_test):
    cfg = validate_config({**TINY, "federation": {**TINY["federation"], "new_clients": 2},
                           "eval": {**TINY["eval"], "pfl_test": pfl_test}})  # fmt: skip
    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    cid = fed.new[0]
    got = client_indices(fed, cid, pfl_test)
    test = (fed.global_split, fed.global_test) if pfl_test == "global" else ("train", fed.clients[cid].test)
    want = {"train": ("train", fed.clients[cid].train), "val": ("train", fed.clients[cid].val), "test": test}
    assert got.keys() == want.keys()
    assert all(got[k][0] == want[k][0] and torch.equal(got[k][1], want[k][1]) for k in want)
    counts = write_client(source, fed, cid, pfl_test, tmp_path / "new" / "nc")  # folders made as needed
    assert counts == {k: len(v[1]) for k, v in want.items()}
    for name, (split, idx) in want.items():
        with np.load(tmp_path / "new" / "nc" / f"{name}.npz") as f:
            assert np.array_equal(f["y"], getattr(source, split).y[idx].numpy())
            np.testing.assert_allclose(source.inputs(f["x"]), getattr(source, split).x[idx], atol=1e-6)
