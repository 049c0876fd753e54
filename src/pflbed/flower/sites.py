"""Deployments whose clients' data stays on the sites (`sites.local`): what a site holds, and the two contexts.

A site is a SuperNode that declares its data in its own node config — never in the server's config:
- `data=PATH`: the site's samples: an `.npz` file with `x` (the model's inputs, [N, *input shape]; [N, H, W] is
  one-channel images, read as [N, 1, H, W]) and `y` (integer labels), a folder of class sub-folders `0/`, `1/`, …
  of images, or a directory holding `train`
  (`train.npz` or a `train/` image folder) and optionally `val` and `test` of the same kind;
- `dataset=NAME` (optional): instead, a dataset pflbed loads (e.g. `hf` for a Hugging Face dataset saved to disk,
  `cifar10`, `femnist`), its files at `data=PATH`, with the run's preprocessing options;
- `val=PATH`, `test=PATH`: optional `.npz` files of the same kind (else a seeded, stratified split of the site's
  data, `federation.val_fraction` / `test_fraction`, as a simulated client's);
- `clients=N` (default 1): how many clients the site holds — one in cross-silo; several for a fleet of devices,
  each file then divided among them (stratified, seeded);
- `state-dir=DIR`: where its clients' states are kept (default `pflbed-states` in the node's working directory);
- `partition-id=K`: the site's number (0…sites − 1), which orders the client ids.
Files are read with `numpy.load(allow_pickle=False)`: a site never unpickles anything.

The server knows only what the sites report at start-up (`report`): clients, their training-sample counts, the
input shape and the labels present; it checks them against `sites.input_shape` and `sites.num_classes`. Client ids
are global: the clients of site 0 first, then site 1's, and so on, so a client's seeds — (seed, round, client id) —
are those of the simulated client with the same id.

Two contexts come out of this module:
- a site's (`site_algorithm`): the run's algorithm over a pool holding only the site's own samples, whose
  federation lists every client of the deployment with only the site's own clients' splits filled in;
- the server's (`server_algorithm`): the same algorithm over no client data at all — its federation knows each
  client's training-sample count (the weights of the server's means) and nothing else, and `client_data` raises.

Trust: a site takes from the server's config only what a server may decide for it (algorithm, model, training,
evaluation, seeds), within sizes the node affords, and may require DP and SecAgg of the run (`site_policy`): a config
that names a path or a download would let a remote server choose what a site reads or writes. The deployment's
client counts the server sends (`site-sizes`) must agree with what this site holds (`site_algorithm`).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflbed import rng
from pflbed.algorithms.base import Algorithm, ClientData, Context
from pflbed.config import Config
from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.data.samples import read_image_folder, read_npz_arrays
from pflbed.engine.build import build_algorithm
from pflbed.errors import ConfigError, DataError, PflbedError
from pflbed.federation.federation import ClientSplit, Federation, client_split
from pflbed.federation.partition import split_local

DATA, VAL, TEST, CLIENTS, DATASET = "data", "val", "test", "clients", "dataset"


class SiteError(PflbedError):
    """A site's data, or what the server asks of a site, is refused (one line naming the site or the key)."""


@dataclass(frozen=True)
class SiteFiles:
    """What a site read: its samples, and optional val and test sets."""

    data: ArrayDataset
    val: ArrayDataset | None
    test: ArrayDataset | None
    origin: str


def read_npz(path: Path, what: str) -> ArrayDataset:
    """`x` (float32) and `y` (int64) of an `.npz` file, read without unpickling.

    `x` of [N, H, W] is one-channel images (sklearn's digits, an MNIST array, as a user saves them) and becomes
    [N, 1, H, W], as pflbed's own loaders give grey images. Read so here, where the server (`sites.test`,
    `describe_sites`) and every site read their files, both sides build the model from the same shape: a
    convolution with H input channels on the server and one-channel batches on a site do not fit."""
    try:
        x, y = read_npz_arrays(path)
    except DataError as e:
        raise SiteError(f"{what} {e}") from None
    if not np.issubdtype(x.dtype, np.number) or not np.issubdtype(y.dtype, np.integer):
        raise SiteError(f"{what} {path}: x must be numbers and y integers (got {x.dtype} and {y.dtype})")
    if x.ndim < 2 or y.shape != (len(x),):
        raise SiteError(f"{what} {path}: x must be [N, *sample shape] and y [N] (got {x.shape} and {y.shape})")
    if not np.isfinite(x).all():  # a site training on NaN samples sends NaN updates, refused as the site's fault
        raise SiteError(f"{what} {path}: {int((~np.isfinite(x.reshape(len(x), -1))).any(1).sum())} of {len(x)} "
                        "samples hold NaN or infinite values")  # fmt: skip
    x_t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return ArrayDataset(x_t.unsqueeze(1) if x_t.ndim == 3 else x_t, torch.from_numpy(y.astype(np.int64)))


def _image_source(cfg: Config) -> DataSource:
    """What turns a site's images into the model's inputs: resized to `sites.input_shape`, pixels to [0, 1], then
    normalized as pflbed's folder datasets (`dataset.normalize`: symmetric to [-1, 1], or ImageNet's statistics)."""
    from pflbed.data.folders import NORMALIZATIONS

    shape = list(cfg.sites.input_shape or [])
    if len(shape) != 3 or shape[0] not in (1, 3):
        raise SiteError(f"image folders need sites.input_shape [1 or 3, H, W], not {shape}")
    mean, std = (tuple(v[: shape[0]]) for v in NORMALIZATIONS[cfg.dataset.normalize])
    empty = _empty(shape)
    return DataSource("site images", empty, empty, int(cfg.sites.num_classes or 0), "site", (mean, std),
                      raw_scale=255.0, raw_channels_last=shape[0] == 3)  # fmt: skip


def _read(path: Path, what: str, cfg: Config) -> ArrayDataset:
    """An `.npz` file, or a folder of class sub-folders `0/`, `1/`, … of images."""
    if path.is_dir():
        source = _image_source(cfg)
        try:
            raw, y = read_image_folder(path, source)
        except DataError as e:
            raise SiteError(f"{what} {e}") from None
        return ArrayDataset(source.inputs(raw, what=what), torch.from_numpy(y))
    if not path.is_file():
        raise SiteError(f"{what} {path}: no such file or directory")
    return read_npz(path, what)


def _named(name: str, path: Any, cfg: Config) -> SiteFiles:
    """A dataset pflbed loads (`dataset=NAME`, its files at `data=PATH`), with the run's preprocessing options
    (`dataset.*`, e.g. image_size, normalize, hf columns): its train split is the site's data, its test split (if
    any) the site's test data."""
    from pflbed.config import DatasetConfig
    from pflbed.data import load_source

    tree = cfg.dataset.model_dump(mode="json")
    tree.update(name=name, path=None if path is None else str(Path(str(path)).expanduser()), download=False)
    tree["hf"] = {**tree["hf"], "id": None}
    try:
        source = load_source(DatasetConfig.model_validate(tree))
    except (PflbedError, ValueError) as e:
        raise SiteError(f"dataset={name}: {e}") from None
    test = source.test if len(source.test) else None
    return SiteFiles(source.train, None, test, f"{name} ({source.origin})")


def read_site(node_config: dict[str, Any], cfg: Config) -> SiteFiles | None:
    """The site's data from its node config (None: the node declares none). `data` is an `.npz` file, a folder of
    class sub-folders of images, or a directory holding `train` (`train.npz` or a `train/` image folder) and
    optionally `val` and `test` of the same kind; `val` and `test` node configs name further files or folders."""
    if DATASET in node_config:
        return _named(str(node_config[DATASET]), node_config.get(DATA), cfg)
    if DATA not in node_config:
        return None
    path = Path(str(node_config[DATA])).expanduser()
    files: dict[str, Path | None] = {DATA: path, VAL: None, TEST: None}
    for key in (VAL, TEST):
        if node_config.get(key) is not None:
            files[key] = Path(str(node_config[key])).expanduser()
    if not path.exists():
        raise SiteError(f"data {path}: no such file or directory")
    for name in ("train", "val", "test"):  # a directory of splits: name.npz or a name/ image folder
        key = DATA if name == "train" else name
        found = next((p for p in (path / f"{name}.npz", path / name) if p.exists()), None) if path.is_dir() else None
        if found is not None and (key == DATA or files[key] is None):
            files[key] = found
    read = {k: _read(v, k, cfg) if v is not None else None for k, v in files.items()}
    data = read[DATA]
    assert data is not None
    shape = tuple(data.x.shape[1:])
    for key in (VAL, TEST):
        other = read[key]
        if other is not None and tuple(other.x.shape[1:]) != shape:
            raise SiteError(f"{key} {files[key]}: samples of shape {list(other.x.shape[1:])}, but the site's data "
                            f"has {list(shape)}")  # fmt: skip
    return SiteFiles(data, read[VAL], read[TEST], str(path))


def num_clients(node_config: dict[str, Any]) -> int:
    n = node_config.get(CLIENTS, 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SiteError(f"clients={n!r} in the node config: a positive integer is needed")
    return n


def _parts(n: int, k: int, seed: int, site: int, stream: int) -> list[np.ndarray]:
    """Positions 0…n−1 divided among `k` clients at random (seeded by the run's seed, the site and the file)."""
    if k == 1:
        return [np.arange(n)]
    order = rng.generator(seed, rng.SITE, site, stream)
    perm = torch.randperm(n, generator=order).numpy()
    return [np.sort(p) for p in np.array_split(perm, k)]


def site_splits(files: SiteFiles, clients: int, cfg: Config, site: int) -> tuple[ArrayDataset, list[tuple]]:
    """The site's pool (data, then val, then test samples) and each client's (train, val, test) positions in it."""
    f = cfg.federation
    pools = [d for d in (files.data, files.val, files.test) if d is not None]
    x, y = torch.cat([d.x for d in pools]), torch.cat([d.y for d in pools])
    labels = y.numpy()
    n_data, n_val = len(files.data), len(files.val) if files.val is not None else 0
    data_parts = _parts(n_data, clients, cfg.seed, site, 0)
    val_parts = [p + n_data for p in _parts(n_val, clients, cfg.seed, site, 1)] if files.val is not None else None
    test_parts = None
    if files.test is not None:
        test_parts = [p + n_data + n_val for p in _parts(len(files.test), clients, cfg.seed, site, 2)]
    out = []
    for c, part in enumerate(data_parts):
        own_val = 0.0 if val_parts is not None else f.val_fraction
        own_test = 0.0 if test_parts is not None else f.test_fraction
        split = np.random.default_rng([cfg.seed, rng.SITE, site, c])
        tr, va, te = split_local(part, labels, own_val, own_test, split) if own_val or own_test else (part, None, None)
        va = val_parts[c] if val_parts is not None else va
        te = test_parts[c] if test_parts is not None else te
        empty = np.zeros(0, dtype=np.int64)
        out.append((tr, empty if va is None else va, empty if te is None else te))
        if len(tr) == 0:
            raise SiteError(f"site {site}: client {c} of {clients} has no training samples; lower clients=")
    return ArrayDataset(x, y), out


def report(files: SiteFiles, clients: int, cfg: Config, site: int) -> dict[str, Any]:
    """What the site tells the server at start-up: its clients' training, test and validation sample counts (the
    first are the weights of the server's means; the others bound what its evaluations may count), the sample
    shape and the labels present (no sample, no per-client label count)."""
    pool, splits = site_splits(files, clients, cfg, site)
    return {"num_train": [len(tr) for tr, _, _ in splits], "num_test": [len(te) for _, _, te in splits],
            "num_val": [len(va) for _, va, _ in splits], "input_shape": list(pool.x.shape[1:]),
            "labels": sorted({int(v) for v in pool.y.unique().tolist()})}  # fmt: skip


def check_report(cfg: Config, site: int, info: dict[str, Any]) -> None:
    """Refuse a site whose data does not fit the run's input shape and label space (one line naming it)."""
    shape, k = list(cfg.sites.input_shape or []), cfg.sites.num_classes or 0
    if list(info["input_shape"]) != shape:
        grey = list(info["input_shape"]) == [1, *shape]
        one = " ([N, H, W] files are read as one channel, [1, H, W])" if grey else ""
        raise SiteError(f"site {site}: its samples have shape {list(info['input_shape'])}, the run's sites."
                        f"input_shape is {shape}{one}")  # fmt: skip
    outside = [v for v in info["labels"] if not 0 <= v < k]
    if outside:
        raise SiteError(f"site {site}: labels {outside[:5]} are outside the run's label space 0…{k - 1} "
                        "(sites.num_classes)")  # fmt: skip


def _nowhere(k: int) -> ClientSplit:
    """A client whose data is elsewhere: no samples, and a prior of NaN, which poisons whatever reads it."""
    empty = torch.zeros(0, dtype=torch.int64)
    return ClientSplit(empty, empty, empty, torch.full((k,), math.nan))


def _federation(clients: list[ClientSplit], k: int, key: str) -> Federation:
    n = len(clients)
    return Federation(clients, list(range(n)), [], torch.zeros(0, dtype=torch.int64), k, key)


@dataclass(frozen=True)
class SitesFederation(Federation):
    """The server's federation: each client's training-sample count, reported by its site; no indices."""

    sizes: tuple[int, ...] = ()

    def num_train(self, cid: int) -> int:
        return self.sizes[cid]


def offsets(sizes: list[list[int]]) -> list[int]:
    """The first global client id of each site (sites in partition order): a running sum, linear in the sites."""
    out, first = [], 0
    for s in sizes:
        out.append(first)
        first += len(s)
    return out


def _source(cfg: Config, train: ArrayDataset, test: ArrayDataset, origin: str) -> DataSource:
    return DataSource(cfg.dataset.name, train, test, int(cfg.sites.num_classes or 0), origin)


def _empty(shape: list[int]) -> ArrayDataset:
    return ArrayDataset(torch.zeros(0, *shape), torch.zeros(0, dtype=torch.int64))


def site_algorithm(cfg: Config, files: SiteFiles, clients: int, site: int, sizes: list[list[int]],
                   device: str = "cpu") -> Algorithm:  # fmt: skip
    """The run's algorithm on site `site` (of the deployment whose sites hold `sizes`, training-sample counts per
    client), over the site's own data."""
    if len(sizes[site]) != clients:
        raise SiteError(f"site {site}: the server counts {len(sizes[site])} clients here, the node config {clients}")
    pool, splits = site_splits(files, clients, cfg, site)
    own = [len(tr) for tr, _, _ in splits]
    if list(sizes[site]) != own:
        raise SiteError(f"site {site}: the server counts {list(sizes[site])[:5]} training samples for its clients, "
                        f"the site holds {own[:5]}")  # fmt: skip
    k = int(cfg.sites.num_classes or 0)
    first = offsets(sizes)[site]
    everyone = [_nowhere(k) for _ in range(sum(len(s) for s in sizes))]
    for c, (tr, va, te) in enumerate(splits):
        everyone[first + c] = client_split(tr, va, te, pool.y.numpy(), k)
    fed = _federation(everyone, k, f"site-{site}")
    source = _source(cfg, pool, _empty(list(pool.x.shape[1:])), files.origin)
    return build_algorithm(replace_device(cfg, device), source, fed, threads=1)


def own_clients(algo: Algorithm) -> list[int]:
    """The clients whose data this context holds."""
    return [c for c, s in enumerate(algo.ctx.federation.clients) if s.train.numel()]


def replace_device(cfg: Config, device: str) -> Config:
    return cfg if cfg.executor.device == device else cfg.model_copy(update={"executor": cfg.executor.model_copy(
        update={"device": device})})  # fmt: skip


class ServerContext(Context):
    """The server's context: client data is on the sites."""

    def client_data(self, cid: int) -> ClientData:
        raise SiteError(f"client {cid}'s data is on its site; {self.cfg.algorithm.name} asked for it on the server")


def server_algorithm(cfg: Config, sizes: list[list[int]]) -> Algorithm:
    """The run's algorithm on the server: no client data; `sites.test` (if set) as the global test set."""
    k = int(cfg.sites.num_classes or 0)
    shape = list(cfg.sites.input_shape or [])
    flat = [n for s in sizes for n in s]
    test = _empty(shape)
    if cfg.sites.test is not None:
        test = read_npz(Path(cfg.sites.test).expanduser(), "sites.test")
        if list(test.x.shape[1:]) != shape or (len(test.y) and not 0 <= int(test.y.min()) <= int(test.y.max()) < k):
            raise DataError(f"sites.test {cfg.sites.test}: samples of shape {shape} and labels 0…{k - 1} are needed")
    fed = SitesFederation([_nowhere(k) for _ in flat], list(range(len(flat))), [],
                          torch.arange(len(test)), k, "sites", sizes=tuple(flat))  # fmt: skip
    try:
        return build_algorithm(cfg, _source(cfg, _empty(shape), test, "the sites"), fed, threads=1,
                               context=ServerContext)  # fmt: skip
    except ConfigError as e:
        if "public data" not in str(e):
            raise
        raise SiteError(f"{cfg.algorithm.name} cannot keep the data on the sites (sites.local): it exchanges "
                        "predictions on public data, which a site-local run does not have") from None


def describe_sites(dirs: list[Path]) -> tuple[tuple[int, ...], int]:
    """(sample shape, number of classes: the largest label + 1) of site directories on this machine: what
    `pflbed flower local --site-data` fills in when the config does not say."""
    shapes, top = set(), 0
    for d in dirs:
        if d.is_dir() and (not (d / "train.npz").is_file() or any(
                (d / s).is_dir() and not (d / f"{s}.npz").exists() for s in ("val", "test"))):  # fmt: skip
            raise SiteError(f"{d}: image folders do not say the run's input shape; --set sites.input_shape and "
                            "sites.num_classes")  # fmt: skip
        files = read_site({DATA: str(d)}, Config())
        assert files is not None
        shapes.add(tuple(files.data.x.shape[1:]))
        top = max([top, *(int(f.y.max()) for f in (files.data, files.val, files.test) if f is not None and len(f))])
    if len(shapes) != 1:
        raise SiteError(f"the --site-data directories hold samples of different shapes: {sorted(shapes)}")
    return shapes.pop(), max(2, top + 1)


SITE_FILES = ("train.npz", "val.npz", "test.npz")  # what `export_sites` writes into each site directory


def export_sites(cfg: Config, out: Path, force: bool = False) -> list[Path]:
    """Write each participated client of `cfg`'s simulated federation as a site directory `out/site-<cid>` holding
    `train.npz`, `val.npz` and `test.npz` — exactly the samples the simulated client trains, validates and is
    tested on, in the same order — so that a site-local deployment over them can be compared with the simulation.

    Site directories already in `out` are replaced only with `force`, and only an earlier export's: writing over
    them left an earlier, larger federation's sites beside the new ones, and `--site-data out/site-*` ran both."""
    from pflbed.data import load_source
    from pflbed.federation import build_federation

    if out.exists() and not out.is_dir():
        raise PflbedError(f"--out {out}: is a file; give the directory to write the site-<client> directories into")
    earlier = sorted((d for d in out.glob("site-*") if d.name[5:].isdigit()), key=lambda d: int(d.name[5:]))
    for d in earlier:
        other = sorted(f"holds {p.name}" for p in d.iterdir() if p.name not in SITE_FILES) if d.is_dir() else [
            "is a file"]  # fmt: skip
        if other:
            raise PflbedError(f"--out {out}: {d.name} is not a site directory pflbed flower sites wrote (it "
                              f"{other[0]}); choose another --out")  # fmt: skip
    if earlier and not force:
        raise PflbedError(f"--out {out}: holds site directories already ({', '.join(d.name for d in earlier[:3])}"
                          f"{', …' if len(earlier) > 3 else ''}); --force replaces them")  # fmt: skip
    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    x, y = source.train.x, source.train.y
    for d in earlier:  # an earlier export's alone (checked above), after the config's own checks
        shutil.rmtree(d)
    dirs = []
    for cid in fed.participated:
        d = out / f"site-{cid}"
        d.mkdir(parents=True)  # new: an earlier export's went above, and no other is taken
        split = fed.clients[cid]
        for name, idx in zip(SITE_FILES, (split.train, split.val, split.test), strict=True):
            np.savez(d / name, x=x[idx].cpu().numpy(), y=y[idx].cpu().numpy())
        dirs.append(d)
    return dirs
