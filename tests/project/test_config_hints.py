"""A config typo gets the near miss it probably meant, still as one line naming the field (exit code 2)."""

import pytest

from pflbed.cli import main
from pflbed.config import load_config
from pflbed.data import load_dataset
from pflbed.errors import ConfigError, DataError

OWN_DATA = "dataset.name=folder, dataset.path=DIR holding DIR/<domain>/<class>/<image>"

HINTS = {
    "key in its section": (["train.round=3"], "train.round: unknown key; did you mean train.rounds?"),
    "section name": (["trian.rounds=3"], "trian: unknown key; did you mean train.rounds?"),
    "nested section": (["federation.pflbed.particpated=0.5"], "did you mean federation.pflbed.participated?"),
    "key a longer one holds": (["train.epochs=3"], "train.epochs: unknown key; did you mean train.local_epochs?"),
    "key of another section": (["train.alpha=1"], "train.alpha: unknown key; did you mean federation.alpha?"),
    "key two sections down": (["train.participated=0.5"],
                              "train.participated: unknown key; did you mean federation.pflbed.participated?"),
    "section and key": (["trian.rouns=3"], "trian: unknown key; did you mean train.rounds?"),
    "section, its key unknown": (["trian.zzz=3"], "trian: unknown key; did you mean train.zzz?"),
    "a section under a key": (["train.round.x=1"], "train.round: unknown key; did you mean train.rounds?"),
    "choice": (["federation.partition=dirichlett"], "(got 'dirichlett'); did you mean dirichlet?"),
    "choice or none": (["federation.sampling=poison"], "federation.sampling: Input should be 'fixed' or 'poisson' "
                                                       "(got 'poison'); did you mean poisson?"),
    "choice in a list": (["dataset.augment=[flip, crpo]"], "dataset.augment.1: Input should be 'crop' or 'flip' "
                                                           "(got 'crpo'); did you mean crop?"),
    "model": (["model.name=cn"], "(got 'cn'); did you mean cnn?"),
    "algorithm": (["algorithm.name=fedavgg"], "unknown algorithm 'fedavgg'; known: apfl"),
    "algorithm option": (["algorithm.name=ditto", "algorithm.lamda=1"],
                         "algorithm.lamda: unknown key; did you mean algorithm.lam? Options of ditto: lam, "
                         "personal_epochs, personal_lr"),
    "another algorithm's option": (["algorithm.mu=0.1"],
                                   "algorithm.mu: unknown key; fedavg has no options of its own; mu is an option of "
                                   "apple, fedprox, gpfl, moon"),
    "dataset": (["dataset.name=svhn"], f"(got 'svhn'); for your own images: {OWN_DATA}"),
    "dataset near miss": (["dataset.name=fmnst"], f"did you mean fmnist? For your own images: {OWN_DATA}"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HINTS))
def test_near_misses_are_suggested(case):
    sets, expected = HINTS[case]
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert expected in str(e.value), str(e.value)
    if case == "algorithm":
        assert str(e.value).endswith("; did you mean fedavg?")


def test_no_suggestion_where_nothing_is_close():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["xyz=1"])
    assert str(e.value) == "xyz: unknown key"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.name=nope"])  # 0.6 similar to knnper: too far to be a typo of it
    assert "did you mean" not in str(e.value)


def test_the_suggestion_stays_one_line_exit_2(tmp_path, capsys):
    assert main(["run", "--set", "train.round=3", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pflbed: error: train.round: unknown key; did you mean train.rounds?"
    assert not (tmp_path / "run").exists()
    assert main(["config", "--set", "train.rou\nnds=3"]) == 2  # a key holding a newline: shown escaped
    err = capsys.readouterr().err.strip()
    assert err == "pflbed: error: 'train.rou\\nnds': unknown key; did you mean train.rounds?"


def test_an_unknown_dataset_in_the_python_api_says_how_to_bring_ones_own():
    with pytest.raises(DataError) as e:
        load_dataset("fmnst")
    assert "did you mean fmnist? For your own images: " + OWN_DATA in str(e.value)


EXACT = {
    "a value with no near miss": (["train.lr=0"], "train.lr: Input should be greater than 0 (got 0)"),
    "a check's own message, no model hint": (["executor.device=mlpp"],
                                             "executor.device: must be cpu, cuda, cuda:N (N = 0, 1, …) or auto "
                                             "(got 'mlpp')"),
    "a choice in a list two sections down": (["eval.new_clients.methods=[ft, lpp]"],
                                             "eval.new_clients.methods.1: Input should be 'ft' or 'lp' (got 'lpp'); "
                                             "did you mean lp?"),
    # a section's error without its input: a whole section would not fit on one readable line
    "a section given a number": (["federation.pflbed=3"],
                                 "federation.pflbed: Input should be a valid dictionary or instance of "
                                 "PflbedSplitConfig"),
    "a section's own check": (["privacy.noise_multiplier=1.0"],
                              "privacy: noise_multiplier needs privacy.clip (the norm each client's update is clipped "
                              "to)"),
    # the input shown up to 80 characters of its repr
    "an 80-character input": ([f"federation.partition={'x' * 78}"],
                              f"federation.partition: Input should be 'iid', 'dirichlet', 'classes' or 'natural' "
                              f"(got '{'x' * 78}')"),
    "an 81-character input": ([f"federation.partition={'x' * 79}"],
                              "federation.partition: Input should be 'iid', 'dirichlet', 'classes' or 'natural'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EXACT))
def test_the_whole_message(case):
    sets, expected = EXACT[case]
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert str(e.value) == expected


def test_a_check_of_a_whole_config_or_options_is_named_by_what_it_checks():
    """A model-level check has no field: its error is named by the section it checks, `config` for the root (its
    message names the keys), the options' prefix for an algorithm's options."""
    from pydantic import BaseModel, ValidationError, model_validator

    from pflbed.config import first_error

    with pytest.raises(ConfigError) as e:
        load_config(None, ["privacy.noise_multiplier=1", "privacy.clip=1", "federation.sampling=fixed"])
    assert str(e.value).startswith("config: federation.sampling: privacy's accountant assumes Poisson sampling")

    class Options(BaseModel, extra="forbid"):
        steps: int = 1

        @model_validator(mode="after")
        def _check(self):
            raise ValueError("steps and lr together")

    with pytest.raises(ValidationError) as v:
        Options()
    assert first_error(v.value, "algorithm.", Options) == "algorithm: steps and lr together"
    assert first_error(v.value, "", Options) == "config: steps and lr together"
    with pytest.raises(ValidationError) as v:
        Options(steps=1, lr=0.1)
    assert first_error(v.value) == "lr: unknown key"  # without the model, no near miss is looked for


def test_no_near_miss_is_looked_for_through_a_list_of_sections():
    """A section inside a list has no dotted name of its own to suggest: the unknown key or choice is named,
    nothing more (and no crash looking for its section)."""
    from typing import Literal

    from pydantic import BaseModel, ValidationError

    from pflbed.config import first_error

    class Item(BaseModel, extra="forbid"):
        size: int = 1
        kind: Literal["a", "b"] = "a"

    class Holder(BaseModel, extra="forbid"):
        items: list[Item] = []

    with pytest.raises(ValidationError) as v:
        Holder.model_validate({"items": [{"sise": 2}]})
    assert first_error(v.value, model=Holder) == "items.0.sise: unknown key"
    with pytest.raises(ValidationError) as v:
        Holder.model_validate({"items": [{"kind": "c"}]})
    assert first_error(v.value, model=Holder) == "items.0.kind: Input should be 'a' or 'b' (got 'c')"
