"""`pflbed tune`: a fair hyperparameter search on Optuna — the same budget for every method, chosen on validation.

Protocol. Each method gets one Optuna study over its own search space (the `search` declarations of `train.*` and
of its algorithm's options, `pflbed.search`, narrowed or extended by the suite) with the same number of trials
(`tune.trials`, all on the run seed `tune.seed`). A trial is an ordinary run directory; its value is the
*validation* figure of the round selected on validation (`objective`: `pfl_val`, `gfl_val`, `new_val` — the new
clients' validation figure under PFLBED — or a summary field ending in `_val`), never a test figure. The pruner
sees the validation curve (the best validation figure so far, at every evaluation round); a diverged trial counts
as pruned. Then the best configuration of each method and its default configuration are re-run over the suite's
seeds by `pflbed bench`'s machinery, and the table gives their test figures (mean ± std) side by side with the
budget and the chosen values.

    name: tune_digits
    base: {dataset: {name: digits}, train: {rounds: 10}}   # run config keys, as in a bench suite
    seeds: [0, 1, 2]                                       # the final re-runs (default and tuned)
    tune:
      trials: 20                # per method; a method's own `trials` must match unless unequal_budgets: true
      sampler: tpe              # tpe | random
      pruner: median            # median | hyperband | none
      objective: pfl_val        # pfl_val | gfl_val | new_val | a summary field ending in _val
      space: {train.momentum: null}                        # drop (null), narrow or add a key, for every method
    methods:
      FedAvg: {set: {algorithm.name: fedavg}, objective: gfl_val}
      FedProx: {set: {algorithm.name: fedprox}, space: {algorithm.mu: {low: 0.001, high: 0.1, log: true}}}
    report: {P-FL: selected.pfl_acc, G-FL: selected.gfl_acc}   # test columns (summary fields) of the table

A space is `{low: L, high: H}` (`log: true` for log-uniform, `int: true` for integers) or `{choices: [...]}`.
A method's `set` (over `base`) is its default configuration, which the table compares with the tuned one; a key in
both `set` and the space is tuned (from the space); `null` in a space fixes a declared key at its default.

`pflbed tune --set KEY=VALUE` changes the suite without editing it: KEY is the suite's own dotted path
(`tune.trials=4`, `seeds=[0]`, `base.train.rounds=5`, `methods.FedProx.space.algorithm.mu=null`; `methods=[A, B]`
keeps those methods, `methods.A=null` drops one). Under a method's `set` / `space` / `report`, `tune.space` and
`report`, the rest of KEY is one key, as those mappings hold dotted config keys.

The tune directory is `--out`, else the suite's `out`, else `runs/tune/<name>` under the working directory (as
`pflbed run` writes `runs/…`): never into the repository unless asked. A study remembers the setup its trials ran
with (base, the method's set, space, objective and trial seed); a later command whose suite differs there stops
with one line naming the key instead of mixing trials of two setups (the budget, seeds and table columns may change).

Storage: an SQLite file `study.db` in the tune directory by default; `--storage URL` takes any Optuna storage, and
`pflbed tune --worker` on other machines joins the same studies (Optuna's distributed mode). A killed `pflbed tune`
continues where it stopped: finished trials (complete or pruned) count toward the budget, the trials a dead process
left running on this machine are marked failed and their parameters queued again (on other machines Optuna's
heartbeat does the same after its grace period), and a trial begun when the budget was already taken by others
fails as surplus, so a study never holds more than its budget.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pflbed import compute
from pflbed.config import Config, TrainConfig, _first_error, parse_override, set_dotted, validate_config
from pflbed.errors import ConfigError, DivergedError, PflbedError
from pflbed.results.bench import Bench, MethodSpec, Suite, TableSpec, _get, _merge, _slug, read_suite_file
from pflbed.search import Space, declared, parse_space

CURVES = ("pfl_val", "gfl_val")  # objectives read from the evaluation records: pruned on their curve
IMPORTANCE_MIN_TRIALS = 10  # parameter importances (a random forest over the trials) from fewer are noise
PLOTS = {"history": "optimization history", "importance": "parameter importances"}
OBJECTIVES = (*CURVES, "new_val")


def _check_objective(v: str | None) -> str | None:
    if v is None or v in OBJECTIVES or v.rsplit(".", 1)[-1].endswith("_val"):
        return v
    raise ValueError(f"not a validation figure; give one of {', '.join(OBJECTIVES)} or a summary field "
                     "ending in _val (never a test figure)")  # fmt: skip


class TuneSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
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


class TuneMethod(BaseModel):
    model_config = ConfigDict(extra="forbid")
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


class TuneSuite(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    base: dict[str, Any] = Field(default_factory=dict)
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
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
    tree = read_suite_file(p)
    if isinstance(tree, dict) and "tune" not in tree:
        raise ConfigError(f"{p}: tune: missing (trials per method, …); `pflbed bench` runs suites without one")
    keys = []
    if overrides:
        tree, keys = apply_overrides(tree if isinstance(tree, dict) else {}, overrides)
    try:
        suite = TuneSuite.model_validate(tree or {})
    except ValidationError as e:
        loc = ".".join(str(x) for x in e.errors()[0]["loc"])
        given = any(loc == k or loc.startswith(f"{k}.") or k.startswith(f"{loc}.") for k in keys)
        raise ConfigError(f"{'--set ' if given else f'{p}: '}{_first_error(e, model=TuneSuite)}") from None
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
    tree, keys = copy.deepcopy(tree), []
    fields = list(TuneSuite.model_fields)
    for item in overrides:
        key, value = parse_override(item)
        parts = key.split(".")
        if parts[0] not in fields:
            raise ConfigError(f"--set {key}: not a key of a tune suite ({', '.join(fields)}); a run config key "
                              f"goes under base (--set base.{key}=…) or a method's set "
                              f"(--set methods.NAME.set.{key}=…)")  # fmt: skip
        methods = tree.get("methods") if isinstance(tree.get("methods"), dict) else {}
        if key == "methods" and isinstance(value, list):
            if missing := [m for m in value if m not in methods]:
                raise ConfigError(f"--set methods: no method {missing[0]!r} in the suite ({', '.join(methods)})")
            tree["methods"] = {m: methods[m] for m in value}
        elif parts[0] == "methods" and len(parts) > 1:
            name = parts[1]
            if name not in methods:
                raise ConfigError(f"--set {key}: no method {name!r} in the suite ({', '.join(methods)})")
            if len(parts) == 2:
                if value is None:
                    del methods[name]
                else:
                    methods[name] = value
            elif parts[2] in _FLAT_IN_METHOD and len(parts) > 3:
                spec = methods[name] if isinstance(methods[name], dict) else {}
                methods[name] = spec
                _flat_set(spec, parts[2], ".".join(parts[3:]), value, key)
            else:
                _set(methods[name], ".".join(parts[2:]), value, key)
        elif tuple(parts[:2]) in _FLAT and len(parts) > 2:
            _flat_set(tree.setdefault("tune", {}), "space", ".".join(parts[2:]), value, key)
        elif tuple(parts[:1]) in _FLAT and len(parts) > 1:
            tree.setdefault("report", TuneSuite.model_fields["report"].get_default(call_default_factory=True))
            _flat_set(tree, "report", ".".join(parts[1:]), value, key)
        else:
            _set(tree, key, value, key)
        keys.append(key)
    return tree, keys


def _set(node: Any, dotted: str, value: Any, key: str) -> None:
    if not isinstance(node, dict):
        raise ConfigError(f"--set {key}: not a section")
    try:
        set_dotted(node, dotted, value)
    except ConfigError as e:
        raise ConfigError(f"--set {key}: {str(e).split(': ', 1)[-1]}") from None


def _flat_set(node: Any, field: str, flat_key: str, value: Any, key: str) -> None:
    mapping = node.setdefault(field, {}) if isinstance(node, dict) else None
    if not isinstance(mapping, dict):
        raise ConfigError(f"--set {key}: {field} is not a mapping")
    mapping[flat_key] = value


def optuna_module():
    """Optuna, imported on first use (the core does not need it)."""
    try:
        import optuna
    except ImportError:
        raise PflbedError("pflbed tune needs Optuna: pip install 'pflbed[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


class _Surplus(Exception):
    """A trial begun when others had already taken the whole budget (it ends as FAIL, not counted)."""


class Method:
    """One method of a tune suite: its config, its search space, its objective and its study."""

    def __init__(self, name: str, spec: TuneMethod, tuner: Tuner) -> None:
        self.name, self.spec, self.tuner = name, spec, tuner
        suite = tuner.suite
        self.budget = spec.budget or suite.tune.budget  # in base runs (`Tuner.unit`)
        self.trials = spec.trials or suite.tune.trials  # a cap, or None
        self.objective = spec.objective or suite.tune.objective
        self.curve = self.objective if self.objective in CURVES else (spec.prune_on or suite.tune.prune_on)
        self.dir = tuner.out / "trials" / _slug(name)
        default = self.config(tuner.seed, {})
        if default.executor.name == "flower":
            raise ConfigError(f"methods.{name}: executor.name: flower trains on the sites, where `pflbed tune` cannot "
                              "count a trial's compute; tune with loop, procs or threads")  # fmt: skip
        self.rounds = default.train.rounds
        from pflbed.algorithms import get_algorithm

        options = get_algorithm(default.algorithm.name).Config
        if options.model_fields and "search" not in vars(options):  # inherited or absent: its own knobs undeclared
            why = (f"methods.{name}: algorithm {default.algorithm.name!r} declares no search space for its own options "
                   f"({', '.join(options.model_fields)}): a comparison would tune the others' knobs and not its own; "
                   "declare `search` on its options (pflbed.search), or set tune.undeclared: warn")  # fmt: skip
            if suite.tune.undeclared == "refuse":
                raise ConfigError(why)
            warnings.warn(why.replace("; declare", "; tuning its train.* alone. Declare"), stacklevel=2)
        space = {f"train.{k}": s for k, s in declared(TrainConfig).items()}
        space |= {f"algorithm.{k}": s for k, s in declared(options).items()}
        for where, extra in (("tune.space", suite.tune.space), (f"methods.{name}.space", spec.space)):
            for key, value in extra.items():
                if value is None:
                    space.pop(key, None)
                else:
                    space[key] = parse_space(value, f"{where}.{key}")
        self.space: dict[str, Space] = space
        for key, s in self.space.items():  # every bound must make a valid config: names the key, not a trial
            for v in (s.options if hasattr(s, "options") else (s.low, s.high)):
                try:
                    self.config(0, {key: v})
                except ConfigError as e:
                    raise ConfigError(f"methods.{name}.space.{key}: {v!r} does not validate ({e})") from None

    def config(self, seed: int, params: dict[str, Any], trial: bool = True) -> Config:
        """The method's config with `params` on `seed`. A trial's (`trial`) leaves out of its data every sample the
        reported seeds test on (`federation.exclude_test_of`): no reported test figure's sample tunes anything."""
        tree = _merge(self.tuner.suite.base, {})
        extra = {"federation.exclude_test_of": self.tuner.suite.seeds} if trial else {}
        for key, value in {**self.spec.set, **params, "seed": seed, **extra}.items():
            set_dotted(tree, key, value)
        try:
            return validate_config(tree)
        except ConfigError as e:
            raise ConfigError(f"methods.{self.name}: {e}") from None

    @property
    def study_name(self) -> str:
        return f"{self.tuner.suite.name}/{self.name}"

    def setup(self) -> dict[str, Any]:
        """What the study's trials depend on, as flat dotted keys (JSON values): the base config, the method's set,
        its search space, its objective and pruning curve, the trial seed and the reported seeds (whose test samples
        the trials' data leaves out). The budget and the table's columns are not in it: they may change between two
        commands on one study."""
        suite = self.tuner.suite
        out = {**_flat(suite.base, "base."), **{f"methods.{self.name}.set.{k}": v for k, v in self.spec.set.items()},
               **{f"space.{k}": s.text() for k, s in self.space.items()}, "objective": self.objective,
               "pruned on": self.curve, "trial seed": self.tuner.seed,
               "trial data excludes the tests of seeds": suite.seeds}  # fmt: skip
        return json.loads(json.dumps(out, default=str))


def _flat(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v}
    return out


def shown_storage(url: str) -> str:
    """A storage URL as the table and messages show it: without its password (`postgresql://user:***@host/db`), so
    that a committed table.json or a pasted error line does not hand out the database's credentials."""
    return re.sub(r"^([^:/]+://[^:/@]*):[^@]*@", r"\1:***@", url)


class Tuner:
    def __init__(self, suite: TuneSuite, out: str | Path | None = None, storage: str | None = None) -> None:
        t = suite.tune
        for m, spec in suite.methods.items():  # equal budgets, unless the suite says otherwise
            for key in ("budget", "trials"):
                own, shared = getattr(spec, key), getattr(t, key)
                if own is not None and own != shared and not t.unequal_budgets:
                    raise ConfigError(f"methods.{m}.{key}: {own} against tune.{key} {shared}: every method gets "
                                      "the same budget (say tune.unequal_budgets: true to allow it)")  # fmt: skip
        self.suite = suite
        self.out = Path(out or suite.out or Path("runs") / "tune" / suite.name)
        self.storage_url = storage or f"sqlite:///{(self.out / 'study.db').resolve()}"
        self.storage_shown = "study.db" if storage is None else shown_storage(storage)  # table.json: no local path
        self.storage_path = str(self.out / "study.db") if storage is None else self.storage_shown  # messages
        default_seed = 100 if 100 not in suite.seeds else max(suite.seeds) + 1  # never a reported seed
        self.seed = suite.tune.seed if suite.tune.seed is not None else default_seed
        self._unit: float | None = None
        self.methods = [Method(n, spec, self) for n, spec in suite.methods.items()]
        self._storage = None
        self._checked: set[str] = set()
        self.plots: dict[str, dict[str, str]] = {}
        self.absent: dict[str, dict[str, str]] = {}  # method → {plot kind: why it is not drawn}

    # --- studies -------------------------------------------------------------------------------------------------
    def storage(self):
        if self._storage is None:
            optuna = optuna_module()
            url = self.storage_url
            if url.startswith("sqlite:///"):
                Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            if url.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "mysql", "postgresql"):
                kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
                retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)  # Optuna ≥ 4.9
                callback = ({"heartbeat_stale_trial_callback": retry(max_retry=1)} if retry is not None else
                            {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=1)})
                for attempt in range(6):
                    try:
                        self._storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=30,
                                                                   grace_period=120, **callback)  # fmt: skip
                        break
                    except Exception as e:  # workers creating one new database's tables at once: the loser waits
                        if attempt == 5 or type(e).__name__ not in ("IntegrityError", "OperationalError"):
                            raise self._storage_error(e) from None
                        time.sleep(0.5 * (attempt + 1))
            else:
                self._storage = url
        return self._storage

    def study(self, method: Method, worker: bool = False):
        optuna = optuna_module()
        t = self.suite.tune
        seed = None
        if not worker:  # a restarted process continues with a fresh stream, not the first one's draws again
            try:
                held = len(optuna.load_study(study_name=method.study_name, storage=self.storage()).trials)
            except KeyError:  # no such study yet
                held = 0
            seed = self.seed + self.methods.index(method) + 7919 * held
        sampler = (optuna.samplers.TPESampler(seed=seed, constant_liar=True) if t.sampler == "tpe"
                   else optuna.samplers.RandomSampler(seed=seed))  # fmt: skip
        warm = max(1, math.ceil(t.warmup * method.rounds))  # the first round a trial may be judged at
        pruner = {"median": lambda: optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=warm),
                  "hyperband": lambda: optuna.pruners.HyperbandPruner(min_resource=warm, max_resource=method.rounds),
                  "none": optuna.pruners.NopPruner}[t.pruner]()  # fmt: skip
        try:
            study = optuna.create_study(storage=self.storage(), study_name=method.study_name, sampler=sampler,
                                        pruner=pruner, direction="maximize", load_if_exists=True)  # fmt: skip
        except Exception as e:  # a storage URL optuna cannot open: one line
            if isinstance(e, PflbedError):
                raise
            raise self._storage_error(e) from None
        if method.name not in self._checked:
            self._check_setup(method, study)
            self._checked.add(method.name)
        return study

    def _check_setup(self, method: Method, study) -> None:
        """The study's trials ran with this method's setup (recorded by the first command on it): a suite changed
        since (another base key, set, space, objective or trial seed — e.g. a --set left out or added) would mix
        trials of two setups in one study and reuse re-runs of the other, so it stops, naming the first key."""
        setup, held = method.setup(), study.user_attrs.get("setup")
        if held is None:
            study.set_user_attr("setup", setup)
            return
        diff = next((k for k in sorted({*setup, *held}) if setup.get(k, "unset") != held.get(k, "unset")), None)
        if diff is not None:
            was, now = (json.dumps(x.get(diff, "unset")) for x in (held, setup))
            new = "another --out" if self.storage_url.endswith(f"{self.out.resolve() / 'study.db'}") else \
                "another suite name (--set name=…)"  # fmt: skip
            raise ConfigError(f"{diff}: {now}, but the {method.name} study in {self.storage_path} ran its trials with "
                              f"{was}; give {new} for a new study (or the same --set as before)")

    def _storage_error(self, e: Exception) -> PflbedError:
        """A storage Optuna cannot open, as one line that names it without its password."""
        return PflbedError(f"--storage {self.storage_shown}: {type(e).__name__}: {e}")

    def counts(self, study) -> tuple[int, int]:
        """(finished trials: complete or pruned, running trials)."""
        from optuna.trial import TrialState

        states = [t.state for t in study.get_trials(deepcopy=False)]
        return (sum(s in (TrialState.COMPLETE, TrialState.PRUNED) for s in states),
                sum(s == TrialState.RUNNING for s in states))  # fmt: skip

    def unit(self) -> float:
        """Sample passes of one base run: FedAvg's local training over every round of the base configuration on the
        trial seed's data (each round's sampled clients × `local_epochs` × their training samples). The budget's
        unit, the same for every method of the suite whatever its own settings."""
        if self._unit is None:
            from pflbed.data import load_source
            from pflbed.federation import build_federation, sample_clients

            tree = _merge(self.suite.base, {})
            for key, value in {"seed": self.seed, "federation.exclude_test_of": self.suite.seeds}.items():
                set_dotted(tree, key, value)
            cfg = validate_config(tree)
            fed = build_federation(load_source(cfg.dataset), cfg.federation, cfg.seed)
            f, t = cfg.federation, cfg.train
            self._unit = float(sum(t.local_epochs * fed.num_train(c) for r in range(1, t.rounds + 1)
                                   for c in sample_clients(cfg.seed, r, fed.participated, f.sample_fraction,
                                                           cfg.poisson_sampling())))  # fmt: skip
        return self._unit

    def spent(self, study, but: int | None = None) -> int:
        """Sample passes the study's trials have trained (finished ones, and running ones so far), but trial
        number `but`'s."""
        from optuna.trial import TrialState

        return sum(int(t.user_attrs.get("passes", 0)) for t in study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)) if t.number != but)

    def finished(self, method: Method, study=None) -> bool:
        """Whether the method's study has its budget: its compute spent, or its trial cap finished."""
        study = study or self.study(method)
        done, running = self.counts(study)
        spent = self.spent(study) >= method.budget * self.unit()
        return not running and (spent or (method.trials is not None and done >= method.trials))

    def recover(self, study) -> int:
        """Trials left RUNNING by a dead process that this one can see (`_dead`): marked failed, their parameters
        queued again. Others (another machine, another container) are left to the storage's heartbeat."""
        from optuna.trial import TrialState

        n = 0
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if not _dead(t.user_attrs):
                continue
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
            n += 1
        return n

    def run_trials(self, max_trials: int | None = None, worker: bool = False, log=print) -> int:
        """Trials until every study holds its budget (at most `max_trials` here); returns how many ran here.

        The main process waits for trials other workers are running (the final re-runs need finished studies); a
        worker (`worker`) stops when nothing is left to start."""
        ran = 0
        for method in self.methods:
            study = self.study(method, worker)
            if self.recover(study):
                log(f"{method.name}: re-queued the trials a stopped process left running")
            budget = method.budget * self.unit()
            while max_trials is None or ran < max_trials:
                done, running = self.counts(study)
                spent = self.spent(study)
                capped = method.trials is not None and done + running >= method.trials
                if not running and (spent >= budget or capped):
                    if worker:
                        log(f"{method.name}: its budget is spent ({spent / self.unit():.2f} of {method.budget:g} "
                            f"base runs, {done} trials finished)")  # fmt: skip
                    break
                if spent >= budget or capped:  # the rest is running elsewhere
                    if worker:
                        log(f"{method.name}: nothing left to start ({spent / self.unit():.2f} of {method.budget:g} "
                            f"base runs spent, {running} trial{'s' * (running != 1)} running elsewhere)")  # fmt: skip
                        break
                    time.sleep(2)
                    with contextlib.suppress(Exception):
                        optuna_module().storages.fail_stale_trials(study)
                    self.recover(study)
                    continue
                ran += self._one_trial(study, method, log)
        return ran

    def _one_trial(self, study, method: Method, log) -> bool:
        """Ask the study for a trial, run it and tell the study how it ended; whether it counted (not surplus).

        Why ask/tell, not `study.optimize`: on a Ctrl-C (or any escape) optimize records the trial as failed at once
        and logs Optuna's traceback before pflbed's one-line message. Here an interrupted trial is left running:
        the next command's `recover` sees its process gone and queues its parameters again, as the guide says."""
        from optuna.trial import TrialState

        optuna = optuna_module()
        with warnings.catch_warnings():  # the storage's heartbeat is kept below, as optimize keeps it
            warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with Study.optimize")
            trial = study.ask()
        try:
            with _heartbeat(study._storage, trial._trial_id):
                value = self._objective(method, trial, log)
        except _Surplus:
            study.tell(trial, state=TrialState.FAIL)
            return False
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
            return True
        except KeyboardInterrupt:
            raise  # left RUNNING on purpose (see above)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
        study.tell(trial, value)
        return True

    def _objective(self, method: Method, trial, log) -> float:
        optuna = optuna_module()
        from optuna.trial import TrialState

        from pflbed.runs import run

        for key, value in _process().items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("passes", 0)
        study, budget = trial.study, method.budget * self.unit()
        ahead = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                       TrialState.RUNNING))
                 if t.number < trial.number]  # fmt: skip
        if self.spent(study, but=trial.number) >= budget or (method.trials is not None and len(ahead) >= method.trials):
            trial.set_user_attr("surplus", True)
            raise _Surplus
        params = {k: s.suggest(trial, k) for k, s in method.space.items()}
        cfg = method.config(self.seed, params)
        path = method.dir / f"trial{trial.number:04d}"
        trial.set_user_attr("run_dir", str(path.relative_to(self.out)))
        best = -math.inf

        shown = ", ".join(f"{k.split('.', 1)[1]}={_short(v)}" for k, v in params.items())
        head = f"{method.name} trial {trial.number} ({shown})"
        unit = self.unit()
        log(f"{head}: started, trial {len(ahead) + 1}; {self.spent(study) / unit:.2f} of {method.budget:g} base runs "
            "spent")  # fmt: skip
        rounds, start = cfg.train.rounds, compute.total()

        def report(record: dict[str, Any]) -> None:
            """At each evaluation: the compute so far (cut where it spends the budget), and the pruner's judgment
            of the best validation figure so far on the method's curve."""
            nonlocal best
            rnd, passes = record["round"], compute.total() - start
            trial.set_user_attr("passes", passes)
            v = record.get(method.curve)
            if v is not None and v == v:
                best = max(best, v)
                log(f"  {method.name} trial {trial.number}: round {rnd}/{rounds}, {method.curve} {_pct(v)}, "
                    f"{passes / unit:.2f} base runs")  # fmt: skip
                trial.report(best, rnd)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"pruned at round {rnd}")
            if rnd < rounds and self.spent(study, but=trial.number) + passes >= budget:
                trial.set_user_attr("cut", rnd)
                raise optuna.TrialPruned(f"the budget is spent at round {rnd}")

        t0 = time.perf_counter()
        try:
            res = run(cfg, path, progress=False, force=True, on_record=report)
        except optuna.TrialPruned as e:
            trial.set_user_attr("passes", compute.total() - start)
            log(f"{head}: {'cut: ' if 'budget' in str(e) else ''}{e}, best {method.curve} {_pct(best)} "
                f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
            raise
        except DivergedError as e:
            trial.set_user_attr("passes", compute.total() - start)
            trial.set_user_attr("diverged", e.round)
            log(f"{head}: diverged in round {e.round}: counted as pruned")
            raise optuna.TrialPruned(f"diverged in round {e.round}") from None
        except ConfigError as e:  # valid key by key (checked above), refused together by the algorithm (L2GD's θ ≤ 1)
            trial.set_user_attr("passes", compute.total() - start)
            trial.set_user_attr("refused", str(e))
            log(f"{head}: refused ({e}): counted as pruned")
            raise optuna.TrialPruned(f"refused: {e}") from None
        trial.set_user_attr("passes", compute.total() - start)
        value = objective_value(res.summary, res.history, method.objective)
        if value is None:
            raise PflbedError(f"methods.{method.name}: the run has no {method.objective} (objective: pick a "
                              "validation figure the method reports)")  # fmt: skip
        log(f"{head}: {method.objective} {_pct(value)} ({time.perf_counter() - t0:.0f} s)")
        return value

    # --- final re-runs and the table -----------------------------------------------------------------------------
    def best(self, method: Method) -> Any:
        from optuna.trial import TrialState

        study = self.study(method)
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return max(done, key=lambda t: (t.value, -t.number)) if done else None

    def bench(self) -> tuple[Bench, dict[str, str]]:
        """The final re-runs as a bench suite: per method its default and its tuned configuration (labelled by the
        chosen trial, so a better trial found later runs anew), over the suite's seeds; and method → tuned row."""
        default, tuned, rows = {}, {}, {}
        for m in self.methods:
            report = {**self.suite.report, **(m.spec.report or {})}
            default[m.name] = MethodSpec(set=m.spec.set, report=report)
            best = self.best(m)
            if best is not None:
                rows[m.name] = label = f"{m.name} trial{best.number}"
                tuned[label] = MethodSpec(set={**m.spec.set, **best.params}, report=report)
        tables = {"default": TableSpec(methods=default, report=self.suite.report)}
        if tuned:
            tables["tuned"] = TableSpec(methods=tuned, report=self.suite.report)
        suite = Suite(name=self.suite.name, base=self.suite.base, seeds=self.suite.seeds, tables=tables,
                      out=str(self.out / "final"))  # fmt: skip
        return Bench(suite), rows

    def rows(self) -> list[dict[str, Any]]:
        """One row per method: budget, trials, chosen values and objective, default and tuned test figures."""
        from optuna.trial import TrialState

        bench, tuned_label = self.bench()
        default_rows = {r["method"]: r for r in bench.table("default").collect()}
        tuned_t = bench.table("tuned")
        tuned_rows = {r["method"]: r for r in tuned_t.collect()} if tuned_t else {}
        out = []
        for m in self.methods:
            study = self.study(m)
            states = [t.state for t in study.get_trials(deepcopy=False)]
            best = self.best(m)
            cols = {**self.suite.report, **(m.spec.report or {})}
            d, t = default_rows[m.name], tuned_rows.get(tuned_label.get(m.name, ""), {})
            out.append({
                "method": m.name, "objective": m.objective, "pruned_on": m.curve, "budget": m.budget,
                "trials_cap": m.trials, "finished": self.finished(m, study),
                "compute": {"sample_passes": self.spent(study), "base_runs": round(self.spent(study) / self.unit(), 3),
                            "unit_sample_passes": self.unit()},
                "complete": sum(s == TrialState.COMPLETE for s in states),
                "pruned": sum(s == TrialState.PRUNED for s in states),
                "best_trial": None if best is None else best.number,
                "best_value": None if best is None else best.value,
                "chosen": {} if best is None else best.params,
                "space": {k: s.text() for k, s in m.space.items()},
                "default": {c: d.get(c) for c in cols if cols[c]}, "tuned": {c: t.get(c) for c in cols if cols[c]},
                "seeds": {"default": d["seeds"], "tuned": t.get("seeds", 0), "of": len(self.suite.seeds)},
                "seconds": {"search": _trial_seconds(study),
                            "reruns": sum((r.get("wall_s") or 0) * r["seeds"] for r in (d, t) if r)},
                "plots": self.plots.get(m.name, {}), "plots_absent": self.absent.get(m.name, {}),
            })  # fmt: skip
        return out

    def draw(self) -> dict[str, dict[str, str]]:
        """Optuna's matplotlib plots per method, as PNGs under plots/: the optimization history (objective in %, as
        the table gives it) and, from `IMPORTANCE_MIN_TRIALS` complete trials over at least two parameters, the
        parameter importances; method → {kind: path relative to the tune directory}. A plot not drawn gets its
        reason in `absent`, which the table's pages say."""
        optuna = optuna_module()
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, MaxNLocator
        from optuna.trial import TrialState
        from optuna.visualization import matplotlib as vis

        (self.out / "plots").mkdir(parents=True, exist_ok=True)
        self.plots, self.absent = {}, {}
        for m in self.methods:
            study = self.study(m)
            n = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            why = {"history": "no complete trial yet" if not n else None,
                   "importance": (f"{len(m.space)} parameter{'s' * (len(m.space) != 1)} searched: nothing to rank"
                                  if len(m.space) < 2 else
                                  f"{n} complete trial{'s' * (n != 1)}; importances need at least "
                                  f"{IMPORTANCE_MIN_TRIALS} to mean anything" if n < IMPORTANCE_MIN_TRIALS else None)}
            kinds = {"history": vis.plot_optimization_history, "importance": vis.plot_param_importances}
            for kind, plot in kinds.items():
                path = Path("plots") / f"{_slug(m.name)}-{kind}.png"
                (self.out / path).unlink(missing_ok=True)  # an earlier drawing, from other trials: never left stale
                if why[kind]:
                    self.absent.setdefault(m.name, {})[kind] = why[kind]
                    continue
                try:
                    ax = plot(study)
                    for loc in ("left", "right"):  # Optuna's own title, where it puts one: would overlap ours
                        ax.set_title("", loc=loc)
                    ax.set_title(f"{m.name}: {PLOTS[kind]}")
                    if kind == "history":
                        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:g}"))
                        ax.set_ylabel(f"{m.objective} (%)")
                        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                    ax.figure.set_size_inches(7, 4)
                    ax.figure.tight_layout()
                    ax.figure.savefig(self.out / path, dpi=90)
                    self.plots.setdefault(m.name, {})[kind] = str(path)
                except (ValueError, RuntimeError, optuna.exceptions.OptunaError) as e:  # e.g. a constant parameter
                    self.absent.setdefault(m.name, {})[kind] = f"Optuna could not draw it ({e})"
                finally:
                    plt.close("all")
        return self.plots

    def table(self, rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
        """The table's header and cells: per method the budget, the best trial, the chosen values, and each test
        column of the default and of the tuned configuration side by side."""
        cols = list(dict.fromkeys(c for r in rows for c in r["default"]))
        head = ["method", "trials (complete / pruned)", "search compute (base runs)", "objective (best, trial)",
                "chosen values"]  # fmt: skip
        head += [f"{c} {w}" for c in cols for w in ("default", "tuned")] + ["seeds (default/tuned)",
                                                                          "search / re-runs (min)"]
        out = []
        for r in rows:
            chosen = ", ".join(f"{k.split('.', 1)[1]}={_short(v)}" for k, v in r["chosen"].items()) or "—"
            best = "—" if r["best_value"] is None else f"{r['objective']} {_pct(r['best_value'])} (#{r['best_trial']})"
            trials = f"{r['complete'] + r['pruned']} ({r['complete']} / {r['pruned']})"
            spent = f"{r['compute']['base_runs']:.2f} of {r['budget']:g}"  # a study stopped early: not comparable yet
            cells = [r["method"], trials, spent + ("" if r["finished"] else ", **short**"), best, chosen]
            for c in cols:
                for w in ("default", "tuned"):
                    v = r[w].get(c)
                    cells.append("—" if v is None else f"{v[0]:.2f} ± {v[1]:.2f}")
            s = r["seeds"]
            cells.append(f"{s['default']}/{s['tuned']} of {s['of']}")
            cells.append(f"{r['seconds']['search'] / 60:.0f} / {r['seconds']['reruns'] / 60:.0f}")
            out.append(cells)
        return head, out

    def _intro(self, rows: list[dict[str, Any]]) -> str:
        t = self.suite.tune
        search, reruns = (sum(r["seconds"][k] for r in rows) / 60 for k in ("search", "reruns"))
        n = len(self.suite.seeds)
        unit = rows[0]["compute"]["unit_sample_passes"] if rows else self.unit()
        cap = f", at most {t.trials} trials" if t.trials else ""
        return (f"Test figures (%), mean ± std over seeds {self.suite.seeds} (the population standard deviation of "
                f"the {n} figures: divided by n, not n − 1), of each method's default configuration and of the "
                f"configuration its study chose on validation ({t.sampler}, pruner {t.pruner} from round "
                f"{math.ceil(t.warmup * (self.methods[0].rounds if self.methods else 1))} on, trials on seed "
                f"{self.seed}, whose data leaves out every sample seeds {self.suite.seeds} test on). Every method's "
                f"search gets the same training compute: {t.budget:g} base runs{cap}, a base run being the "
                f"{unit:,.0f} sample passes (samples through a gradient) of FedAvg's local training over one run "
                "of the base configuration; a trial running when its study's budget is spent is cut at that "
                "evaluation, so a study overshoots by at most the training between two evaluations and the final "
                "stages of its last trial. The objective is the validation figure of the round selected on "
                "validation. Wall time: "
                f"{search:.0f} min of trials (their running times summed) and {reruns:.0f} min of re-runs "
                f"(each run's wall time), {search + reruns:.0f} min in all. A compute marked short: the study has "
                "not spent its budget yet (stopped early): its row is not yet an equal-budget comparison.")

    def markdown(self, rows: list[dict[str, Any]]) -> str:
        from pflbed.results.report import _md_table

        lines = [f"## {self.suite.name}: default vs tuned", "", self._intro(rows), "", _md_table(*self.table(rows)), "",
                 "Search spaces:", ""]  # fmt: skip
        for r in rows:
            lines.append(f"- {r['method']}: " + (", ".join(f"`{k}` {t}" for k, t in r["space"].items()) or "none"))
        for r in rows:
            lines += ["", f"### {r['method']}", ""]
            lines += [f"![{r['method']} {kind}]({p})\n" for kind, p in r["plots"].items()]
            lines += [f"{PLOTS[kind].capitalize()}: not drawn ({why}).\n" for kind, why in r["plots_absent"].items()]
        return "\n".join(lines) + "\n"

    def html(self, rows: list[dict[str, Any]]) -> str:
        """The table and the plots as one self-contained HTML file (the plots embedded)."""
        import base64
        import html

        from pflbed.results.report import STYLE, _html_table

        title = f"pflbed tune: {self.suite.name}"
        parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                 f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
                 f"<h2>Default vs tuned</h2><p>{html.escape(self._intro(rows))}</p>", _html_table(*self.table(rows)),
                 "<h2>Search spaces</h2><ul>"]  # fmt: skip
        parts += [f"<li>{html.escape(r['method'])}: " + html.escape(", ".join(f"{k} {t}" for k, t in
                                                                             r["space"].items()) or "none") + "</li>"
                  for r in rows]  # fmt: skip
        parts.append("</ul>")
        for r in rows:
            parts.append(f"<h2>{html.escape(r['method'])}</h2>")
            for kind, p in r["plots"].items():
                data = base64.b64encode((self.out / p).read_bytes()).decode()
                parts.append(f"<img alt='{html.escape(r['method'])} {kind}' src='data:image/png;base64,{data}'>")
            parts += [f"<p>{PLOTS[kind].capitalize()}: not drawn ({html.escape(why)}).</p>"
                      for kind, why in r["plots_absent"].items()]
        return "\n".join(parts + ["</body></html>"])

    def write_tables(self) -> tuple[Path, Path]:
        """table.md (plots linked), table.json and report.html (self-contained) in the tune directory."""
        self.draw()
        rows = self.rows()
        self.out.mkdir(parents=True, exist_ok=True)
        md, js = self.out / "table.md", self.out / "table.json"
        (self.out / "report.html").write_text(self.html(rows))
        md.write_text(self.markdown(rows))
        js.write_text(json.dumps({"suite": self.suite.name, "seeds": self.suite.seeds, "trial_seed": self.seed,
                                  "sampler": self.suite.tune.sampler, "pruner": self.suite.tune.pruner,
                                  "storage": self.storage_shown, "methods": rows}, indent=2) + "\n")  # fmt: skip
        return md, js


def _trial_seconds(study) -> float:
    """The study's trials' running time, summed (Optuna's start and end of each complete or pruned trial): its wall
    time when one process ran them one after another, pauses between resumptions left out. Failed trials are left
    out too: one a stopped process left running is marked failed when the study resumes, hours later perhaps."""
    from optuna.trial import TrialState

    return sum((t.datetime_complete - t.datetime_start).total_seconds()
               for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def objective_value(summary: dict[str, Any], history: list[dict[str, Any]], objective: str) -> float | None:
    """A finished run's validation figure: `pfl_val` / `gfl_val` at the round selected on that same figure (the
    best, earliest on ties); `new_val` = the new clients' validation figure (Best-by-validation, at the rate chosen
    on validation, mean over the sizes, of the first new-client method); else the summary field `objective`."""
    from pflbed.results.summary import select_round

    if objective in CURVES:
        if not any(h.get(objective) is not None for h in history):
            return None
        rnd = select_round(history, objective)["round"]
        v = next(h for h in history if h["round"] == rnd).get(objective)
    elif objective == "new_val":
        nc = summary.get("new_clients")
        if not nc or not nc.get("methods"):
            return None
        per_size = next(iter(nc["methods"].values()))
        vals = [r["per_lr"][f"{r['lr_best']:g}"]["best_val"] for r in per_size.values()]
        v = sum(vals) / len(vals)
    else:
        v = _get(summary, objective)
    return None if v is None or v != v else float(v)


def _process(pid: int | None = None) -> dict[str, Any]:
    """Who runs a trial, as `_dead` tells it apart: the host name, the process id, the process-id namespace (two
    containers of one host share a host name and may reuse each other's pids: a pid is only meaningful within its
    namespace) and the process's start time in clock ticks since boot (a pid reused after a reboot or by a later
    process is another process). The last two where Linux's /proc says them."""
    pid = os.getpid() if pid is None else pid
    out: dict[str, Any] = {"host": socket.gethostname(), "pid": pid}
    with contextlib.suppress(OSError):
        out["pidns"] = os.readlink(f"/proc/{'self' if pid == os.getpid() else pid}/ns/pid")
    with contextlib.suppress(OSError, IndexError, ValueError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        out["started"] = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: after the name, the 20th
    return out


def _dead(owner: dict[str, Any]) -> bool:
    """Whether the process recorded in `owner` (`_process`) is known to be gone: only a process of this host and
    of this process's pid namespace can be checked; anywhere else it may be alive, and is left alone."""
    here, pid = _process(), owner.get("pid")
    same_ns = owner.get("pidns", here.get("pidns")) == here.get("pidns")  # unrecorded: a trial of an older pflbed
    if pid is None or owner.get("host") != here["host"] or not same_ns:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    started = owner.get("started")
    return started is not None and _process(int(pid)).get("started") not in (None, started)  # the pid reused


def _pct(v: float) -> str:
    return "—" if v is None or v == -math.inf else f"{100 * v:.2f}"


@contextlib.contextmanager
def _heartbeat(storage: Any, trial_id: int) -> Iterator[None]:
    """While a trial runs, its heartbeat in a storage that keeps them (`RDBStorage(heartbeat_interval=…)`), as
    `study.optimize` records it: a trial whose process died elsewhere goes stale and is failed and retried
    (`fail_stale_trials`), where the host-and-pid check of `recover` cannot see."""
    interval = storage.get_heartbeat_interval() if hasattr(storage, "get_heartbeat_interval") else None
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="pflbed-tune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
