"""`pflbed tune` (issue 39): search spaces declared where the options live, studies on validation only, equal
budgets, resumable and shared studies."""

from __future__ import annotations

import pytest

from pflbed.algorithms import ALGORITHMS
from pflbed.config import TrainConfig
from pflbed.errors import ConfigError
from pflbed.search import Choice, IntSearch, Search, check_declared, declared, parse_space


def test_declared_search_names_are_options_of_their_model():
    for name, cls in ALGORITHMS.items():
        check_declared(cls.Config, f"algorithms.{name}")
        for key, space in declared(cls.Config).items():  # every declared value validates as the option
            for v in ([space.low, space.high] if not isinstance(space, Choice) else list(space.options)):
                cls.Config.model_validate({key: v})
    check_declared(TrainConfig, "train")
    assert set(declared(TrainConfig)) == {"lr", "local_epochs", "momentum"}
    wanted = {"fedprox": {"mu"}, "ditto": {"lam"}, "fedselect": {"alpha", "p"}, "fedbasis": {"K", "tau"},
              "pfedhn": {"hn_lr"}}  # fmt: skip
    for name, keys in wanted.items():
        assert keys <= set(declared(ALGORITHMS[name].Config)), name
    assert declared(ALGORITHMS["fedprox"].Config)["mu"].log


def test_a_declaration_naming_no_option_is_caught():
    from typing import ClassVar

    from pydantic import BaseModel

    class Opts(BaseModel):
        search: ClassVar[dict] = {"nu": Search(0.1, 1.0)}
        mu: float = 0.1

    with pytest.raises(ConfigError, match="'nu' is not an option"):
        check_declared(Opts, "x")


def test_parse_space_forms_and_errors():
    assert parse_space({"low": 1e-3, "high": 1, "log": True}, "w") == Search(1e-3, 1.0, True)
    assert parse_space({"low": 1, "high": 4, "int": True}, "w") == IntSearch(1, 4)
    assert parse_space([1, "a"], "w") == Choice([1, "a"])
    for bad in ({"low": 0, "high": 1, "log": True}, {"low": 2, "high": 1}, {"lo": 1}, 3):
        with pytest.raises(ConfigError, match="^w: "):
            parse_space(bad, "w")


def test_algorithms_name_shows_the_search_space(capsys):
    from pflbed.cli import main

    assert main(["algorithms", "fedbasis"]) == 0
    out = capsys.readouterr().out
    tau = next(line for line in out.splitlines() if line.startswith("│ tau "))
    assert [c.strip() for c in tau.split("│")[1:-1]][5] == "log-uniform [0.02, 1]"
    assert "train.lr: log-uniform [0.001, 0.3]" in out
