"""Algorithms and models of other installed packages (plugins), found through their packages' entry points.

Why entry points, and not only `pflbed.algorithms.register`: a registration exists only in the process that ran it.
`pflbed run`, `bench` and `tune` never see it, nor do the other processes a run trains in (`procs`' workers, Flower's
apps, a deployment's sites), which build the algorithm and the model from their names. A package that declares them
in its metadata is found by every process of every machine where it is installed, the command line's included:

    [project.entry-points."pflbed.algorithms"]
    mymethod = "mypackage.mymethod:MyMethod"   # an Algorithm subclass whose `name` is "mymethod"

    [project.entry-points."pflbed.models"]
    mynet = "mypackage.nets:mynet"             # (input_shape, num_classes) -> BlockNet

The names are read from the metadata alone, nothing imported (a misspelt name is reported before torch loads);
the plugins are imported with the registry they join (`pflbed.algorithms`, `pflbed.models.zoo`). A plugin that does
not import, is not what its group takes, shares its name with another, or takes one of pflbed's own names, is left
out; using its name gives the reason in one line (`problem`), and nothing else changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from importlib.metadata import EntryPoint, entry_points

ALGORITHMS = "pflbed.algorithms"
MODELS = "pflbed.models"

_problems: dict[str, dict[str, str]] = {}  # group → name → why the plugin was left out (`load`)


@functools.cache
def declared(group: str) -> tuple[EntryPoint, ...]:
    """The entry points of `group` in the installed packages' metadata (read once a process: installing a package
    takes a new process)."""
    return tuple(sorted(entry_points(group=group), key=lambda ep: (ep.name, ep.value)))


def names(group: str) -> tuple[str, ...]:
    """The plugin names of `group`, from the metadata alone."""
    return tuple(sorted({ep.name for ep in declared(group)}))


def _where(ep: EntryPoint) -> str:
    dist = ep.dist  # None for one not read from a package's metadata
    return f"{ep.value}, package {dist.name} {dist.version}" if dist is not None else ep.value


def what(obj: object) -> str:
    """`obj` named for a message, without its address: "class X", "a function", "an int"."""
    if isinstance(obj, type):
        return f"class {obj.__qualname__}"
    kind = type(obj).__name__
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def load(group: str, own: Collection[str], check: Callable[[str, object], str | None]) -> dict[str, object]:
    """Each plugin of `group` imported: name → object, for those `check(name, object)` finds nothing wrong with.

    Left out, each with its reason (`problem`): a name of pflbed's own (`own`), a name two entry points declare, a
    plugin that raises on import, one `check` refuses. A plugin's exception is caught whole: one broken package must
    not stop every run of every other algorithm or model."""
    found: dict[str, object] = {}
    problems = _problems.setdefault(group, {})
    for name in names(group):
        eps = [ep for ep in declared(group) if ep.name == name]
        where = "; ".join(_where(ep) for ep in eps)
        if name in own:
            problems[name] = f"the plugin {name!r} ({where}) takes the name of pflbed's own, which stays"
            continue
        if len(eps) > 1:
            problems[name] = f"the plugin name {name!r} is declared twice ({where}); uninstall one"
            continue
        try:
            obj = eps[0].load()
        except BaseException as e:  # noqa: BLE001  (a plugin's import may raise anything, SystemExit included)
            if isinstance(e, KeyboardInterrupt):
                raise
            said = str(e).strip().splitlines()[:1]  # one line: the first of what it said
            problems[name] = f"the plugin {name!r} ({where}) did not import: {': '.join([type(e).__name__, *said])}"
            continue
        if (why := check(name, obj)) is not None:
            problems[name] = f"the plugin {name!r} ({where}) {why}"
            continue
        found[name] = obj
    return found


def left_out(group: str) -> dict[str, str]:
    """The plugins of `group` its registry left out, each with its reason (`load`)."""
    return dict(_problems.get(group, {}))


def problem(group: str, name: str) -> str | None:
    """Why the plugin `name` of `group` was left out, once its registry has loaded it; None otherwise."""
    return _problems.get(group, {}).get(name)
