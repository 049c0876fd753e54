"""Property tests of every algorithm's options: any value either runs or is refused cleanly.

`test_config_properties.py` draws every config field but only the algorithm's name; an algorithm's own options
(`algorithm.<option>`, its `Config` model) are drawn here. The valid domain of each option is read from its
annotation and bounds (a Literal's values, a number between its `ge`/`gt` and `le`/`lt`, a list's items, None where
the option takes it), so a new algorithm or option is covered without editing this file; junk of every type is mixed
in. Each draw sets one algorithm and one to three of its options on top of a tiny run, through the real command line,
and must end as `test_config_properties` requires: exit 0 with a `summary.json`; exit 2 with one line naming an
option set (or the file or value it names) and no run directory; or exit 3, a diverging run, with one line saying so.

Options whose cost grows with their value (epochs, steps, iterations, widths, the number of bases) are drawn small:
a large one is a long run, not a refusal. The others are also drawn at large values, where a bound the config does not
state (more blocks than the model has, more neighbours than a client's samples) must be refused, not crash.
"""

from __future__ import annotations

import re
import types
import typing

import pytest
from annotated_types import Ge, Gt, Le, Lt, MinLen
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pydantic.fields import FieldInfo

from pflbed.algorithms import ALGORITHMS

from .test_config_properties import BASE, JUNK, run_is_clean, validates_or_names

# Where an option is not drawn, a cheap value of it: the distillation family's architectures (the default zoo holds
# ResNet-18; public data for them below), few server distillation steps (FedDF), few local steps (pFedHN's 50).
LIGHT = {"architectures": ["alexnet_small_x025", "mlp"], "server_steps": 3, "local_steps": 2}
RUN = {**BASE, "train.rounds": 2, "federation.public": 64}
MODELS_DRAWN = ["mlp", "lenet5", "lenet5_bn", "alexnet_small_x025", "resnet99"]  # cheap ones, and an unknown name
COSTLY = re.compile(r"epoch|step|iter|hidden|embed_dim|num_pre_loss|^K$")  # cost grows with the value
SMALL = 6  # a costly integer is drawn in [its lower bound, lower bound + SMALL]
LARGE = [10, 1000, 10**6]  # other integers are also drawn here (within their bounds)
FLOAT_TOP = 1e6  # unbounded floats: drawn up to here (a learning rate this large diverges: exit 3)


def _bounds(metadata: list) -> tuple[float | None, bool, float | None, bool]:
    lo = hi = None
    lo_open = hi_open = False
    for m in metadata:
        if isinstance(m, Ge):
            lo = m.ge
        elif isinstance(m, Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, Le):
            hi = m.le
        elif isinstance(m, Lt):
            hi, hi_open = m.lt, True
    return lo, lo_open, hi, hi_open


def _flat(metadata: tuple) -> list:
    """Annotated's metadata with a `Field(...)` inside it (`Annotated[float, Field(ge=0)]`) opened to its bounds."""
    return [m for x in metadata for m in (x.metadata if isinstance(x, FieldInfo) else [x])]


def _number(kind: type, metadata: list, costly: bool) -> st.SearchStrategy:
    lo, lo_open, hi, hi_open = _bounds(metadata)
    if kind is int:
        first = int(lo) + lo_open if lo is not None else 0
        last = int(hi) - hi_open if hi is not None else None
        near = st.integers(first, first + SMALL if last is None else min(last, first + SMALL))
        if costly:
            return near
        far = [v for v in LARGE if v >= first and (last is None or v <= last)] + ([last] if last is not None else [])
        return st.one_of(near, st.sampled_from(far)) if far else near
    top = hi if hi is not None else FLOAT_TOP
    return st.floats(lo if lo is not None else -1.0, top, exclude_min=lo_open, exclude_max=hi_open and hi is not None)


def domain(name: str, annotation: typing.Any, metadata: list) -> st.SearchStrategy:
    """Values of an option annotated `annotation` (with its bounds `metadata`), as its config would accept them."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return domain(name, args[0], [*metadata, *_flat(args[1:])])
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[domain(name, a, metadata) for a in args])
    if annotation is type(None):
        return st.none()
    if origin is typing.Literal:
        return st.sampled_from(args)
    if annotation is bool:
        return st.booleans()
    if annotation in (int, float):
        return _number(annotation, metadata, bool(COSTLY.search(name)))
    if origin is list:
        (item,) = args
        size = next((m.min_length for m in metadata if isinstance(m, MinLen)), 0)
        items = st.sampled_from(MODELS_DRAWN) if item is str else domain(name, item, [])
        return st.lists(items, min_size=max(size - 1, 0), max_size=3)  # one short of the minimum, too
    if annotation is str:  # a free-form option (FedSelect's layers): its default, its neighbours, and text
        return st.sampled_from(["all", "head", "body", "conv1", "fc", "fc1,fc2", "block0", "x", ""])
    raise AssertionError(f"option {name}: no domain for {annotation!r}; add one here")


def edges(name: str, annotation: typing.Any, metadata: list) -> list[typing.Any]:
    """The values at the edges of what an option accepts: None where it takes None, each Literal value, each
    boolean, a number's bounds (an open one approached), and a large value where its cost does not grow with it.
    Drawn at random these are rare; each is run once (`test_each_edge_of_each_option_runs_or_is_refused`)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return edges(name, args[0], [*metadata, *_flat(args[1:])])
    if origin in (typing.Union, types.UnionType):
        return [v for a in args for v in edges(name, a, metadata)]
    if annotation is type(None):
        return [None]
    if origin is typing.Literal:
        return list(args)
    if annotation is bool:
        return [False, True]
    if annotation in (int, float):
        lo, lo_open, hi, hi_open = _bounds(metadata)
        step = 1 if annotation is int else 1e-6
        costly = annotation is int and bool(COSTLY.search(name))  # at its upper bound: a long run, not an edge
        ends = [lo if lo is None else lo + step * lo_open, None if hi is None or costly else hi - step * hi_open]
        if annotation is int and not costly and (hi is None or hi > LARGE[-1]):
            ends.append(LARGE[-1])
        return [v for v in ends if v is not None]
    if origin is list:
        size = next((m.min_length for m in metadata if isinstance(m, MinLen)), 0)
        (item,) = args
        one = MODELS_DRAWN[0] if item is str else edges(name, item, [])[0]
        return [[one] * size] if size else [[]]
    return []


def _field_domain(name: str, f: FieldInfo) -> st.SearchStrategy:
    valid = domain(name, f.annotation, list(f.metadata))
    return st.one_of(valid, valid, valid, JUNK)  # valid three times as often as junk: most draws reach a run


OPTIONS = {a: c.Config.model_fields for a, c in sorted(ALGORITHMS.items()) if c.Config.model_fields}

draws = st.sampled_from(sorted(OPTIONS)).flatmap(
    lambda algo: st.tuples(
        st.just(algo),
        st.permutations(sorted(OPTIONS[algo])).flatmap(lambda names: st.integers(1, min(3, len(names))).map(
            lambda k: names[:k])).flatmap(
            lambda names: st.tuples(*[st.tuples(st.just(n), _field_domain(n, OPTIONS[algo][n])) for n in names])
        ),
    )
)


def _base(algo: str, chosen: set[str]) -> dict[str, typing.Any]:
    fields = ALGORITHMS[algo].Config.model_fields
    light = {f"algorithm.{k}": v for k, v in LIGHT.items() if k in fields and k not in chosen}
    return {**RUN, "algorithm.name": algo, **light}


def test_every_option_has_a_domain():
    """Each option's annotation is one `domain` knows (else a new kind of option would fail every draw)."""
    for algo, fields in OPTIONS.items():
        for name, f in fields.items():
            assert domain(name, f.annotation, list(f.metadata)) is not None, (algo, name)


EDGES = {a: [(n, v) for n, f in fields.items() for v in edges(n, f.annotation, list(f.metadata))]
         for a, fields in OPTIONS.items()}  # fmt: skip


def _run_is_clean(algo: str, sets: list[tuple[str, typing.Any]], capsys) -> int:
    """Run `algo` with `sets` (its options) through the command line; assert it ended as the module says."""
    chosen = {n for n, _ in sets}
    base = [(k, v) for k, v in _base(algo, chosen).items() if k not in BASE or v != BASE[k]]
    drawn = [(f"algorithm.{n}", v) for n, v in sets]  # a refusal names one of them, not the run's base
    return run_is_clean([*base, *drawn], capsys, "pflbed-opt-", drawn)


@pytest.mark.parametrize("algo", sorted(EDGES))
def test_each_edge_of_each_option_runs_or_is_refused(algo, capsys):
    for name, value in EDGES[algo]:
        try:
            _run_is_clean(algo, [(name, value)], capsys)
        except AssertionError as e:
            raise AssertionError(f"algorithm.{name}={value!r}: {e}") from None


@settings(max_examples=4 * settings.default.max_examples)  # validation only: cheap, so many more draws
@given(draw=draws)
def test_any_option_validates_or_is_one_config_error_naming_it(draw):
    """The fast half (no run): validating the options raises nothing but a one-line ConfigError naming one."""
    algo, sets = draw
    drawn = [(f"algorithm.{n}", v) for n, v in sets]
    validates_or_names(_base(algo, {n for n, _ in sets}), drawn, drawn)


@given(draw=draws)
def test_any_option_runs_or_exits_2_with_one_line_and_no_directory(draw, capsys):
    algo, sets = draw
    event(f"{algo}: exit {_run_is_clean(algo, list(sets), capsys)}")
