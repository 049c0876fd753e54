"""`pflbed algorithms` and the algorithm pages: each option's type, default, range and search space as the user
reads them, taken from the option model itself. ToyAlgorithm's paper is this module's first paragraph.

Second paragraph: not part of the paper line."""

from __future__ import annotations

import sys
import typing
from typing import Annotated, Any, ClassVar, Literal

import pytest
from pydantic import BaseModel, Field

from pflbed.results.catalog import bounds, catalog, options, paper, shared_search, type_name
from pflbed.search import IntSearch, Search


@pytest.mark.parametrize(("annotation", "text"), [
    (int, "int"),
    (Annotated[float, Field(gt=0)], "float"),
    (int | None, "int | None"),
    (typing.Optional[typing.List[int]], "list[int] | None"),  # noqa: UP006, UP045 (the typing module's spelling)
    (Literal["a", "b"], "one of 'a', 'b'"),
    (list[str] | None, "list[str] | None"),
    (dict[str, float], "dict[str, float]"),
    (tuple[int, ...], "tuple[int, ...]"),
    (typing.Any, "Any"),
    (typing.ClassVar[int], "ClassVar[int]"),
    (typing.LiteralString, "LiteralString"),  # neither a class nor a generic: its own text, without "typing."
    (typing.TypeVar("T"), "~T"),
])  # fmt: skip
def test_a_type_reads_as_written(annotation, text):
    assert type_name(annotation) == text


class ToyConfig(BaseModel):
    rate: float = Field(0.1, gt=0, le=1, description="the rate")
    steps: Annotated[int, Field(ge=1, lt=10)] = 3
    names: list[str] = Field(default_factory=lambda: ["a", "b"], description="made on each read")
    mode: Literal["x", "y"] = "x"
    search: ClassVar[dict[str, Any]] = {"rate": Search(0.01, 1.0, True), "steps": IntSearch(1, 5)}


class ToyAlgorithm:
    Config = ToyConfig

    @staticmethod
    def unread_train(options: ToyConfig) -> set[str]:
        return {"momentum", "local_epochs"}


class ReadsEveryKey(ToyAlgorithm):
    @staticmethod
    def unread_train(options: ToyConfig) -> set[str]:
        return set()


def test_each_option_is_a_row_of_its_type_default_range_description_and_search():
    assert options(ToyAlgorithm) == [  # type: ignore[arg-type]
        {"name": "rate", "type": "float", "default": 0.1, "range": "> 0, ≤ 1", "description": "the rate",
         "search": "log-uniform [0.01, 1]"},
        {"name": "steps", "type": "int", "default": 3, "range": "≥ 1, < 10", "description": "", "search": "int [1, 5]"},
        {"name": "names", "type": "list[str]", "default": ["a", "b"], "range": "", "description": "made on each read",
         "search": ""},
        {"name": "mode", "type": "one of 'x', 'y'", "default": "x", "range": "", "description": "", "search": ""},
    ]  # fmt: skip
    assert bounds(ToyConfig.model_fields["mode"]) == ""


def test_the_paper_is_the_first_paragraph_of_the_algorithm_file_on_one_line():
    assert paper(ToyAlgorithm) == ("`pflbed algorithms` and the algorithm pages: each option's type, default, range "  # type: ignore[arg-type]
                                   "and search space as the user reads them, taken from the option model itself. "
                                   "ToyAlgorithm's paper is this module's first paragraph.")


def test_an_algorithm_file_without_a_docstring_has_no_paper_line(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "undocumented", types.ModuleType("undocumented"))
    Bare = type("Bare", (ToyAlgorithm,), {"__module__": "undocumented"})
    assert paper(Bare) == ""


def test_the_shared_search_leaves_out_the_keys_an_algorithm_never_reads_and_says_so():
    text = shared_search(ToyAlgorithm)  # type: ignore[arg-type]
    assert text == ("train.lr: log-uniform [0.001, 0.3] (left out: train.local_epochs, train.momentum, never read by "
                    "its training with its default options)")
    assert shared_search(ReadsEveryKey) == (  # type: ignore[arg-type]
        "train.lr: log-uniform [0.001, 0.3], train.local_epochs: int [1, 5], train.momentum: uniform [0, 0.9]")


def test_the_catalog_lists_every_registered_algorithm_in_name_order():
    from pflbed.algorithms import ALGORITHMS

    rows = catalog()
    assert [r["name"] for r in rows] == sorted(ALGORITHMS)
    fedavg = next(r for r in rows if r["name"] == "fedavg")
    assert fedavg["paper"].startswith("FedAvg — McMahan et al.") and fedavg["options"] == []
