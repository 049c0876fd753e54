"""Run directories: `config.yaml` (resolved), `metrics.jsonl` (one line per evaluation) and `metrics.csv` (the same
records as a table), `summary.json`,
`checkpoints/last.pt` (the last checkpointed round; the final state once the run is finished), `plots/`.

The directory is created only after the config, data and federation have been validated, so bad input never
leaves a half-written run behind. An existing run is never replaced silently: a finished one (it has
`summary.json`), an unfinished one (continue it with `--resume`) and one of another config are all refused
unless the caller passes `force`, which removes the old run's files (and only those) first.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from itertools import takewhile
from pathlib import Path
from typing import Any

import yaml

from pflbed.config import Config
from pflbed.errors import ConfigError, PflbedError
from pflbed.writable import check_writable

try:
    import fcntl
except ImportError:  # no advisory locks (Windows): a run there is not guarded against a second process
    fcntl = None  # type: ignore[assignment]

SUMMARY_KEYS = {"algorithm": str, "dataset": str, "rounds": int, "final": dict, "timing": dict}  # what readers need


def _damaged(path: Path, what: str) -> PflbedError:
    return PflbedError(f"{path}: {what}; the file is damaged (rerun the run, or restore the file)")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in the run file `path`; one line naming the file if it is not one (a truncated copy, an
    edit gone wrong) rather than a traceback from the reader."""
    try:
        value = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise _damaged(path, "not text") from None
    except json.JSONDecodeError as e:
        raise _damaged(path, f"not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(value, dict):
        raise _damaged(path, f"a JSON {type(value).__name__}, not an object")
    return value


RUN_FILES = ("metrics.jsonl", "metrics.csv", "summary.json", "config.yaml")  # a run's own files, beside its folders


def require_run(path: Path, name: str = "") -> Path:
    """`path`, where it holds a run: its config.yaml, and no model.pt. A pretraining's directory holds a config.yaml
    that reads as a run's, so its model.pt (`models.pretrained.MODEL_FILE`; a personalization's too), which no run
    writes, says what it is: replaced as a run (`--force`) it lost its config.yaml and summary.json and kept its
    weights, resumed it was a traceback, loaded or reported a run "without a checkpoint" or "damaged". `name`: the
    option that gave the path (`--resume`), for the message."""
    shown = f"{name} {path}" if name else str(path)
    if not (path / "config.yaml").is_file():
        raise PflbedError(f"{shown}: not a pflbed run directory (no config.yaml){_what_it_is(path)}")
    _refuse_a_model(path, shown)
    return path


SUITE_FILE = "suite.yaml"  # in a bench suite's results directory: the suite its cells ran, whose results are there


def _what_it_is(path: Path) -> str:
    """Where the runs are, for a directory of many: a suite's results directory or a tune directory was given to a
    command that takes one run (`report`, `personalize`), and "no config.yaml" alone left the user guessing."""
    if (path / SUITE_FILE).is_file():
        return f": it is a bench suite's results directory, whose runs are {path / 'runs'}/<table>/<setting>/" \
               "<method>/seed<N>"
    if (path / "study.db").is_file() or (path / "trials").is_dir():
        return f": it is a tune directory, whose trials are {path / 'trials'}/<method>/trialNNNN and re-runs " \
               f"{path / 'final' / 'runs'}/…"
    return ""


def suite_dir(path: Path, name: str = "out") -> Path:
    """`path`, as the directory of a suite (`bench`'s runs and tables, `tune`'s studies, trials and tables): not a
    file (it was a message about a cell's run directory, or about the study's database), and not a run's or a
    model's directory (its results, or a pretrained or personalized model.pt: a config file alone is no run), among
    whose files the suite's were written."""
    if path.exists() and not path.is_dir():
        raise PflbedError(f"{name} {path}: is a file; give the suite a directory")
    check_writable(path, f"{name} {path}")
    if RunDir(path).has_results or (path / "model.pt").exists():
        raise PflbedError(f"{name} {path}: is a run's or a model's directory; give the suite a directory of its own")
    return path


def files_dir(path: Path, shown: str, writes: str) -> Path:
    """`path`, as a directory for files a command writes beside nothing of another command's (`writes` names
    them): not a file, in a place this process may write, and not a run's, a pretrained model's, a bench suite's or
    a tune directory. `data new-client --out RUN` wrote a held-out client's samples among the run's own files, and
    `flower sites --out` its site directories; either was then taken for part of the run (or the suite) it lay in."""
    if path.exists() and not path.is_dir():
        raise PflbedError(f"{shown}: is a file; give the directory to write {writes} into")
    check_writable(path, shown)
    if (path / "config.yaml").is_file() or RunDir(path).has_results:
        what = "a run's or a pretrained model's directory"
    elif _what_it_is(path):
        what = "a bench suite's or a tune directory"
    else:
        return path
    raise PflbedError(f"{shown}: is {what}; write {writes} elsewhere")


def _refuse_a_model(path: Path, shown: str, then: str = "") -> None:
    if (path / "model.pt").exists():
        raise PflbedError(f"{shown}: holds a pretrained or personalized model (model.pt), not a run{then}")


def read_summary(path: Path) -> dict[str, Any]:
    """A run's `summary.json`, with the entries every reader of it takes (the results, the timing) of their types."""
    summary = read_json(path)
    for key, kind in SUMMARY_KEYS.items():
        if not isinstance(summary.get(key), kind):
            raise _damaged(path, f"no {key} ({kind.__name__}) in it, as every pflbed summary has")
    return summary


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """A run's `metrics.jsonl`: its evaluation records, each with the round it was logged in."""
    records = read_jsonl(path)
    for i, record in enumerate(records, 1):
        if not isinstance(record.get("round"), int):
            raise _damaged(path, f"record {i} has no round (int), as every pflbed evaluation record has")
    return records


def read_history(path: Path) -> list[dict[str, Any]]:
    """A run's evaluation records (`read_metrics`); none where it has no metrics.jsonl yet. One that is a directory
    is damaged, not absent: `report` and `load_run` left the curves and the history out without a word."""
    if path.exists() and not path.is_file():
        raise _damaged(path, "a directory, not a file")
    return read_metrics(path) if path.exists() else []


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of the run file `path`, one per line (`metrics.jsonl`); one line naming the bad line."""
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise _damaged(path, "not text") from None
    records = []
    for i, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise _damaged(path, f"line {i} is not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise _damaged(path, f"line {i} is a JSON {type(record).__name__}, not an object")
        records.append(record)
    return records


def read_config_tree(path: Path) -> dict[str, Any]:
    """The mapping in a run's `config.yaml`; one line naming the file if it is no YAML mapping."""
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except UnicodeDecodeError:
        raise _damaged(path, "not text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise _damaged(path, f"not valid YAML{f' (line {mark.line + 1})' if mark else ''}") from None
    if not isinstance(tree, dict):
        raise _damaged(path, f"a YAML {type(tree).__name__}, not a mapping of config sections")
    return tree


def default_out(cfg: Config) -> Path:
    return Path("runs") / f"{cfg.algorithm.name}-{cfg.dataset.name}-seed{cfg.seed}"


def config_text(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# Where a run computes, not what: a run checkpointed on a GPU may continue on a CPU and the reverse, with other
# thread or worker counts. Each changes floats by rounding at most (`procs` not even that), never the experiment.
PLACEMENT = ("device", "threads", "workers", "batch_clients", "compile", "deterministic", "autotune")
IN_PROCESS = ("auto", "loop", "procs")  # executors driven from this process; the same figures (`procs` bit for bit)


def _placed_anywhere(tree: dict[str, Any]) -> dict[str, Any]:
    executor = {k: v for k, v in (tree.get("executor") or {}).items() if k not in PLACEMENT}
    if executor.get("name") in IN_PROCESS:  # their figures are the same: a run may continue on another
        executor.pop("name")
    return {**tree, "executor": executor}


# Where a run's files are on the machine running it: a run moved to another machine (a site-local run's server
# test file, the dataset's directory) is loaded or resumed with them changed in its config.yaml.
LOCATIONS = {"dataset": "path", "sites": "test", "model": "init_from", "federation": "manifest",
             "executor": "state_dir"}  # fmt: skip


def config_record(cfg: Config) -> dict[str, Any]:
    """What of `cfg` a run may not change once it has started, as plain JSON values: all but the `PLACEMENT` keys
    and the files' `LOCATIONS`. A checkpoint keeps it, so that a config.yaml edited since is found
    (`results.checkpoint.check_config`)."""
    tree = json.loads(json.dumps(_placed_anywhere(cfg.to_dict()), default=str))
    for section, key in LOCATIONS.items():
        if isinstance(tree.get(section), dict):
            tree[section].pop(key, None)
    return tree


def same_config(saved: Path, cfg: Config) -> bool:
    """Whether the config.yaml at `saved` describes `cfg`: compared as configs, not as text, so a run written before
    a config key was added (its default then applies) is still the same run; `PLACEMENT` keys are not compared;
    unreadable or invalid: not the same."""
    try:
        return _placed_anywhere(run_config(read_config_tree(saved)).to_dict()) == _placed_anywhere(cfg.to_dict())
    except (OSError, PflbedError):
        return False


def run_config(tree: dict[str, Any], placement: Config | None = None, path: Path | None = None) -> Config:
    """A run's saved config tree, validated here: its `PLACEMENT` keys replaced by `placement`'s when given, else
    its device made the CPU where the saved one does not exist on this machine (a GPU run loaded on a laptop).
    `path`: the file it was read from, which a value it refuses is named with (an edited config.yaml's mistake
    was said as if the user had typed it)."""
    from pflbed.config import resolve_device, validate_config

    executor = dict(tree.get("executor") or {})
    if placement is not None:
        executor.update({k: getattr(placement.executor, k) for k in PLACEMENT})
        if executor.get("name", "auto") in IN_PROCESS and placement.executor.name in IN_PROCESS:
            executor["name"] = placement.executor.name
    else:
        try:
            resolve_device(str(executor.get("device", "cpu")))
        except ValueError:
            executor["device"] = "cpu"
    try:
        return validate_config({**tree, "executor": executor})
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError(f"{path}: {e}") from None


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._held: int | None = None  # the directory's descriptor while this process holds it (`hold`)

    def hold(self) -> None:
        """Take the directory for this process until `release` (or the process's end, however it ends: the lock
        is the kernel's, on the directory itself, so a killed run leaves none behind). A second process resuming
        or replacing a run still in progress there interleaved its metrics with the first's and rewrote its
        checkpoints: it is refused instead. Nothing to take where the directory does not exist yet (`start`
        takes it once made)."""
        if fcntl is None or self._held is not None or not self.path.is_dir():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PflbedError(f"{self.path}: a run is in progress there, in another process; wait for it to end, or "
                              "stop it first") from None  # fmt: skip
        except OSError:  # a file system without these locks (some network ones): unguarded, as on Windows
            os.close(fd)
            return
        self._held = fd

    def release(self) -> None:
        if self._held is not None:
            os.close(self._held)  # and with it the lock
            self._held = None

    def refuse_in_progress(self) -> None:
        """`hold`'s refusal at once, before a command loads its data, holding nothing."""
        self.hold()
        self.release()

    @property
    def finished(self) -> bool:
        return (self.path / "summary.json").is_file()

    @property
    def has_results(self) -> bool:
        """Whether a run here has recorded anything: metrics, a checkpoint or its summary (`start` leaves none)."""
        return any((self.path / name).exists() for name in ("metrics.jsonl", "summary.json", "checkpoints"))

    @classmethod
    def check(cls, path: Path, cfg: Config, *, force: bool = False, resume: bool = False,
              resume_with: str | None = None, out_name: str = "--out", force_name: str = "--force") -> RunDir:
        """Refuse a path that cannot hold this run, or holds a run that `force` does not allow replacing; create
        nothing yet. With `resume`, an unfinished run of the same config is the expected case. `resume_with`: the
        command that continues an unfinished run there (default `pflbed run --resume PATH`); `out_name` and
        `force_name`: what the messages call the path and the option that replaces a run (a Flower app's run config
        says `out` and `--run-config force=true`)."""
        if path.exists() and not path.is_dir():
            raise PflbedError(f"{out_name} {path}: exists and is not a directory")
        check_writable(path, f"{out_name} {path}")
        run = cls(path)
        run.refuse_in_progress()
        existing = path / "config.yaml"
        if path.exists() and not existing.exists() and any(path.iterdir()):
            raise PflbedError(f"{out_name} {path}: is a non-empty directory that holds no pflbed run")
        _refuse_a_model(path, f"{out_name} {path}", f"; choose another {out_name}")
        if force or not existing.exists():
            return run
        if not same_config(existing, cfg):
            raise PflbedError(f"{out_name} {path}: holds a run of a different config; choose another {out_name} "
                              f"(or pass {force_name} to replace it)")  # fmt: skip
        if run.finished:
            what = "is finished; nothing to resume" if resume else "holds a finished run of this config"
            raise PflbedError(f"{out_name} {path}: {what}; choose another {out_name} (or pass {force_name} to run it "
                              "again)")  # fmt: skip
        if not resume:
            raise PflbedError(f"{out_name} {path}: holds an unfinished run of this config; continue it with "
                              f"'{resume_with or f'pflbed run --resume {path}'}' (or pass {force_name} to start "
                              "over)")  # fmt: skip
        return run

    def start(self, cfg: Config) -> None:
        """Create the directory (removing an earlier run's files, which `check` allowed) and write config.yaml,
        holding the directory (`hold`) from then on: the caller releases it.

        An unwritable location becomes one error line, and what this call created is removed again: the directory,
        and the parents it made unless another run has written there since (`bench --jobs` starts cells at once)."""
        created = list(takewhile(lambda p: not p.exists(), (self.path, *self.path.parents)))  # innermost first
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.hold()  # before an earlier run's files go: not while another process writes them
            for stale in RUN_FILES:
                (self.path / stale).unlink(missing_ok=True)
            for stale in ("checkpoints", "plots"):
                shutil.rmtree(self.path / stale, ignore_errors=True)
            atomic_write(self.path / "config.yaml", config_text(cfg))
        except OSError as e:
            if created:
                shutil.rmtree(self.path, ignore_errors=True)
                for parent in created[1:]:
                    try:
                        parent.rmdir()
                    except OSError:  # not empty (another run's), or gone already
                        break
            raise PflbedError(f"--out {self.path}: cannot write the run directory ({e.strerror})") from None

    @classmethod
    def for_resume(cls, path: Path, cfg: Config | None) -> tuple[RunDir, Config]:
        """Open an existing run dir to continue it; `cfg`, if given, must equal the run's own config."""
        saved = require_run(path, "--resume") / "config.yaml"
        cls(path).refuse_in_progress()
        for name, folder in [*((n, True) for n in ("checkpoints", "plots")), *((n, False) for n in RUN_FILES)]:
            there = path / name  # a file where the checkpoints go was no checkpoint: the run started over, deleting
            if there.exists() and there.is_dir() != folder:  # its metrics, then failed on a temporary file's name
                raise PflbedError(f"--resume {path}: {name} is a {'file' if folder else 'directory'}, not the "
                                  f"run's {'folder' if folder else 'file'}; restore it or move it away")  # fmt: skip
        if cfg is not None and not same_config(saved, cfg):
            raise PflbedError(f"--resume {path}: the run was started with a different config (only executor."
                              f"{', executor.'.join(PLACEMENT)} may change when resuming)")  # fmt: skip
        return cls(path), run_config(read_config_tree(saved), cfg, saved)

    def rewrite_metrics(self, history: list[dict[str, Any]]) -> None:
        """Make metrics.jsonl exactly the checkpointed history (drops lines logged after the checkpoint)."""
        atomic_write(self.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in history))
        self._write_csv()
        (self.path / "summary.json").unlink(missing_ok=True)

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self._write_csv()

    def _write_csv(self) -> None:
        """metrics.csv from metrics.jsonl, rewritten whole: a later record may bring a column (a diagnostic, a
        failed-clients list) that earlier ones lack. Nested values become dotted columns (`diag.mask_iou`), lists
        JSON text. A few records per run, so rewriting costs nothing."""
        rows = [_flat(json.loads(x)) for x in (self.path / "metrics.jsonl").read_text().splitlines() if x]
        columns = list(dict.fromkeys(k for r in rows for k in r))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write(self.path / "metrics.csv", buf.getvalue())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")


def _flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else v
    return out


def atomic_write(path: Path, text: str) -> None:
    """`text` as the whole of `path`, never half of it: written beside it, then renamed over it. A failed write (a full
    disk) leaves no temp file, which would make an emptied run directory one that 'holds no pflbed run'."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
