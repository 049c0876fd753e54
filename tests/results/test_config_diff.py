"""The report's config table on hand-written config trees (no run trained): each key's default is its own
algorithm's, a value a run lacks and a default no version has read "—", values are shown as one line of YAML, and
an algorithm this version lacks is compared without failing."""

from pflbed.algorithms import get_algorithm
from pflbed.results.config_diff import _show, config_diff, diff_rows


def test_each_run_s_algorithm_options_are_compared_with_that_algorithm_s_defaults():
    """FedProx's μ has FedProx's default in the default column, also beside a run of an algorithm without μ; a key
    only one run sets reads "—" for the other; a key no version knows has no default ("—")."""
    mu = get_algorithm("fedprox").Config().mu
    header, rows = diff_rows([
        ("a", {"algorithm": {"name": "fedavg"}, "train": {"rounds": 5}, "custom": {"key": [1, 2]}}),
        ("b", {"algorithm": {"name": "fedprox", "mu": 0.5}, "train": {"rounds": 5}}),
    ])  # fmt: skip
    assert header == ["key", "a", "b", "default"]
    assert rows == [
        (["train.rounds", "5", "5", "30"], False),  # off its default in both runs, the same in each: not marked
        (["custom.key", "[1, 2]", "—", "—"], True),
        (["algorithm.name", "fedavg", "fedprox", "fedavg"], True),  # keys in the order the runs first change them
        (["algorithm.mu", "—", "0.5", str(mu)], True),
    ]


def test_a_run_at_an_algorithm_s_default_option_shows_no_row_and_one_run_is_never_marked():
    _, rows = diff_rows([("only", {"algorithm": {"name": "fedprox", "mu": 0.01}, "seed": 3})])
    assert rows == [(["algorithm.name", "fedprox", "fedavg"], False), (["seed", "3", "0"], False)]
    assert config_diff({"seed": 3, "train": {"rounds": 30}}) == {"seed": 3}  # no algorithm named: the default one


def test_an_algorithm_this_version_lacks_has_every_option_changed_and_no_error():
    """A run of a newer version's method: its options cannot be compared with defaults this version does not know,
    so each is shown as set (none hidden), and the report is still written."""
    tree = {"algorithm": {"name": "not_in_this_version", "beta": 0.1}}
    assert config_diff(tree) == {"algorithm.name": "not_in_this_version", "algorithm.beta": 0.1}
    _, rows = diff_rows([("new", tree)])
    assert rows[1] == (["algorithm.beta", "0.1", "—"], False)


def test_values_are_one_line_of_flow_yaml():
    """Strings as written; anything else as flow YAML on one line, however long (a list of 300 client ids), with
    nested mappings in braces rather than block YAML that would break a table row."""
    assert _show("fedavg") == "fedavg" and _show("yes") == "yes"  # a string is not quoted as YAML would
    assert _show(True) == "true" and _show(None) == "null" and _show(0.5) == "0.5"
    assert _show({"a": {"b": 1}}) == "{a: {b: 1}}"
    long = list(range(300))
    assert _show(long) == "[" + ", ".join(map(str, long)) + "]"
