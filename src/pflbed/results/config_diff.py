"""A run's config as what it changes: the keys whose value is not pflbed's default, dotted (`train.rounds`,
`dataset.synthetic.n_train`). A resolved config.yaml lists every one of ~120 keys; the handful a user set are what
tell two runs apart, and are lost in it. The defaults come from the pydantic models themselves (`Config`, and the
algorithm's own `Config` for `algorithm.*`), so they cannot drift from what a run would resolve to.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pflbed.errors import PflbedError


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"a.b": 1}`; lists (and empty sections) are values."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def default_config(algorithm: str | None = None) -> dict[str, Any]:
    """pflbed's default config, dotted, with `algorithm`'s own options at their defaults (None: the default
    algorithm's): what a config with only `algorithm.name` set resolves to. Read from the pydantic models, so it
    cannot drift from them."""
    from pflbed.algorithms import get_algorithm
    from pflbed.config import validate_config

    flat = _flat(validate_config({}).to_dict())
    with contextlib.suppress(PflbedError):  # an algorithm this version lacks: its options compare with no default
        flat.update(_flat(get_algorithm(algorithm or flat["algorithm.name"]).Config().model_dump(mode="json"),
                          "algorithm."))  # fmt: skip
    return flat


def _defaults_of(tree: dict[str, Any]) -> dict[str, Any]:
    """`default_config` of the algorithm a run's config tree names (a tree naming none: the default one's)."""
    name = (tree.get("algorithm") or {}).get("name")
    return default_config(None if name is None else str(name))


def config_diff(tree: dict[str, Any]) -> dict[str, Any]:
    """The keys of a run's config whose value is not the default, dotted (`dataset.synthetic.n_train`), in the
    config's order. A key the defaults lack (a run of another version) counts as changed."""
    base = _defaults_of(tree)
    return {k: v for k, v in _flat(tree).items() if k not in base or base[k] != v}


def _show(v: Any) -> str:
    import yaml

    return v if isinstance(v, str) else yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix(
        "\n...").strip()  # fmt: skip


def diff_rows(runs: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[tuple[list[str], bool]]]:
    """The table of `runs` (name, config tree): header (key, each run, default) and, per key not at its default in
    some run, its cells and whether the runs' values differ from each other (what a comparison is about)."""
    trees = [t for _, t in runs]
    diffs = [config_diff(t) for t in trees]
    flats = [_flat(t) for t in trees]
    defaults = [_defaults_of(t) for t in trees]
    rows = []
    for key in dict.fromkeys(k for d in diffs for k in d):
        values = [f.get(key, "—") for f in flats]
        default = next((d[key] for d in defaults if key in d), "—")
        rows.append(([key, *map(_show, values), _show(default)], len(runs) > 1 and len(set(map(_show, values))) > 1))
    return ["key", *(name for name, _ in runs), "default"], rows
