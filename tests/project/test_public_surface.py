"""What a user meets first: the package namespace, `--help` pages, `pflbed algorithms`, the shipped configs."""

import copy
import inspect
import re
from pathlib import Path

import pytest

import pflbed
from pflbed.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_namespace_is_its_api():
    """`dir(pflbed)` shows the API and the subpackages, no stray imports (`Any`, `Path`, `annotations`)."""
    public = {n for n in dir(pflbed) if not n.startswith("_") and not inspect.ismodule(getattr(pflbed, n))}
    assert public == set(pflbed.__all__) - {"__version__"} == {"load_config", "load_run", "run"}
    assert all(hasattr(pflbed, n) for n in pflbed.__all__)


def test_pflbed_run_takes_a_config_a_dict_a_yaml_file_s_path_or_nothing(tmp_path, monkeypatch):
    """`pflbed.run("config.yaml")`, as `pflbed run -c`, was a bare ValueError of `dict("config.yaml")`; another type
    is a TypeError naming it. A dict's dotted keys (`{"train.rounds": 3}`, as `--set` writes them) were "unknown
    key"; they are set after the nested ones, and the caller's dict is left as it was."""
    import pflbed.results.experiment
    from pflbed.errors import ConfigError

    got = []
    monkeypatch.setattr(pflbed.results.experiment, "run", lambda cfg, out, **kw: got.append((cfg, out, kw)))
    f = tmp_path / "c.yaml"
    f.write_text("train: {rounds: 3}\n")
    for config in (str(f), f, {"train": {"rounds": 3}}, pflbed.load_config(f)):
        pflbed.run(config, out="o")
        cfg, out, kw = got.pop()
        assert cfg == pflbed.load_config(f) and out == Path("o")
        assert kw == {"write": True, "progress": False, "force": False}
    pflbed.run(None, write=False)
    assert got.pop()[0] == pflbed.load_config()
    given = {"train.rounds": 3, "train": {"rounds": 9, "lr": 0.2}, "eval": {"new_clients": {"epochs": 2}},
             "eval.new_clients.lrs": [0.1], "seed": 4}  # dotted after nested, into a section two levels down
    before = copy.deepcopy(given)
    pflbed.run(given, out="o")
    assert got.pop()[0] == pflbed.load_config(None, ["train.lr=0.2", "train.rounds=3", "eval.new_clients.epochs=2",
                                                     "eval.new_clients.lrs=[0.1]", "seed=4"])  # fmt: skip
    assert given == before  # the caller's dict, its sections too, as it was
    deep = {"federation.x": {"y": {"z": 1}}, "federation.x.y.w": 2}  # a dotted section, then a key inside it
    with pytest.raises(ConfigError, match=r"^federation\.x: unknown key"):
        pflbed.run(deep)
    assert deep == {"federation.x": {"y": {"z": 1}}, "federation.x.y.w": 2}  # refused, and left as it was
    with pytest.raises(ConfigError, match=r"^train\.round: unknown key; did you mean train\.rounds\?$"):
        pflbed.run({"train.round": 3})
    with pytest.raises(ConfigError, match=r"none\.yaml: cannot read config \(No such file or directory\)$"):
        pflbed.run(str(tmp_path / "none.yaml"))
    with pytest.raises(TypeError) as e:
        pflbed.run(["train.rounds=3"])
    assert str(e.value) == ("pflbed.run: config must be a Config, a dict of config keys, a YAML file's path or None, "
                            "not list")  # fmt: skip
    for bad, said in (({"force": "no"}, "force must be True or False, not str 'no'"),  # "no" replaced a run
                      ({"write": 0}, "write must be True or False, not int 0"),
                      ({"out": ""}, "out must be a directory's path or None, not str ''"),  # the default place
                      ({"out": 5}, "out must be a directory's path or None, not int 5")):  # fmt: skip
        with pytest.raises(TypeError) as e:
            pflbed.run(None, **bad)
        assert str(e.value) == f"pflbed.run: {said}"
    assert got == []


@pytest.mark.parametrize("action, own, other", [("local", "--supernodes", "--run-dir"),
                                                ("app", "--run-dir", "--supernodes")])  # fmt: skip
def test_flower_subcommands_have_their_own_help(action, own, other, capsys):
    with pytest.raises(SystemExit) as done:
        main(["flower", action, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pflbed flower {action}") and own in out and other not in out


def _file_references(text: str) -> set[str]:
    """Tokens that look like a path to a file (`dir/name.ext`)."""
    return set(re.findall(r"[\w.-]+(?:/[\w.-]+)+\.(?:txt|pdf|md|tex|py|yaml)\b", text))


def test_algorithms_cite_papers_and_name_no_missing_file(capsys):
    """`pflbed algorithms NAME` prints the paper's citation: any file it names exists in the repository."""
    from pflbed.algorithms import ALGORITHMS

    for name in ALGORITHMS:
        assert main(["algorithms", name]) == 0
        out = capsys.readouterr().out
        missing = [f for f in _file_references(out) if not (ROOT / f).exists() and not (ROOT / "src" / f).exists()]
        assert not missing, (name, missing)
        assert "Spec:" not in out and "papers/" not in out, name


def test_shipped_configs_describe_themselves_in_user_terms():
    """The comments of benchmarks/configs and benchmarks/suites say what a config runs, not why it was written."""
    files = sorted(f for d in ("configs", "suites") for f in (ROOT / "benchmarks" / d).glob("*.yaml"))
    assert files
    for f in files:
        comments = "\n".join(line for line in f.read_text().splitlines() if line.lstrip().startswith("#"))
        assert not re.search(r"\bissue\b|acceptance", comments, re.IGNORECASE), f
