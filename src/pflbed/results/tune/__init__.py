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
with (base, the method's set, space, objective, trial seed and reported seeds); a later command whose suite
differs there stops with one line naming the key instead of mixing trials of two setups (the budget and the table
columns may change; the reported seeds may not: the trials' data leaves out their test samples).

Storage: an SQLite file `study.db` in the tune directory by default; `--storage URL` takes any Optuna storage, and
`pflbed tune --worker` on other machines joins the same studies (Optuna's distributed mode). A killed `pflbed tune`
continues where it stopped: finished trials (complete or pruned) count toward the budget, the trials a dead process
left running on this machine are marked failed and their parameters queued again (on other machines Optuna's
heartbeat does the same after its grace period), and a trial begun when the budget was already taken by others
fails as surplus, so a study never holds more than its budget.
"""

from __future__ import annotations

from pathlib import Path

from pflbed.errors import ConfigError
from pflbed.results.rundir import suite_dir
from pflbed.results.tune.reruns import Reruns, _trial_seconds
from pflbed.results.tune.studies import Method, Studies, _dead, _process, optuna_module, shown_storage
from pflbed.results.tune.suite import TuneMethod, TuneSpec, TuneSuite, apply_overrides, load_tune_suite
from pflbed.results.tune.tables import Tables
from pflbed.results.tune.trials import Trials, _Surplus, objective_value

__all__ = ["Method", "TuneMethod", "TuneSpec", "TuneSuite", "Tuner", "_Surplus", "_dead", "_process", "_trial_seconds",
           "apply_overrides", "load_tune_suite", "objective_value", "optuna_module", "shown_storage"]


class Tuner(Studies, Trials, Reruns, Tables):
    """A tune suite's studies, trials, re-runs and table: one mixin per module of this package."""

    def __init__(self, suite: TuneSuite, out: str | Path | None = None, storage: str | None = None) -> None:
        t = suite.tune
        for m, spec in suite.methods.items():  # equal budgets, unless the suite says otherwise
            for key in ("budget", "trials"):
                own, shared = getattr(spec, key), getattr(t, key)
                if own is not None and own != shared and not t.unequal_budgets:
                    raise ConfigError(f"methods.{m}.{key}: {own} against tune.{key} {shared}: every method gets "
                                      "the same budget (say tune.unequal_budgets: true to allow it)")  # fmt: skip
        self.suite = suite
        self.out = suite_dir(Path(out or suite.out or Path("runs") / "tune" / suite.name), "--out" if out else "out")
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

