"""The studies: one per method (its config and search space), where they are stored, their budgets in compute,
and which running trials a dead process left behind."""

from __future__ import annotations

import contextlib
import fcntl
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
from typing import TYPE_CHECKING, Any

from pflbed.config import Config, TrainConfig, set_dotted, validate_config
from pflbed.errors import ConfigError, PflbedError
from pflbed.results.bench import _merge, _slug
from pflbed.results.tune.suite import CURVES, TuneMethod
from pflbed.search import Choice, IntSearch, Space, declared, parse_space

if TYPE_CHECKING:
    from pflbed.results.tune import Tuner


def optuna_module():
    """Optuna, imported on first use (the core does not need it)."""
    try:
        import optuna
    except ImportError:
        raise PflbedError("pflbed tune needs Optuna: pip install 'pflbed[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


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
        unread = _unread(default)
        for key, s in space.items():  # every bound must make a valid config: names the key, not a trial
            for v in (s.options if hasattr(s, "options") else (s.low, s.high)):
                try:
                    unread &= _unread(self.config(0, {key: v}))
                except ConfigError as e:
                    raise ConfigError(f"methods.{name}.space.{key}: {v!r} does not validate ({e})") from None
        # a `train.*` key that no trial reads is no dimension of the search: its trials would learn nothing about it
        # and its "chosen value" would mean nothing (the re-runs keep the base's value)
        self.unread = sorted(k for k in (f"train.{k}" for k in unread) if k in space)
        for key in self.unread:
            if spec.space.get(key) is not None:
                raise ConfigError(f"methods.{name}.space.{key}: algorithm {default.algorithm.name!r} never reads "
                                  f"{key} in these trials; leave it out")  # fmt: skip
            del space[key]
        self.space: dict[str, Space] = space
        self.default = _defaults(space, self.resolved({})) if suite.tune.first == "default" else {}

    def config(self, seed: int, params: dict[str, Any], trial: bool = True) -> Config:
        """The method's config with `params` on `seed`. A trial's (`trial`) leaves out of its data every sample the
        reported seeds test on (`federation.exclude_test_of`): no reported test figure's sample tunes anything; and
        unless its objective is `new_val` it skips the new clients' personalization, which nothing it reports reads
        (its training would count against the budget)."""
        tree = _merge(self.tuner.suite.base, {})
        extra = {"federation.exclude_test_of": self.tuner.suite.seeds} if trial else {}
        if trial and self.objective != "new_val":  # a stage no objective reads: not run in the search
            extra |= {"eval.new_clients.methods": [], "eval.new_clients.zero_shot": False}
        for key, value in {**self.spec.set, **params, "seed": seed, **extra}.items():
            set_dotted(tree, key, value)
        try:
            return validate_config(tree)
        except ConfigError as e:
            raise ConfigError(f"methods.{self.name}: {e}") from None

    def resolved(self, params: dict[str, Any]) -> dict[str, Any]:
        """The re-run config with `params`, its algorithm's options filled in: an option set to its default value
        and the option left out give the same run, and compare equal here (a `Config` keeps the options as given);
        so do an option left `None` that stands for another key (`search.same_as`: `head_lr` None = `train.lr`)
        and the option set to that key's value."""
        from pflbed.algorithms import get_algorithm
        from pflbed.search import sources

        cfg = self.config(0, params, trial=False)
        model = get_algorithm(cfg.algorithm.name).Config
        tree = cfg.model_dump(mode="json")
        options = model.model_validate(cfg.algorithm_options()).model_dump(mode="json")
        for name, key in sources(model).items():
            if options.get(name) is None:
                options[name] = _at(tree, key)
        return {**tree, "algorithm": {"name": cfg.algorithm.name, **options}}

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
               "trial data excludes the tests of seeds": suite.seeds,
               "first trial": suite.tune.first}  # fmt: skip
        return json.loads(json.dumps(out, default=str))


def _unread(cfg: Config) -> frozenset[str]:
    """The `train.*` keys a run of `cfg` never reads: its algorithm's `unread_train` for its options, less those a
    personalization takes (`Budget.TRAIN_KEYS`) where the run personalizes (`eval.finetune`, new clients)."""
    from pflbed.algorithms import get_algorithm
    from pflbed.algorithms.common import Budget

    cls = get_algorithm(cfg.algorithm.name)
    unread = cls.unread_train(cls.Config.model_validate(cfg.algorithm_options()))
    return unread - Budget.TRAIN_KEYS if cfg.eval.finetune or cfg.eval.new_clients.methods else unread


def _defaults(space: dict[str, Space], default: dict[str, Any]) -> dict[str, Any]:
    """The default configuration's value (`default`: `Method.resolved`) of each searched key that its space holds
    (`tune.first: default`).

    Why: with a budget of few trials (a costly method gets two or three), every one of them is a random draw of the
    sampler's start-up, and the chosen configuration can be far worse than the default on validation; a first trial at
    the defaults makes the search start where an untuned comparison stands. An option whose None stands for another
    key arrives filled in (`search.same_as`); a default still outside its space (FedRoD-hyper's hyper_lr, half the
    personal lr) is left to the sampler."""
    out = {}
    for key, s in space.items():
        value = _at(default, key)
        if _holds(s, value):
            out[key] = value
    return out


def _at(tree: dict[str, Any], key: str) -> Any:
    """The value at dotted `key` of a config dump (None where the path ends early)."""
    value: Any = tree
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _holds(s: Space, value: Any) -> bool:
    if isinstance(s, Choice):
        return value in s.options
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return s.low <= value <= s.high and (isinstance(value, int) or not isinstance(s, IntSearch))


def _flat(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v}
    return out


def shown_storage(url: str) -> str:
    """A storage URL as the table and messages show it: without its password (`postgresql://user:***@host/db`), so
    that a committed table.json or a pasted error line does not hand out the database's credentials."""
    return re.sub(r"^([^:/]+://[^:/@]*):[^@]*@", r"\1:***@", url)



class Studies:
    """The studies of a `Tuner` (a mixin: the state is the tuner's)."""

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
            with self._opening():
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
        with self._opening():
            study = optuna.create_study(storage=self.storage(), study_name=method.study_name, sampler=sampler,
                                        pruner=pruner, direction="maximize", load_if_exists=True)  # fmt: skip
        if method.name not in self._checked:
            self._check_setup(method, study)
            self._checked.add(method.name)
            with self.exclusive():  # the default trial: queued by the first command on the study, as its first
                if method.default and not study.trials:
                    study.enqueue_trial(method.default, user_attrs={"default": True})
        return study

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held while this process looks at a study and changes it on what it saw (queues the default trial, queues
        a dead process's trials again, takes a waiting trial): on an SQLite storage, no other process does so
        meanwhile (a lock file beside the database, created private).

        Why: SQLite cannot lock a row (Optuna's `SELECT … FOR UPDATE` is a no-op there), so two processes taking
        one waiting trial at once could both get it; they ran it twice, and the second's report was refused
        ("Trial#0 has already finished"). Two takes started together got the same trial 14 times in 30. A server
        database locks the row; the duplicates its other look-then-change steps can leave (two commands starting a
        study at once both queue its default) are dropped when taken (`twin`)."""
        db = self.storage_url.removeprefix("sqlite:///") if self.storage_url.startswith("sqlite:///") else ""
        if db in ("", ":memory:"):
            yield
            return
        fd = os.open(f"{db}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and with it the lock

    def _check_setup(self, method: Method, study) -> None:
        """The study's trials ran with this method's setup (recorded by the first command on it): a suite changed
        since (another base key, set, space, objective or trial seed — e.g. a --set left out or added) would mix
        trials of two setups in one study and reuse re-runs of the other, so it stops, naming the first key."""
        setup, held = method.setup(), study.user_attrs.get("setup")
        if held is None:
            study.set_user_attr("setup", setup)
            return
        held = {"first trial": "sampled", **held}  # a study from before `tune.first` drew its first trial
        diff = next((k for k in sorted({*setup, *held}) if setup.get(k, "unset") != held.get(k, "unset")), None)
        if diff is not None:
            was, now = (json.dumps(x.get(diff, "unset")) for x in (held, setup))
            new = "another --out" if self.storage_url.endswith(f"{self.out.resolve() / 'study.db'}") else \
                "another suite name (--set name=…)"  # fmt: skip
            raise ConfigError(f"{diff}: {now}, but the {method.name} study in {self.storage_path} ran its trials with "
                              f"{was}; give {new} for a new study (or the same --set as before)")

    @contextlib.contextmanager
    def _opening(self) -> Iterator[None]:
        """Around Optuna's first look at the storage: a URL it cannot open (a server that does not answer, a storage
        it no longer supports, as redis://) is one line, not a traceback."""
        try:
            yield
        except PflbedError:
            raise
        except Exception as e:
            raise self._storage_error(e) from None

    def _storage_error(self, e: Exception) -> PflbedError:
        """A storage Optuna cannot open, as one line that names it without its password: the default file by its
        path (no --storage was given), the first line of the error (SQLAlchemy adds the statement and a link)."""
        where = self.storage_path if self.storage_shown == "study.db" else f"--storage {self.storage_shown}"
        first = next(iter(str(e).splitlines()), "")
        return PflbedError(f"{where}: {type(e).__name__}: {first}")

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
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        n = 0
        with self.exclusive():
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if not _dead(t.user_attrs):
                    continue
                try:
                    study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                except UpdateFinishedTrialError:  # another process of this machine recovered it first
                    continue
                study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
                n += 1
        return n


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

