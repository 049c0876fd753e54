"""Partition manifests: a run's federation as a JSON file (`pflbed data export`), and a federation read back from one
(`federation.manifest`), so that a split travels between runs, tools and papers exactly.

The schema (docs/guide/datasets.md) holds every index a run's data use: per client its train / val / test
indices into the training split, its class prior and domain; which clients take part and which are new; the new
clients' S/M/L training subsets; the global (or per-domain) test and validation sets and the public samples. Its
dataset fingerprint (`DataSource.fingerprint`) ties it to the data it indexes: a manifest is refused on other data.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pflbed.data.arrays import DataSource
from pflbed.errors import ConfigError, DataError
from pflbed.federation.federation import _PARTITION_KEYS, ClientSplit, Federation, new_client_train

if TYPE_CHECKING:
    from pflbed.config import Config  # annotations only

FORMAT = "pflbed-federation"
VERSION = 1
SIZE_NAMES = ("S", "M", "L")


def manifest(cfg: Config, source: DataSource, fed: Federation) -> dict[str, Any]:
    """The manifest of `fed`, the federation `cfg` makes of `source` (its new-client subsets are those a run of
    `cfg` uses: `eval.new_clients.fractions` drawn from `cfg.seed`, or the ones `fed` already fixes)."""
    fractions = list(cfg.eval.new_clients.fractions[: len(SIZE_NAMES)])
    made = cfg.federation.model_dump(mode="json")
    as_list = lambda t: t.cpu().tolist()  # noqa: E731
    return {
        "format": FORMAT,
        "version": VERSION,
        "dataset": {"name": cfg.dataset.name, "fingerprint": source.fingerprint(), "train": len(source.train),
                    "test": len(source.test), "num_classes": source.num_classes},  # fmt: skip
        "made_with": {"seed": cfg.seed, "federation": {k: v for k, v in made.items() if k in _PARTITION_KEYS
                                                        or k in ("min_samples", "manifest")}},  # fmt: skip
        "global_split": fed.global_split,
        "global_test": as_list(fed.global_test),
        "public": as_list(fed.public),
        "domain_val": [as_list(t) for t in fed.domain_val],
        "domain_test": [as_list(t) for t in fed.domain_test],
        "participated": list(fed.participated),
        "new": list(fed.new),
        "clients": [{"train": as_list(c.train), "val": as_list(c.val), "test": as_list(c.test),
                     "prior": [float(p) for p in c.prior.cpu()], "domain": int(c.domain)}
                    for c in fed.clients],  # fmt: skip
        "new_client_subsets": {
            "sizes": dict(zip(SIZE_NAMES, fractions, strict=False)),
            "clients": {str(c): {size: as_list(new_client_train(fed, c, i, f, cfg.seed))
                                 for i, (size, f) in enumerate(zip(SIZE_NAMES, fractions, strict=False))}
                        for c in fed.new},
        },
    }  # fmt: skip


def write_manifest(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """`data` as JSON: one line per top-level key and per client, written to a temporary name and renamed."""
    path = Path(path)
    dump = lambda v: json.dumps(v, separators=(",", ":"))  # noqa: E731
    lines = []
    for k, v in data.items():
        if k == "clients":
            body = ",\n".join(f"  {dump(c)}" for c in v)
            lines.append(f'"clients": [\n{body}\n ]')
        else:
            lines.append(f"{dump(k)}: {dump(v)}")
    text = "{\n " + ",\n ".join(lines) + "\n}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:  # named as the user gave it, not as the temporary file it failed on
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


class _Bad(Exception):
    """What is wrong with a manifest's content; read_manifest adds the file."""


def read_manifest(path: str | os.PathLike[str], source: DataSource) -> Federation:
    """The federation a manifest holds, checked against `source` (its fingerprint, every index in range). Raises
    `DataError` with one line for a missing, unreadable or malformed file and for a manifest of other data."""
    p = Path(path).expanduser()
    where = f"federation.manifest: {p}"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{where}: no such file (write one with `pflbed data export FILE`)") from None
    except IsADirectoryError:
        raise DataError(f"{where}: is a directory, not a manifest file") from None
    except OSError as e:
        raise DataError(f"{where}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not a partition manifest (not UTF-8 text, byte {e.start})") from None
    try:
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not a partition manifest (invalid JSON at line {e.lineno})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataError(f"{where}: not a partition manifest (no \"format\": \"{FORMAT}\")")
    if m.get("version") != VERSION:
        raise DataError(f"{where}: manifest version {m.get('version')!r}; this pflbed reads version {VERSION}")
    data = m.get("dataset")
    theirs = data.get("fingerprint") if isinstance(data, dict) else None
    ours = source.fingerprint()
    if theirs != ours:
        made = f"dataset {data.get('name')!r} with fingerprint {theirs}" if isinstance(data, dict) else "no dataset"
        raise DataError(f"{where}: made for {made}, but this config's dataset ({source.name!r}) has "
                        f"fingerprint {ours}; a manifest runs only on the data it was exported from")  # fmt: skip
    try:
        fed = _federation(m, source, hashlib.sha256((ours + text).encode()).hexdigest()[:20])
    except _Bad as e:
        raise DataError(f"{where}: malformed manifest: {e}") from None
    return fed


def _get(m: dict[str, Any], key: str, kind: type, what: str = "") -> Any:
    """`m[key]`, a JSON list, object or string (`kind`)."""
    if key not in m:
        raise _Bad(f"{what}{key!r} missing")
    if not isinstance(m[key], kind):
        raise _Bad(f"{what}{key!r} has the wrong type")
    return m[key]


def _indices(values: Any, n: int, what: str) -> torch.Tensor:
    """A list of distinct integer indices in [0, n) as an int64 tensor, order kept."""
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise _Bad(f"{what} must be a list of integer indices")
    if values and (min(values) < 0 or max(values) >= n):  # in Python's integers: 2**70 overflows int64
        raise _Bad(f"{what} holds index {min(values) if min(values) < 0 else max(values)}, outside 0…{n - 1}")
    a = np.asarray(values, dtype=np.int64)
    if len(np.unique(a)) != len(a):
        raise _Bad(f"{what} holds an index twice")
    return torch.from_numpy(a)


def _federation(m: dict[str, Any], source: DataSource, key: str) -> Federation:
    n, k = len(source.train), source.num_classes
    labels = source.train.y.cpu().numpy()
    raw = _get(m, "clients", list)
    if not raw:
        raise _Bad("no clients")
    clients = []
    for cid, c in enumerate(raw):
        if not isinstance(c, dict):
            raise _Bad(f"client {cid} is not an object")
        tr, va, te = (_indices(_get(c, s, list, f"client {cid}: "), n, f"client {cid}'s {s}")
                      for s in ("train", "val", "test"))  # fmt: skip
        if len(tr) == 0:
            raise _Bad(f"client {cid} has no training samples")
        domain = c.get("domain", 0)
        if type(domain) is not int or domain < 0:
            raise _Bad(f"client {cid}'s domain must be a non-negative integer")
        counts = np.bincount(labels[tr.numpy()], minlength=k).astype(np.float32)
        prior = torch.from_numpy(counts / counts.sum())  # as the federation computes it: the train split's classes
        if "prior" in c:
            given = c["prior"]
            if not (isinstance(given, list) and len(given) == k and all(isinstance(v, (int, float)) for v in given)
                    and np.allclose(np.asarray(given, dtype=np.float64), prior.numpy(), rtol=0, atol=1e-6)):
                raise _Bad(f"client {cid}'s prior is not the class distribution of its train indices")  # fmt: skip
        clients.append(ClientSplit(tr, va, te, prior=prior, domain=domain))
    ids = range(len(clients))
    participated, new = (_get(m, key_, list) for key_ in ("participated", "new"))
    for what, v in (("participated", participated), ("new", new)):
        if not all(type(c) is int and c in ids for c in v) or len(set(v)) != len(v):
            raise _Bad(f"{what!r} must list distinct client ids 0…{len(clients) - 1}")
    if not participated:
        raise _Bad("no participated client")
    if set(participated) & set(new) or set(participated) | set(new) != set(ids):
        raise _Bad("every client must be either participated or new, not both")
    split = _get(m, "global_split", str)
    if split not in ("train", "test"):
        raise _Bad("'global_split' must be \"train\" or \"test\"")
    global_test = _indices(_get(m, "global_test", list), len(getattr(source, split)), "global_test")
    if len(global_test) == 0:
        raise _Bad("global_test is empty")
    domain_val = [_indices(t, n, f"domain_val[{d}]") for d, t in enumerate(_get(m, "domain_val", list))]
    domain_test = [_indices(t, n, f"domain_test[{d}]") for d, t in enumerate(_get(m, "domain_test", list))]
    if len(domain_val) != len(domain_test) or (domain_test and any(c.domain >= len(domain_test) for c in clients)):
        raise _Bad("domain_val and domain_test must hold one set for each client's domain")
    public = _indices(_get(m, "public", list), n, "public")
    learned = [(f"client {cid}'s {s}", t) for cid, c in enumerate(clients) for s, t in (("train", c.train),
               ("val", c.val))] + [("public", public), *((f"domain_val[{d}]", t) for d, t in enumerate(domain_val))]
    tested = [(f"client {cid}'s test", c.test) for cid, c in enumerate(clients)]
    _disjoint(learned + tested + [(f"domain_test[{d}]", t) for d, t in enumerate(domain_test)], n)
    if split == "train":  # test sets may share samples with it (PFLBED's is the domains' together), no other set
        _disjoint([("global_test", global_test), *learned], n)
    subsets, fractions = _subsets(m.get("new_client_subsets"), clients, sorted(new), n)
    return Federation(clients, sorted(participated), sorted(new), global_test, k, key, global_split=split,
                      domain_val=domain_val, domain_test=domain_test, public=public, new_subsets=subsets,
                      new_fractions=fractions)  # fmt: skip


def _disjoint(parts: list[tuple[str, torch.Tensor]], n: int) -> None:
    """Every sample of the training pool in one place at most: a client's test index also in its (or another
    client's) train split, or in the public set, would score a model on what it trained on, and the run would say
    nothing. A federation pflbed draws is disjoint by construction; a manifest is checked."""
    owner = np.full(n, -1, dtype=np.int64)
    for i, (name, t) in enumerate(parts):
        idx = t.numpy()
        held = owner[idx]
        if (held >= 0).any():
            at = int(np.flatnonzero(held >= 0)[0])
            raise _Bad(f"{parts[held[at]][0]} and {name} share index {int(idx[at])}; a sample belongs to one place")
        owner[idx] = i


def _subsets(raw: Any, clients: list[ClientSplit], new: list[int], n: int
             ) -> tuple[dict[int, list[torch.Tensor]], list[float]]:  # fmt: skip
    """The new clients' fixed S/M/L subsets (none: a run draws them from its seed)."""
    if raw is None:
        return {}, []
    if not isinstance(raw, dict):
        raise _Bad("'new_client_subsets' is not an object")
    sizes = _get(raw, "sizes", dict, "new_client_subsets: ")
    names = list(sizes)
    if names != list(SIZE_NAMES[: len(names)]) or not names or not all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1 for f in sizes.values()):
        raise _Bad("new_client_subsets.sizes must map S (, M, L) to fractions in (0, 1]")  # fmt: skip
    per_client = _get(raw, "clients", dict, "new_client_subsets: ")
    if set(per_client) != {str(c) for c in new}:
        raise _Bad("new_client_subsets.clients must hold every new client, and only them")
    out = {}
    for c in new:
        entry = per_client[str(c)]
        if not isinstance(entry, dict) or list(entry) != names:
            raise _Bad(f"new_client_subsets: client {c} needs one subset per size ({', '.join(names)})")
        out[c] = [_indices(entry[s], n, f"new client {c}'s {s} subset") for s in names]
        train = clients[c].train.numpy()
        if any(len(t) == 0 or not np.isin(t.numpy(), train).all() for t in out[c]):
            raise _Bad(f"new client {c}'s subsets must be non-empty parts of its train indices")
    return out, [float(sizes[s]) for s in names]


def check_fractions(fed: Federation, cfg: Config) -> None:
    """A manifest's new-client subsets were made for some `eval.new_clients.fractions`: refuse a run with others
    (before anything is written) rather than report S/M/L figures of sizes the config does not ask for."""
    if not fed.new_subsets:
        return
    asked = [float(f) for f in cfg.eval.new_clients.fractions[: len(SIZE_NAMES)]]
    if asked != fed.new_fractions:
        raise ConfigError(f"eval.new_clients.fractions: {asked}, but the new-client subsets of federation.manifest "
                          f"are for {fed.new_fractions}; set those, or delete the manifest's new_client_subsets to "
                          "draw them from the seed")  # fmt: skip
