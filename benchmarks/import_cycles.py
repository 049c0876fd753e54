"""Import cycles among pflbed's own modules: `python benchmarks/import_cycles.py [SRC_DIR]`.

Parses every module under `src/pflbed` (or SRC_DIR, the folder that holds the top-level package) with `ast` and
collects the package's own modules each one imports, wherever the import statement is (module level, inside a
function or a class), except inside an `if TYPE_CHECKING:` block (it never runs; its `else:` does):

- `import pflbed.a.b` and `from pflbed.a import b` where `b` is a submodule: the module `pflbed.a.b`;
- `from pflbed.a import name` where `name` is not a submodule: `pflbed.a` (a package's `__init__` counts as a module);
- relative imports, resolved against the importing module;
- `importlib.import_module("pflbed.a")` / `__import__("pflbed.a")` with a constant name: a dynamic import that
  recreates the dependency is still a dependency; an f-string name with a constant prefix (`f"{__name__}.{x}"`)
  counts as importing every module directly under that prefix.

The parent packages that Python imports on the way (`pflbed`, `pflbed.a` for `pflbed.a.b`) are not counted: only
the module named. Prints every strongly connected component of more than one module (or a module importing itself),
each as a sorted list, then "N cycles"; exit status 1 if there is any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_names(src: Path, package: str = "pflbed") -> dict[str, Path]:
    """Every module of `package` under `src`: dotted name -> file (a package is its `__init__.py`)."""
    out: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")  # fmt: skip


def _walk(node: ast.AST):
    """Every node under `node`, except the bodies of `if TYPE_CHECKING:` (their `else:` is walked)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield sub
                yield from _walk(sub)
            continue
        yield child
        yield from _walk(child)


def _dynamic_name(call: ast.Call, module: str, package: str) -> tuple[str, bool] | None:
    """(name, is_prefix) of `importlib.import_module(...)` / `__import__(...)` with a constant or f-string name."""
    func = call.func
    if not ((isinstance(func, ast.Attribute) and func.attr == "import_module")
            or (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))):  # fmt: skip
        return None
    if not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value, False
    if isinstance(arg, ast.JoinedStr):
        prefix = ""
        for value in arg.values:
            if isinstance(value, ast.Constant):
                prefix += str(value.value)
            elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name) and (
                    value.value.id in ("__name__", "__package__")):  # fmt: skip
                prefix += module if value.value.id == "__name__" else package
            else:
                return prefix, True
        return prefix, False
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that module `name` (file `path`) imports, outside `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        # the named module, or (a name inside a module) the deepest module that holds it
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target:
            found.add(target)

    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                else:
                    add(origin)
        elif isinstance(node, ast.Call):
            dynamic = _dynamic_name(node, name, package)
            if dynamic is None:
                continue
            target, is_prefix = dynamic
            if is_prefix:
                found.update(m for m in modules if m.startswith(target) and "." not in m[len(target):])
            else:
                add(target)
    return found


def import_graph(src: Path = SRC, package: str = "pflbed") -> dict[str, set[str]]:
    modules = module_names(src, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(sorted(component))
    return out


def find_cycles(src: Path = SRC, package: str = "pflbed") -> list[list[str]]:
    """Every import cycle of `package` under `src`: the strongly connected components of more than one module, and
    any module that imports itself; sorted."""
    graph = import_graph(src, package)
    cycles = [c for c in strongly_connected(graph) if len(c) > 1 or c[0] in graph[c[0]]]
    return sorted(cycles)


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """The index in `layers` (bottom first; each a tuple of module or package names) of the longest name that is
    `module` or a package holding it, so that a module can sit above its package (`pflbed.flower.server`, a Flower
    app, above `pflbed.flower`, Flower's executor); None where no name does. The top-level package's name (no dot)
    stands for its `__init__` only, so a new top-level module has no layer until it is given one."""
    best, depth = None, -1
    for i, names in enumerate(layers):
        for name in names:
            inside = "." in name and module.startswith(name + ".")
            if (module == name or inside) and name.count(".") > depth:
                best, depth = i, name.count(".")
    return best


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[tuple[str, str]]:
    """Every (module, imported module) of `graph` where the imported one sits in a higher layer, sorted; a module in
    no layer is reported as (module, "no layer")."""
    out = [(m, "no layer") for m in graph if layer_of(m, layers) is None]
    for module, targets in graph.items():
        here = layer_of(module, layers)
        out += [(module, t) for t in targets if here is not None and (layer_of(t, layers) or 0) > here]
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src = Path(argv[0]) if argv else SRC
    cycles = find_cycles(src)
    for cycle in cycles:
        print(cycle)
    print(f"{len(cycles)} cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
