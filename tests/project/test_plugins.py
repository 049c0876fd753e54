"""Plugins (`pflbed.plugins`): algorithms and models of other installed packages, found by their entry points in
every process a run uses; a plugin that cannot be used is left out, and its name says why."""

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint

import pytest
import yaml

import pflbed
from pflbed import plugins
from pflbed.algorithms import ALGORITHMS, _plugin_problem, get_algorithm, register
from pflbed.algorithms.base import Algorithm
from pflbed.algorithms.fedavg import FedAvg
from pflbed.config import validate_config
from pflbed.errors import ConfigError, PflbedError
from pflbed.models import MODELS, build_model
from pflbed.models.zoo import _plugin_problem as _model_problem
from pflbed.models.zoo import mlp

from ..doc_commands import ROOT, page_commands, page_python, with_sets
from ..tiny import TINY

GUIDE = "docs/guide/plugins.md"
MINE = ('from pflbed.algorithms.fedavg import FedAvg\n\n\nclass Mine(FedAvg):\n    """FedAvg under another name."""\n'
        '\n    name = "mine"\n')  # fmt: skip
NETS = "from pflbed.models.zoo import mlp\n\n\ndef tinynet(input_shape, num_classes):\n    return mlp(input_shape, " \
       "num_classes)\n"  # fmt: skip


def install(site, modules, entry_points, dist="myfl"):
    """A package as pip installs it into `site`: its modules, and its metadata naming its entry points (a
    `.dist-info` directory), which a process given `site` on its path finds."""
    site.mkdir(exist_ok=True)
    for name, code in modules.items():
        (site / f"{name}.py").write_text(code)
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{n} = {v}\n" for n, v in eps.items()) + "\n" for group, eps in entry_points.items()))


def cli(args, site, cwd):
    """`pflbed ARGS` in a process of its own, whose path holds `site` (plugins are read as a process starts)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "pflbed", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


SHORT = ["train.rounds=1", "eval.finetune=[]", "executor.threads=1"]


def test_the_plugins_guide_s_package_runs_as_written(tmp_path):
    """The guide's `pyproject.toml` and `myfl.py`, installed as pip would (their entry points in the package's
    metadata, the module beside it), then its commands (1 round): `pflbed algorithms` shows the plugin's paper and
    the run trains the plugin's algorithm on the plugin's model."""
    (toml,) = re.findall(r"```toml\n(.*?)```", (ROOT / GUIDE).read_text(), re.S)
    project = tomllib.loads(toml)["project"]
    (code,) = page_python(GUIDE)
    install(tmp_path / "site", {"myfl": code}, project["entry-points"], dist=project["name"])
    shown, ran = page_commands(GUIDE)
    assert shown == ["algorithms", "fedavg_uniform"] and ran[0] == "run"
    listed = cli(shown, tmp_path / "site", tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("fedavg_uniform: FedAvg with uniform client weights: McMahan et al.")
    done = cli(with_sets(ran, *SHORT), tmp_path / "site", tmp_path)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load((tmp_path / "runs" / "uniform" / "config.yaml").read_text())
    assert (config["algorithm"]["name"], config["model"]["name"]) == ("fedavg_uniform", "small_mlp")


@pytest.mark.xdist_group("flower-simulation")  # a Ray runtime of its own: not beside the others' on the other core
def test_a_plugin_runs_in_the_loop_in_procs_workers_and_on_flower_as_the_algorithm_it_is(tmp_path):
    """A plugin is found by every process a run uses: `procs`' workers and Flower's apps build the algorithm and
    the model by name (a `register`ed one was "unknown algorithm" there). A plugin that is FedAvg under another name
    on a model that is the zoo's MLP gives the built-in run's figures, on every executor."""
    install(tmp_path / "site", {"mine": MINE, "nets": NETS},
            {plugins.ALGORITHMS: {"mine": "mine:Mine"}, plugins.MODELS: {"tinynet": "nets:tinynet"}})  # fmt: skip
    base = ["run", "--no-progress", "--set", "dataset.name=synthetic", "--set", "train.rounds=2", "--set",
            "eval.finetune=[]", "--set", "executor.threads=1", "--set", "federation.clients=4"]  # fmt: skip
    finals = {}
    for name, algorithm, model, executor in [("builtin", "fedavg", "mlp", "loop"), ("loop", "mine", "tinynet", "loop"),
                                             ("procs", "mine", "tinynet", "procs"),
                                             ("flower", "mine", "tinynet", "flower")]:  # fmt: skip
        done = cli(with_sets([*base, "--out", name], f"algorithm.name={algorithm}", f"model.name={model}",
                             f"executor.name={executor}"), tmp_path / "site", tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr
        finals[name] = json.loads((tmp_path / name / "summary.json").read_text())["final"]
    assert finals["loop"] == finals["procs"] == finals["flower"] == finals["builtin"]


def test_a_plugin_that_cannot_be_used_is_one_line_at_the_command_line_and_listed_as_left_out(tmp_path):
    """Using a broken plugin's name is one line naming the plugin, its package and why, exit 2, nothing written;
    `pflbed algorithms` lists what it left out; a misspelt name is suggested among the plugins' names."""
    install(tmp_path / "site", {"mine": MINE}, {plugins.ALGORITHMS: {"mine": "mine:Mine", "broken": "nothere:X",
                                                                     "fedavg": "mine:Mine"},
                                              plugins.MODELS: {"cnn": "mine:Mine"}})  # fmt: skip
    done = cli(["run", "--set", "algorithm.name=broken", "--out", "r"], tmp_path / "site", tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("pflbed: error: algorithm.name: the plugin 'broken' (nothere:X, package myfl 0.1) did not "
                           "import: ModuleNotFoundError: No module named 'nothere'\n")  # fmt: skip
    assert not (tmp_path / "r").exists()
    misspelt = cli(["run", "--set", "algorithm.name=mien", "--out", "r"], tmp_path / "site", tmp_path)
    assert misspelt.returncode == 2 and misspelt.stderr.endswith("; did you mean mine?\n"), misspelt.stderr
    assert ", local, mine, moon," in misspelt.stderr and misspelt.stderr.count(" fedavg,") == 1
    listed = cli(["algorithms"], tmp_path / "site", tmp_path)
    assert listed.returncode == 0 and "│ mine " in listed.stdout
    assert listed.stdout.splitlines()[-3:] == [
        "left out (pflbed.algorithms): the plugin 'broken' (nothere:X, package myfl 0.1) did not import: "
        "ModuleNotFoundError: No module named 'nothere'",
        "left out (pflbed.algorithms): the plugin 'fedavg' (mine:Mine, package myfl 0.1) takes the name of pflbed's "
        "own, which stays",
        "left out (pflbed.models): the plugin 'cnn' (mine:Mine, package myfl 0.1) takes the name of pflbed's own, "
        "which stays"]


class Mine(FedAvg):
    """FedAvg under another name, for the entry points below (`module:attribute` of this test module)."""

    name = "mine"


class Misnamed(FedAvg):
    name = "other"


class Unnamed(FedAvg):
    """Its `name` is FedAvg's, inherited: a plugin class is named as its entry point."""


class Nameless(Algorithm):
    """No `name` at all (the base class only declares it)."""


NOT_A_MODEL = 3


@pytest.fixture
def zoo(monkeypatch):
    """The zoo, its plugins not yet added, on a copy of its models (restored after the test)."""
    from pflbed.models import zoo

    monkeypatch.setattr(zoo, "MODELS", dict(zoo.MODELS))
    monkeypatch.setattr(zoo, "_with_plugins", False)
    return zoo


def _declare(monkeypatch, group, entries):
    """`entries` (name → `module:attribute`) as `group`'s entry points, and no plugin left out yet."""
    monkeypatch.setattr(plugins, "declared", lambda g: tuple(EntryPoint(n, v, g) for n, v in entries) if g == group
                        else ())  # fmt: skip
    monkeypatch.setattr(plugins, "_problems", {})


def test_each_plugin_is_loaded_or_left_out_with_its_reason(monkeypatch, tmp_path):
    here = __name__
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "says_much.py").write_text("raise RuntimeError('first line\\nsecond line')\n")
    (tmp_path / "says_nothing.py").write_text("raise RuntimeError\n")
    monkeypatch.syspath_prepend(tmp_path)
    _declare(monkeypatch, plugins.ALGORITHMS, [
        ("mine", f"{here}:Mine"), ("fedavg", f"{here}:Mine"), ("misnamed", f"{here}:Misnamed"),
        ("unnamed", f"{here}:Unnamed"), ("nameless", f"{here}:Nameless"), ("function", f"{here}:_declare"),
        ("twice", f"{here}:Mine"), ("twice", f"{here}:Misnamed"), ("exits", "exits_on_import:X"),
        ("absent", f"{here}:Nothing"), ("much", "says_much:X"), ("nothing", "says_nothing:X")])  # fmt: skip
    found = plugins.load(plugins.ALGORITHMS, {"fedavg"}, _plugin_problem)
    assert found == {"mine": Mine}
    assert plugins.left_out(plugins.ALGORITHMS) == {
        "absent": f"the plugin 'absent' ({here}:Nothing) did not import: AttributeError: module '{here}' has no "
                  "attribute 'Nothing'",
        "exits": "the plugin 'exits' (exits_on_import:X) did not import: SystemExit: 3",
        "much": "the plugin 'much' (says_much:X) did not import: RuntimeError: first line",
        "nothing": "the plugin 'nothing' (says_nothing:X) did not import: RuntimeError",
        "fedavg": f"the plugin 'fedavg' ({here}:Mine) takes the name of pflbed's own, which stays",
        "function": f"the plugin 'function' ({here}:_declare) is a function, not a subclass of "
                    "pflbed.algorithms.base.Algorithm",
        "misnamed": f"the plugin 'misnamed' ({here}:Misnamed) is named 'other' in its class, not 'misnamed' as its "
                    "entry point",
        "nameless": f"the plugin 'nameless' ({here}:Nameless) is named None in its class, not 'nameless' as its "
                    "entry point",
        "twice": f"the plugin name 'twice' is declared twice ({here}:Mine; {here}:Misnamed); uninstall one",
        "unnamed": f"the plugin 'unnamed' ({here}:Unnamed) is named 'fedavg' in its class, not 'unnamed' as its entry "
                   "point",
    }  # fmt: skip
    assert plugins.problem(plugins.ALGORITHMS, "mine") is None
    assert plugins.problem(plugins.MODELS, "exits") is None  # another group's
    assert plugins.left_out(plugins.MODELS) == {}  # a group never loaded


def test_a_keyboard_interrupt_while_a_plugin_imports_is_not_taken_for_its_fault(monkeypatch, tmp_path):
    (tmp_path / "interrupted.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(tmp_path)
    _declare(monkeypatch, plugins.MODELS, [("interrupted", "interrupted:f")])
    with pytest.raises(KeyboardInterrupt):
        plugins.load(plugins.MODELS, (), _model_problem)


def test_a_left_out_plugin_s_name_says_why_wherever_it_is_checked(monkeypatch, zoo):
    """The config's check of `algorithm.name` and `model.name`, the registry and the zoo: each gives the plugin's
    reason, not "unknown" (an algorithm's and a model's, one group each)."""
    _declare(monkeypatch, plugins.ALGORITHMS, [("misnamed", f"{__name__}:Misnamed")])
    assert plugins.load(plugins.ALGORITHMS, (), _plugin_problem) == {}
    why = f"the plugin 'misnamed' ({__name__}:Misnamed) is named 'other' in its class, not 'misnamed' as its entry " \
          "point"  # fmt: skip
    for check in (lambda: validate_config({"algorithm": {"name": "misnamed"}}), lambda: get_algorithm("misnamed")):
        with pytest.raises(ConfigError) as e:
            check()
        assert str(e.value) == f"algorithm.name: {why}"
    _declare(monkeypatch, plugins.MODELS, [("three", f"{__name__}:NOT_A_MODEL"), ("tiny", "pflbed.models.zoo:mlp")])
    assert plugins.load(plugins.MODELS, (), _model_problem) == {"tiny": mlp}
    why = f"the plugin 'three' ({__name__}:NOT_A_MODEL) is an int, not a function of (input_shape, num_classes)"
    for check, got in [(lambda: validate_config({"model": {"name": "three"}}), " (got 'three')"),
                       (lambda: build_model("three", (4,), 2), "")]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            check()
        assert str(e.value) == f"model.name: {why}{got}"


def test_the_zoo_adds_the_plugins_models_once_on_first_use(monkeypatch, zoo):
    """Not as the zoo is imported (a plugin importing pflbed's algorithms would find it half imported), and not
    again on every lookup."""
    _declare(monkeypatch, plugins.MODELS, [("tiny", "pflbed.models.zoo:mlp"), ("three", f"{__name__}:NOT_A_MODEL")])
    loads, load = [], plugins.load
    monkeypatch.setattr(plugins, "load", lambda *args: loads.append(args[0]) or load(*args))
    assert zoo.models()["tiny"] is mlp and "three" not in zoo.MODELS
    assert zoo.models() is zoo.MODELS and loads == [plugins.MODELS]
    assert build_model("tiny", (4,), 2).zoo_name == "tiny"


def test_a_model_that_builds_no_block_net_is_refused_by_name(monkeypatch):
    import torch

    monkeypatch.setitem(MODELS, "linear", lambda shape, n: torch.nn.Linear(shape[0], n))
    with pytest.raises(ConfigError) as e:
        build_model("linear", (4,), 2)
    assert str(e.value) == ("model.name: linear built a Linear, not a pflbed.models.blocks.BlockNet (its blocks are "
                            "what the algorithms split into body and head)")  # fmt: skip
    assert build_model("mlp", (4,), 2).block_names() == mlp((4,), 2).block_names()


def test_the_names_a_config_takes_before_the_registry_loads_include_the_declared_plugins(monkeypatch):
    """Before torch loads, `algorithm.name` and `model.name` are checked against the built-in names and the
    plugins' declared ones (from the metadata; whether they load is the registry's check)."""
    from pflbed import hooks
    from pflbed.config.algorithm import check_algorithm_name
    from pflbed.config.model import MODEL_NAMES, known_models

    monkeypatch.setattr(hooks, "_registry", None)
    monkeypatch.delitem(sys.modules, "pflbed.models.zoo")  # as before the zoo is imported (`known_models`)
    declared = {plugins.ALGORITHMS: ("zeta", "fedavg"), plugins.MODELS: ("omega", "mlp")}
    monkeypatch.setattr(plugins, "names", declared.__getitem__)
    check_algorithm_name("zeta")
    with pytest.raises(ConfigError) as e:
        check_algorithm_name("zetq")
    assert str(e.value).endswith(", topk_pfl, zeta; did you mean zeta?") and str(e.value).count(" fedavg,") == 1
    assert known_models() == (*MODEL_NAMES, "omega")


def test_an_algorithm_registered_here_is_refused_on_flower_before_anything_is_written(monkeypatch, tmp_path):
    """Flower's apps build the algorithm by name in processes of their own: each failed with "unknown algorithm".
    A plugin is found there; a class registered in this process is refused, saying so."""
    monkeypatch.setitem(ALGORITHMS, "mine", FedAvg)  # restored (removed) after the test
    monkeypatch.setattr(sys.modules["pflbed.algorithms"], "REGISTERED_HERE", set())
    register(Mine)
    cfg = {**TINY, "algorithm": {"name": "mine"}, "executor": {"name": "flower"}}
    with pytest.raises(PflbedError) as e:
        pflbed.run(cfg, out=tmp_path / "r")
    assert str(e.value) == ("executor.name: flower: algorithm mine was registered in this process "
                            "(pflbed.algorithms.register), and Flower's apps build it by name in processes of their "
                            "own: make it a plugin (docs/guide/plugins.md)")  # fmt: skip
    assert not (tmp_path / "r").exists()
    ran = pflbed.run({**cfg, "executor": {"name": "loop"}}, out=tmp_path / "loop")  # in this process: it runs
    assert ran.summary["algorithm"] == "mine"
