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
from tests.printed import table_cells


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


# --- the command: `pflbed algorithms [NAME]` ----------------------------------------------------------------------
def test_algorithms_name_prints_its_paper_a_row_per_option_its_search_and_whether_privacy_applies(monkeypatch,
                                                                                                  capsys):
    import pflbed.algorithms as registry
    from pflbed.cli import main

    toy = type("Toy", (ToyAlgorithm,), {"dp_refused": "each client's update is read alone"})
    monkeypatch.setattr(registry, "get_algorithm", lambda name: toy)
    assert main(["algorithms", "toy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("toy: `pflbed algorithms` and the algorithm pages: each option's type, default, range and "
                        "search space as the user reads them, taken from the option model itself. ToyAlgorithm's "
                        "paper is this module's first paragraph.")
    assert lines[1].strip() == "toy options (--set algorithm.<option>=VALUE)"
    assert table_cells(lines) == (["option", "type", "default", "range", "meaning", "search (pflbed tune)"], [
        ["rate", "float", "0.1", "> 0, ≤ 1", "the rate", "log-uniform [0.01, 1]"],
        ["steps", "int", "3", "≥ 1, < 10", "", "int [1, 5]"],
        ["names", "list[str]", "['a', 'b']", "", "made on each read", ""],
        ["mode", "one of 'x', 'y'", "'x'", "", "", ""],
    ])  # fmt: skip
    assert lines[-2:] == [
        "search space (pflbed tune): train.lr: log-uniform [0.001, 0.3] (left out: train.local_epochs, "
        "train.momentum, never read by its training with its default options), and the options with a search column",
        "client-level DP (privacy.*) and SecAgg+ (sites.secagg): refused, because each client's update is read alone"]

    class NoOptions(BaseModel):
        search: ClassVar[dict[str, Any]] = {}

    bare = type("Bare", (ReadsEveryKey,), {"Config": NoOptions, "dp_refused": None})
    monkeypatch.setattr(registry, "get_algorithm", lambda name: bare)
    assert main(["algorithms", "bare"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "bare has no options of its own",
        "search space (pflbed tune): train.lr: log-uniform [0.001, 0.3], train.local_epochs: int [1, 5], "
        "train.momentum: uniform [0, 0.9], and the options with a search column",
        "client-level DP (privacy.*) and SecAgg+ (sites.secagg): apply"]


def test_algorithms_prints_one_row_each_with_the_paper_cut_at_110_characters_and_the_options_defaults(monkeypatch,
                                                                                                      capsys):
    import pflbed.results.catalog as module
    from pflbed.cli import main

    listed = [{"name": "short", "paper": "p" * 110, "options": []},
              {"name": "long", "paper": "q" * 111, "options": [{"name": "rate", "default": 0.1},
                                                              {"name": "mode", "default": "x"}]}]  # fmt: skip
    monkeypatch.setattr(module, "catalog", lambda: listed)
    assert main(["algorithms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip() == "algorithms (--set algorithm.name=NAME; `pflbed algorithms NAME` for its options)"
    assert table_cells(lines) == (["name", "paper", "options (default)"], [
        ["short", "p" * 110, ""], ["long", "q" * 109 + "…", "rate=0.1, mode='x'"]])


def test_an_unknown_name_is_one_line_naming_the_command_s_argument_the_known_names_and_the_nearest(capsys):
    from pflbed.algorithms import ALGORITHMS
    from pflbed.cli import main

    assert main(["algorithms", "fedavgg"]) == 2
    assert capsys.readouterr().err == (f"pflbed: error: algorithms NAME: unknown algorithm 'fedavgg'; known: "
                                       f"{', '.join(sorted(ALGORITHMS))}; did you mean fedavg?\n")
