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
