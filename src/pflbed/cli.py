"""`pflbed` command line. User errors print one line and exit with code 2; a run that diverges (non-finite loss
or parameters) prints one line and exits with code 3; a Flower deployment that fails (`flower local`) prints the
cause and exits with code 4; Ctrl-C says which round is checkpointed and how to continue, and exits with 130."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from pflbed import plugins
from pflbed.errors import DivergedError, PflbedError
from pflbed.results.console import console as make_console
from pflbed.writable import check_writable

_CLI_START = time.monotonic()  # where a command's time starts where the process's start is unknown


SET_HELP = "override a config key, e.g. --set train.rounds=5 (repeatable)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose error is one line, as every other error of the command line: argparse prints the
    whole usage block above it (five lines for `personalize`), which `--help` shows to whoever asks."""

    def error(self, message: str) -> NoReturn:
        missing = message.removeprefix("the following arguments are required: ")
        choices = next((a.choices for a in self._actions if not a.option_strings and a.choices and
                        missing.startswith(str(a.metavar or a.dest))), None)  # fmt: skip
        if choices and missing != message:  # `pflbed` alone, `pflbed data`: what may follow, named
            message += f" (one of: {', '.join(choices)}; see '{self.prog} --help')"
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _parser() -> argparse.ArgumentParser:
    from pflbed import __version__

    p = _Parser(prog="pflbed", description="Personalized federated learning benchmark.")
    p.add_argument("--version", action="version", version=f"pflbed {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one experiment (default: FedAvg on the embedded digits data)")
    r.add_argument("-c", "--config", help="YAML config file")
    r.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.rounds=50 (repeatable)",
    )
    r.add_argument("--out", type=Path, help="run directory (default runs/<algorithm>-<dataset>-seed<seed>)")
    r.add_argument("--resume", type=Path, metavar="DIR", help="continue the run in DIR from its last checkpoint")
    r.add_argument("--force", action="store_true",
                   help="replace the run already in --out (finished, unfinished or of another config)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    b = sub.add_parser("bench", help="run a suite (settings × methods × seeds) and write mean ± std tables")
    b.add_argument("-c", "--config", required=True, help="suite YAML file, or a suite's results directory (the "
                   "suite it ran is kept there)")  # fmt: skip
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the suite, e.g. --set base.train.rounds=5, --set 'seeds=[0]', --set "
                   "'tables.NAME.methods=[FedAvg]' (repeatable; give the changed suite its own --out: cells run "
                   "with another version of a suite are refused)")  # fmt: skip
    b.add_argument("--out", type=Path, help="results directory (default: the suite's out, else "
                   "benchmarks/results/<name>; another runs the suite anew there)")  # fmt: skip
    b.add_argument("--max-cells", type=_count, help="run at most N unfinished cells, then write the tables")
    b.add_argument("--jobs", type=_jobs, default=1, metavar="N",
                   help="run N cells at a time in worker processes with one torch thread each (e.g. N = cores)")
    b.add_argument("--shard", type=_shard, default=(1, 1), metavar="I/N",
                   help="run only every N-th cell starting at the I-th (start N processes, shards 1/N … N/N)")
    b.add_argument("--table-only", action="store_true", help="only (re)write the tables from finished cells")
    b.add_argument("--list", action="store_true", help="list the cells and which are finished")
    u = sub.add_parser("tune", help="fair hyperparameter search (Optuna): the same training compute per method, "
                       "chosen on validation, then default vs tuned over seeds")  # fmt: skip
    u.add_argument("-c", "--config", required=True, help="tune suite YAML file (docs/guide/tuning.md)")
    u.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the suite, e.g. --set tune.budget=4, --set base.train.rounds=5, "
                   "--set 'methods=[FedAvg]' (repeatable)")  # fmt: skip
    u.add_argument("--out", type=Path, help="tune directory (default: the suite's out, else runs/tune/<name>)")
    u.add_argument("--storage", metavar="URL", help="Optuna storage URL shared by workers (default: SQLite "
                   "study.db in the tune directory)")  # fmt: skip
    u.add_argument("--worker", action="store_true", help="only run trials of the suite's studies in --storage (as "
                   "many workers as machines), then stop; the main `pflbed tune` does the re-runs and the table")
    u.add_argument("--max-trials", type=_count, metavar="N", help="run at most N trials here, then stop (resumable)")
    u.add_argument("--jobs", type=_jobs, default=1, metavar="N", help="final re-runs: N at a time (as bench --jobs)")
    u.add_argument("--table-only", action="store_true", help="only (re)write the table and plots")
    f = sub.add_parser("flower", help="run on Flower: a local deployment, or write a Flower app project")
    fa = f.add_subparsers(dest="action", required=True, metavar="{local,app,sites}")
    fl = fa.add_parser("local", help="run the experiment on a SuperLink and --supernodes SuperNodes started on this "
                       "machine")  # fmt: skip
    fp = fa.add_parser("app", help="write a Flower app project for the experiment into --out")
    for g in (fl, fp):
        g.add_argument("-c", "--config", help="YAML config file")
        g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    fl.add_argument("--supernodes", type=int, metavar="N",
                    help="SuperNodes to start (default 2; with --resume, the run's own)")
    fl.add_argument("--site-data", type=Path, nargs="+", metavar="DIR",
                    help="keep the data on the sites: one SuperNode per DIR, each DIR one client's data (train.npz, "
                    "optionally val.npz and test.npz: x, y), which only that node reads; sets sites.local, "
                    "federation.clients and (unless set) sites.input_shape and sites.num_classes from the files")
    fl.add_argument("--secagg", action="store_true", help="with --site-data: secure aggregation (Flower's SecAgg+), "
                    "the server learns only the round's mean update; sets sites.secagg")  # fmt: skip
    fl.add_argument("--tls", action="store_true", help="TLS with a self-signed certificate authority")
    fl.add_argument("--auth", action="store_true",
                    help="SuperNode authentication (a key pair per node, registered with the SuperLink)")
    fl.add_argument("--out", type=Path, help="run directory (default runs/<algorithm>-<dataset>-seed<seed>)")
    fl.add_argument("--force", action="store_true", help="replace the run already in --out")
    fl.add_argument("--resume", type=Path, metavar="DIR",
                    help="continue the deployment's run in DIR from its last checkpoint (with the same --tls/--auth)")
    fl.add_argument("--no-progress", action="store_true", help="no progress display")
    fs = fa.add_parser("sites", help="write each client of the config's federation as a site directory (its "
                       "train, val and test samples), to try --site-data or to give each machine its data")
    fs.add_argument("-c", "--config", help="YAML config file")
    fs.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    fs.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the site-<client> directories go")
    fs.add_argument("--force", action="store_true", help="replace the site directories an earlier export wrote")
    fp.add_argument("--out", type=Path, required=True, help="the project directory")
    fp.add_argument("--force", action="store_true", help="replace the project (pyproject.toml, site.toml) already "
                    "in --out")  # fmt: skip
    fp.add_argument("--run-dir", type=Path, help="where the ServerApp writes the run (default: runs/<...>)")
    t = sub.add_parser("pretrain", help="train the config's model centrally on a declared source no client uses, "
                       "for model.init_from")  # fmt: skip
    t.add_argument("-c", "--config", help="YAML config file (its pretrain section, dataset, model and federation)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    t.add_argument("--out", type=Path, required=True, metavar="DIR", help="where model.pt, summary.json and "
                   "config.yaml go (then: --set model.init_from=DIR)")  # fmt: skip
    t.add_argument("--force", action="store_true", help="replace an earlier pretraining's output in --out")
    z = sub.add_parser("personalize", help="personalize a trained run's model for a new client from its samples")
    z.add_argument("run", type=Path, metavar="RUN", help="a run directory (finished, or with a checkpoint)")
    z.add_argument("--data", type=Path, required=True, metavar="FILE",
                   help=".npz with x (raw samples, the dataset's native format) and y, or a folder of class "
                   "sub-folders 0/, 1/, … of images")  # fmt: skip
    z.add_argument("--val", type=Path, metavar="FILE", help="validation samples (same formats): keep the best epoch")
    z.add_argument("--test", type=Path, metavar="FILE", help="test samples (same formats): report the accuracy")
    z.add_argument("--method", choices=["native", "ft", "lp"], default="native",
                   help="native: the method's own personalization (default); ft / lp: fine-tune the generic model "
                   "/ its head")  # fmt: skip
    z.add_argument("--epochs", type=int, help="default: the run's eval.new_clients.epochs")
    z.add_argument("--lr", type=float, help="default: the new-client learning rate the run chose on validation")
    z.add_argument("--seed", type=int, default=0, help="seed of the personalization's batch order")
    z.add_argument("--out", type=Path, required=True, metavar="DIR", help="where model.pt and summary.json go")
    z.add_argument("--force", action="store_true", help="replace the model.pt and summary.json already in --out")
    rp = sub.add_parser("report", help="one run, or several compared, as one self-contained HTML (or Markdown) file")
    rp.add_argument("runs", type=Path, nargs="+", metavar="RUN", help="finished run directories")
    rp.add_argument("-o", "--out", type=Path, required=True, metavar="FILE", help="the report file (.html or .md)")
    rp.add_argument("--format", choices=["html", "md"], help="default: from the file's suffix (.md: md, else html)")
    a = sub.add_parser("algorithms", help="the algorithms, their papers and their options (algorithm.<option>)")
    a.add_argument("name", nargs="?", help="one algorithm: its options with types, defaults, ranges and meaning")
    c = sub.add_parser("config", help="print the resolved config (YAML) of -c/--set, or the defaults")
    c.add_argument("-c", "--config", help="YAML config file")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    c.add_argument("--defaults", action="store_true", help="the default config (what `pflbed run` alone runs)")
    d = sub.add_parser("data", help="datasets")
    d.add_argument("action", choices=["list", "show", "export", "new-client"],
                   help="list: datasets found; show: a config's partition; export OUT: write it as a partition "
                   "manifest (run it with --set federation.manifest=OUT); new-client RUN: write one of the run's "
                   "held-out clients (never trained on) as --out DIR/{train,val,test}.npz, for pflbed personalize"
                   )  # fmt: skip
    d.add_argument("target", nargs="?", type=Path, metavar="OUT|RUN",
                   help="export: OUT, the manifest file to write (JSON); new-client: RUN, a run directory")  # fmt: skip
    d.add_argument("--path", help="list: a dataset directory to describe (any file-backed dataset's files, or a "
                   "folder dataset root)")
    d.add_argument("-c", "--config", help="show, export: YAML config whose dataset and federation to use")
    d.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    d.add_argument("--png", type=Path, help="show: also draw the partition heat-map into this PNG file")
    d.add_argument("--force", action="store_true", help="export: replace an existing OUT; new-client: existing "
                   "files in --out")  # fmt: skip
    d.add_argument("--out", dest="out_dir", type=Path, metavar="DIR", help="new-client: where train.npz, val.npz "
                   "and test.npz go")  # fmt: skip
    d.add_argument("--client", type=int, metavar="ID", help="new-client: which held-out client (default: the first)")
    u.description = ("Fair hyperparameter search on Optuna: one study per method over its declared search space, "
                     "the same training compute each (tune.budget, in base runs), every trial on data without the "
                     "reported seeds' test samples and scored on a validation figure (never a test one); then each "
                     "method's "
                     "default and tuned configurations re-run over the suite's seeds, into one table. "
                     "The same command continues an interrupted suite. Guide: docs/guide/tuning.md.")  # fmt: skip
    _describe(sub)
    return p


def _describe(sub: argparse._SubParsersAction) -> None:
    """A subcommand's `--help` opens with what it does: its one-line help, where it has no description of its own
    (nested subcommands too)."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, parser in sub.choices.items():
        if parser.description is None:
            parser.description = helps.get(name)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _describe(action)


def _count(text: str) -> int:
    """A count of cells or trials: 0 or more (a negative one sliced the cells from the end: all but the last ran)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return n


def _jobs(text: str) -> int:
    """Worker processes at a time: 1 to 4 × cores, as `executor.workers` (each holds a torch; a huge N started
    one per cell until the machine's memory was gone)."""
    from pflbed.config.base import max_threads

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= n <= max_threads():  # a negative one too: "0 or more" (a count's bound) was said of -1, not of 0
        raise argparse.ArgumentTypeError(f"must be 1 to {max_threads()} (4 × this machine's cores), got {text!r}")
    return n


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 1/2, got {text!r}") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"need 1 <= I <= N, got {text!r}")
    return i, n


class DivergedCells(PflbedError):
    """Some cells of a bench diverged: the others ran and the tables are written; exit code 3, as a diverged run."""

    exit_code = 3


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a command that can be continued: `describe()` says what is kept and the command to continue."""

    def __init__(self, describe: Callable[[], str]) -> None:
        super().__init__()
        self.describe = describe


@contextlib.contextmanager
def _continuable(out: Path, again: str, rounds: int) -> Iterator[None]:
    """Ctrl-C inside becomes `Interrupted`, describing the run in `out`: its checkpointed round and `again`."""
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(lambda: _interrupted_run(out, again, rounds)) from None


def _interrupted_run(out: Path, again: str, rounds: int) -> str:
    from pflbed.results.checkpoint import checkpoint_path, checkpoint_round

    if (out / "summary.json").is_file():
        return f"interrupted after the run finished; results in {out}"
    if not (out / "config.yaml").is_file():
        return f"interrupted before the run started; nothing was written to {out}"
    rnd = checkpoint_round(out)
    if rnd is None:
        return (f"interrupted before the first checkpoint (the first evaluation or train.checkpoint_every); "
                f"'{again}' starts the run over")
    return f"interrupted; round {rnd} of {rounds} is checkpointed in {checkpoint_path(out)}; continue with '{again}'"


def _resume_flags(args: argparse.Namespace) -> None:
    if args.out and args.out != args.resume:
        raise PflbedError("--out and --resume name different directories; --resume continues in place")
    if args.force:
        raise PflbedError("--force and --resume contradict each other: --force starts over, --resume continues")


def _finished(rundir) -> bool:
    """Print a finished run's results and say so (--resume on a finished run changes nothing)."""
    from pflbed.results.rundir import read_summary
    from pflbed.results.summary import print_table

    if rundir.finished:
        path = rundir.path / "summary.json"
        summary = read_summary(path)
        try:
            print_table(summary)
        except (KeyError, TypeError, AttributeError, ValueError) as e:  # hand-edited: an entry of another type
            raise PflbedError(f"{path}: its results cannot be printed ({type(e).__name__}: {e}); the file is damaged "
                              "(rerun the run, or restore the file)") from None  # fmt: skip
        make_console().print(f"{rundir.path} is already finished: nothing to resume, nothing changed")
    return rundir.finished


def _cmd_run(args: argparse.Namespace) -> None:
    from pflbed.config import load_config
    from pflbed.results.rundir import RunDir, default_out
    from pflbed.results.summary import print_table

    if args.resume:
        _resume_flags(args)
        # -c: the whole config again (checked against the run's); --set alone: changes to the run's own config
        given = load_config(args.config or args.resume / "config.yaml", args.overrides) \
            if (args.config or args.overrides) else None  # fmt: skip
        rundir, cfg = RunDir.for_resume(args.resume, given)
        if _finished(rundir):
            return
        out, resume, force = args.resume, True, False
    else:
        cfg = load_config(args.config, args.overrides)
        out, resume, force = args.out or default_out(cfg), False, args.force
    # after the config's checks: it imports torch (a second), a mistake is said at once
    from pflbed.results.experiment import run

    with _continuable(out, shlex.join(["pflbed", "run", "--resume", str(out)]), cfg.train.rounds):
        result = run(cfg, out, progress=not args.no_progress, resume=resume, force=force)
    print_table(result.summary, command_s=args.clock())
    make_console().print(f"results: {result.out}")


def _cmd_bench(args: argparse.Namespace) -> None:
    from pflbed.results.bench import Bench, load_suite

    bench = Bench(load_suite(args.config, args.overrides), out=args.out)
    console = make_console()
    if args.list or args.table_only:  # as `Bench.run` does: these tabled another version's cells with the rest
        bench.refuse_stale()
    if args.list:
        pending = {(t.name, c) for t, c in bench.pending()}
        for t, cell in bench.pending():  # a cell the run would refuse is refused here too, not listed as to do
            t.cell_config(*cell)
        for t, cell in bench.cells():
            console.print(f"{'todo' if (t.name, cell) in pending else 'done'}  {t.run_dir(*cell)}")
        return
    if args.table_only and not bench.out.is_dir():  # tables of nothing, and a results directory made for them
        raise PflbedError(f"--table-only: {bench.out} holds no results of this suite; run it first (without "
                          "--table-only)")  # fmt: skip
    finished_before = not bench.pending()
    if not args.table_only:
        given = [*(x for o in args.overrides for x in ("--set", o)), *(["--out", str(args.out)] if args.out else []),
                 *(["--jobs", str(args.jobs)] if args.jobs > 1 else []),
                 *(["--shard", "/".join(map(str, args.shard))] if args.shard != (1, 1) else []),
                 *(["--max-cells", str(args.max_cells)] if args.max_cells is not None else [])]
        again = shlex.join(["pflbed", "bench", "-c", args.config, *given])  # a path with a space stays one word
        try:
            bench.run(args.max_cells, log=console.print, shard=args.shard, jobs=args.jobs)
        except KeyboardInterrupt:
            raise Interrupted(lambda: f"interrupted; finished cells are kept and an interrupted cell continues from "
                              f"its checkpoint: continue with '{again}'") from None  # fmt: skip
    md, cs = bench.write_tables()
    console.print(md.read_text())
    left = len(bench.pending())
    console.print(f"tables: {md}, {cs}" + (f" — {left} cells still to run (re-run to continue)" if left else ""))
    if finished_before and not args.table_only:  # a clone's committed results: the tables came at once, unexplained
        console.print(f"note: nothing ran: every cell in {bench.out} had finished before (the tables are theirs); "
                      "--out ANOTHER_DIRECTORY runs the suite anew there")  # fmt: skip
    for line in bench.unreported():  # after the tables, where the reader looks; --table-only rewrites them mended
        console.print(f"note: {line} (its cells show —)")
    diverged = bench.diverged()
    if diverged:  # results of their cells (the tables say so), and still a failure of the command
        raise DivergedCells(f"{len(diverged)} cell(s) diverged, e.g. {diverged[0]} (its diverged.json says where; "
                            "delete a cell's directory to run it anew)")  # fmt: skip


def _cmd_tune(args: argparse.Namespace) -> None:
    from pflbed.results.tune import Tuner, load_tune_suite, optuna_module

    suite = load_tune_suite(args.config, args.overrides)
    optuna_module()  # a missing Optuna: one line, before anything runs
    tuner = Tuner(suite, out=args.out, storage=args.storage)
    console = make_console()
    if args.worker and args.table_only:
        raise PflbedError("--worker runs trials only; --table-only writes the table: give one")
    if args.table_only and args.storage is None and not (tuner.out / "study.db").is_file():  # else a study made
        raise PflbedError(f"--table-only: {tuner.out} holds no study of this suite; run it first (without "
                          "--table-only)")  # fmt: skip
    given = [*(x for o in args.overrides for x in ("--set", o)), *(["--out", str(args.out)] if args.out else []),
             *(["--storage", args.storage] if args.storage else []), *(["--worker"] if args.worker else []),
             *(["--max-trials", str(args.max_trials)] if args.max_trials is not None else []),
             *(["--jobs", str(args.jobs)] if args.jobs > 1 else [])]  # as bench's: the options given, not defaults
    again = shlex.join(["pflbed", "tune", "-c", args.config, *given])
    try:
        if not args.table_only:
            tuner.run_trials(args.max_trials, worker=args.worker, log=console.print)
        if args.worker:
            return
        unfinished = [m.name for m in tuner.methods if not tuner.finished(m)]
        if not args.table_only and not unfinished:
            bench, _ = tuner.bench()
            bench.run(log=console.print, jobs=args.jobs)
    except KeyboardInterrupt:
        raise Interrupted(lambda: f"interrupted; finished trials and re-runs are kept: continue with: {again}"
                          ) from None  # fmt: skip
    md, js = tuner.write_tables()
    console.print(md.read_text())
    note = f" — studies still short of their budget: {', '.join(unfinished)} (re-run to continue)" if unfinished else ""
    console.print(f"tables: {md}, {js}; study: {tuner.storage_path}{note}")


def _cmd_flower(args: argparse.Namespace) -> None:
    from pflbed.config import load_config
    from pflbed.results.rundir import default_out
    from pflbed.results.summary import print_table

    if args.action == "app":
        from pflbed.flower.project import write_app
        from pflbed.results.rundir import files_dir

        cfg = load_config(args.config, [*args.overrides, "executor.name=flower"])
        files_dir(args.out, f"--out {args.out}", "the project")
        app = write_app(args.out, cfg, args.run_dir or default_out(cfg), force=args.force)
        make_console().print(f"Flower app project: {app}/pyproject.toml (docs/guide/flower.md)")
        return
    if args.action == "sites":
        from pflbed.flower.sites import export_sites
        from pflbed.results.rundir import files_dir

        cfg = load_config(args.config, args.overrides)
        out = files_dir(args.out, f"--out {args.out}", "the site-<client> directories")
        dirs = export_sites(cfg, out, force=args.force)
        make_console().print(f"{len(dirs)} site directories in {args.out}; try them with: pflbed flower local "
                             f"--site-data {args.out}/site-*")  # fmt: skip
        return
    from pflbed.results.rundir import RunDir

    sites = args.site_data
    if args.secagg and sites is None:
        raise PflbedError("--secagg needs --site-data: secure aggregation protects the sites' updates, and without "
                          "--site-data the server holds all the data")  # fmt: skip
    twice = next((d for i, d in enumerate(sites or []) if d.resolve() in {e.resolve() for e in sites[:i]}), None)
    if twice is not None:  # two SuperNodes serving one site's data trained it twice, as two sites
        raise PflbedError(f"--site-data {twice}: given twice; each site once")
    gone = next((d for d in sites or [] if not d.exists()), None)  # a shell glob that matched nothing: `sites/site-*`
    if gone is not None:  # said before a deployment starts, whose node would say it in its log
        raise PflbedError(f"--site-data {gone}: no such file or directory")
    if sites is not None and args.supernodes is not None and args.supernodes != len(sites):
        raise PflbedError(f"--supernodes {args.supernodes} but {len(sites)} --site-data directories (one node each)")

    def fixed(supernodes: int | None) -> list[str]:
        if sites is not None:
            return ["executor.name=flower", f"executor.supernodes={len(sites)}", "sites.local=true",
                    f"federation.clients={len(sites)}", *(["sites.secagg=true"] if args.secagg else [])]  # fmt: skip
        return ["executor.name=flower", f"executor.supernodes={2 if supernodes is None else supernodes}"]

    def described() -> list[str]:
        """What the site files say of the run's inputs, where the config file and --set leave it unsaid: the
        config's own figures win (its 10 classes are no 5 because these sites hold labels 0…4 only), and image
        folders, which say no input shape, run when the config gives both."""
        from pflbed.config.load import config_tree
        from pflbed.flower.sites import describe_sites

        said = config_tree(args.config, args.overrides).get("sites")
        unsaid = [k for k in ("input_shape", "num_classes") if not isinstance(said, dict) or said.get(k) is None]
        if not unsaid:
            return []
        shape, classes = describe_sites(sites)
        found = {"input_shape": list(shape), "num_classes": classes}
        return [f"sites.{k}={found[k]}" for k in unsaid]

    if args.resume:
        _resume_flags(args)
        _, cfg = RunDir.for_resume(args.resume, None)
        if cfg.executor.name != "flower" or cfg.executor.supernodes is None:
            raise PflbedError(f"--resume {args.resume}: not a run of 'pflbed flower local'; continue it with "
                              f"'pflbed run --resume {args.resume}'")  # fmt: skip
        # --site-data and --secagg too: a run's sites, or their secure aggregation, cannot be added when resuming
        given = args.config or args.overrides or args.supernodes is not None or sites is not None
        supernodes = cfg.executor.supernodes if args.supernodes is None else args.supernodes
        if cfg.sites.local and sites is None:
            raise PflbedError(f"--resume {args.resume}: the run keeps its data on the sites; give their directories "
                              "again with --site-data")  # fmt: skip
        if not cfg.sites.local and sites is not None:
            raise PflbedError(f"--resume {args.resume}: the run's data is the server's (not sites.local); resume it "
                              "without --site-data")  # fmt: skip
        if cfg.sites.local and len(sites) != supernodes:
            raise PflbedError(f"--resume {args.resume}: the run has {supernodes} sites; give as many --site-data "
                              f"directories (got {len(sites)})")  # fmt: skip
        # -c: the whole config again (checked against the run's); --set, --supernodes alone: changes to the run's
        # own config, as `pflbed run --resume` (they were applied to the defaults: any of them refused the resume)
        given_cfg = load_config(args.config or args.resume / "config.yaml", [*args.overrides, *fixed(supernodes)]) \
            if given else None  # fmt: skip
        rundir, cfg = RunDir.for_resume(args.resume, given_cfg)
        if _finished(rundir):
            return
        out = args.resume
    else:
        inferred = described() if sites is not None else []
        cfg = load_config(args.config, [*inferred, *args.overrides, *fixed(args.supernodes)])
        out = args.out or default_out(cfg)
    from pflbed.flower.local import check_site_data, resume_command, run_local  # after the config's checks

    console = make_console()
    supernodes = cfg.executor.supernodes
    assert supernodes is not None  # set by `fixed`, or checked on resume
    for k, d in enumerate(sites or []):  # as each node will check it, before the deployment starts
        check_site_data(cfg, d, k, supernodes)
    with _continuable(out, resume_command(out, args.tls, args.auth, sites), cfg.train.rounds):
        summary = run_local(cfg, out, supernodes, tls=args.tls, auth=args.auth, force=args.force,
                            resume=bool(args.resume), site_data=sites, log=console.print,
                            progress=not args.no_progress)  # fmt: skip
    print_table(summary, command_s=args.clock())
    console.print(f"results: {out}")


def _read_samples(run, path: Path, scored: bool = False) -> tuple:
    """A `personalize` file's (x, y, scale), its samples and labels checked here and named by the file: checked
    later, a bad --test file (`scored`, so it needs a sample) was found once the personalization was done, and a
    bad --data file was called "x"."""
    from pflbed.data.samples import read_samples

    x, y, scale = read_samples(path, run.source)
    run.inputs(x, scale, str(path))
    run.labels(y, f"{path}: y", len(x))
    if scored and not len(y):
        raise PflbedError(f"{path}: no samples to score")
    return x, y, scale


def _cmd_personalize(args: argparse.Namespace) -> None:
    from pflbed.results.trained import check_out, load_run

    check_out(args.out, args.force)  # before the personalization, which a refused --out would waste
    run = load_run(args.run)
    x, y, scale = _read_samples(run, args.data)
    val = None
    if args.val is not None:
        xv, yv, vscale = _read_samples(run, args.val)
        if vscale != scale:
            raise PflbedError("--data and --val must be of one format (both .npz or both image folders)")
        val = (xv, yv)
    if args.test is not None:  # read before the personalization, which a bad file would waste
        xt, yt, tscale = _read_samples(run, args.test, scored=True)
    model = run.personalize(x, y, method=args.method, epochs=args.epochs, lr=args.lr, val=val, scale=scale,
                            seed=args.seed)  # fmt: skip
    scored = ""  # the kept model's accuracy and, beside it, that of the unadapted model it started from
    if args.test is not None:
        model.info["test_acc"] = model.accuracy(xt, yt, tscale)
        model.info["zero_shot_test_acc"] = model.zero_shot_accuracy(xt, yt, tscale)
        model.info["test_samples"] = len(yt)
        scored = _with_zero_shot("test", model.info["test_acc"], model.info["zero_shot_test_acc"])
    elif val is not None:
        kept = model.epochs[model.selected_epoch - 1]["val_acc"]
        scored = _with_zero_shot("validation", kept, model.zero_shot_accuracy(*val, scale))
    out = model.save(args.out, args.force)
    console = make_console()
    what = f"{run.config.algorithm.name} ({args.method}), {len(y)} samples, lr {model.lr:g}"
    console.print(f"personalized {what}: epoch {model.selected_epoch} of {len(model.epochs)} kept{scored}; "
                  f"{model.seconds:.1f} s")  # fmt: skip
    console.print(f"model: {out / 'model.pt'}, summary: {out / 'summary.json'}")


def _with_zero_shot(split: str, acc: float, zero_shot: float | None) -> str:
    start = "the method has no zero-shot model" if zero_shot is None else f"zero-shot {100 * zero_shot:.2f} %"
    return f", {split} accuracy {100 * acc:.2f} % ({start})"


def _cmd_pretrain(args: argparse.Namespace) -> None:
    from pflbed.config import load_config

    cfg = load_config(args.config, args.overrides)
    from pflbed.engine.pretrain import pretrain  # after the config's checks, as `pflbed run`

    console = make_console()
    s = pretrain(cfg, args.out, force=args.force, log=console.print)
    src = s["source"]
    held = "" if s["val_acc"] is None else f", held-out accuracy {100 * s['val_acc']:.2f} %"
    console.print(f"pretrained {s['model']} on {src['train']} samples of {src['dataset']}'s {src['split']} split "
                  f"(domains {', '.join(src['domains'] or []) or 'all'}), disjoint from the federation's data: epoch "
                  f"{s['selected_epoch']} kept{held}; {s['seconds']:.1f} s")  # fmt: skip
    console.print(f"model: {args.out / 'model.pt'} (use: --set model.init_from={args.out})")


def _cmd_report(args: argparse.Namespace) -> None:
    import time

    from pflbed.results.report import write_report

    t0 = time.perf_counter()
    fmt = args.format or ("md" if args.out.suffix.lower() == ".md" else "html")
    out = write_report(args.runs, args.out, fmt)
    size = out.stat().st_size
    make_console().print(f"report: {out} ({size / 1024:.0f} KiB, {time.perf_counter() - t0:.1f} s)")


def _cmd_algorithms(args: argparse.Namespace) -> None:
    from rich.table import Table

    from pflbed.algorithms import get_algorithm
    from pflbed.models.zoo import models
    from pflbed.results.catalog import catalog, options, paper, shared_search

    console = make_console()
    if args.name:
        try:
            cls = get_algorithm(args.name)
        except PflbedError as e:
            raise PflbedError(str(e).replace("algorithm.name", "algorithms NAME")) from None
        console.print(f"{args.name}: {paper(cls)}")
        t = Table(title=f"{args.name} options (--set algorithm.<option>=VALUE)")
        for col in ("option", "type", "default", "range", "meaning", "search (pflbed tune)"):
            t.add_column(col)
        for o in options(cls):
            t.add_row(o["name"], o["type"], repr(o["default"]), o["range"], o["description"], o["search"])
        console.print(t if t.row_count else f"{args.name} has no options of its own")
        console.print(f"search space (pflbed tune): {shared_search(cls)}, and the options with a search column")
        console.print("client-level DP (privacy.*) and SecAgg+ (sites.secagg): " + (
            "apply" if cls.dp_refused is None else f"refused, because {cls.dp_refused}"))  # fmt: skip
        return
    t = Table(title="algorithms (--set algorithm.name=NAME; `pflbed algorithms NAME` for its options)")
    for col in ("name", "paper", "options (default)"):
        t.add_column(col)
    for a in catalog():
        cited = a["paper"] if len(a["paper"]) <= 110 else a["paper"][:109] + "…"  # in full: algorithms NAME
        t.add_row(a["name"], cited, ", ".join(f"{o['name']}={o['default']!r}" for o in a["options"]))
    console.print(t)
    models()  # the model plugins loaded too (on first use), so that those left out are listed with the algorithms'
    for group in (plugins.ALGORITHMS, plugins.MODELS):  # a plugin that is not listed says why
        for why in plugins.left_out(group).values():
            console.print(f"left out ({group}): {why}")


def _cmd_config(args: argparse.Namespace) -> None:
    from pflbed.config import load_config
    from pflbed.results.rundir import config_text

    if args.defaults and (args.config or args.overrides):
        raise PflbedError("--defaults prints the defaults: leave out -c and --set")
    sys.stdout.write(config_text(load_config(args.config, args.overrides)))


def _cmd_data(args: argparse.Namespace) -> None:
    needs = {"export": "OUT, the manifest file to write", "new-client": "RUN, the run directory"}.get(args.action)
    if (args.target is not None) != (needs is not None):
        raise PflbedError(f"data {args.action} needs {needs}" if needs else f"data {args.action} takes no "
                          "OUT or RUN (only data export and data new-client do)")  # fmt: skip
    if (args.out_dir is not None or args.client is not None) != (args.action == "new-client"):
        raise PflbedError("data new-client needs --out DIR" if args.action == "new-client" else
                          f"data {args.action} takes no --out or --client (only data new-client does)")  # fmt: skip
    for option, given, action in (("--path", args.path is not None, "list"), ("--png", args.png is not None, "show")):
        if given and args.action != action:  # was silently ignored: the reader saw another listing than asked for
            raise PflbedError(f"data {args.action} takes no {option} (only data {action} does)")
    if args.path is not None and not Path(args.path).is_dir():
        raise PflbedError(f"--path {args.path}: no such directory (a dataset's files, or a folder dataset's root)")
    if args.action == "export":
        _data_export(args)
        return
    if args.action == "new-client":
        _data_new_client(args)
        return
    if args.action == "show":
        from pflbed.config import load_config

        cfg = load_config(args.config, args.overrides)  # before the modules that import torch: a mistake at once
        if args.png is not None and (args.png.suffix.lower() != ".png" or args.png.is_dir()):  # matplotlib took
            # the suffix for the format (.json: a traceback) and added .png to a name without one, which it printed bare
            raise PflbedError(f"--png {args.png}: give the heat-map's file name, ending in .png")
        if args.png is not None:  # was the bare "No such file or directory" after the table, under a file
            check_writable(args.png.parent, f"--png {args.png}")
        from pflbed.data import load_source
        from pflbed.federation import build_federation
        from pflbed.results.partition_plot import plot_partition, print_partition

        source = load_source(cfg.dataset)
        fed = build_federation(source, cfg.federation, cfg.seed)
        print_partition(source, fed)
        if args.png is not None:
            make_console().print(f"heat-map: {plot_partition(source, fed, args.png)}")
        return
    from pflbed.data import describe_datasets

    sys.stdout.write(_data_listing(describe_datasets(args.path)))


LISTING_WIDTH = 120


def _data_listing(rows: list[dict]) -> str:
    """`data list` as plain text, one paragraph per dataset wrapped to at most 120 columns (a terminal's width if
    narrower): a table of its long "how to get it" lines would be hundreds of columns wide in a pipe or a file."""
    import shutil
    import textwrap

    width = min(LISTING_WIDTH, shutil.get_terminal_size((LISTING_WIDTH, 24)).columns) if sys.stdout.isatty() \
        else LISTING_WIDTH  # fmt: skip
    pad = max(len(r["name"]) for r in rows) + 2
    out = []
    for r in rows:
        sizes = f"{r['train']} train, {r['test']} test" if r["train"] is not None else ""
        facts = "; ".join(v for v in (sizes, r["domains"] and f"domains {r['domains']}") if v)
        for i, text in enumerate(v for v in (r["error"] or r["location"], facts) if v):
            out.append(textwrap.fill(text, width, initial_indent=(r["name"] if i == 0 else "").ljust(pad),
                                     subsequent_indent=" " * pad, break_long_words=False,
                                     break_on_hyphens=False))  # fmt: skip
    return "\n".join(out) + "\n"


def _data_export(args: argparse.Namespace) -> None:
    from pflbed.config import load_config

    cfg = load_config(args.config, args.overrides)  # before the modules that import torch: a mistake at once
    if args.target.is_dir():
        raise PflbedError(f"{args.target}: is a directory; give the manifest file to write")
    if args.target.exists() and not args.force:
        raise PflbedError(f"{args.target} exists; --force replaces it")
    check_writable(args.target.parent, str(args.target))  # was "File exists" under a file, once the data was read
    from pflbed.data import load_source
    from pflbed.federation import build_federation
    from pflbed.federation.manifest import manifest, write_manifest

    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    out = write_manifest(args.target, manifest(cfg, source, fed))
    make_console().print(f"manifest: {out} ({len(fed.participated)} participated and {len(fed.new)} new clients of "
                         f"{cfg.dataset.name}, fingerprint {source.fingerprint()}); run it with --set "
                         f"federation.manifest={out}")  # fmt: skip


def _data_new_client(args: argparse.Namespace) -> None:

    from pflbed.data import load_source
    from pflbed.federation import build_federation
    from pflbed.federation.new_client import SPLITS, held_out, write_client
    from pflbed.results.rundir import files_dir, read_config_tree, require_run, run_config

    run, out = args.target, args.out_dir
    if args.config or args.overrides:
        raise PflbedError("data new-client takes the run's own config (RUN/config.yaml): leave out -c and --set")
    require_run(run)
    cfg = run_config(read_config_tree(run / "config.yaml"), path=run / "config.yaml")
    if cfg.sites.local:
        raise PflbedError(f"{run}: its clients' data stayed on their sites (sites.local); a new site brings its own")
    files_dir(out, f"--out {out}", "train.npz, val.npz and test.npz")
    there = next((out / f"{s}.npz" for s in SPLITS if (out / f"{s}.npz").exists()), None)
    if there is not None and not args.force:
        raise PflbedError(f"{there} exists; --force replaces it")
    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    cid = held_out(fed, args.client, str(run))
    n = write_client(source, fed, cid, cfg.eval.pfl_test, out)
    make_console().print(f"new client {cid} of {run} (held out of training, as {len(fed.new)} clients were): "
                         f"{n['train']} training, {n['val']} validation and {n['test']} test samples of "
                         f"{cfg.dataset.name} in {out}/{{train,val,test}}.npz; try: pflbed personalize {run} --data "
                         f"{out}/train.npz --val {out}/val.npz --test {out}/test.npz --out DIR")  # fmt: skip


def since_process_start() -> float | None:
    """Seconds since this process started, or None where unknown: Linux's start time of the process in
    /proc/self/stat (clock ticks after boot) against the boot clock, so the interpreter's start and every import
    count, which no clock read inside pflbed can see."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()  # from the 3rd field, the state
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # the 22nd field, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return None


def command_clock(whole_process: bool) -> Callable[[], float]:
    """The command's wall time so far: from the process's start where the process is the command (`pflbed ...`,
    `python -m pflbed ...`; else from the CLI's first line), from the call where Python calls `main` itself."""
    start = _CLI_START if whole_process else time.monotonic()

    def seconds() -> float:
        since = time.monotonic() - start
        return max(since, (since_process_start() or 0.0) if whole_process else 0.0)

    return seconds


_TERMINATED: list[bool] = []  # set once this process has been sent SIGTERM


def _terminate_as_ctrl_c() -> None:
    """SIGTERM (`kill`, `timeout`, a scheduler's time limit) stops the command as Ctrl-C does, so its `finally`
    blocks run: without this, Python dies at once and a `flower local` deployment's SuperLink and SuperNodes, each in
    a session of its own, run on forever. A later SIGTERM is ignored while that clean-up runs (SIGKILL still ends
    it); a forked child that inherited this handler dies as SIGTERM would have killed it."""
    command = os.getpid()

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != command:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _TERMINATED.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    clock = command_clock(whole_process=argv is None)  # no argv: this process is the command
    if argv is None:
        _terminate_as_ctrl_c()
    args = _parser().parse_args(argv)
    args.clock = clock
    try:
        commands = {"run": _cmd_run, "bench": _cmd_bench, "data": _cmd_data, "flower": _cmd_flower,
                    "personalize": _cmd_personalize, "pretrain": _cmd_pretrain, "algorithms": _cmd_algorithms,
                    "config": _cmd_config, "report": _cmd_report, "tune": _cmd_tune}  # fmt: skip
        commands[args.command](args)
    except DivergedError as e:
        print(f"pflbed: error: {e}", file=sys.stderr)
        return e.exit_code
    except PflbedError as e:
        print(f"pflbed: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except OSError as e:  # a file the run needs vanished or the disk filled up mid-run: name it, no traceback
        print(f"pflbed: error: {e.filename or 'I/O'}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"pflbed: {e.describe() if isinstance(e, Interrupted) else 'interrupted'}", file=sys.stderr)
        return 128 + signal.SIGTERM if _TERMINATED else 130  # as a shell reports the signal that stopped it
    return 0


if __name__ == "__main__":
    sys.exit(main())
