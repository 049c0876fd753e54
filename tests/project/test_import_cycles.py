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


# The layers above the config (DESIGN §2) and the API on top (`pflbed` itself, `pflbed.cli`, `pflbed.runs`).
ABOVE_CONFIG = ("pflbed.algorithms", "pflbed.models", "pflbed.data", "pflbed.federation", "pflbed.evaluation",
                "pflbed.engine", "pflbed.results", "pflbed.flower", "pflbed.cli", "pflbed.runs")  # fmt: skip


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
