"""The bounds every number in a config shares (`pflbed.config.base`), at their edges: the largest value passes and
the next one is refused with its reason, in a config section, in a list field and in an algorithm's options.

The property tests (`test_config_properties`) only see that a huge value runs or is refused; a float beyond
float32's range that is let through then diverges (exit 3, also allowed there), so the edges are checked here."""

import math

import pytest

from pflbed.config import FLOAT_MAX, INT_MAX, check_numbers, validate_config
from pflbed.errors import ConfigError

PAST_FLOAT = math.nextafter(FLOAT_MAX, math.inf)


def test_a_float_field_holds_float32s_range_and_no_more():
    """`train.lr` has only a lower bound of its own: float32's range is its upper one."""
    assert validate_config({"train": {"lr": FLOAT_MAX}}).train.lr == FLOAT_MAX
    with pytest.raises(ConfigError, match=r"^train\.lr: must be within float32's range, ±3\.4e\+38"):
        validate_config({"train": {"lr": PAST_FLOAT}})


def test_each_float_of_a_list_field_is_held_to_the_range():
    assert validate_config({"eval": {"new_clients": {"lrs": [0.1, FLOAT_MAX]}}}).eval.new_clients.lrs[1] == FLOAT_MAX
    with pytest.raises(ConfigError, match=r"^eval\.new_clients\.lrs: must be within float32's range"):
        validate_config({"eval": {"new_clients": {"lrs": [0.1, PAST_FLOAT]}}})


@pytest.mark.parametrize(("value", "error"), [
    (INT_MAX, None), (-INT_MAX, None), (True, None), (FLOAT_MAX, None), (-FLOAT_MAX, None), ("text", None),
    (INT_MAX + 1, f"must be at most {INT_MAX} in magnitude"), (-INT_MAX - 1, f"must be at most {INT_MAX} in magnitude"),
    (PAST_FLOAT, "must be within float32's range, ±3.4e+38"), (-PAST_FLOAT, "must be within float32's range, ±3.4e+38"),
    (math.inf, "must be a finite number"), (math.nan, "must be a finite number"),
])  # fmt: skip
def test_an_option_is_held_to_the_shared_bounds_at_their_edges(value, error):
    """`check_numbers` on an algorithm's options: integers to int32's magnitude, floats finite and within
    float32's range; the error names the option and the value."""
    if error is None:
        check_numbers({"opt": value}, "algorithm.")
    else:
        with pytest.raises(ConfigError) as e:
            check_numbers({"opt": value}, "algorithm.")
        assert str(e.value) == f"algorithm.opt: {error} (got {value!r})"


def test_the_options_bounds_reach_into_lists_and_nested_options():
    """An option may be a list or a mapping (an algorithm registered from outside pflbed): each number in it is
    checked, and the error names it by its path."""
    check_numbers({"sizes": [1, 2, INT_MAX], "inner": {"lr": 0.1, "deeper": {"steps": [3]}}}, "algorithm.")
    with pytest.raises(ConfigError, match=r"^algorithm\.sizes: must be at most"):
        check_numbers({"sizes": [1, INT_MAX + 1]}, "algorithm.")
    with pytest.raises(ConfigError, match=r"^algorithm\.inner\.deeper\.lr: must be a finite number \(got nan\)$"):
        check_numbers({"inner": {"ok": 1, "deeper": {"lr": math.nan}}}, "algorithm.")
    with pytest.raises(ConfigError, match=r"^algorithm\.inner\.steps: must be at most"):
        check_numbers({"inner": {"steps": [[0], 2**40]}}, "algorithm.")


def test_threads_are_bounded_at_four_per_core_even_where_the_cores_are_unknown(monkeypatch):
    import os

    from pflbed.config import max_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert max_threads() == 12
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # the OS cannot tell: one core assumed
    assert max_threads() == 4


def test_a_suite_s_seeds_are_each_a_run_seed_once():
    """`Seeds` (a bench or tune suite's): mean ± std over distinct runs, so a seed given twice is refused."""
    from pydantic import BaseModel, ValidationError

    from pflbed.config.base import SEED_MAX, Seeds

    class Suite(BaseModel):
        seeds: Seeds

    assert Suite(seeds=[0, SEED_MAX]).seeds == [0, SEED_MAX]
    for seeds, error in (([], "List should have at least 1 item"), ([SEED_MAX + 1], "less than or equal to"),
                         ([-1], "greater than or equal to 0")):  # fmt: skip
        with pytest.raises(ValidationError) as e:
            Suite(seeds=seeds)
        assert error in e.value.errors()[0]["msg"]
    with pytest.raises(ValidationError) as e:
        Suite(seeds=[2, 1, 2])
    assert e.value.errors()[0]["msg"] == ("Value error, each seed once: a repeated seed reruns the same run and "
                                          "counts it twice in mean ± std")


@pytest.mark.parametrize(("key", "value"), [
    ("train.rounds", True), ("train.rounds", False), ("train.lr", True), ("federation.alpha", True),
    ("seed", True), ("eval.new_clients.lrs", [0.1, True]), ("algorithm.mu", True),
])  # fmt: skip
def test_a_number_field_refuses_a_boolean_and_a_boolean_field_takes_one(key, value):
    """true (YAML's yes, on and True too) was 1 and false 0: `--set train.rounds=true` ran one round, `train.lr: on`
    trained at 1.0, without a word. A field that takes booleans still does."""
    tree: dict = {"algorithm": {"name": "fedprox"}}
    head, _, last = key.rpartition(".")
    node = tree
    for part in head.split(".") if head else []:
        node = node.setdefault(part, {})
    node[last] = value
    with pytest.raises(ConfigError) as e:
        validate_config(tree)
    assert str(e.value) == f"{key}: must be a number, not a boolean (got {value!r})"
    assert validate_config({"train": {"rounds": 2, "lr": 1}, "executor": {"strict": True}}).executor.strict is True
    from typing import Any

    from pflbed.config.base import Seeds, boolean_for_a_number

    for kind, takes_it in ((int | bool, True), (bool | None, True), (Any, True), (float | None, False),
                           (Seeds, False), (dict[str, float], False), (str, True)):  # fmt: skip
        assert boolean_for_a_number(kind, True) is not takes_it, kind
        assert boolean_for_a_number(kind, 1) is False


def test_a_suite_s_numbers_refuse_booleans_and_non_finite_scales(tmp_path):
    """A suite's `seeds: [true]` ran seed 1 and `scale: .nan` printed "nan ± nan"; bench and tune suites alike."""
    import yaml

    from pflbed.results.bench import load_suite
    from pflbed.results.tune.suite import load_tune_suite

    table = {"methods": {"A": {"set": {"algorithm.name": "fedavg"}}}}
    for suite, message in (({"seeds": [True]}, "seeds: must be a number, not a boolean (got [True])"),
                           ({"tables": {"t": {**table, "scale": math.nan}}}, "tables.t.scale: Input should be a "
                                                                              "finite number (got nan)"),
                           ({"tables": {"t": {**table, "column_scale": {"P-FL": True}}}},
                            "tables.t.column_scale: must be a number, not a boolean")):  # fmt: skip
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump({"name": "s", "seeds": [0], "tables": {"t": table}, **suite}))
        with pytest.raises(ConfigError) as e:
            load_suite(path)
        assert message in str(e.value), str(e.value)
    path.write_text(yaml.safe_dump({"name": "s", "seeds": [0], "tune": {"budget": True}, "methods": {"A": {}}}))
    with pytest.raises(ConfigError, match=r"tune\.budget: must be a number, not a boolean"):
        load_tune_suite(path)
