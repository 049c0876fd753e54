"""A tune suite: its file format (pydantic models), loading it and `--set` overrides on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from pflbed.config import _first_error, validate_config
from pflbed.config.base import Numbers, Seeds
from pflbed.errors import ConfigError
from pflbed.results import suite_overrides
from pflbed.results.bench import SuiteName, _merge, _slug, read_suite_file
from pflbed.results.suite_overrides import flat_set, set_by_overrides, set_in, set_labelled

CURVES = ("pfl_val", "gfl_val")  # objectives read from the evaluation records: pruned on their curve
IMPORTANCE_MIN_TRIALS = 10  # parameter importances (a random forest over the trials) from fewer are noise
PLOTS = {"history": "optimization history", "importance": "parameter importances"}
OBJECTIVES = (*CURVES, "new_val")


def _check_objective(v: str | None) -> str | None:
    """A validation figure's name ends in _val (each of `OBJECTIVES`, each summary field that is one); no test
    figure's does."""
    if v is None or v.endswith("_val"):
        return v
    raise ValueError(f"not a validation figure; give one of {', '.join(OBJECTIVES)} or a summary field "
                     "ending in _val (never a test figure)")  # fmt: skip


class TuneSpec(Numbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    budget: float = Field(gt=0, le=1e6, description="training compute per method, in base runs: the sample passes of "
                          "FedAvg's local training over one run of the base configuration (the same for every "
                          "method); trials start while a study has spent less, the last one is cut when it is spent")
    trials: int | None = Field(None, ge=1, le=100_000, description="at most this many trials per method (default: "
                               "as many as the budget pays for)")
    sampler: Literal["tpe", "random"] = "tpe"
    pruner: Literal["median", "hyperband", "none"] = "median"
    warmup: float = Field(0.25, ge=0, lt=1, description="share of the rounds before the pruner judges a trial (a "
                          "slow starter is not cut at its first evaluation)")
    objective: str = Field("pfl_val", description="validation figure maximized (never a test figure)")
    prune_on: Literal["pfl_val", "gfl_val"] = Field(
        "pfl_val", description="the validation curve pruned on where the objective is not one (a summary field, "
        "new_val): a proxy read at every evaluation")
    first: Literal["default", "sampled"] = Field(
        "default", description="a study's first trial: the method's default configuration (its values in the search "
        "space), so the chosen one is never a worse draw on validation than the default; or sampled like the rest")
    seed: int | None = Field(None, ge=0, description="run seed of the trials and seed of the sampler; never one of "
                             "`seeds` (default: 100, else the first free seed above the reported ones)")
    unequal_budgets: bool = Field(False, description="allow a method its own budget or trials")
    space: dict[str, Any] = Field(default_factory=dict, description="dotted key → space (null: not tuned), all methods")
    undeclared: Literal["refuse", "warn"] = Field(
        "refuse", description="a method whose algorithm declares no search space for its own options: refused, or "
        "(warn) tuned on the shared train.* keys alone, with a warning")

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: str) -> str:
        return _check_objective(v)


class TuneMethod(Numbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    set: dict[str, Any] = Field(default_factory=dict, description="config overrides (dotted keys)")
    budget: float | None = Field(None, gt=0, le=1e6, description="only with tune.unequal_budgets: true")
    trials: int | None = Field(None, ge=1, le=100_000, description="only with tune.unequal_budgets: true")
    objective: str | None = None
    prune_on: Literal["pfl_val", "gfl_val"] | None = None
    space: dict[str, Any] = Field(default_factory=dict, description="dotted key → space (null: not tuned)")
    report: dict[str, str | None] | None = Field(None, description="columns → summary fields, overriding the suite's")

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: str | None) -> str | None:
        return _check_objective(v)


class TuneSuite(Numbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: SuiteName
    base: dict[str, Any] = Field(default_factory=dict)
    seeds: Seeds = Field(default_factory=lambda: [0, 1, 2])
    tune: TuneSpec
    methods: dict[str, TuneMethod] = Field(min_length=1)
    report: dict[str, str] = Field(default_factory=lambda: {"P-FL": "selected.pfl_acc", "G-FL": "selected.gfl_acc"})
    out: str | None = Field(None, description="tune directory (default runs/tune/<name>; --out wins)")

    @model_validator(mode="after")
    def _check(self) -> TuneSuite:
        if self.tune.seed is not None and self.tune.seed in self.seeds:
            raise ValueError(f"tune.seed: {self.tune.seed} is one of the reported seeds {self.seeds}: that seed's "
                             "tuned re-run would be the chosen trial itself; give another")  # fmt: skip
        dirs: dict[str, str] = {}
        for m in self.methods:
            if _slug(m) in dirs:
                raise ValueError(f"methods {dirs[_slug(m)]!r} and {m!r} would share the directory {_slug(m)!r}")
            dirs[_slug(m)] = m
        return self


def load_tune_suite(path: str | Path, overrides: list[str] | None = None) -> TuneSuite:
    """The suite file with `--set KEY=VALUE` overrides applied; an error names the file's field or the `--set`."""
    p = Path(path)
    tree = read_suite_file(p, "tune")
    if isinstance(tree, dict) and "tune" not in tree:
        raise ConfigError(f"{p}: tune: missing (trials per method, …); `pflbed bench` runs suites without one")
    keys = []
    if overrides and isinstance(tree, dict | None):  # a file that is no mapping is refused as it is, not emptied
        tree, keys = apply_overrides(tree or {}, overrides)
    try:
        suite = TuneSuite.model_validate(tree or {})
    except ValidationError as e:
        where = "--set " if set_by_overrides(e, keys) else f"{p}: "
        raise ConfigError(f"{where}{_first_error(e, model=TuneSuite)}") from None
    base_keys = [k.removeprefix("base.") for k in keys if k.startswith("base.")]
    if base_keys:  # a wrong run config key under base, named as given (else a method's config names it later)
        try:
            validate_config(_merge(suite.base, {}))
        except ConfigError as e:
            if any(str(e).startswith(f"{k}:") or str(e).startswith(f"{k}.") for k in base_keys):
                raise ConfigError(f"--set base.{str(e).replace('did you mean ', 'did you mean base.')}") from None
    return suite



# Mappings whose keys are dotted config keys or column names: below them, the rest of a --set key is one key.
_FLAT = {("tune", "space"), ("report",)}
_FLAT_IN_METHOD = ("set", "space", "report")


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """A copy of the suite's tree with each `KEY=VALUE` set (the value read as YAML), and the keys set. KEY is the
    suite's own dotted path; `methods=[A, B]` keeps those methods, `methods.A=null` drops one."""
    return suite_overrides.apply_overrides(tree, overrides, list(TuneSuite.model_fields), "tune",
                                           "a method's set (--set methods.NAME.set.{key}=…)", _in_tune_suite)


def _in_tune_suite(tree: dict[str, Any], key: str, parts: list[str], value: Any) -> bool:
    """A method's label and its `set`, `space` and `report`; the shared search space; the table's columns."""
    if parts[0] == "methods":
        if found := set_labelled(tree, "methods", parts[1:], value, "method", key):
            methods, name, below = found
            if below[0] in _FLAT_IN_METHOD and len(below) > 1:
                flat_set(methods[name], below[0], ".".join(below[1:]), value, key)
            else:
                set_in(methods[name], ".".join(below), value, key)
    elif tuple(parts[:2]) in _FLAT and len(parts) > 2:
        flat_set(tree.setdefault("tune", {}), "space", ".".join(parts[2:]), value, key)
    elif tuple(parts[:1]) in _FLAT and len(parts) > 1:
        tree.setdefault("report", TuneSuite.model_fields["report"].get_default(call_default_factory=True))
        flat_set(tree, "report", ".".join(parts[1:]), value, key)
    else:
        return False
    return True
