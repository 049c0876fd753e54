"""`--set KEY=VALUE` on a suite file's tree (`pflbed bench`, `pflbed tune`): the pieces both suites' rules are made
of. KEY is the suite's own dotted path; below a mapping whose keys are config keys or column names (a method's
`set`, a table's `report`) the rest of KEY is one key, and a label of the suite's own (a table, a setting, a
method) may hold dots itself (`Dir(0.3)`), so it is matched as the longest label the suite has."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from pflbed.config import parse_override, set_dotted
from pflbed.errors import ConfigError

Rule = Callable[[dict[str, Any], str, list[str], Any], bool]


def apply_overrides(tree: dict[str, Any], overrides: list[str], fields: Sequence[str], suite: str, elsewhere: str,
                    rule: Rule) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """A copy of the suite's tree with each `KEY=VALUE` set (the value read as YAML), and the keys set. `rule(tree,
    key, parts, value)` places a key the suite's own structure places (its labels, its mappings of one-key
    entries) and says so; any other is a dotted path. A KEY whose first part is none of `fields` is refused, with
    where a run config key goes: under `base`, or `elsewhere` (`{key}` the key given)."""
    tree, keys = copy.deepcopy(tree), []
    for item in overrides:
        key, value = parse_override(item)
        parts = key.split(".")
        if parts[0] not in fields:
            raise ConfigError(f"--set {key}: not a key of a {suite} suite ({', '.join(fields)}); a run config key "
                              f"goes under base (--set base.{key}=…) or {elsewhere.format(key=key)}")  # fmt: skip
        if not rule(tree, key, parts, value):
            set_in(tree, key, value, key)
        keys.append(key)
    return tree, keys


def listed(labels: Any) -> str:
    """The labels a suite has, for a message naming one it has not."""
    return ", ".join(labels) or "it has none"


def set_in(node: Any, dotted: str, value: Any, key: str) -> None:
    """`dotted` = `value` in the section `node` (levels created as needed); `key` names the `--set` in errors."""
    if not isinstance(node, dict):
        raise ConfigError(f"--set {key}: not a section")
    try:
        set_dotted(node, dotted, value)
    except ConfigError as e:
        raise ConfigError(f"--set {key}: {str(e).removeprefix(f'{dotted}: ')}") from None


def flat_set(node: Any, field: str, flat_key: str, value: Any, key: str) -> None:
    """`node[field][flat_key]` = `value`: `flat_key` is one key of the mapping `field` (a config key, a column)."""
    if not isinstance(node, dict):  # the section above `field` is none (`tune=5`): said as `set_in` says it
        raise ConfigError(f"--set {key}: not a section")
    mapping = node.setdefault(field, {})
    if not isinstance(mapping, dict):
        raise ConfigError(f"--set {key}: {field} is not a section")
    mapping[flat_key] = value


def label_at(mapping: dict[str, Any], parts: Sequence[str], what: str, key: str, where: str) -> tuple[str, list[str]]:
    """The label of `mapping` that `parts` start with (the longest, as a label may hold dots) and the parts after
    it; a label `where` has not is one line listing those it has."""
    for j in range(len(parts), 0, -1):
        label = ".".join(parts[:j])
        if label in mapping:
            return label, list(parts[j:])
    raise ConfigError(f"--set {key}: no {what} {parts[0]!r} in {where} ({listed(mapping)})")


def set_labelled(tree: dict[str, Any], field: str, parts: Sequence[str], value: Any, what: str, key: str,
                 where: str = "the suite") -> tuple[dict[str, Any], str, list[str]] | None:  # fmt: skip
    """`FIELD=[A, B]` keeps those entries of the mapping `tree[field]`, in that order; `FIELD.A=null` drops one
    and `FIELD.A=VALUE` replaces it (None then: done). Else (the mapping, the label, the parts below it) for the
    caller's rule of what lies below a label, the label's entry made a section if it was empty (`A:` in YAML)."""
    mapping = tree.get(field) if isinstance(tree.get(field), dict) else {}
    if not parts:
        if isinstance(value, list):
            if missing := [v for v in value if v not in mapping]:
                raise ConfigError(f"--set {key}: no {what} {missing[0]!r} in {where} ({listed(mapping)})")
            value = {v: mapping[v] for v in value}
        tree[field] = value
        return None
    label, rest = label_at(mapping, parts, what, key, where)
    if rest:
        if mapping[label] is None:
            mapping[label] = {}
        return mapping, label, rest
    if value is None:
        del mapping[label]
    else:
        mapping[label] = value
    return None


def set_by_overrides(error: ValidationError, keys: Sequence[str]) -> bool:
    """Whether the suite's first validation error lies at, below or above a key a `--set` gave (`seeds.0` of
    `seeds=[-1]`; a table's own check of a method set in it): its message then names the `--set`, not the file."""
    loc = ".".join(str(x) for x in error.errors()[0]["loc"])
    return any(loc == k or loc.startswith(f"{k}.") or k.startswith(f"{loc}.") for k in keys)
