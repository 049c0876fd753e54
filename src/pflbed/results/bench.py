"""`pflbed bench`: a suite of tables, each settings × methods × seeds → mean ± std in Markdown and CSV.

A suite file holds a shared base config and seeds, and one or more tables; a table adds its own base keys,
settings (column groups, e.g. Dir(0.3) vs Dir(0.1)) and methods (rows). Every cell is an ordinary run directory
under `<out>/runs/<table>/<setting>/<method>/seed<k>`, so a suite is resumable for free: finished cells (with
`summary.json`) are skipped, an interrupted cell continues from its checkpoint, and `--max-cells` runs a bounded
chunk. A method may reuse another's runs and report other fields (FedAvg+FT is FedAvg's run, reported from
`final.ft.pfl_acc`), also another table's (`same_as: <table>/<method>`, for the settings both tables have).

A table's ± is the population standard deviation over the seeds that finished (divided by their number, not by one
less): the spread of those runs themselves. A method's name may hold a `/` (`FedAvg w/ FT`); a `same_as` naming
such a method gives its table first (`main/FedAvg w/ FT`).

    name: fmnist
    base: {dataset: {name: fmnist}, train: {rounds: 50}}        # any run config keys
    seeds: [0, 1, 2]
    tables:
      dirichlet:
        settings: {"Dir(0.3)": {federation.alpha: 0.3}, "Dir(0.1)": {federation.alpha: 0.1}}
        methods:
          FedAvg: {set: {algorithm.name: fedavg}}
          FedAvg+FT: {same_as: FedAvg, report: {G-FL: null, P-FL: final.ft.pfl_acc}}
        report: {G-FL: final.gfl_acc, P-FL: final.pfl_acc}        # column → summary.json field
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, ConfigDict, Field, ValidationError, model_validator

from pflbed.config import Config, _first_error, set_dotted, validate_config
from pflbed.config.base import Numbers, Seeds
from pflbed.config.load import file_kind, read_yaml_file
from pflbed.errors import ConfigError, DivergedError, PflbedError
from pflbed.hints import did_you_mean
from pflbed.results import suite_overrides
from pflbed.results.rundir import SUITE_FILE, atomic_write, read_summary, suite_dir
from pflbed.results.suite_overrides import flat_set, set_by_overrides, set_in, set_labelled


class MethodSpec(Numbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    set: dict[str, Any] = Field(default_factory=dict, description="config overrides (dotted keys)")
    same_as: str | None = Field(None, description="reuse another method's runs ('<table>/<method>': another table's)")
    report: dict[str, str | None] | None = Field(None, description="columns → summary fields, overriding the suite's")

    def runs_of(self, name: str) -> tuple[str | None, str]:
        """(table, or None for this one; method) whose runs the row `name` of this spec reports: its own, or its
        `same_as`'s. A method's own name is not parsed (`FedAvg w/ FT` is no table `FedAvg w`)."""
        return _source(self.same_as) if self.same_as is not None else (None, name)


class TableSpec(Numbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    title: str | None = None
    base: dict[str, Any] = Field(default_factory=dict, description="config keys merged over the suite's base")
    seeds: Seeds | None = Field(None, description="default: the suite's seeds")
    settings: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"": {}}, min_length=1)  # {}: no rows
    methods: dict[str, MethodSpec] = Field(min_length=1)
    report: dict[str, str] = Field(default_factory=lambda: {"G-FL": "final.gfl_acc", "P-FL": "final.pfl_acc"},
                                   min_length=1)  # {}: rows without a figure  # fmt: skip
    scale: float = Field(100.0, description="multiply reported values (100: accuracies as %)")
    column_scale: dict[str, float] = Field(default_factory=dict, description="per-column scale overriding `scale`")

    @model_validator(mode="after")
    def _check(self) -> TableSpec:
        for m, spec in self.methods.items():
            local = spec.same_as is not None and _source(spec.same_as)[0] is None  # others: checked by the suite
            if local and (spec.same_as not in self.methods or self.methods[spec.same_as].same_as):
                raise ValueError(f"methods.{m}.same_as: must name a method that has its own runs")
            if spec.same_as is not None and spec.set:
                raise ValueError(f"methods.{m}: give either set or same_as")
        for column in self.column_scale:  # one for a column not reported was ignored without a word
            if column not in self.report:
                raise ValueError(f"column_scale.{column}: no such column; the report's are "
                                 f"{', '.join(self.report)}")  # fmt: skip
        for kind, names in (("methods", list(self.methods)), ("settings", list(self.settings))):
            dirs: dict[str, str] = {}
            for n in names:
                if _slug(n) in dirs:
                    raise ValueError(f"{kind} {dirs[_slug(n)]!r} and {n!r} would share the run directory "
                                     f"{_slug(n)!r}; rename one")  # fmt: skip
                dirs[_slug(n)] = n
        return self


class Suite(Numbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: SuiteName
    base: dict[str, Any] = Field(default_factory=dict)
    seeds: Seeds = Field(default_factory=lambda: [0, 1, 2])
    tables: dict[str, TableSpec] = Field(min_length=1)
    out: str | None = Field(None, description="results directory (default benchmarks/results/<name>)")

    @model_validator(mode="after")
    def _check(self) -> Suite:
        for name, t in self.tables.items():
            for m, spec in t.methods.items():
                other, method = spec.runs_of(m)
                if other is None:
                    continue
                o = self.tables.get(other)
                if o is None or method not in o.methods or o.methods[method].same_as is not None:
                    raise ValueError(f"tables.{name}.methods.{m}.same_as: no table {other!r} with a method "
                                     f"{method!r} that has its own runs")  # fmt: skip
                if not set(t.settings) <= set(o.settings):
                    raise ValueError(f"tables.{name}.methods.{m}.same_as: table {other!r} lacks some settings")
        return self


def read_suite_file(p: Path, command: str = "bench") -> Any:
    """A suite file's YAML tree; an unreadable or malformed file is one ConfigError naming it, and so is another
    command's file (a run config, the other kind of suite; `config.load.file_kind`): "name: Field required" did
    not say which it was."""
    tree = read_yaml_file(p, "suite")
    if isinstance(tree, dict) and (kind := file_kind(tree)) not in (command, None):
        raise ConfigError(f"{p}: {FILE_KINDS[kind]}, not a {command} suite: give it to "
                          f"`{shlex.join(['pflbed', kind, '-c', str(p)])}`")  # fmt: skip
    return tree


FILE_KINDS = {"run": "a run config", "bench": "a bench suite (it has tables)", "tune": "a tune suite (it has tune)"}


def load_suite(path: str | Path, overrides: list[str] | None = None) -> Suite:
    """The suite of a suite file, or of a results directory (`SUITE_FILE`, its results that directory): the
    suite a `--out` elsewhere ran, for `--table-only`, `--list` and the scripts that read a suite's runs; with
    `--set KEY=VALUE` overrides applied (`apply_overrides`), an error naming the `--set` it comes from."""
    p = Path(path)
    if p.is_dir():
        if not (p / SUITE_FILE).is_file():
            raise ConfigError(f"{p}: a directory without {SUITE_FILE}; give a suite file or the results directory "
                              "of one (`pflbed bench` writes its suite there)")  # fmt: skip
        return load_suite(p / SUITE_FILE, overrides).model_copy(update={"out": str(p)})
    tree = read_suite_file(p)
    keys: list[str] = []
    if overrides and isinstance(tree, dict | None):  # a file that is no mapping is refused as it is, not emptied
        tree, keys = apply_overrides(tree or {}, overrides)
    try:
        return Suite.model_validate(tree or {})
    except ValidationError as e:
        where = "--set " if set_by_overrides(e, keys) else f"{p}: "
        raise ConfigError(f"{where}{_first_error(e, model=Suite)}") from None


_TABLE_FLAT = ("report", "column_scale")  # a table's mappings whose keys are column names


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """A copy of the suite's tree with each `KEY=VALUE` set (the value read as YAML), and the keys set. KEY is the
    suite's own dotted path: `base.train.rounds=5`, `seeds=[0]`, `tables=[main]` (keep those tables),
    `tables.T.methods=[A, B]`, `tables.T.methods.A=null` (drop one), `tables.T.methods.A.set.train.lr=0.1`,
    `tables.T.settings.Dir(0.3).federation.alpha=0.5`, `tables.T.report.P-FL=final.pfl_acc`."""
    return suite_overrides.apply_overrides(tree, overrides, list(Suite.model_fields), "bench",
                                           "a table's base (--set tables.NAME.base.{key}=…)", _in_tables)


def _in_tables(tree: dict[str, Any], key: str, parts: list[str], value: Any) -> bool:
    """`tables…` keys: a table's label, then `_set_in_table`'s rule below it."""
    if parts[0] != "tables":
        return False
    if found := set_labelled(tree, "tables", parts[1:], value, "table", key):
        _set_in_table(*found, value, key)
    return True


def _set_in_table(tables: dict[str, Any], name: str, parts: list[str], value: Any, key: str) -> None:
    """`tables.NAME.<parts>` = `value`: a method's `set` and `report`, a setting's keys and the table's columns are
    each one key below them; the rest is a dotted path (`base.train.rounds`)."""
    if not isinstance(tables[name], dict):
        raise ConfigError(f"--set {key}: not a section")
    field, rest, where = parts[0], parts[1:], f"table {name!r}"
    if field in ("methods", "settings"):
        what = field.removesuffix("s")
        if found := set_labelled(tables[name], field, rest, value, what, key, where):
            entries, label, below = found
            if field == "settings":
                flat_set(entries, label, ".".join(below), value, key)
            elif below[0] in ("set", "report") and len(below) > 1:
                flat_set(entries[label], below[0], ".".join(below[1:]), value, key)
            else:
                set_in(entries[label], ".".join(below), value, key)
    elif field in _TABLE_FLAT and rest:
        flat_set(tables[name], field, ".".join(rest), value, key)
    else:
        set_in(tables[name], ".".join(parts), value, key)


def _source(same_as: str) -> tuple[str | None, str]:
    """(table or None for this table, method) named by a `same_as` value: `Method` or `<table>/<method>`."""
    table, sep, method = same_as.partition("/")
    return (table, method) if sep else (None, same_as)


def _slug(s: str) -> str:
    """A directory name for a setting or method label: `Dir(0.3)` → `Dir-0.3`, `FedRoD (hyper)` → `FedRoD-hyper`;
    never `.` or `..` (a method `..` ran in its table's directory)."""
    out = "".join(c if c.isalnum() or c in "_.+=" else "-" for c in s)
    while "--" in out:
        out = out.replace("--", "-")
    out = out.strip("-")
    return out if out.strip(".") else "default"


def _plain_name(v: str) -> str:
    """A suite's name is one directory's name under the results directory: `../x` or `a/b` put it elsewhere."""
    if not v.strip(".") or any(c in v for c in "/\\\0"):
        raise ValueError("must be one directory's name (no /, \\ or NUL, not . or ..); give out to choose where the "
                         "results go")  # fmt: skip
    return v


SuiteName = Annotated[str, AfterValidator(_plain_name)]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


class Table:
    """One table of a suite: its cells, their configs and run directories, and the aggregated rows."""

    def __init__(self, name: str, spec: TableSpec, suite: Suite, out: Path) -> None:
        self.name, self.spec, self.out = name, spec, out
        self.base = _merge(suite.base, spec.base)
        self.seeds = spec.seeds or suite.seeds

    def cell_config(self, setting: str, method: str, seed: int) -> Config:
        tree = copy.deepcopy(self.base)
        overrides = {**self.spec.settings[setting], **self.spec.methods[method].set, "seed": seed}
        for key, value in overrides.items():
            set_dotted(tree, key, value)
        try:
            return validate_config(tree)
        except ConfigError as e:
            where = f"table {self.name}, {setting or 'default'} / {method} / seed {seed}"
            raise ConfigError(f"{where}: {e}") from None

    def run_dir(self, setting: str, method: str, seed: int, table: str | None = None) -> Path:
        return self.out / "runs" / _slug(table or self.name) / _slug(setting) / _slug(method) / f"seed{seed}"

    def cells(self) -> list[tuple[str, str, int]]:
        """Cells with their own runs, seed-major: a partly run suite already has whole tables for its first seeds."""
        s = self.spec
        return [(st, m, seed) for seed in self.seeds for st in s.settings for m, spec in s.methods.items()
                if spec.same_as is None]  # fmt: skip

    def runs_of(self, method: str) -> tuple[str | None, str]:
        """`MethodSpec.runs_of` of the row `method`."""
        return self.spec.methods[method].runs_of(method)

    def finished_runs(self, method: str, setting: str) -> dict[int, Path]:
        """{seed: run directory} of the seeds of a row that finished, also when the row reuses another's runs."""
        table, source = self.runs_of(method)
        dirs = {seed: self.run_dir(setting, source, seed, table) for seed in self.seeds}
        return {seed: d for seed, d in dirs.items() if (d / "summary.json").exists()}

    def diverged_runs(self, method: str, setting: str) -> list[Path]:
        """The run directories of a row whose run diverged (`DIVERGED`), also when the row reuses another's runs."""
        table, source = self.runs_of(method)
        dirs = [self.run_dir(setting, source, seed, table) for seed in self.seeds]
        return [d for d in dirs if (d / DIVERGED).exists()]

    def report_of(self, method: str) -> dict[str, str | None]:
        """The row's columns → summary fields: the table's, overridden by the method's own."""
        return {**self.spec.report, **(self.spec.methods[method].report or {})}

    def figures(self, method: str, run_dir: Path) -> str:
        """A finished cell's report columns, as its row shows them (`P-FL 90.30 G-FL 84.45`): a method reporting
        another field (FedAvg+FT's fine-tuned P-FL) is logged with that field, not with the run's plain one."""
        summary = read_summary(run_dir / "summary.json")
        shown = []
        for col, field in self.report_of(method).items():
            if field is None:
                continue
            v, k = _get(summary, field), self.spec.column_scale.get(col, self.spec.scale)
            shown.append(f"{col} {'—' if v is None else f'{v * k:.2f}'}")
        return " ".join(shown)

    def collect(self) -> list[dict[str, Any]]:
        """One row per (method, setting): mean and std over the seeds that finished, per report column."""
        s = self.spec
        rows = []
        for m in s.methods:
            report = self.report_of(m)
            for st in s.settings:
                runs = self.finished_runs(m, st).values()
                summaries = [read_summary(d / "summary.json") for d in runs]
                row: dict[str, Any] = {"method": m, "setting": st, "seeds": len(summaries),
                                       "diverged": len(self.diverged_runs(m, st))}  # fmt: skip
                for col, field in report.items():
                    vals = [v for v in (_get(x, field) for x in summaries) if v is not None] if field else []
                    k = s.column_scale.get(col, s.scale)
                    row[col] = _mean_std([v * k for v in vals]) if vals else None
                wall = [w for x in summaries if (w := _get(x, "timing.wall_s")) is not None]  # a hand-edited "x"
                # was a TypeError traceback: the time is a note beside the row's figures, which stand without it
                row["wall_s"] = sum(wall) / len(wall) if wall else None
                rows.append(row)
        return rows

    def unreported(self) -> list[str]:
        """A line for each report field that no finished run reading it has: its cells show "—" as if the figure
        were merely missing, which hid a misspelt field (`final.pfl_ac`) in a table that looked complete.

        A column of the table is named only when none of the table's rows reading it has the field: one that some
        row has is a figure only some methods give (FedSelect's personal fraction, a zero-shot accuracy a method
        without a global head has not), and its "—" elsewhere is the answer. A row's own column (its `report`) was
        asked of that row, so it is named when none of the row's runs has it."""
        runs = {m: {d: read_summary(d / "summary.json") for st in self.spec.settings
                    for d in self.finished_runs(m, st).values()} for m in self.spec.methods}  # fmt: skip
        lines = []
        for col, field in self.spec.report.items():
            readers = [m for m, spec in self.spec.methods.items() if col not in (spec.report or {})]
            summaries = list({d: x for m in readers for d, x in runs[m].items()}.values())  # a reused run once
            if line := _unreported(col, field, summaries, "the table's"):
                lines.append(f"table {self.name}: {line}")
        for m, spec in self.spec.methods.items():
            for col, field in (spec.report or {}).items():
                if line := _unreported(col, field, list(runs[m].values()), "its"):
                    lines.append(f"table {self.name}, {m}: {line}")
        return lines

    def columns(self) -> list[str]:
        cols = list(self.spec.report)
        for spec in self.spec.methods.values():
            cols += [c for c in (spec.report or {}) if c not in cols]
        return cols

    def markdown(self) -> str:
        rows, cols, settings = self.collect(), self.columns(), list(self.spec.settings)
        head = ["method"] + [f"{st} {c}".strip() for st in settings for c in cols] + ["seeds"]
        lines = [f"### {self.spec.title or self.name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        by = {(r["method"], r["setting"]): r for r in rows}
        for m in self.spec.methods:
            cells = [m]
            for st in settings:
                for c in cols:
                    v = by[(m, st)].get(c)
                    gone = by[(m, st)]["diverged"] and not by[(m, st)]["seeds"]  # no seed left to give a figure
                    cells.append(("diverged" if gone else "—") if v is None else f"{v[0]:.2f} ± {v[1]:.2f}")
            gone = sum(by[(m, st)]["diverged"] for st in settings)
            cells.append(f"{min(by[(m, st)]['seeds'] for st in settings)}/{len(self.seeds)}"
                         + (f", {gone} diverged" if gone else ""))  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def csv_rows(self) -> list[list[str]]:
        """Long format: one row per (method, setting, column)."""
        out = []
        for r in self.collect():
            for c in self.columns():
                v = r.get(c)
                mean, std = ("", "") if v is None else (f"{v[0]:.4f}", f"{v[1]:.4f}")
                wall = "" if r["wall_s"] is None else f"{r['wall_s']:.1f}"
                out.append([self.name, r["method"], r["setting"], c, mean, std, str(r["seeds"]), wall])
        return out


class Bench:
    def __init__(self, suite: Suite, root: Path | None = None, out: Path | None = None) -> None:
        """`out` (a command's `--out`) before the suite's own `out`, before `root`/<name> (default
        benchmarks/results)."""
        self.suite = suite
        given = out is not None
        out = out or (Path(suite.out) if suite.out else (root or Path("benchmarks/results")) / suite.name)
        self.out = suite_dir(out, "--out" if given else "out")
        theirs = _suite_name(self.out / SUITE_FILE)
        if theirs is not None and theirs != suite.name:  # its suite.yaml and tables were replaced by this one's,
            # its cells left behind under runs/ as if they were this suite's
            raise PflbedError(f"{'--out' if given else 'out'} {self.out}: holds the results of suite {theirs!r}; "
                              f"give suite {suite.name!r} a directory of its own")  # fmt: skip
        self.tables = [Table(n, spec, suite, self.out) for n, spec in suite.tables.items()]

    def table(self, name: str) -> Table | None:
        return next((t for t in self.tables if t.name == name), None)

    def cells(self) -> list[tuple[Table, tuple[str, str, int]]]:
        return [(t, c) for t in self.tables for c in t.cells()]

    def cell_files(self, relpath: str) -> list[tuple[Table, tuple[str, str, int], Path]]:
        """The cells whose run directory holds `relpath` (e.g. an algorithm's `plots/…` artifact), with its path."""
        found = [(t, c, t.run_dir(*c) / relpath) for t, c in self.cells()]
        return [(t, c, p) for t, c, p in found if p.exists()]

    def pending(self) -> list[tuple[Table, tuple[str, str, int]]]:
        """Cells with neither a summary nor a record of having diverged (`DIVERGED`: deterministic, it would
        diverge again; delete the cell's directory to run it anew)."""
        return [(t, c) for t, c in self.cells() if not any((t.run_dir(*c) / f).exists() for f in
                                                           ("summary.json", DIVERGED))]  # fmt: skip

    def diverged(self) -> list[Path]:
        return [t.run_dir(*c) for t, c in self.cells() if (t.run_dir(*c) / DIVERGED).exists()]

    def stale(self) -> list[Path]:
        """Run directories whose recorded config no longer matches the suite (the suite was edited)."""
        from pflbed.results.rundir import same_config

        out = []
        for t, c in self.cells():
            saved = t.run_dir(*c) / "config.yaml"
            if saved.exists() and not same_config(saved, t.cell_config(*c)):
                out.append(saved.parent)
        return out

    def refuse_stale(self) -> None:
        """Refuse a results directory holding cells of another version of the suite: a run would mix them into its
        tables, and so did `--table-only` and `--list` (which listed them as done)."""
        stale = self.stale()
        if stale:
            raise PflbedError(f"{len(stale)} cell(s) were run with another version of the suite, e.g. {stale[0]}; "
                              "delete them, restore the suite, or run it in another directory (--out)")  # fmt: skip

    def run(self, max_cells: int | None = None, log=print, shard: tuple[int, int] = (1, 1), jobs: int = 1) -> int:
        """Run the unfinished cells (at most `max_cells`); returns how many ran.

        `jobs` > 1 runs that many cells at a time, each in its own worker process with one torch thread (small
        models on oversubscribed cores slow down by orders of magnitude); a worker takes the next cell when it
        finishes one, so uneven cells balance out. `shard` = (i, n) runs only the cells whose position in the suite
        is i-1 modulo n, for splitting a suite across machines without running a cell twice.
        """
        self.refuse_stale()
        i_shard, n_shard = shard
        cells, pending = self.cells(), self.pending()
        position = {(t.name, c): k for k, (t, c) in enumerate(cells)}
        todo = [(t, c) for t, c in pending if position[(t.name, c)] % n_shard == i_shard - 1]
        configs = {(t.name, c): t.cell_config(*c) for t, c in todo}  # validate every cell before running any
        self.write_suite()  # then the suite beside what it runs (a suite refused above writes nothing)
        total, done = len(cells), len(cells) - len(pending)
        todo = todo[:max_cells] if max_cells is not None else todo
        tasks = [(configs[(t.name, c)], t.run_dir(*c)) for t, c in todo]
        for k, ((table, (setting, method, seed)), (final, took)) in enumerate(zip(todo, _run_cells(tasks, jobs),
                                                                                 strict=True)):  # fmt: skip
            figures = f"diverged in round {final['diverged']}" if "diverged" in final else \
                table.figures(method, tasks[k][1])  # fmt: skip
            log(f"[{done + k + 1}/{total}] {table.name} · {setting or '-'} · {method} · seed {seed}: {figures} "
                f"({'finished by another process' if took is None else f'{took:.0f} s'})")  # fmt: skip
        return len(todo)

    def markdown(self) -> str:
        return f"## {self.suite.name}\n\n" + "\n".join(t.markdown() for t in self.tables)

    def csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["table", "method", "setting", "column", "mean", "std", "seeds", "wall_s"])
        for t in self.tables:
            w.writerows(t.csv_rows())
        return buf.getvalue()

    def unreported(self) -> list[str]:
        """Every table's report fields that no finished run of their row has (`Table.unreported`)."""
        return [line for t in self.tables for line in t.unreported()]

    def write_suite(self) -> Path:
        """The suite beside its results (`SUITE_FILE`), without its `out`: the directory is its results wherever it
        is moved, and `load_suite(directory)` reads it back."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / SUITE_FILE
        atomic_write(path, yaml.safe_dump(self.suite.model_dump(mode="json", exclude={"out"}), sort_keys=False))
        return path

    def write_tables(self) -> tuple[Path, Path]:
        """table.md and table.csv, each whole or as it was: shards of one suite (`--shard`) finishing together both
        write them, and two writes into one file at once could leave a shorter table followed by a longer one's
        tail."""
        self.write_suite()
        md, cs = self.out / "table.md", self.out / "table.csv"
        atomic_write(md, self.markdown())
        atomic_write(cs, self.csv())
        return md, cs


DIVERGED = "diverged.json"  # in a cell's run directory: the run diverged (its round and message)


def _suite_name(path: Path) -> str | None:
    """The name in a results directory's suite file, if it is one that names a suite."""
    try:
        tree = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):  # damaged: its own readers say so
        return None
    name = tree.get("name") if isinstance(tree, dict) else None
    return name if isinstance(name, str) else None


def _run_cell(cfg: Config, path: Path, threads: int | None = None) -> tuple[dict[str, Any], float | None]:
    """Run (or resume) one cell; returns its final figures and seconds taken (None: it was not run here).

    A cell that another process finished after this bench made its plan (a second bench on an overlapping set of
    cells) is read, not run again: the run would refuse a finished directory and stop the whole bench."""
    from pflbed.results.experiment import run as run_one

    if (path / "summary.json").exists():
        return read_summary(path / "summary.json")["final"], None
    t0 = time.perf_counter()
    try:
        res = run_one(cfg, path, progress=False, resume=path.exists(), threads=threads)
    except DivergedError as e:  # a result of the cell, not the end of the suite: recorded, and the others run
        (path / DIVERGED).write_text(json.dumps({"round": e.round, "error": str(e)}) + "\n")
        return {"diverged": e.round}, time.perf_counter() - t0
    return res.summary["final"], time.perf_counter() - t0


def _run_cells(tasks: list[tuple[Config, Path]], jobs: int) -> Iterator[tuple[dict[str, Any], float | None]]:
    """Results in task order; with `jobs` > 1 from a pool of fresh worker processes (yielded as the order allows)."""
    if jobs <= 1:
        for cfg, path in tasks:
            yield _run_cell(cfg, path)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from pflbed.engine.procs import exit_with_parent

    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=exit_with_parent)  # fmt: skip
    futures = [pool.submit(_run_cell, _one_core(cfg), path, 1) for cfg, path in tasks]
    try:
        for fut in futures:
            yield fut.result()
    except BaseException:  # a failed cell or Ctrl-C: stop the others now, not after their cells finish
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def _one_core(cfg: Config) -> Config:
    """A `--jobs` worker holds one core: `procs` (or `auto` choosing it) would start workers there, beside the other
    jobs' (measured: 6 processes on 2 cores), so it runs the cell with `loop`, whose figures `procs` gives bit for
    bit; other executors (Flower's) are left as they are."""
    if cfg.executor.name not in ("auto", "procs"):
        return cfg
    return cfg.model_copy(update={"executor": cfg.executor.model_copy(update={"name": "loop"})})


_ABSENT = object()  # `_lookup`'s answer for a path that is not in the tree (a field whose value is null is there)


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted path, or `_ABSENT`; keys may themselves contain dots (`per_lr.0.005.last`): longest
    match first."""
    parts, node, i = dotted.split("."), tree, 0
    while i < len(parts):
        if not isinstance(node, dict):
            return _ABSENT
        for j in range(len(parts), i, -1):
            key = ".".join(parts[i:j])
            if key in node:
                node, i = node[key], j
                break
        else:
            return _ABSENT
    return node


def _get(tree: dict[str, Any], dotted: str) -> float | None:
    """A number at a dotted path (None: absent, null or not a number)."""
    node = _lookup(tree, dotted)
    return float(node) if isinstance(node, int | float) and not isinstance(node, bool) else None


def _unreported(col: str, field: str | None, summaries: list[dict[str, Any]], whose: str) -> str | None:
    """The note for a column whose field none of `summaries` has (None: some has it, it is left out, or there is
    no finished run yet), with the closest field they do have."""
    if field is None or not summaries or any(_lookup(x, field) is not _ABSENT for x in summaries):
        return None
    have = dict.fromkeys(f for x in summaries for f in _fields(x))  # every run's, in order
    return (f"column {col}'s field {field} is in none of {whose} {len(summaries)} finished run(s)' summary.json"
            f"{did_you_mean(field, have)}")  # fmt: skip


def _fields(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of a summary's figures (its numbers, nested sections included)."""
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += _fields(v, f"{prefix}{k}.")
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out.append(f"{prefix}{k}")
    return out


def _mean_std(vals: list[float]) -> tuple[float, float]:
    m = sum(vals) / len(vals)
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))
