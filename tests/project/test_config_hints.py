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
    "choice": (["federation.partition=dirichlett"], "(got 'dirichlett'); did you mean dirichlet?"),
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


def test_an_unknown_dataset_in_the_python_api_says_how_to_bring_ones_own():
    with pytest.raises(DataError) as e:
        load_dataset("fmnst")
    assert "did you mean fmnist? For your own images: " + OWN_DATA in str(e.value)
