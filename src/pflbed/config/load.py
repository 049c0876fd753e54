"""Reading a config: a YAML file, `--set key=value` overrides on top, then the checks, all before anything runs.

`validate_config` checks every section here (a mistake is one line naming the field, in a fraction of a second:
nothing heavy is imported), then the algorithm's options through the algorithm registry, which knows their models
(`pflbed.hooks`), then whether a privacy target can be reached.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pflbed import hooks
from pflbed.config.algorithm import check_algorithm_name
from pflbed.config.hints import first_error
from pflbed.config.root import Config
from pflbed.errors import ConfigError


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c = value` in a nested dict, creating levels as needed."""
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        node = child
    node[leaf] = value


def parse_override(item: str) -> tuple[str, Any]:
    """`key=value` with the value read as YAML (so numbers, booleans and lists get their types)."""
    if not isinstance(item, str):  # the API's overrides: 5 was an AttributeError from inside
        raise TypeError(f"overrides: 'key=value' strings, got {type(item).__name__} {item!r}")
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


class _RepeatedKey(yaml.YAMLError):
    pass


class _OnceEachKey(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last silently, so a file
    setting `rounds: 1` and further down `rounds: 200` would run whichever came last, unsaid. The keys a merge
    (`<<: *anchor`) brings in are not the mapping's own: they may be overridden, as YAML means them to be."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    raise _RepeatedKey(f"key {key_node.value!r} given twice (lines {seen[key_node.value]} and "
                                       f"{line}); a mapping holds each key once")  # fmt: skip
                seen[key_node.value] = line
        return super().construct_mapping(node, deep)


MAX_YAML_BYTES = 16 * 2**20  # a config or suite is a page of text; a larger file is the wrong file


def read_yaml_file(p: Path, what: str) -> Any:
    """The YAML tree of the `what` file `p` (a config, a suite); anything that is not YAML text of at most
    `MAX_YAML_BYTES` is one `ConfigError` naming it. The read is bounded, not the file checked first: `-c <(…)` is a
    pipe, and `-c /dev/zero` would otherwise fill the memory before any check."""
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        held = p / "config.yaml" if isinstance(e, IsADirectoryError) and (p / "config.yaml").is_file() else None
        raise ConfigError(f"{p}: cannot read {what} ({e.strerror})"
                          + (f"; a run's directory: its config is {held}" if held else "")) from None
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"{p}: larger than {MAX_YAML_BYTES // 2**20} MB; a {what} is a YAML text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); a {what} is a YAML text file") from None
    try:
        return yaml.load(text, Loader=_OnceEachKey)  # noqa: S506 — a SafeLoader that also refuses a repeated key
    except _RepeatedKey as e:
        raise ConfigError(f"{p}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{p}: invalid YAML{where}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read an optional YAML file, apply overrides and validate, raising `ConfigError` with one line."""
    return validate_config(config_tree(path, overrides))


def file_kind(tree: dict[str, Any]) -> str | None:
    """Which command a YAML file's top-level keys are for: `tune` (it has `tune`), `bench` (it has `tables`), `run`
    (only config sections); None where they say no more than that it is a suite (`name`, `seeds`, …) or nothing
    (an empty file). Read by the config loader and the suite loaders alike, so a file given to the wrong command
    is named the same way by each."""
    if "tune" in tree:
        return "tune"
    if "tables" in tree:
        return "bench"
    if tree and set(tree) <= set(Config.model_fields):
        return "run"
    return None


def config_tree(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The keys an optional YAML file and the overrides set, as a nested dict, before validation: what a user said,
    apart from the defaults (`pflbed flower local --site-data` fills in only what it leaves unsaid)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        loaded = read_yaml_file(p, "config")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of config keys")
        if isinstance(loaded, dict) and (kind := file_kind(loaded)) in ("bench", "tune"):
            raise ConfigError(f"{p}: a {kind} suite, not a run config: give it to "
                              f"`{shlex.join(['pflbed', kind, '-c', str(p)])}`")  # fmt: skip
        tree = loaded or {}
    if isinstance(overrides, str | bytes):  # iterated, its characters were each a `--set` ("'t': expected key=value")
        raise TypeError(f"overrides: a list of 'KEY=VALUE' strings, got one string: [{overrides!r}]")
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(tree, key, value)
    return tree


def validate_config(tree: dict[str, Any]) -> Config:
    """The `Config` of a nested dict of keys, or `ConfigError` with one line naming the first wrong field."""
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(first_error(e, model=Config)) from None
    check_algorithm_name(cfg.algorithm.name)
    hooks.check_algorithm(cfg)  # its options, and what SecAgg+ and client-level DP refuse for it
    if cfg.privacy.target_epsilon is not None:
        from pflbed.privacy import noise_multiplier  # late: the accountant (Opacus, torch)

        try:  # derived here, so that an unreachable target is refused before anything runs
            noise_multiplier(cfg.privacy.target_epsilon, cfg.privacy.delta, cfg.federation.sample_fraction,
                             cfg.train.rounds, cfg.privacy.accountant)  # fmt: skip
        except ValueError as e:
            raise ConfigError(f"privacy.target_epsilon: {e}") from None
    return cfg
