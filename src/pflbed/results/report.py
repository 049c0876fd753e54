"""`pflbed report RUN [RUN ...]`: one run, or several side by side, as a single self-contained HTML page (figures
inlined: it opens from a file, mails as one attachment and needs no network) or as Markdown (figures in a folder
beside it).

Contents, in reading order: a comparison table (final and validation-selected figures, new clients,
communication, time); the config as its differences from pflbed's defaults (keys that differ between the runs
marked; each full config folded away below); the learning curves as one grid of small panels sharing the round
axis (G-FL and P-FL on test and validation, the 10th-percentile client, any loss the records hold, and the bytes
sent up and down per round), runs overlaid in one colour, line style and marker each (identical curves named in the
note and drawn one over a wider other); the per-client P-FL histogram; the partition heat-map (rebuilt from the run's
config: the same federation, bit for bit); the algorithm's own plots (`plots/`: FedSelect's mask IoU, FedBasis's α,
KT-pFL's coefficients…); timing.

Names: the algorithm column gives each algorithm's name as its paper writes it (`display_name`: "FedRoD (linear)",
"kNN-Per"), and the column headers are words, not field names. The runs are named by their directories.

Round 0: the curves hold exactly the evaluations in metrics.jsonl. pflbed's engine evaluates after rounds
`eval.every`, 2·`eval.every`, … and the last, never before training, so its runs' curves start at the first
evaluated round; a record of round 0 (from a run or a tool that logs one) is plotted like any other, and none is
made up. The round axis starts at 0 either way, so a late first evaluation shows as such.

Data and drawing are kept apart: `RunData` holds what the run directory says and nothing else, `panels` and
`config_diff.diff_rows` derive what is shown from it (tests check them against the files), `report_figures` draws.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pflbed.errors import PflbedError
from pflbed.results.config_diff import diff_rows
from pflbed.results.report_figures import Panel, curves_svg, histogram_svg, run_colour, run_series
from pflbed.results.rundir import RUN_FILES, read_config_tree, read_history, read_summary, require_run
from pflbed.writable import check_writable

ACCURACY = (("gfl_acc", "G-FL test"), ("pfl_acc", "P-FL test"), ("pfl_val", "P-FL validation"),
            ("gfl_val", "G-FL validation"), ("pfl_acc_p10", "P-FL test, 10th-percentile client"))  # fmt: skip
COMMUNICATION = (("up_bytes_per_round", "up (clients → server)"), ("down_bytes_per_round", "down (server → clients)"))
MB = 1e6  # communication in MB (10⁶ bytes), as stated on the axes


@dataclass
class RunData:
    name: str
    path: Path
    config_text: str
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    artifacts: dict[str, Path] = field(default_factory=dict)

    def curve(self, key: str) -> tuple[list[int], list[float]]:
        """(rounds, values) of a metric over the evaluations that logged it, round 0 included where logged."""
        points = [(r["round"], r[key]) for r in self.history if _number(r.get(key))]
        return [p[0] for p in points], [p[1] for p in points]

    def config(self) -> dict[str, Any]:
        import yaml

        return yaml.safe_load(self.config_text) or {}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _inside(file: Path, run: Path) -> bool:
    """Whether `file` lies in the run directory: a summary naming a plot elsewhere does not bring that file in."""
    return file.resolve().is_relative_to(run.resolve())


def read_run(path: Path) -> RunData:
    """A finished run directory's files (an unfinished run has no summary yet: refused)."""
    summary, metrics, config = path / "summary.json", path / "metrics.jsonl", path / "config.yaml"
    require_run(path)
    if not summary.is_file():
        raise PflbedError(f"{path}: the run is not finished (no summary.json); finish it with 'pflbed run --resume'")
    s = read_summary(summary)
    history = read_history(metrics)
    read_config_tree(config)  # read once here: a damaged one is named before any figure is drawn
    artifacts = s.get("artifacts")
    artifacts = {k: path / v for k, v in (artifacts if isinstance(artifacts, dict) else {}).items()
                 if isinstance(v, str) and (path / v).is_file() and _inside(path / v, path)}  # fmt: skip
    return RunData(path.name or str(path), path, config.read_text(), s, history, artifacts)


def _entries(d: dict[str, Any], key: str) -> dict[str, Any]:
    """`d[key]` where it is a JSON object, else none: a hand-edited summary's entry of another type shows as "—"."""
    v = d.get(key)
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _pct(v: Any) -> str:
    return f"{100 * v:.2f}" if _number(v) else "—"


def _mb(v: Any) -> str:
    return f"{v / MB:.3g}" if _number(v) else "—"


def _fixed(v: Any, digits: int) -> str:
    """A summary's number to `digits` decimals; "—" for anything else (a hand-edited summary)."""
    return f"{v:.{digits}f}" if _number(v) else "—"


def display_name(algorithm: str) -> str:
    """An algorithm as its paper names it: the head of its file's docstring before " — " ("FedRoD (linear)",
    "kNN-Per", "LG-FedAvg"), else its class's name; a name pflbed does not know, as given."""
    from pflbed.algorithms import ALGORITHMS
    from pflbed.results.catalog import paper

    cls = ALGORITHMS.get(algorithm)
    if cls is None:
        return algorithm
    head, dash, _ = paper(cls).partition(" — ")
    return head if dash and len(head.split()) <= 3 else cls.__name__


def comparison(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    """The comparison table: header and one row per run (accuracies in %, communication in MB per round)."""
    header = ["run", "algorithm", "dataset", "rounds", "G-FL", "P-FL", "P-FL std", "P-FL, 10th-percentile client",
              "selected round", "P-FL at the selected round", "P-FL after fine-tuning", "P-FL after linear probing",
              "new clients, fine-tuned", "MB per round, up / down", "wall time (s)"]  # fmt: skip
    rows = []
    for r in runs:
        s, f = r.summary, r.summary["final"]
        sel = _entries(s, "selected")
        ft = _entries(_entries(_entries(_entries(s, "new_clients"), "methods"), "ft"), "M")
        comm = _entries(s, "communication")
        rows.append([r.name, display_name(s["algorithm"]), s["dataset"], str(s["rounds"]), _pct(f.get("gfl_acc")),
                     _pct(f.get("pfl_acc")), _pct(f.get("pfl_acc_std")), _pct(f.get("pfl_acc_p10")),
                     _fixed(sel.get("round"), 0), _pct(sel.get("pfl_acc")), _pct(_entries(f, "ft").get("pfl_acc")),
                     _pct(_entries(f, "lp").get("pfl_acc")), _pct(ft.get("best")),
                     f"{_mb(comm.get('up_bytes_per_round'))} / {_mb(comm.get('down_bytes_per_round'))}",
                     _fixed(s["timing"].get("wall_s"), 1)])  # fmt: skip
    if any("privacy" in r.summary for r in runs):  # client-level DP: the guarantee each run ended with
        header.append("DP ε (δ)")
        for r, row in zip(runs, rows, strict=True):
            row.append(_epsilon(r.summary.get("privacy")))
    return header, rows


def _epsilon(p: Any) -> str:
    if p is None:
        return "no DP"
    p = p if isinstance(p, dict) else {}
    eps, delta = p.get("epsilon"), p.get("delta")
    shown = "∞" if eps is None and "epsilon" in p else _fixed(eps, 2)
    return f"{shown} ({format(delta, 'g') if _number(delta) else '—'})"


# --- figures -----------------------------------------------------------------------------------------------------
def panels(runs: list[RunData]) -> list[Panel]:
    """The learning-curve panels the runs have data for, each run in its colour, line style and marker
    (`run_series`, by position)."""

    def panel(key: str, title: str, ylabel: str, unit: str, scale: Callable[[float], float]) -> Panel:
        series = [run_series(i, r.name, xs, [scale(y) for y in ys])
                  for i, r in enumerate(runs) for xs, ys in [r.curve(key)] if xs]  # fmt: skip
        return Panel(key, title, ylabel, unit, series)

    losses = sorted({k for r in runs for rec in r.history for k, v in rec.items() if "loss" in k and _number(v)})
    out = [panel(key, title, "accuracy %", "%", lambda y: 100 * y) for key, title in ACCURACY]
    out += [panel(key, key.replace("_", " "), "loss", "", float) for key in losses]
    out += [panel(key, title, "MB per round", "MB", lambda y: y / MB) for key, title in COMMUNICATION]
    return [p for p in out if p.series]


@dataclass
class Figure:
    name: str
    title: str
    section: str  # curves, clients, algorithm
    data: bytes | str  # PNG bytes, or SVG text

    @property
    def ext(self) -> str:
        return "svg" if isinstance(self.data, str) else "png"


def partition_png(run: RunData) -> bytes | None:
    """The run's partition heat-map, rebuilt from its config (None if its data cannot be loaded here)."""
    from pflbed.config import validate_config
    from pflbed.data import load_source
    from pflbed.federation import build_federation
    from pflbed.results.partition_plot import DPI, partition_figure

    try:
        cfg = validate_config(run.config())
        if cfg.sites.local:  # the clients' data is the sites' own: no partition of the config's dataset
            return None
        source = load_source(cfg.dataset)
        fed = build_federation(source, cfg.federation, cfg.seed)
    except PflbedError:
        return None
    fig = partition_figure(source, fed)  # selects the Agg backend before pyplot is imported
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def figures(runs: list[RunData]) -> list[Figure]:
    out = []
    if grid := panels(runs):
        out.append(Figure("curves", "learning curves", "curves", curves_svg(grid)))
    hist = [(r.name, run_colour(i), [100 * v for v in _list(_entries(r.summary, "per_client").get("pfl_acc"))
                                     if _number(v)]) for i, r in enumerate(runs)]  # fmt: skip
    if any(v for *_, v in hist):
        out.append(Figure("per-client", "per-client P-FL", "clients", histogram_svg(hist)))
    federations: dict[str, list[RunData]] = {}  # one heat-map per distinct federation, named by its runs
    for r in runs:
        same = {k: v for k, v in r.config().items() if k in ("seed", "dataset", "federation")}
        federations.setdefault(json.dumps(same, sort_keys=True), []).append(r)
    for group in federations.values():
        if (png := partition_png(group[0])) is not None:
            title = f"partition of {', '.join(r.name for r in group)}" + (" (one federation)" if len(group) > 1 else "")
            out.append(Figure(f"partition-{group[0].name}", title, "clients", png))
    for r in runs:
        for k, path in r.artifacts.items():
            if path.suffix.lower() == ".png":
                out.append(Figure(f"{r.name}-{k}", f"{r.name}: {k} ({path.name})", "algorithm", path.read_bytes()))
    return out


def _timing_rows(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    keys = list(dict.fromkeys(k for r in runs for k in _entries(r.summary, "timing")))
    return ["run", *keys], [[r.name, *(_fixed(r.summary["timing"].get(k), 2) for k in keys)] for r in runs]


def curves_note(runs: list[RunData], inline: bool = True) -> str:
    """What the curves' points are, said under them: which rounds each run was evaluated at (and how to get more
    points where there are few), whether round 0 is among them, which curves coincide (drawn over each other);
    `inline`: the SVG is in the page, so its tooltips show (an SVG shown as an image, as Markdown does, shows none)."""
    zero = [r.name for r in runs if any(rec.get("round") == 0 for rec in r.history)]
    note = "Each point is an evaluation. " + _schedule(runs)
    note += "Hover a point for its value, zoom the page for detail. " if inline else ""
    note += (f"Round 0 (before training) is logged for {', '.join(zero)}. " if zero else
             "No run logged an evaluation before training (round 0), so each curve starts at its first evaluated "
             "round. ")  # fmt: skip
    if any(rec.get("full_test") is False for r in runs for rec in r.history):
        note += "Intermediate evaluations score a subsample of the shared test sets (eval.test_subsample). "
    if same := coinciding(panels(runs)):
        note += ("Identical curves, drawn over each other (told apart by line style and marker): "
                 + "; ".join(same) + ". ")  # fmt: skip
    return note + "Communication in MB (10⁶ bytes) per round: up = clients → server, down = server → clients."


FEW_POINTS = 5  # a curve of fewer evaluations says little about its shape: the note says how to get more


def _schedule(runs: list[RunData]) -> str:
    """`fedavg, fedrod: evaluated every 5 rounds and after the last — 2 points (rounds 5, 10).`, the runs of one
    schedule together."""
    groups: dict[str, list[str]] = {}
    few = False
    for r in runs:
        rounds = sorted({rec["round"] for rec in r.history if _number(rec.get("round"))})
        every = (r.config().get("eval") or {}).get("every")
        when = f"evaluated every {every} round{'s' * (every != 1)} and after the last" if _number(every) else \
            "evaluated as logged"  # fmt: skip
        shown = ", ".join(map(str, rounds)) if len(rounds) <= 8 else f"{rounds[0]} … {rounds[-1]}"
        groups.setdefault(f"{when} — {len(rounds)} point{'s' * (len(rounds) != 1)} (rounds {shown})", []).append(
            r.name)
        few |= len(rounds) < FEW_POINTS
    text = "; ".join(f"{', '.join(names)}: {what}" for what, names in groups.items()) + ". "
    if few:
        text += "For more points, run again with --set eval.every=1 (an evaluation after every round; slower). "
    return text


def coinciding(grid: list[Panel]) -> list[str]:
    """`panel: run, run` for each set of runs whose curves in a panel are the same points."""
    out = []
    for p in grid:
        same: dict[tuple, list[str]] = {}
        for s in p.series:
            same.setdefault((tuple(s.rounds), tuple(round(v, 9) for v in s.values)), []).append(s.run)
        out += [f"{p.title}: {', '.join(names)}" for names in same.values() if len(names) > 1]
    return out


SECTIONS = (("curves", "Learning curves"), ("clients", "Clients"), ("algorithm", "The algorithm's own plots"))


# --- rendering ---------------------------------------------------------------------------------------------------
def _html_table(header: list[str], rows: list[list[str]], marked: list[bool] | None = None, cls: str = "") -> str:
    """A table; the rows whose `marked` is true get class `differs` (highlighted)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    marked = marked or [False] * len(rows)
    body = "".join(("<tr class='differs'>" if m else "<tr>") + "".join(f"<td>{html.escape(c)}</td>" for c in row)
                   + "</tr>" for row, m in zip(rows, marked, strict=True))  # fmt: skip
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _md(text: str) -> str:
    """Text for Markdown: `<`, `>` and `&` as entities (a run named `<script>`, a config value `<home>/data` is shown,
    not taken for HTML and dropped or run; rendered, it reads the same)."""
    return html.escape(text, quote=False)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; a `|` in any cell, the header's run names included, is escaped (it would split the cell)."""

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(_md(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def _file_stem(name: str, taken: set[str]) -> str:
    """A figure's file name for the Markdown's folder: letters, digits, `.`, `-` and `_` only (a space, as in a
    renamed run's "run (2)", would end the Markdown link; a `/` in a plot's name would point into a folder that is
    not there), unique among the report's figures."""
    stem = re.sub(r"[^\w.-]+", "_", name, flags=re.ASCII).strip("._") or "figure"
    out, k = stem, 1
    while out in taken:
        k += 1
        out = f"{stem}_{k}"
    taken.add(out)
    return out


def _inline_svg(svg: str) -> str:
    """The SVG scaled to the page's width, never above its own size (pt → px)."""
    m = re.search(r'width="([\d.]+)pt" height="([\d.]+)pt"', svg)
    if m is None:
        return svg
    style = f'style="width:100%;height:auto;max-width:{float(m.group(1)) * 4 / 3:.0f}px"'
    return svg[: m.start()] + style + svg[m.end() :]


def _config_intro(runs: list[RunData], rows: list[tuple[list[str], bool]]) -> str:
    differ = [row[0] for row, d in rows if d]
    text = "Keys whose value is not pflbed's default (nested keys dotted); the rest is at its default."
    if differ:
        text += f" Differ between the runs (highlighted): {', '.join(differ)}."
    elif len(runs) > 1:
        text += " The runs' configs are the same."
    return text


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 7px;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
table.cfg td{text-align:left;font-family:ui-monospace,monospace}tr.differs td{background:#fff1c2;font-weight:600}
img{max-width:100%;margin:.5em 0}svg{display:block;margin:.5em 0}pre{background:#f7f7f7;padding:1em;
overflow:auto;font-size:12px}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
p.note{color:#555;font-size:13px;max-width:70em}summary{cursor:pointer;color:#444;margin:.3em 0}"""


TABLE_NOTE = ("Accuracies in %. G-FL: the generic model on the shared test set; P-FL: each client's personal model on "
              "its own test data, mean over clients (std: across clients); the selected round is the evaluation with "
              "the best P-FL on validation. After fine-tuning / linear probing: P-FL once each client has trained "
              "its copy of the final model (all of it / its head only: eval.finetune). New clients: clients held "
              "out of training, each fine-tuning the final model on its M share of training data (the second of "
              "eval.new_clients.fractions: all of it by default), scored on test at the epoch best on validation. "
              "Communication: MB (10⁶ bytes) per round, of the last round.")


def render_html(runs: list[RunData], figs: list[Figure]) -> str:
    title = "pflbed report: " + ", ".join(r.name for r in runs)
    cfg_header, cfg = diff_rows([(r.name, r.config()) for r in runs])
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
             "<h2>Comparison</h2>", _html_table(*comparison(runs)),
             f"<p class='note'>{html.escape(TABLE_NOTE)}</p>",
             "<h2>Config</h2>", f"<p class='note'>{html.escape(_config_intro(runs, cfg))}</p>",
             _html_table(cfg_header, [c for c, _ in cfg], [d for _, d in cfg], " class='cfg'")]  # fmt: skip
    for r in runs:
        parts.append(f"<details><summary>full config of {html.escape(r.name)}</summary>"
                     f"<pre>{html.escape(r.config_text)}</pre></details>")  # fmt: skip
    for section, heading in SECTIONS:
        shown = [f for f in figs if f.section == section]
        if shown:
            parts.append(f"<h2>{heading}</h2>")
        if section == "curves" and shown:
            parts.append(f"<p class='note'>{html.escape(curves_note(runs))}</p>")
        for f in shown:
            if f.section != "curves" and f.name != "per-client":  # those two carry their title inside
                parts.append(f"<h3>{html.escape(f.title)}</h3>")
            if isinstance(f.data, str):
                parts.append(_inline_svg(f.data))
            else:
                data = base64.b64encode(f.data).decode()
                parts.append(f"<img alt='{html.escape(f.title)}' src='data:image/png;base64,{data}'>")
    parts += ["<h2>Timing (seconds)</h2>", _html_table(*_timing_rows(runs)), "</body></html>"]
    return "\n".join(parts)


def render_markdown(runs: list[RunData], figs: list[Figure], figure_dir: Path, relative_to: Path) -> str:
    figure_dir.mkdir(parents=True, exist_ok=True)
    cfg_header, cfg = diff_rows([(r.name, r.config()) for r in runs])
    cfg_rows = [[f"**{c[0]}** ≠", *c[1:]] if d else c for c, d in cfg]
    parts = ["# pflbed report: " + _md(", ".join(r.name for r in runs)), "", "## Comparison", "",
             _md_table(*comparison(runs)), "", TABLE_NOTE, "", "## Config", "",
             _md(_config_intro(runs, cfg).replace("highlighted", "marked ≠")), "", _md_table(cfg_header, cfg_rows),
             ""]  # fmt: skip
    for r in runs:  # a fence longer than any run of backticks in the config: the config cannot close it
        fence = "`" * max(3, 1 + max(map(len, re.findall("`+", r.config_text)), default=0))
        parts += [f"<details><summary>full config of {html.escape(r.name)}</summary>", "", f"{fence}yaml",
                  r.config_text.rstrip(), fence, "", "</details>", ""]  # fmt: skip
    taken: set[str] = set()
    for section, heading in SECTIONS:
        shown = [f for f in figs if f.section == section]
        parts += [f"## {heading}", ""] if shown else []
        parts += [_md(curves_note(runs, inline=False)), ""] if section == "curves" and shown else []
        for f in shown:
            path = figure_dir / f"{_file_stem(f.name, taken)}.{f.ext}"
            path.write_text(f.data) if isinstance(f.data, str) else path.write_bytes(f.data)
            alt = _md(f.title).replace("[", "\\[").replace("]", "\\]")
            parts += [f"### {_md(f.title)}", "", f"![{alt}]({path.relative_to(relative_to).as_posix()})", ""]
    parts += ["## Timing (seconds)", "", _md_table(*_timing_rows(runs)), ""]
    return "\n".join(parts)


def write_report(run_dirs: list[Path], out: Path, fmt: str = "html") -> Path:
    """Write the report of `run_dirs` to `out` (html, or md with figures in `<out stem>_files/`)."""
    if not run_dirs:
        raise PflbedError("report: name at least one run directory")
    if fmt not in ("html", "md"):  # before the runs are read and their figures drawn
        raise PflbedError(f"--format: unknown {fmt!r}; choose html or md")
    if out.is_dir():  # was a bare "Is a directory" once every figure was drawn
        raise PflbedError(f"-o {out}: is a directory; give the report's file (.html or .md)")
    if out.name in RUN_FILES and (out.parent / "config.yaml").is_file():  # it replaced a run's summary.json
        raise PflbedError(f"-o {out}: is a run's own file; give the report a name of its own")
    check_writable(out.parent, f"-o {out}")  # was "File exists", naming the file, once every figure was drawn
    seen: dict[Path, Path] = {}
    for p in map(Path, run_dirs):  # the same run twice was drawn as two, "run (1)" and "run (2)"
        if p.resolve() in seen:
            first = seen[p.resolve()]
            raise PflbedError(f"{p}: given twice{'' if first == p else f' (as {first} too)'}; name each run once")
        seen[p.resolve()] = p
    runs = [read_run(Path(p)) for p in run_dirs]
    names = [r.name for r in runs]
    for i, r in enumerate(runs):  # two runs of the same name (e.g. a/run, b/run): tell them apart
        if names.count(r.name) > 1:
            r.name = f"{r.name} ({i + 1})"
    figs = figures(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "html":
        out.write_text(render_html(runs, figs))
    else:
        out.write_text(render_markdown(runs, figs, out.parent / f"{out.stem}_files", out.parent))
    return out
