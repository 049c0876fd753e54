"""Mutants of the functions mutmut leaves alone: every decorated one (a pydantic validator, a property).

mutmut does not mutate a function with a decorator, so the config's checks of bad input (`@model_validator`,
`@field_validator`) and an algorithm's option presets were never in `mutation_screen.py`'s scope, whatever
`only_mutate` lists. This script plants in each such function, one at a time, the wrong versions that matter for
a check: a `raise` dropped, a call or an assignment to an attribute dropped, a comparison's operator changed (`<`
for `<=`, `==` for `!=`, `in` for `not in`, ...), `and` for `or`, a `not` dropped, a constant off by one. Each
plant is written into a copy of src/ (one per shard) and the source file's tests (`mutation_screen.TESTS_FOR`, or
`--tests`) run on it in a fresh pytest process; a plant that leaves them passing survives.

    python benchmarks/decorated_mutants.py list src/pflbed/config/*.py
    python benchmarks/decorated_mutants.py run src/pflbed/config/*.py --shard 0 --shards 2 --out mutants/dec-0.txt

Results: one `KILLED|SURVIVED <file> <function> line <n>: <change>` line per plant, resumable (a plant already in
`--out` is not run again).
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from mutation_screen import test_files, test_path  # noqa: E402

SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
        ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}  # fmt: skip


def decorated(tree: ast.Module) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.decorator_list]


def plants(fn: ast.FunctionDef) -> Iterator[tuple[int, int, str]]:
    """(node index in `ast.walk(fn)`, operand index, description) of each wrong version of `fn`."""
    for i, n in enumerate(ast.walk(fn)):
        if isinstance(n, ast.Raise):
            yield i, 0, f"line {n.lineno}: raise dropped"
        elif isinstance(n, ast.Compare):
            for j, op in enumerate(n.ops):
                if type(op) in SWAP:
                    yield i, j, f"line {n.lineno}: {type(op).__name__} -> {SWAP[type(op)].__name__}"
        elif isinstance(n, ast.BoolOp):
            yield i, 0, f"line {n.lineno}: {type(n.op).__name__} -> {'Or' if isinstance(n.op, ast.And) else 'And'}"
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            yield i, 0, f"line {n.lineno}: not dropped"
        elif isinstance(n, ast.AugAssign) or (isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Attribute | ast.Subscript) for t in n.targets)):  # a local's: a NameError
            yield i, 0, f"line {n.lineno}: assignment dropped"
        elif isinstance(n, ast.Expr) and isinstance(n.value, ast.Call):
            yield i, 0, f"line {n.lineno}: call dropped"
        elif isinstance(n, ast.Constant) and type(n.value) in (int, float) and not isinstance(n.value, bool):
            yield i, 0, f"line {n.lineno}: {n.value!r} -> {n.value + 1!r}"


def _drop(parent: ast.AST, target: ast.AST) -> None:
    """Replace the statement `target` in `parent`'s body by `pass`."""
    for field in ("body", "orelse", "finalbody"):
        stmts = getattr(parent, field, None)
        if isinstance(stmts, list) and target in stmts:
            stmts[stmts.index(target)] = ast.Pass()
            return
    raise AssertionError("statement not found in its parent")


def planted_source(source: str, fn_index: int, node_index: int, operand: int) -> str:
    tree = ast.parse(source)
    fn = decorated(tree)[fn_index]
    first = min(d.lineno for d in fn.decorator_list)
    last, indent = fn.end_lineno, " " * fn.col_offset
    fn = copy.deepcopy(fn)
    nodes = list(ast.walk(fn))
    n = nodes[node_index]
    if isinstance(n, ast.Raise | ast.Assign | ast.AugAssign | ast.Expr):
        _drop(next(p for p in nodes if any(isinstance(getattr(p, f, None), list) and n in getattr(p, f)
                                           for f in ("body", "orelse", "finalbody"))), n)
    elif isinstance(n, ast.Compare):
        n.ops[operand] = SWAP[type(n.ops[operand])]()
    elif isinstance(n, ast.BoolOp):
        n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()
    elif isinstance(n, ast.UnaryOp):
        for p in nodes:  # the `not x` replaced by `x` in its parent
            for field, value in ast.iter_fields(p):
                if value is n:
                    setattr(p, field, n.operand)
                elif isinstance(value, list) and n in value:
                    value[value.index(n)] = n.operand
    elif isinstance(n, ast.Constant):
        n.value = n.value + 1
    lines = source.splitlines(keepends=True)
    body = "".join(indent + line + "\n" for line in ast.unparse(ast.fix_missing_locations(fn)).splitlines())
    return "".join(lines[: first - 1]) + body + "".join(lines[last:])


def all_plants(files: list[str]) -> Iterator[tuple[str, int, int, int, str]]:
    for f in files:
        tree = ast.parse(Path(f).read_text())
        for k, fn in enumerate(decorated(tree)):
            for i, j, what in plants(fn):
                yield f, k, i, j, f"{fn.name} {what}"


def run(files: list[str], shard: int, shards: int, out: Path, tests: list[str] | None, timeout: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {line.split(" ", 1)[1] for line in out.read_text().splitlines()} if out.exists() else set()
    work = Path(tempfile.mkdtemp(prefix=f"decorated-{shard}-"))
    env = {**os.environ, "PYTHONPATH": str(work / "src")}
    try:
        shutil.copytree(ROOT / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        where = subprocess.run([sys.executable, "-c", "import pflbed; print(pflbed.__file__)"], env=env,
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        if not where.startswith(str(work)):
            sys.exit(f"decorated_mutants: the tests would import {where.strip()}, not the planted copy")
        for f, k, i, j, what in list(all_plants(files))[shard::shards]:
            rel = Path(f).resolve().relative_to(ROOT / "src")
            key = f"{rel} {what}"
            if key in done:
                continue
            original = (work / "src" / rel).read_text()
            (work / "src" / rel).write_text(planted_source(original, k, i, j))
            # else a plant written within the second of the last one, of its size, runs the last one's bytecode
            Path(importlib.util.cache_from_source(str(work / "src" / rel))).unlink(missing_ok=True)
            selection = tests or test_files(str(rel.relative_to("pflbed")))
            try:
                rc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-x", "-p",
                                     "no:cacheprovider", *selection], cwd=ROOT, env=env, capture_output=True,
                                    timeout=timeout).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = -1
            finally:
                (work / "src" / rel).write_text(original)
            with out.open("a") as fh:
                fh.write(f"{'SURVIVED' if rc == 0 else 'KILLED'} {key}\n")
    finally:
        shutil.rmtree(work)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["list", "run"])
    p.add_argument("files", nargs="+")
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "mutants" / "decorated.txt")
    p.add_argument("--tests", help="comma-separated test modules instead of each file's own")
    p.add_argument("--timeout", type=int, default=600, help="seconds per plant (past it: killed)")
    a = p.parse_args()
    if a.command == "list":
        for f, _, _, _, what in all_plants(a.files):
            print(f, what)
        return
    tests = [test_path(n) for n in a.tests.split(",")] if a.tests else None
    run(a.files, a.shard, a.shards, a.out, tests, a.timeout)


if __name__ == "__main__":
    main()
