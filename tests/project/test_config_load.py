"""Reading a config: `--set key=value` overrides, the YAML file, and a DP target checked before anything runs —
each mistake one `ConfigError` line with the whole message checked."""

import re

import pytest

from pflbed.config import load_config, parse_override
from pflbed.config.load import read_yaml_file
from pflbed.errors import ConfigError


@pytest.mark.parametrize(("item", "parsed"), [
    ("train.lr=0.1", ("train.lr", 0.1)),
    (" train.lr = 0.1", ("train.lr", 0.1)),
    ("dataset.path=a=b", ("dataset.path", "a=b")),  # the first = separates: a value may hold one
    ("eval.finetune=[ft, lp]", ("eval.finetune", ["ft", "lp"])),
    ("dataset.path=", ("dataset.path", "")),  # nothing after =: the empty string, not YAML's null
    ("dataset.path=  ", ("dataset.path", "")),
    ("dataset.path=[a, b", ("dataset.path", "[a, b")),  # not YAML: the text as it is
    ("seed=null", ("seed", None)),
])  # fmt: skip
def test_an_override_is_a_key_and_a_yaml_value(item, parsed):
    assert parse_override(item) == parsed


@pytest.mark.parametrize("item", ["train.lr", "=0.1", " =0.1", ""])
def test_an_override_without_a_key_and_an_equals_sign_is_refused(item):
    with pytest.raises(ConfigError) as e:
        parse_override(item)
    assert str(e.value) == f"--set {item!r}: expected key=value"


@pytest.mark.parametrize("item", [5, None, ("seed", 1), b"seed=1"])
def test_an_override_that_is_no_text_is_a_type_error_naming_it(item):
    """`load_config(None, [5])` was an AttributeError from inside the parser."""
    with pytest.raises(TypeError) as e:
        load_config(None, [item])
    assert str(e.value) == f"overrides: 'key=value' strings, got {type(item).__name__} {item!r}"


def test_an_override_below_a_value_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.lr=0.1", "train.lr.max=1"])
    assert str(e.value) == "train.lr.max: lr is not a section"


@pytest.mark.parametrize(("text", "error"), [
    ("- 1\n- 2\n", "top level must be a mapping of config keys"),
    ("seed: 1\ntrain:\n\trounds: 2\n", "invalid YAML at line 3"),  # a tab indents line 3
    ("seed: \x07\n", "invalid YAML"),  # a character YAML refuses to read: no line to name
])  # fmt: skip
def test_a_config_file_that_is_not_a_mapping_of_keys_is_named(tmp_path, text, error):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: {error}"


def test_a_key_given_twice_in_a_config_or_suite_is_refused_a_merged_key_may_be_overridden(tmp_path):
    """PyYAML keeps the last of two equal keys silently: `rounds: 1` then, further down, `rounds: 200` ran 200
    rounds, unsaid. A key a merge (`<<: *anchor`) brings in is overridden as YAML means it to be."""
    from pflbed.results.bench import load_suite

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  rounds: 1\n  lr: 0.1\n  rounds: 200\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: key 'rounds' given twice (lines 2 and 4); a mapping holds each key once"
    path.write_text("name: s\nname: t\ntables: {}\n")
    with pytest.raises(ConfigError, match=r"key 'name' given twice \(lines 1 and 2\)"):
        load_suite(path, [])
    path.write_text("x: &base {rounds: 3, lr: 0.1}\ntrain:\n  <<: *base\n  rounds: 2\n")
    assert read_yaml_file(path, "config")["train"] == {"rounds": 2, "lr": 0.1}


def test_an_empty_config_file_is_the_defaults(tmp_path):
    (tmp_path / "c.yaml").write_text("# nothing set\n")
    assert load_config(tmp_path / "c.yaml") == load_config(None)


def test_an_unreachable_privacy_target_is_refused_with_what_it_was_computed_for():
    """The noise for `privacy.target_epsilon` is derived at validation, from δ, the sampling rate, the rounds and
    the accountant, so that a target out of reach stops the run before it starts."""
    sets = ["privacy.clip=1", "privacy.target_epsilon=0.0001", "privacy.delta=0.001", "federation.sample_fraction=0.5",
            "train.rounds=2"]  # fmt: skip
    floors = {}
    for accountant in ("rdp", "prv"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [*sets, f"privacy.accountant={accountant}"])
        found = re.fullmatch(r"privacy\.target_epsilon: 0\.0001 is out of reach: even σ = 1000 gives ε = (\S+) at "
                             r"δ = 0\.001 after 2 rounds at sampling rate 0\.5", str(e.value))  # fmt: skip
        assert found, str(e.value)
        floors[accountant] = found[1]
    assert floors["rdp"] != floors["prv"]
    assert load_config(None, [*sets[:1], "privacy.target_epsilon=8"]).privacy.target_epsilon == 8


def test_a_config_file_that_cannot_be_read_as_text_is_named(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(missing)
    assert str(e.value) == f"{missing}: cannot read config (No such file or directory)"
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"seed: \xe9\n")
    with pytest.raises(ConfigError) as e:
        load_config(latin)
    assert str(e.value) == f"{latin}: not UTF-8 text (byte 6); a config is a YAML text file"


def test_a_config_file_is_read_up_to_its_bound_and_no_further(tmp_path, monkeypatch):
    """A file of the bound's size is read; one byte more is refused, having read no more than that byte: `-c
    /dev/zero` (a file that never ends) is refused, not read into memory."""
    from pflbed.config import load

    monkeypatch.setattr(load, "MAX_YAML_BYTES", 2**20)
    path = tmp_path / "c.yaml"
    path.write_text("#" * (2**20 - 1) + "\n")
    assert load_config(path) == load_config(None)
    path.write_text("#" * 2**20 + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: larger than 1 MB; a config is a YAML text file"

    class Endless:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, size=-1):
            assert size is not None and 0 <= size <= 2**20 + 1, f"read({size})"
            return b"\0" * size

    monkeypatch.setattr(load, "open", lambda *a, **k: Endless(), raising=False)
    with pytest.raises(ConfigError, match=r": larger than 1 MB; a config is a YAML text file$"):
        load_config("/dev/zero")


def test_overrides_are_a_list_not_one_string():
    """`load_config(None, "train.rounds=3")` read each character as an override ("--set 't': expected key=value");
    one string is refused as such, the list form read."""
    for given in ("train.rounds=3", b"train.rounds=3"):
        with pytest.raises(TypeError, match=r"^overrides: a list of 'KEY=VALUE' strings, got one string: \[.*3'\]$"):
            load_config(None, given)
    assert load_config(None, ["train.rounds=3"]).train.rounds == 3
    assert load_config(None, ("train.rounds=3",)).train.rounds == 3


def test_a_run_s_directory_given_as_a_config_names_the_config_in_it(tmp_path):
    """`pflbed run -c runs/x` (a run's directory, where its config.yaml was meant) says where that config is; a
    directory without one says only that it is a directory."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "run")
    assert str(e.value) == (f"{tmp_path / 'run'}: cannot read config (Is a directory); a run's directory: its config "
                            f"is {tmp_path / 'run' / 'config.yaml'}")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"{tmp_path}: cannot read config (Is a directory)"
