"""`pflbed report RUN [RUN ...]`: one run, or several side by side, as a single self-contained HTML page (figures
embedded as data URIs: it opens from a file, mails as one attachment and needs no network) or as Markdown (figures
in a folder beside it).

Contents: a comparison table (final and validation-selected figures, new clients, time), learning curves per round
(G-FL, P-FL, P-FL on validation; runs overlaid), the histogram of per-client P-FL, communication per round, the
partition heat-map (rebuilt from the run's config: the same federation, bit for bit), timing, the algorithm's own
artifacts (`plots/`: FedSelect's mask IoU, FedBasis's α, KT-pFL's coefficients…) and each run's config.

The figures are drawn from `ReportData`, which reads the run directories and nothing else; tests check the data
and the rendered tables against the files.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pflbed.errors import PflbedError

CURVES = (("gfl_acc", "G-FL test"), ("pfl_acc", "P-FL test"), ("pfl_val", "P-FL validation"))


@dataclass
class RunData:
    name: str
    path: Path
    config_text: str
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    artifacts: dict[str, Path] = field(default_factory=dict)

    def curve(self, key: str) -> tuple[list[int], list[float]]:
        """(rounds, values) of a metric over the evaluations that logged it."""
        points = [(r["round"], r[key]) for r in self.history if r.get(key) is not None]
        return [p[0] for p in points], [p[1] for p in points]


def read_run(path: Path) -> RunData:
    """A finished run directory's files (an unfinished run has no summary yet: refused)."""
    summary, metrics, config = path / "summary.json", path / "metrics.jsonl", path / "config.yaml"
    if not config.is_file():
        raise PflbedError(f"{path}: not a pflbed run directory (no config.yaml)")
    if not summary.is_file():
        raise PflbedError(f"{path}: the run is not finished (no summary.json); finish it with 'pflbed run --resume'")
    s = json.loads(summary.read_text())
    history = [json.loads(x) for x in metrics.read_text().splitlines() if x] if metrics.is_file() else []
    artifacts = {k: path / v for k, v in (s.get("artifacts") or {}).items() if (path / v).is_file()}
    return RunData(path.name or str(path), path, config.read_text(), s, history, artifacts)


def _pct(v: Any) -> str:
    return f"{100 * v:.2f}" if isinstance(v, (int, float)) else "—"


def comparison(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    """The comparison table: header and one row per run (accuracies in %)."""
    header = ["run", "algorithm", "dataset", "rounds", "G-FL", "P-FL", "± std", "P-FL p10", "selected round",
              "P-FL at selected", "+FT P-FL", "+LP P-FL", "new clients M ft best", "wall s"]  # fmt: skip
    rows = []
    for r in runs:
        s, f = r.summary, r.summary["final"]
        sel = s.get("selected") or {}
        ft = ((s.get("new_clients") or {}).get("methods") or {}).get("ft", {}).get("M", {})
        rows.append([r.name, s["algorithm"], s["dataset"], str(s["rounds"]), _pct(f.get("gfl_acc")),
                     _pct(f.get("pfl_acc")), _pct(f.get("pfl_acc_std")), _pct(f.get("pfl_acc_p10")),
                     str(sel.get("round", "—")), _pct(sel.get("pfl_acc")), _pct((f.get("ft") or {}).get("pfl_acc")),
                     _pct((f.get("lp") or {}).get("pfl_acc")), _pct(ft.get("best")),
                     f"{s.get('timing', {}).get('wall_s', float('nan')):.1f}"])  # fmt: skip
    return header, rows


# --- figures -----------------------------------------------------------------------------------------------------
def _figure(draw, width: float = 7.0, height: float = 3.6) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(width, height))
    draw(ax)
    if ax.get_xlabel() == "round":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def curves_png(runs: list[RunData], key: str, label: str) -> bytes | None:
    if not any(r.curve(key)[0] for r in runs):
        return None

    def draw(ax) -> None:
        for r in runs:
            xs, ys = r.curve(key)
            if xs:
                ax.plot(xs, [100 * y for y in ys], marker="o", markersize=3, label=r.name)
        ax.set_xlabel("round")
        ax.set_ylabel(f"{label} accuracy %")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    return _figure(draw)


def histogram_png(runs: list[RunData]) -> bytes | None:
    data = [(r.name, r.summary.get("per_client", {}).get("pfl_acc") or []) for r in runs]
    if not any(v for _, v in data):
        return None

    def draw(ax) -> None:
        for name, values in data:
            if values:
                ax.hist([100 * v for v in values], bins=20, range=(0, 100), alpha=0.5, label=name)
        ax.set_xlabel("P-FL test accuracy of a client %")
        ax.set_ylabel("clients")
        ax.set_title("per-client P-FL (final round)")
        ax.legend(fontsize=8)

    return _figure(draw)


def communication_png(runs: list[RunData]) -> bytes | None:
    if not any(r.curve("up_bytes_per_round")[0] for r in runs):
        return None

    def draw(ax) -> None:
        for r in runs:
            for key, style in (("up_bytes_per_round", "-"), ("down_bytes_per_round", "--")):
                xs, ys = r.curve(key)
                if xs:
                    ax.plot(xs, [y / 2**20 for y in ys], style, marker="o", markersize=3,
                            label=f"{r.name} {key.split('_')[0]}")  # fmt: skip
        ax.set_xlabel("round")
        ax.set_ylabel("MiB per round")
        ax.set_title("communication (up: clients → server, down: server → clients)")
        ax.legend(fontsize=8)

    return _figure(draw)


def partition_png(run: RunData) -> bytes | None:
    """The run's partition heat-map, rebuilt from its config (None if its data cannot be loaded here)."""
    import tempfile

    import yaml

    from pflbed.config import validate_config
    from pflbed.data import load_source
    from pflbed.federation import build_federation
    from pflbed.results.partition_plot import plot_partition

    try:
        cfg = validate_config(yaml.safe_load(run.config_text))
        if cfg.sites.local:  # the clients' data is the sites' own: no partition of the config's dataset
            return None
        source = load_source(cfg.dataset)
        fed = build_federation(source, cfg.federation, cfg.seed)
    except PflbedError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return plot_partition(source, fed, Path(tmp) / "p.png").read_bytes()


@dataclass
class Figure:
    name: str
    title: str
    png: bytes


def figures(runs: list[RunData]) -> list[Figure]:
    out = [Figure(f"curve-{key}", label, png) for key, label in CURVES
           if (png := curves_png(runs, key, label)) is not None]  # fmt: skip
    for name, title, png in (("per-client", "per-client P-FL", histogram_png(runs)),
                             ("communication", "communication per round", communication_png(runs))):  # fmt: skip
        if png is not None:
            out.append(Figure(name, title, png))
    seen: set[str] = set()
    for r in runs:
        same = {k: v for k, v in _config(r).items() if k in ("seed", "dataset", "federation")}
        key = json.dumps(same, sort_keys=True)  # one heat-map per distinct federation
        if key not in seen and (png := partition_png(r)) is not None:
            seen.add(key)
            out.append(Figure(f"partition-{r.name}", f"partition of {r.name}", png))
        for k, path in r.artifacts.items():
            if path.suffix.lower() == ".png":
                out.append(Figure(f"{r.name}-{k}", f"{r.name}: {k} ({path.name})", path.read_bytes()))
    return out


def _config(run: RunData) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(run.config_text) or {}


def _timing_rows(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    keys = list(dict.fromkeys(k for r in runs for k in r.summary.get("timing", {})))
    return ["run", *keys], [[r.name, *(f"{r.summary['timing'].get(k, float('nan')):.2f}" for k in keys)] for r in runs]


# --- rendering ---------------------------------------------------------------------------------------------------
def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}th,td{border:1px solid #ccc;padding:4px 8px;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
img{max-width:min(100%,900px);border:1px solid #eee;margin:.5em 0}pre{background:#f7f7f7;padding:1em;overflow:auto;
font-size:12px}h2{border-bottom:1px solid #ddd;padding-bottom:.2em}"""


def render_html(runs: list[RunData], figs: list[Figure]) -> str:
    title = "pflbed report: " + ", ".join(r.name for r in runs)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
             "<h2>Comparison</h2>", _html_table(*comparison(runs)),
             "<p>Accuracies in %. G-FL: the generic model on the shared test set; P-FL: each client's personal model "
             "on its own test data, mean over clients; the selected round is the evaluation with the best P-FL on "
             "validation.</p>"]  # fmt: skip
    parts.append("<h2>Figures</h2>")
    for f in figs:
        data = base64.b64encode(f.png).decode()
        parts.append(f"<h3>{html.escape(f.title)}</h3><img alt='{html.escape(f.title)}' "
                     f"src='data:image/png;base64,{data}'>")  # fmt: skip
    parts += ["<h2>Timing (seconds)</h2>", _html_table(*_timing_rows(runs)), "<h2>Configs</h2>"]
    for r in runs:
        parts.append(f"<h3>{html.escape(r.name)}</h3><pre>{html.escape(r.config_text)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def render_markdown(runs: list[RunData], figs: list[Figure], figure_dir: Path, relative_to: Path) -> str:
    figure_dir.mkdir(parents=True, exist_ok=True)
    parts = ["# pflbed report: " + ", ".join(r.name for r in runs), "", "## Comparison", "",
             _md_table(*comparison(runs)), "", "## Figures", ""]  # fmt: skip
    for f in figs:
        path = figure_dir / f"{f.name}.png"
        path.write_bytes(f.png)
        parts += [f"### {f.title}", "", f"![{f.title}]({path.relative_to(relative_to).as_posix()})", ""]
    parts += ["## Timing (seconds)", "", _md_table(*_timing_rows(runs)), "", "## Configs", ""]
    for r in runs:
        parts += [f"### {r.name}", "", "```yaml", r.config_text.rstrip(), "```", ""]
    return "\n".join(parts)


def write_report(run_dirs: list[Path], out: Path, fmt: str = "html") -> Path:
    """Write the report of `run_dirs` to `out` (html, or md with figures in `<out stem>_files/`)."""
    if not run_dirs:
        raise PflbedError("report: name at least one run directory")
    runs = [read_run(Path(p)) for p in run_dirs]
    names = [r.name for r in runs]
    for i, r in enumerate(runs):  # two runs of the same name (e.g. a/run, b/run): tell them apart
        if names.count(r.name) > 1:
            r.name = f"{r.name} ({i + 1})"
    figs = figures(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "html":
        out.write_text(render_html(runs, figs))
    elif fmt == "md":
        out.write_text(render_markdown(runs, figs, out.parent / f"{out.stem}_files", out.parent))
    else:
        raise PflbedError(f"--format: unknown {fmt!r}; choose html or md")
    return out
