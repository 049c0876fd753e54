"""What algorithms there are and what each accepts (`pflbed algorithms`), read from the code itself: the paper
from each algorithm file's docstring, the options (`algorithm.<option>` config keys) from its option model, so the
listing can never disagree with what the config validates."""

from __future__ import annotations

import sys
import types
import typing
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo

from pflbed.algorithms import ALGORITHMS
from pflbed.algorithms.base import Algorithm
from pflbed.config import TrainConfig
from pflbed.search import declared

_BOUNDS = ((annotated_types.Ge, "≥"), (annotated_types.Gt, ">"), (annotated_types.Le, "≤"), (annotated_types.Lt, "<"))


def paper(cls: type[Algorithm]) -> str:
    """The first paragraph of the algorithm file's docstring: its paper, as the file cites it."""
    doc = sys.modules[cls.__module__].__doc__ or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def type_name(annotation: Any) -> str:
    """A field's type as a reader wants it: `list[str] | None`, validators (`Annotated` metadata) left out."""
    if typing.get_origin(annotation) is typing.Annotated:
        return type_name(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:  # tuple[int, ...]
        return "..."
    if isinstance(annotation, type):  # a class; `list[int]` is not one
        return annotation.__name__
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"  # typing's forms have names too
    return str(annotation).replace("typing.", "")


def _type(info: FieldInfo) -> str:
    return type_name(info.annotation)


def bounds(info: FieldInfo) -> str:
    """A field's bounds as text (`≥ 1, ≤ 100000`), empty where it has none."""
    parts = [f"{sign} {getattr(m, type_.__name__.lower())}" for m in info.metadata for type_, sign in _BOUNDS
             if isinstance(m, type_)]  # fmt: skip
    return ", ".join(parts)


def options(cls: type[Algorithm]) -> list[dict[str, Any]]:
    """Each option: name, type, default, range (bounds, empty if none), description and search space (`pflbed
    tune`'s, as text; empty if the option is not tuned)."""
    rows, space = [], declared(cls.Config)
    for name, info in cls.Config.model_fields.items():
        default = info.get_default(call_default_factory=True)
        rows.append({"name": name, "type": _type(info), "default": default, "range": bounds(info),
                     "description": info.description or "",
                     "search": space[name].text() if name in space else ""})  # fmt: skip
    return rows


def shared_search(cls: type[Algorithm]) -> str:
    """The search space of the shared `train.*` keys that `cls` reads with its default options, as one line of text,
    and those it never reads (`Algorithm.unread_train`), which `pflbed tune` leaves out of its search unless the
    suite personalizes (a personalization reads `train.momentum`)."""
    unread = cls.unread_train(cls.Config())
    text = ", ".join(f"train.{k}: {s.text()}" for k, s in declared(TrainConfig).items() if k not in unread)
    keys = ", ".join(f"train.{k}" for k in sorted(unread))
    return text + (f" (left out: {keys}, never read by its training with its default options)" if unread else "")


def catalog() -> list[dict[str, Any]]:
    """Every registered algorithm: name, paper, options."""
    return [{"name": n, "paper": paper(c), "options": options(c)} for n, c in sorted(ALGORITHMS.items())]
