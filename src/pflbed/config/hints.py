"""A validation error as one line naming the dotted field, with the near miss a typo probably meant: a key of the
same section (`train.round` → `train.rounds`), the same key in another section (`train.alpha` → `federation.alpha`),
a choice (`dirichlett` → `dirichlet`), a model of the zoo; and for a dataset the config does not know, how to bring
one's own."""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from pflbed.config.dataset import OWN_DATA
from pflbed.config.model import known_models
from pflbed.hints import closest, did_you_mean, then


def _section(model: type[BaseModel] | None, path: list[str]) -> type[BaseModel] | None:
    """The model class of the section at `path` under `model` (None: no such section). A mapping of sections (a
    suite's `tables`, `methods`) is passed through by its key: `methods.FedAvg` is a method's section."""
    parts = iter(path)
    for part in parts:
        info = model.model_fields.get(part) if model is not None else None
        if info is None:
            return None
        annotation = info.annotation
        if get_origin(annotation) is dict and _model_class(get_args(annotation)[1]) is not None:
            annotation = get_args(annotation)[1] if next(parts, None) is not None else None
        model = _model_class(annotation)
    return model


def _model_class(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _literals(annotation: Any) -> list[Any]:
    """The values of the Literal inside `annotation` (through list[…] and … | None), empty if none."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    if get_origin(annotation) in (list, Union, types.UnionType):
        return [v for a in get_args(annotation) for v in _literals(a)]
    return []


def _fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key under `model`, sections and their fields."""
    out = []
    for name, info in model.model_fields.items():
        out.append(f"{prefix}{name}")
        if (sub := _model_class(info.annotation)) is not None:
            out += _fields(sub, f"{prefix}{name}.")
    return out


def _unknown_key_hint(model: type[BaseModel], parts: list[str], prefix: str, given: Any) -> str:
    """A near miss among the keys of the section (`train.round` → `train.rounds`; `trian: {rounds: 3}` →
    `train.rounds`), or the same key in another section (`train.alpha` → `federation.alpha`)."""
    parent, leaf = parts[:-1], parts[-1]
    section = _section(model, parent)
    if section is None:
        return ""
    close = closest(leaf, section.model_fields)
    if close:
        dotted = prefix + ".".join([*parent, close])
        sub = _model_class(section.model_fields[close].annotation)
        if sub is not None and isinstance(given, dict) and len(given) == 1:
            key = str(next(iter(given)))
            dotted += f".{closest(key, sub.model_fields) or key}"
        return f"; did you mean {dotted}?"
    elsewhere = [f for f in _fields(model) if f.rsplit(".", 1)[-1] == leaf]
    return f"; did you mean {prefix}{elsewhere[0]}?" if len(elsewhere) == 1 else ""


def first_error(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """The first validation error as one line naming the dotted field; with `model` (the validated class), a
    near-miss suggestion for an unknown key or an unknown choice."""
    e = err.errors()[0]
    parts = [str(p) for p in e["loc"]]
    loc = ".".join(parts)
    field = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "config"
    field = field if field.isprintable() else repr(field)  # a key holding a newline stays on the error's one line
    if e["type"] == "extra_forbidden":
        return f"{field}: unknown key" + (_unknown_key_hint(model, parts, prefix, e.get("input")) if model else "")
    msg = e["msg"].removeprefix("Value error, ")
    got = repr(e.get("input"))
    if e["type"] == "model_type" or isinstance(e.get("input"), dict) or len(got) > 80:
        return f"{field}: {msg}"  # a whole section (model-level checks) would not fit on one readable line
    hint = ""
    if field == "model.name" and e["type"] == "value_error":
        hint = did_you_mean(e.get("input"), known_models())
    if e["type"] == "literal_error" and model is not None:
        names = parts[:-1] if parts[-1].isdigit() else parts  # an item of a list of choices: the list's field
        section = _section(model, names[:-1])
        info = section.model_fields.get(names[-1]) if section else None
        if info is not None:
            hint = did_you_mean(e.get("input"), _literals(info.annotation))
    message = f"{field}: {msg} (got {got}){hint}"
    return then(message, OWN_DATA) if field == "dataset.name" else message
