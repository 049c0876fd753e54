"""pflbed's own modules import each other without a cycle (`benchmarks/import_cycles.py`)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _finder():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "benchmarks" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pflbed_has_no_import_cycles():
    assert _finder().find_cycles(ROOT / "src") == []


# DESIGN §2's layers, bottom first: each imports only from its own layer and those below. The utilities every
# layer uses sit at the bottom with the config. Flower's executor (client apps, site nodes, simulation) is an
# executor beside the engine's; the Flower apps that write a run directory (the deployment's ServerApp, the
# site-local launcher) sit above the results layer, which runs the experiment around the rounds.
LAYERS = [
    ("pflbed.config", "pflbed.errors", "pflbed.rng", "pflbed.hooks", "pflbed.privacy", "pflbed.private_files",
     "pflbed.allocator", "pflbed.compute", "pflbed.memory", "pflbed.hints", "pflbed.plugins", "pflbed.search",
     "pflbed.version", "pflbed.writable"),
    ("pflbed.data",),
    ("pflbed.federation",),
    ("pflbed.models",),
    ("pflbed.algorithms",),
    ("pflbed.evaluation",),
    ("pflbed.engine", "pflbed.flower"),
    ("pflbed.results",),
    ("pflbed.flower.server", "pflbed.flower.local"),
    ("pflbed", "pflbed.cli", "pflbed.__main__"),
]  # fmt: skip
ABOVE_CONFIG = tuple(name for names in LAYERS[1:] for name in names if name != "pflbed")  # "pflbed": exactly


def test_every_layer_imports_only_from_its_own_and_those_below():
    """DESIGN §2: imports point downwards only, wherever the statement is (a function-level import runs too).
    Every module has a layer: a new top-level module is placed here before it is imported."""
    assert _finder().upward_imports(_finder().import_graph(ROOT / "src"), LAYERS) == []


def test_the_engine_never_imports_flower():
    """Flower is an optional extra: the engine runs without it; Flower's executor builds on the engine."""
    graph = _finder().import_graph(ROOT / "src")
    assert sorted((m, t) for m in graph if m.startswith("pflbed.engine")
                  for t in graph[m] if t.startswith("pflbed.flower")) == []  # fmt: skip


def test_the_layer_check_reports_an_upward_import_and_a_module_without_a_layer(tmp_path):
    src = _write(tmp_path, {
        "pflbed/__init__.py": "",
        "pflbed/low/__init__.py": "",
        "pflbed/low/a.py": "def f():\n    from pflbed.high import b  # upwards, inside a function\n",
        "pflbed/low/app.py": "from pflbed.high import b  # an app above its package: allowed\n",
        "pflbed/high/__init__.py": "",
        "pflbed/high/b.py": "from pflbed.low import a\n",
        "pflbed/stray.py": "",
    })  # fmt: skip
    finder = _finder()
    layers = [("pflbed.low",), ("pflbed.high",), ("pflbed", "pflbed.low.app")]
    assert finder.upward_imports(finder.import_graph(src), layers) == [
        ("pflbed.low.a", "pflbed.high.b"), ("pflbed.stray", "no layer")]


def test_the_config_reaches_no_layer_above_it():
    """Nothing the config package imports, at module level or inside a function, leads to a layer above it: an
    algorithm's options are checked by the registry, which registers itself in `pflbed.hooks` (and the API layer
    says there how to import it), so no circle runs config → algorithms → … → config."""
    graph = _finder().import_graph(ROOT / "src")
    config = {m for m in graph if m == "pflbed.config" or m.startswith("pflbed.config.")}
    assert {"pflbed.config.load", "pflbed.config.root"} <= config
    reached, todo = set(), list(config)
    while todo:
        for m in graph[todo.pop()] - reached:
            reached.add(m)
            todo.append(m)
    above = sorted(m for m in reached if m == "pflbed" or m.startswith(ABOVE_CONFIG))
    assert above == [], above
    assert graph["pflbed.hooks"] == set()


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_finder_reports_a_planted_cycle(tmp_path, capsys):
    src = _write(tmp_path, {
        "pflbed/__init__.py": "",
        "pflbed/a.py": "from pflbed.b import f\n",
        "pflbed/b.py": "def f():\n    from pflbed import a  # a function-level import still runs\n",
        "pflbed/c.py": "import pflbed.a\n",
    })  # fmt: skip
    finder = _finder()
    assert finder.find_cycles(src) == [["pflbed.a", "pflbed.b"]]
    assert finder.main([str(src)]) == 1
    assert capsys.readouterr().out.splitlines() == ["['pflbed.a', 'pflbed.b']", "1 cycles"]


def test_what_counts_as_an_import(tmp_path):
    """Relative imports, package `__init__`s and dynamic imports count; `if TYPE_CHECKING:` blocks do not."""
    src = _write(tmp_path, {
        "pflbed/__init__.py": "",
        "pflbed/pkg/__init__.py": "from .low import g\n",
        "pflbed/pkg/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pflbed.top import T\n",
        "pflbed/top.py": "from pflbed.pkg import g\n",
        "pflbed/x.py": "import importlib\nimportlib.import_module('pflbed.y')\n",
        "pflbed/y.py": "from . import x\n",
    })  # fmt: skip
    finder = _finder()
    graph = finder.import_graph(src)
    assert graph["pflbed.top"] == {"pflbed.pkg"} and graph["pflbed.pkg"] == {"pflbed.pkg.low"}
    assert graph["pflbed.pkg.low"] == set()
    assert finder.find_cycles(src) == [["pflbed.x", "pflbed.y"]]
