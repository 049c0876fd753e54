"""The mutation screen's commands in docs/contributing.md, run as written on a project of one small module.

The screen runs for hours on pflbed itself, so here its commands run in a copy of the project's layout holding one
module, `src/pflbed/toy.py`, with a test file that misses some of its mutants (the division's guard) and
`tests/algorithms/test_contract.py`, which catches them (the test file the page's last command names). What the
commands must do: `generate` makes the mutants and a copy of the tests, the two shards screen every mutant once,
`report` counts them, and the last command screens the named survivors again, against the other tests."""

import collections
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TOY = '''
def share(x, total):
    """x's share of total; none of nothing."""
    return x / total if total > 0 else 0.0


def scaled(x, factor=2):
    return x * factor
'''
WEAK = """from pflbed.toy import scaled, share


def test_a_share_and_scaled():
    assert share(1, 4) == 0.25
    assert scaled(3) == 6
"""
STRICT = """import numpy as np
import pytest

from pflbed.toy import share


# a node id pytest's argument parser cannot select again (`[[b'\\\\x00']]`, of a parameter shown by `str`): `--reach`
# must still run the test
@pytest.mark.parametrize("why", [np.zeros(1, dtype="V1")], ids=str)
def test_a_whole_share_and_none_of_nothing(why):
    assert share(2, 1) == 2.0
    assert share(3, 0) == 0.0
"""
PYPROJECT = """[tool.mutmut]
source_paths = ["src/"]
only_mutate = ["src/pflbed/toy.py"]
"""


def _commands():
    """The page's mutation-screen block, one shell command per entry (a comment line goes with the one above)."""
    page = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", page, re.S) if "mutation_screen.py generate" in b)
    commands = []
    for line in block.splitlines():
        if line.strip().startswith("#"):
            commands[-1] += "\n" + line
        else:
            commands.append(line)
    return commands


def _shell(command, cwd, ok=True, timeout=300):
    """`command`'s output (`ok`: it succeeded); `python` is this interpreter."""
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    out = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env={"PATH": path, "HOME": str(cwd)})  # fmt: skip
    if ok:
        assert out.returncode == 0, f"{command}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        return out.stdout
    return out


def _verdicts(project, out="screen"):
    """(verdict, mutant) of every line of the results files `mutants/<out>-*.txt`."""
    lines = [line.split() for f in sorted((project / "mutants").glob(f"{out}-*.txt")) for line in
             f.read_text().splitlines()]  # fmt: skip
    return [(verdict, name) for verdict, name in lines]


def _project(tmp_path, module, tests):
    """A copy of the project's layout holding the screen, one module `src/pflbed/toy.py` of source `module`, and
    the test files `tests` ((folder, name, source) each)."""
    project = tmp_path / "project"
    (project / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "mutation_screen.py", project / "benchmarks")
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "src" / "pflbed").mkdir(parents=True)
    (project / "src" / "pflbed" / "__init__.py").write_text("")
    (project / "src" / "pflbed" / "toy.py").write_text(module)
    for folder, name, text in tests:
        (project / "tests" / folder).mkdir(parents=True, exist_ok=True)
        (project / "tests" / folder / "__init__.py").write_text("")
        (project / "tests" / folder / name).write_text(text)
    (project / "tests" / "__init__.py").write_text("")
    return project


@pytest.mark.skipif(shutil.which("bash") is None, reason="the page's commands are bash")
def test_the_contributing_page_s_mutation_screen_commands_run_as_written(tmp_path):
    project = _project(tmp_path, TOY, [("project", "test_toy.py", WEAK), ("algorithms", "test_contract.py", STRICT)])
    generate, shard0, shard1, report, rerun = _commands()
    assert "mutants" in _shell(generate, project)
    assert (project / "mutants" / "tests" / "algorithms" / "test_contract.py").read_text() == STRICT
    _shell(f"{shard0}\n{shard1}", project)  # the second shard waits for the first, as the page shows

    first = _verdicts(project)
    names = [name for _, name in first]
    assert len(names) == len(set(names)) > 0  # the two shards screen every mutant once
    survivors = sorted(name for verdict, name in first if verdict == "SURVIVED")
    assert survivors and len(survivors) < len(first)  # the weak test kills some, not all
    table = _shell(report, project)
    assert f"| `toy.py` | {len(first)} | {len(first) - len(survivors)} | {len(survivors)} | 0 |" in table

    (project / "survivors.txt").write_text("\n".join(survivors) + "\n")
    _shell(rerun, project)
    again = [line.split() for line in (project / "mutants" / "screen-r-0.txt").read_text().splitlines()]
    assert sorted(name for _, name in again) == survivors  # only the named ones, against the strict test
    assert all(verdict == "KILLED" for verdict, _ in again)
    assert f"| `toy.py` | {len(first)} | {len(first)} | 0 | 0 | 100.0 % |" in _shell(report, project)

    # --reach: each mutant against only the tests that call its function. test_contract never calls `scaled`: its
    # mutants run no test; `share`'s get the verdicts the whole file gives them
    verdicts = {}
    for out, reach in (("all", ""), ("reach", "--reach")):
        _shell(f"python benchmarks/mutation_screen.py run --tests test_contract {reach} --out {out}", project)
        lines = (project / "mutants" / f"{out}-0.txt").read_text().splitlines()
        verdicts[out] = {name: verdict for verdict, name in (line.split() for line in lines)}
    assert sorted(verdicts["reach"]) == sorted(names)
    scaled = {n for n in names if ".x_scaled__" in n}
    assert scaled and {verdicts["reach"][n] for n in scaled} == {"NOTESTS"} != {verdicts["all"][n] for n in scaled}
    assert {n: v for n, v in verdicts["reach"].items() if n not in scaled} == \
        {n: v for n, v in verdicts["all"].items() if n not in scaled}  # fmt: skip

    # A copy of the tests that the unmutated code fails (here: edited after `generate`) would count every mutant
    # as killed: the screen stops instead, and records nothing.
    copied = project / "mutants" / "tests" / "algorithms" / "test_contract.py"
    copied.write_text(STRICT.replace("== 2.0", "== 3.0"))
    out = _shell(rerun.replace("screen-r", "screen-s"), project, ok=False)
    assert out.returncode != 0 and "the unmutated code fails tests/algorithms/test_contract.py" in out.stderr
    assert not (project / "mutants" / "screen-s-0.txt").read_text()


SPIN = '''import gc


class _Cycle:
    """Garbage only the collector frees, whose finalizer runs Python: where a time limit's signal may land."""

    def __init__(self):
        self.me = self

    def __del__(self):
        sum(range(100))


def drain(n):
    while n > 0:
        try:
            n -= 1
            _Cycle()
            gc.collect()
        except Exception:  # the code's own handler, which must not take the time limit for one of its errors
            pass
    return n
'''
SPIN_TEST = """from pflbed.toy import drain


def test_drain():
    assert drain(3) == 0
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="the screen's commands are bash")
def test_a_mutant_that_never_ends_times_out_and_the_screen_goes_on_afresh(tmp_path):
    """A mutant that loops for ever (`n -= 1` as `n += 1`) counts as killed at its time limit, however its loop
    meets the limit's signal: inside a finalizer the garbage collector runs, where Python drops the exception a
    signal's handler raises, or inside the code's own `except Exception`. Either once took a one-shot alarm and
    ran on until stopped. After a timeout the screen goes on in a fresh process and screens every mutant once."""
    project = _project(tmp_path, SPIN, [("project", "test_toy.py", SPIN_TEST)])
    _shell("python benchmarks/mutation_screen.py generate", project)
    out = _shell("python benchmarks/mutation_screen.py run --reach --timeout 1", project, ok=False, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    verdicts = _verdicts(project)
    names = [name for _, name in verdicts]
    assert len(names) == len(set(names)) and {n for n in names if ".x_drain__" in n}
    timed_out = [name for verdict, name in verdicts if verdict == "TIMEOUT"]
    assert timed_out and all(".x_drain__" in n for n in timed_out)
    assert {v for v, _ in verdicts} >= {"KILLED", "SURVIVED"}  # the rest as the test finds them
    assert [line for line in out.stderr.splitlines() if "timed out" in line] == \
        [f"mutation_screen: {name} timed out; going on in a fresh process" for name in timed_out]  # fmt: skip
    count = collections.Counter(v for v, _ in verdicts)
    killed = count["KILLED"] + count["TIMEOUT"]
    row = f"| `toy.py` | {len(names)} | {killed} | {count['SURVIVED']} | {count['NOTESTS']} |"
    assert row in _shell("python benchmarks/mutation_screen.py report", project)


@pytest.mark.skipif(shutil.which("bash") is None, reason="the screen's commands are bash")
def test_a_mutant_s_time_limit_is_at_least_three_times_its_tests_own_time(tmp_path):
    """A limit (`--timeout 1`) shorter than the tests' own time on the unmutated code (1.2 s here) is stretched to
    `SLOWER` times that time, with and without `--reach`: else every mutant of the slow test would count as killed
    (timed out), the survivors among them too."""
    slow = WEAK.replace("from pflbed", "import time\n\nfrom pflbed").replace(
        "def test_a_share_and_scaled():\n", "def test_a_share_and_scaled():\n    time.sleep(1.2)\n")
    project = _project(tmp_path, TOY, [("project", "test_toy.py", slow)])
    _shell("python benchmarks/mutation_screen.py generate", project)
    shares = [n for n in json.loads((project / "mutants/src/pflbed/toy.py.meta").read_text())["exit_code_by_key"]
              if ".x_share__" in n]  # fmt: skip
    (project / "shares.txt").write_text("\n".join(shares))
    for out, reach in (("all", ""), ("reach", "--reach")):
        _shell(f"python benchmarks/mutation_screen.py run --only shares.txt --timeout 1 {reach} --out {out}", project)
        verdicts = {verdict for verdict, _ in _verdicts(project, out)}
        assert verdicts == {"KILLED", "SURVIVED"}, (out, verdicts)  # the weak test's own: the guard's survive


def _screen_module():
    """benchmarks/mutation_screen.py as a module (benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_screen", ROOT / "benchmarks" / "mutation_screen.py")
    screen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screen)
    return screen


def test_a_loader_s_mutant_empties_the_loader_s_cache_that_other_mutants_keep(monkeypatch):
    """The data loaders' caches (keyed by their files) are kept between mutants of other code, but a mutant of a
    loader empties them: else the loader's result, decoded by the unmutated code, is read back and the mutated code
    never runs (a false survivor)."""
    import functools
    import types

    screen = _screen_module()
    calls = []
    loader = types.ModuleType("pflbed.data.fake_loader")

    @functools.lru_cache
    def load(path):
        calls.append(path)
        return path

    loader.load = load
    monkeypatch.setitem(sys.modules, "pflbed.data.fake_loader", loader)

    def decodes_again(mutant, pure=False):
        load("a")
        before = len(calls)
        screen.clear_caches(mutant, pure=pure)
        load("a")
        return len(calls) > before

    assert not decodes_again("pflbed.algorithms.fedavg.x_step__mutmut_1")  # other code: the data stay decoded
    assert not decodes_again("pflbed.privacy.x__epsilon__mutmut_1")
    assert decodes_again("pflbed.data.fake_loader.x_load__mutmut_1")  # the loader's own mutant
    assert decodes_again("pflbed.data.digits.x__to_dataset__mutmut_3")  # a loader's cache may hold another's work
    assert decodes_again("", pure=True)  # `--reach`'s recording while loaders are screened: each test loads afresh


def test_module_memos_are_emptied_before_every_mutant():
    """A plain dict a module memoizes into (masks' constants per device, the convolutions' timed choices) is
    emptied like the functools caches: filled under the unmutated code, it would keep the mutated code that fills
    it from running (a false survivor: `masks._on`'s copy replaced by None survived so)."""
    import torch

    from pflbed.algorithms import masks
    from pflbed.engine import conv_weight_grad

    screen = _screen_module()
    masks._on(masks._SHIFTS, torch.device("cpu"))
    conv_weight_grad._CHOICES[("a shape",)] = True
    screen.clear_caches("pflbed.algorithms.fedavg.x_step__mutmut_1")
    assert not masks._ON and not conv_weight_grad._CHOICES


@pytest.mark.skipif(shutil.which("bash") is None, reason="the screen's commands are bash")
def test_the_tests_that_fail_on_mutmut_s_copy_are_left_out_of_every_selection(tmp_path):
    """Each test in `UNSCREENABLE` (it fails on mutmut's copy of the code) is left out of the selections, with and
    without `--reach`: in its place here a test that always fails, beside the weak test of the page's run. And each
    is named as pytest names it: a renamed test would otherwise come back and stop the screen."""
    screen = _screen_module()
    files = {}
    for nodeid in screen.UNSCREENABLE:
        path, name = nodeid.split("::")
        assert f"\ndef {name}(" in (ROOT / path).read_text(encoding="utf-8"), nodeid
        files[path] = files.get(path, WEAK) + f"\n\ndef {name}():\n    raise AssertionError\n"
    assert files
    project = _project(tmp_path, TOY, [(Path(p).parent.name, Path(p).name, text) for p, text in files.items()])
    _shell("python benchmarks/mutation_screen.py generate", project)
    stems = ",".join(Path(p).stem for p in files)
    for out, reach in (("all", ""), ("reach", "--reach")):
        _shell(f"python benchmarks/mutation_screen.py run --tests {stems} {reach} --out {out}", project)
        verdicts = {verdict for verdict, _ in _verdicts(project, out)}
        assert {"KILLED", "SURVIVED"} <= verdicts  # the weak test's verdicts, as in the page's run


BOUNDED = '''def checked(f):
    return f


@checked
def bounded(x):
    if x < 0 or x > 10:
        raise ValueError("out of range")
    return x
'''
BOUNDED_WEAK = """import pytest

from pflbed.config.toy import bounded


def test_bounded():
    assert bounded(5) == 5
    with pytest.raises(ValueError):
        bounded(-1)
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="the page's commands are bash")
def test_the_contributing_page_s_decorated_mutant_commands_run_as_written(tmp_path):
    """The page's `decorated_mutants.py` commands on a decorated function mutmut would skip: each plant listed once,
    the two shards run each once, and a test that checks only the middle and one side of the range kills the
    dropped raise and `and` for `or` but not the edges moved (`<=` for `<`, `>=` for `>`, 10 → 11)."""
    project = _project(tmp_path, "", [("config", "test_toy.py", BOUNDED_WEAK)])
    (project / "src" / "pflbed" / "toy.py").unlink()
    (project / "src" / "pflbed" / "config").mkdir()
    (project / "src" / "pflbed" / "config" / "__init__.py").write_text("")
    (project / "src" / "pflbed" / "config" / "toy.py").write_text(BOUNDED)
    shutil.copy(ROOT / "benchmarks" / "decorated_mutants.py", project / "benchmarks")
    page = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", page, re.S) if "decorated_mutants.py list" in b)
    listing, shard0, shard1 = block.strip().splitlines()
    plants = [line.split(" ", 2)[2] for line in _shell(listing, project).splitlines()]
    assert sorted(plants) == sorted([
        "line 7: Or -> And", "line 8: raise dropped", "line 7: Lt -> LtE", "line 7: Gt -> GtE", "line 7: 0 -> 1",
        "line 7: 10 -> 11"])  # fmt: skip
    _shell(f"{shard0}\n{shard1}", project)
    results = [line.split(" ", 1) for f in ("dec-0.txt", "dec-1.txt")
               for line in (project / "mutants" / f).read_text().splitlines()]  # fmt: skip
    assert sorted(key for _, key in results) == sorted(f"pflbed/config/toy.py bounded {p}" for p in plants)
    survived = sorted(key.rsplit(": ", 1)[1] for verdict, key in results if verdict == "SURVIVED")
    assert survived == ["0 -> 1", "10 -> 11", "Gt -> GtE", "Lt -> LtE"]
    assert (project / "src" / "pflbed" / "config" / "toy.py").read_text() == BOUNDED  # planted in a copy only
