"""The near-miss hint every layer's one-line errors end with: the option a word most likely misspells, else the
option it is a part of, and nothing for a word too short to say which."""

from __future__ import annotations

import pytest

from pflbed.hints import closest, did_you_mean, then


@pytest.mark.parametrize(("word", "options", "expected"), [
    ("lr_haed", ["lr", "lr_head", "lr_body"], "lr_head"),  # the closest of several close ones, not the first
    ("lrr", ["lr", "lrr_decay"], "lr"),  # a close spelling wins over an option containing the word
    ("seed", ["sampling_seed_offset", "rounds"], "sampling_seed_offset"),  # contained, however far in spelling
    ("pfl", ["pfl_val", "test"], "pfl_val"),  # three characters are enough to be contained
    ("pf", ["pfl_val", "test"], None),  # two are not
    ("epochs", ["local_epochs", "global_epochs_x"], "local_epochs"),  # the closest of those containing it
    ("zzz", ["lr", "rounds"], None),
    (3, [1, 2, 3], "3"),  # any value, as text
    ("FedAvg", ["fedprox", "fedavg"], "fedavg"),  # a paper's spelling of a lower-case name
    ("CNN", ["cnn_bn", "cnn"], "cnn"),  # the same name in other case, before a longer one
    ("fedavg", ["FedProx", "FedAvg"], "FedAvg"),  # the option as it is written (a suite's method names)
    ("rod", ["FedRoD", "FedProx"], "FedRoD"),  # contained, in other case
])  # fmt: skip
def test_closest(word, options, expected):
    assert closest(word, options) == expected


def test_did_you_mean_and_then():
    assert did_you_mean("rouns", {"rounds": 1}) == "; did you mean rounds?"
    assert did_you_mean("zzz", ["rounds"]) == ""
    assert then("unknown key x; did you mean y?", "see the docs") == "unknown key x; did you mean y? See the docs"
    assert then("unknown key x", "see the docs") == "unknown key x; see the docs"
