"""What algorithms there are and what each accepts (`pflbed algorithms`), read from the code itself: the paper
from each algorithm file's docstring, the options (`algorithm.<option>` config keys) from its option model, so the
listing can never disagree with what the config validates."""

from __future__ import annotations

import sys
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo

from pflbed.algorithms import ALGORITHMS
from pflbed.algorithms.base import Algorithm

_BOUNDS = ((annotated_types.Ge, "≥"), (annotated_types.Gt, ">"), (annotated_types.Le, "≤"), (annotated_types.Lt, "<"))


def paper(cls: type[Algorithm]) -> str:
    """The first paragraph of the algorithm file's docstring: its paper, as the file cites it."""
    doc = sys.modules[cls.__module__].__doc__ or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def _type(info: FieldInfo) -> str:
    return str(info.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _range(info: FieldInfo) -> str:
    parts = [f"{sign} {getattr(m, type_.__name__.lower())}" for m in info.metadata for type_, sign in _BOUNDS
             if isinstance(m, type_)]  # fmt: skip
    return ", ".join(parts)


def options(cls: type[Algorithm]) -> list[dict[str, Any]]:
    """Each option: name, type, default, range (bounds, empty if none) and description."""
    rows = []
    for name, info in cls.Config.model_fields.items():
        default = info.get_default(call_default_factory=True)
        rows.append({"name": name, "type": _type(info), "default": default, "range": _range(info),
                     "description": info.description or ""})  # fmt: skip
    return rows


def catalog() -> list[dict[str, Any]]:
    """Every registered algorithm: name, paper, options."""
    return [{"name": n, "paper": paper(c), "options": options(c)} for n, c in sorted(ALGORITHMS.items())]
