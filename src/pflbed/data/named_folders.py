"""The cross-domain image benchmarks distributed as `<domain>/<class>/<image>` trees, by name: Office-Home, PACS,
DomainNet. Each is the folder loader (`folders.py`: one pool, domain labels, PFLBED protocol) plus a check that
the tree found is that dataset: its domain folders are among the dataset's domains (a subset is fine) and its
classes number what the dataset has. So `dataset.name=pacs dataset.path=DIR` is all a run needs, and a wrong or
half-copied tree is a one-line error before any image is decoded.

A top-level folder that holds no folder is no domain and is passed over: copies prepared by some libraries keep an
`image_list/` of `.txt` split files beside the domains. A folder that does hold folders but is not one of the
dataset's domains is an error, so a misnamed domain is not silently left out.

Domain folder names are compared ignoring case and treating spaces, `_` and `-` alike (Office-Home's "Real World"
is "Real_World" in some copies). None has an official archive with a published digest, so `download=True` only
says where to get it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from pflbed.data import store
from pflbed.data.arrays import DataSource
from pflbed.data.folders import describe_domain_folders, load_domain_folders
from pflbed.errors import DataError


@dataclass(frozen=True)
class Benchmark:
    title: str
    domains: tuple[str, ...]
    num_classes: int
    tops: tuple[str, ...]  # folder names the tree commonly sits in (official archives, DomainBed's download script)
    source: str  # where to get it


BENCHMARKS: dict[str, Benchmark] = {
    "officehome": Benchmark("Office-Home", ("Art", "Clipart", "Product", "Real World"), 65,
                            ("office_home", "OfficeHomeDataset_10072016", "OfficeHome"),
                            "hemanthdv.github.io/officehome-dataset"),  # fmt: skip
    "pacs": Benchmark("PACS", ("art_painting", "cartoon", "photo", "sketch"), 7, ("PACS", "kfold", "PACS/kfold"),
                      "domaingeneralization.github.io (the kfold folder)"),  # fmt: skip
    "domainnet": Benchmark("DomainNet", ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"), 345,
                           ("domain_net", "DomainNet"), "ai.bu.edu/M3SDA (one zip per domain)"),  # fmt: skip
}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", " ", name).strip().lower()


def how_to_get(name: str) -> str:
    b = BENCHMARKS[name]
    return (f"download it from {b.source} and set dataset.path (or $PFLBED_DATA/{name}) to the folder holding "
            f"{', '.join(b.domains)}")  # fmt: skip


def _holds(name: str):
    known = {_key(d) for d in BENCHMARKS[name].domains}
    return lambda d: any(p.is_dir() and _key(p.name) in known for p in d.iterdir())


def find_named(name: str, path: str | os.PathLike[str] | None = None) -> Path | None:
    return store.find(name, path, BENCHMARKS[name].tops, _holds(name))


def check_tree(name: str, directory: Path) -> dict:
    """The folder listing of `directory` (`describe_domain_folders`), checked against benchmark `name`."""
    b = BENCHMARKS[name]
    tree = describe_domain_folders(directory, skip_classless=True)
    known = {_key(d) for d in b.domains}
    stray = [d for d in tree["domains"] if _key(d) not in known]
    if stray:
        raise DataError(f"{Path(tree['root']) / stray[0]}: not a {b.title} domain folder ({b.title} has "
                        f"{', '.join(b.domains)}); move it out of {tree['root']}")  # fmt: skip
    if len(tree["classes"]) != b.num_classes:
        raise DataError(f"{tree['root']}: {len(tree['classes'])} class folders across its domains, but {b.title} has "
                        f"{b.num_classes}: not a complete {b.title} tree")  # fmt: skip
    return tree


_NAMED: dict[tuple[str, int], tuple[DataSource, DataSource]] = {}


def load_named(
    name: str, path: str | os.PathLike[str] | None, image_size: int, download: bool, normalize: str
) -> DataSource:
    b = BENCHMARKS[name]
    directory = store.locate(name, b.title, path, b.tops, _holds(name), how_to_get(name), download)
    check_tree(name, directory)
    pool = load_domain_folders(directory, image_size=image_size, normalize=normalize, skip_classless=True)
    key = (name, id(pool))
    if key not in _NAMED:  # the same object for an unchanged tree, as the pool itself is
        while len(_NAMED) >= 4:  # the folder loader keeps 4 pools: keep no more alive here
            del _NAMED[next(iter(_NAMED))]
        _NAMED[key] = (pool, replace(pool, name=name))
    return _NAMED[key][1]


def load_officehome(
    path: str | os.PathLike[str] | None = None, image_size: int = 32, download: bool = False,
    normalize: str = "symmetric",
) -> DataSource:
    """Office-Home (Venkateswara et al. 2017): 4 domains, 65 classes; x float32 [N, 3, S, S], one pool."""
    return load_named("officehome", path, image_size, download, normalize)


def load_pacs(
    path: str | os.PathLike[str] | None = None, image_size: int = 32, download: bool = False,
    normalize: str = "symmetric",
) -> DataSource:
    """PACS (Li et al. 2017): 4 domains, 7 classes; x float32 [N, 3, S, S], one pool."""
    return load_named("pacs", path, image_size, download, normalize)


def load_domainnet(
    path: str | os.PathLike[str] | None = None, image_size: int = 32, download: bool = False,
    normalize: str = "symmetric",
) -> DataSource:
    """DomainNet (Peng et al. 2019): 6 domains, 345 classes; x float32 [N, 3, S, S], one pool."""
    return load_named("domainnet", path, image_size, download, normalize)
