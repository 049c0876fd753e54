"""A held-out client of a federation, as the files a new client would bring (`pflbed data new-client`).

`pflbed personalize` takes a new client's own samples. To try it on a client whose data no training client ever
saw, without guessing which samples those are, take one of the run's own held-out clients (`federation.
new_clients`, or the PFLBED protocol's new clients): its training samples, and the validation and test samples the
run itself scores it on (under the PFLBED protocol and `eval.pfl_test: global`, shared sets that the run weights by
the client's class prior). Samples are written raw, in the dataset's native format (`DataSource.inputs` maps them
back to exactly the model inputs the run used), because that is what `personalize` expects.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pflbed.data.arrays import DataSource
from pflbed.errors import PflbedError
from pflbed.federation.federation import Federation

SPLITS = ("train", "val", "test")


def raw_samples(source: DataSource, x: torch.Tensor) -> np.ndarray:
    """Model inputs `x` back to raw samples: the inverse of `DataSource.inputs`. Values within 1e-3 of integers
    are rounded (8-bit images come back as uint8), so the files are those a user of the dataset would hold."""
    mean, std = (v if isinstance(v, float | int) else torch.tensor(v).view(-1, *[1] * (x.ndim - 2))
                 for v in source.pixel_norm)  # fmt: skip
    raw = ((x.detach().cpu().double() * std + mean) * source.raw_scale).numpy()
    if raw.ndim == 4 and tuple(raw.shape[1:]) != source.raw_shape:
        raw = raw.transpose(0, 2, 3, 1) if source.raw_channels_last else raw[:, 0]
    rounded = np.rint(raw)
    if raw.size and np.abs(raw - rounded).max() < 1e-3:
        return rounded.astype(np.uint8) if rounded.min() >= 0 and rounded.max() <= 255 else rounded.astype(np.int64)
    return raw.astype(np.float32)


def held_out(fed: Federation, cid: int | None, what: str) -> int:
    """The held-out client to write: `cid`, checked, or the federation's first one (`what` names the run)."""
    if not fed.new:
        raise PflbedError(f"{what} holds no new clients: every client trained (federation.new_clients is 0); run "
                          "with --set federation.new_clients=N to hold N of them out")  # fmt: skip
    if cid is None:
        return fed.new[0]
    if cid not in fed.new:
        took = "took part in training" if 0 <= cid < len(fed.clients) else "does not exist"
        raise PflbedError(f"--client {cid}: client {cid} of {what} {took}; its held-out clients are "
                          f"{', '.join(map(str, fed.new))}")  # fmt: skip
    return cid


def client_indices(fed: Federation, cid: int, pfl_test: str) -> dict[str, tuple[str, torch.Tensor]]:
    """Per split, (source split, indices) of client `cid`: its own training samples and the validation and test
    samples the run scores it on (`evaluation.evaluate.needs`)."""
    client = fed.clients[cid]
    if fed.domain_test:
        val, test = ("train", fed.domain_val[client.domain]), ("train", fed.domain_test[client.domain])
    else:
        val = ("train", client.val)
        test = (fed.global_split, fed.global_test) if pfl_test == "global" else ("train", client.test)
    return {"train": ("train", client.train), "val": val, "test": test}


def write_client(source: DataSource, fed: Federation, cid: int, pfl_test: str, out: Path) -> dict[str, int]:
    """`out/train.npz`, `val.npz` and `test.npz` (raw `x`, integer `y`) of client `cid`; samples per split."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, (split, idx) in client_indices(fed, cid, pfl_test).items():
        data = getattr(source, split)
        idx = idx.cpu()
        np.savez(out / f"{name}.npz", x=raw_samples(source, data.x[idx]), y=data.y[idx].cpu().numpy())
        counts[name] = int(idx.numel())
    return counts
