"""`pflbed pretrain`: centralized training of the run's model on a declared source, for `model.init_from`.

Why: the FedBasis paper and most practitioners start federated training from a pretrained body; the failure
FedBasis targets (fine-tuning a few samples away from a good start) only exists with one. The source must be data
that no client and no evaluation set of the federation uses, or every later score is inflated. So the source is
declared (`pretrain.split`, `pretrain.domains`, `pretrain.samples`), checked against the federation that the same
config describes (`federation.check_disjoint`) before any training, and its sample indices are stored in the
output, so that a run loading it checks again against its own federation.

Training: mini-batch SGD (`pretrain.lr`, `momentum`, `weight_decay`, `batch_size`) for `pretrain.epochs` epochs
on the source minus a held-out `val_fraction`; the epoch with the best held-out accuracy is kept (earliest on
ties; the last without held-out data). Output (written to a temporary directory, then moved into place, so an
error never leaves a half-written one): `model.pt` (`models.pretrained` format, with the source), `summary.json`
(per-epoch loss and held-out accuracy, the epoch kept) and `config.yaml`.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from pflbed import rng
from pflbed.algorithms.base import ClientData
from pflbed.algorithms.training import sgd_epochs
from pflbed.config import Config, resolve_device
from pflbed.data import base_dataset, load_source
from pflbed.data.arrays import DataSource
from pflbed.engine.threads import choose_threads
from pflbed.errors import ConfigError, DataError, DivergedError, PflbedError
from pflbed.federation import build_federation
from pflbed.federation.federation import check_disjoint
from pflbed.models import build_model
from pflbed.models.pretrained import MODEL_FILE, save_model
from pflbed.version import __version__
from pflbed.writable import check_writable

STREAM = 0x9E7  # pretraining's own random streams: 0 the sample draw, 1 the held-out split, 2 batches, 3 init


def source_indices(source: DataSource, cfg: Config) -> torch.Tensor:
    """Sorted indices into `pretrain.split` of the declared source (domains, then a seeded draw of `samples`)."""
    p = cfg.pretrain
    split = getattr(source, p.split)
    if len(split) == 0:
        raise DataError(f"pretrain.split: {source.name} has no {p.split} split")
    keep = torch.ones(len(split), dtype=torch.bool)
    if p.domains is not None:
        if not source.domain_names:
            raise ConfigError(f"pretrain.domains: {source.name} has no domains")
        unknown = [d for d in p.domains if d not in source.domain_names]
        if unknown:
            raise ConfigError(f"pretrain.domains: unknown {unknown}; {source.name} has {list(source.domain_names)}")
        ids = torch.tensor([source.domain_names.index(d) for d in p.domains])
        keep = torch.isin(split.domain.cpu(), ids)
    idx = keep.nonzero().squeeze(1)
    if p.samples is not None and p.samples < len(idx):
        g = torch.Generator().manual_seed(rng.derive_seed(cfg.seed, STREAM, 0))
        idx = idx[torch.randperm(len(idx), generator=g)[: p.samples]].sort().values
    if len(idx) == 0:
        raise ConfigError(f"pretrain.domains: no {p.split} sample of {source.name} is in {p.domains}")
    return idx


def pretrain(cfg: Config, out: Path, force: bool = False, log=print) -> dict[str, Any]:
    """Pretrain `cfg.model` on the declared source, write `out` (see the module docstring); returns the summary."""
    _check_out(out, force)
    started = time.perf_counter()
    p, device = cfg.pretrain, resolve_device(cfg.executor.device)
    source = load_source(cfg.dataset)
    idx = source_indices(source, cfg)
    dataset = base_dataset(cfg.dataset)
    record = {"dataset": dataset, "split": p.split, "domains": p.domains, "indices": idx}
    fed = build_federation(source, cfg.federation, cfg.seed)
    check_disjoint(fed, dataset, record, "pretrain")
    g = torch.Generator().manual_seed(rng.derive_seed(cfg.seed, STREAM, 1))
    perm = idx[torch.randperm(len(idx), generator=g)]
    n_val = int(round(p.val_fraction * len(idx)))
    val, train = perm[:n_val].sort().values, perm[n_val:].sort().values
    if len(train) == 0:
        raise ConfigError("pretrain.val_fraction: leaves no training sample")
    split = getattr(source, p.split).to(device)
    data = ClientData(-1, split.x, split.y, train.to(device), val.to(device), torch.zeros(source.num_classes))
    torch.manual_seed(rng.derive_seed(cfg.seed, STREAM, 3))
    model = build_model(cfg.model.name, source.input_shape, source.num_classes, device, cfg.model.channels_last)
    torch.set_num_threads(cfg.executor.threads or choose_threads(model))
    batches = torch.Generator().manual_seed(rng.derive_seed(cfg.seed, STREAM, 2))
    epochs, best, kept, selected = [], None, None, 0
    steps = sgd_epochs(model, data, epochs=p.epochs, batch_size=p.batch_size, lr=p.lr, momentum=p.momentum,
                       weight_decay=p.weight_decay, generator=batches)  # fmt: skip
    for e, loss in enumerate(steps, 1):
        if not math.isfinite(loss):
            raise DivergedError(e, "pretraining loss (epoch, not round)", hint="lower pretrain.lr")
        acc = _accuracy(model, split.x, split.y, data.val) if len(val) else None
        epochs.append({"epoch": e, "train_loss": loss, "val_acc": acc})
        log(f"epoch {e}/{p.epochs}: loss {loss:.4f}" + ("" if acc is None else f", held-out acc {100 * acc:.2f}"))
        if acc is None or best is None or acc > best:  # the best held-out epoch, earliest on ties; else the last
            best, kept, selected = acc, copy.deepcopy(model.state_dict()), e
    model.load_state_dict(kept)
    summary = {
        "pflbed_version": __version__, "dataset": cfg.dataset.name, "model": cfg.model.name, "seed": cfg.seed,
        "source": {"dataset": dataset, "split": p.split, "domains": p.domains, "samples": len(idx),
                   "train": len(train), "val": len(val)},
        "checked_against": {"federation": fed.key, "samples_used": {k: len(v) for k, v in fed.used_indices().items()}},
        "epochs": epochs, "selected_epoch": selected, "val_acc": best,
        "seconds": round(time.perf_counter() - started, 3),
    }  # fmt: skip
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp, cfg.model.name, source.input_shape, source.num_classes, record)
    (tmp / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (tmp / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if out.exists():  # empty, or an earlier pretraining's files alone (`_check_out`)
        shutil.rmtree(out)
    tmp.replace(out)
    return summary


OUTPUT = (MODEL_FILE, "summary.json", "config.yaml")  # what `pretrain` writes into `out`, and all it writes


def _check_out(out: Path, force: bool) -> None:
    """`out` may be new, empty, or (with `force`) an earlier pretraining's output. Not anything else: the output
    replaces `out` whole, so forcing a directory with other files in it (a parent of several pretrained models, a
    run's, the working directory) deleted them. The output is made beside `out` and renamed into place, so it is
    `out`'s parent that must be writable."""
    check_writable(out.parent, f"--out {out}")  # was a temporary directory's "Not a directory", after the training
    if not out.exists():
        return
    if not out.is_dir():
        raise PflbedError(f"--out {out}: is a file; give the directory to write {', '.join(OUTPUT)} into")
    other = sorted(p.name for p in out.iterdir() if p.name not in OUTPUT)
    if other:
        raise PflbedError(f"--out {out}: holds files pflbed pretrain did not write ({', '.join(other[:3])}"
                          f"{', …' if len(other) > 3 else ''}); choose another --out (--force replaces only an "
                          "earlier pretraining's)")  # fmt: skip
    if any(out.iterdir()) and not force:
        raise PflbedError(f"--out {out}: holds an earlier pretraining's output (--force replaces it)")


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(x[b]).argmax(1) == y[b]).sum()) for b in idx.split(1024))
    return hits / max(len(idx), 1)

