"""The report's figures, drawn with matplotlib from data `report.py` has already read: the learning curves as one
grid of small panels sharing the round axis, and the per-client histogram, both as SVG.

Why SVG: a vector figure zooms crisply with the browser, is text the page can search, and is a few tens of KiB —
inlined, it keeps the HTML one self-contained file with no JavaScript. Interactivity stays native: every plotted
point carries an SVG `<title>` (run, round, value) that browsers show on hover. matplotlib writes a line's markers
as `<use>` elements, in data order, inside a group whose id is the line's gid; `_with_titles` wraps each of them
with its title. A plotting library with its own JavaScript (plotly: megabytes per page) was not worth that.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

# matplotlib's tab10, by hand: a run's colour is fixed before any figure is drawn
RUN_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
               "#17becf")  # fmt: skip


# and a line style and marker of its own: two runs with the same figures (FedAvg's and FedRoD's communication) draw
# the same curve, and colour alone would leave only the one drawn last in sight
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def run_colour(i: int) -> str:
    """Run i's colour, the same in every panel and figure of a report."""
    return RUN_COLOURS[i % len(RUN_COLOURS)]


@dataclass
class Series:
    """One run's points in one panel: values already in the panel's unit (%, MB, …), drawn in the run's colour,
    line style and marker (`run_series`)."""

    run: str
    colour: str
    rounds: list[int]
    values: list[float]
    linestyle: str = "-"
    marker: str = "o"


def run_series(i: int, run: str, rounds: list[int], values: list[float]) -> Series:
    """Run i's points in its colour, line style and marker, the same in every panel."""
    return Series(run, run_colour(i), rounds, values, LINESTYLES[i % len(LINESTYLES)], MARKERS[i % len(MARKERS)])


@dataclass
class Panel:
    key: str  # the metrics.jsonl field
    title: str
    ylabel: str
    unit: str  # of the values, in the tooltips: "%", "MB", ""
    series: list[Series]


# Text stays text (searchable, and a tenth of the size of glyph outlines); the salt makes ids, and so the bytes,
# the same for the same figure.
RC = {"svg.fonttype": "none", "svg.hashsalt": "pflbed", "font.size": 9}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid_columns(n: int) -> int:
    """4 columns, or 3 where that leaves fewer empty cells (6 panels: 3 × 2, not 4 + 2)."""
    return n if n <= 4 else min((4, 3), key=lambda c: (-n) % c)


def curves_svg(panels: list[Panel]) -> str:
    """The panels as one grid of small charts sharing the round axis, the runs in one legend."""
    plt = _pyplot()
    with plt.rc_context(RC):
        return _curves(plt, panels)


def _curves(plt, panels: list[Panel]) -> str:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    runs = list({s.run: s for p in panels for s in p.series}.values())  # one legend entry per run, in order
    cols = _grid_columns(len(panels))
    rows = math.ceil(len(panels) / cols)
    legend_rows = math.ceil(len(runs) / 5)
    height = 2.3 * rows + 0.3 * legend_rows
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, height), sharex=True, squeeze=False)
    tips: dict[str, list[str]] = {}
    flat = axes.ravel()
    for i, (ax, p) in enumerate(zip(flat, panels, strict=False)):
        keys = [_points(s) for s in p.series]
        for k, s in enumerate(p.series):
            under = keys[k + 1 :].count(keys[k])  # later runs with the same points: drawn wider, beneath them
            gid = f"pt{i}-{len(tips)}"
            # clip_on=False: a point on the axis (0 %, 0 MB) is drawn whole; the limits hold every point anyway.
            # Few points (eval.every of a short run): larger markers, so that they read as the measurements
            ax.plot(s.rounds, s.values, color=s.colour, linestyle=s.linestyle, marker=s.marker,
                    linewidth=1.4 + 2 * under, markersize=(3.5 if len(s.rounds) > 5 else 5.5) + 3 * under,
                    zorder=2 - 0.1 * under, gid=gid, clip_on=False)  # fmt: skip
            tips[gid] = [f"{s.run} · round {r} · {p.title}: {_value(v)} {p.unit}".rstrip()
                         for r, v in zip(s.rounds, s.values, strict=True)]  # fmt: skip
        _y_range(ax, p.unit)
        ax.set_title(p.title, fontsize=9.5)
        ax.set_ylabel(p.ylabel, fontsize=8.5)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in flat[len(panels) :]:
        ax.remove()
    for j, ax in enumerate(flat[: len(panels)]):  # the lowest panel of each column carries the round axis
        if j + cols >= len(panels):
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel("round", fontsize=8.5)
    flat[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    flat[0].set_xlim(left=0)  # training starts at round 0, whether or not it was evaluated there
    handles = [Line2D([], [], color=s.colour, linestyle=s.linestyle, marker=s.marker, markersize=4, label=s.run)
               for s in runs]  # fmt: skip
    fig.legend(handles=handles, loc="upper center", ncol=min(len(runs), 5), frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.32 * legend_rows / height))
    return _with_titles(_svg(fig, plt), tips)


def _points(s: Series) -> tuple:
    """A series' points, to tell which curves coincide."""
    return tuple(s.rounds), tuple(round(v, 9) for v in s.values)


def _y_range(ax, unit: str) -> None:
    """Accuracies within 0–100 % and at least 5 points tall (a flat 0 % curve is not drawn on ±0.04); sizes (MB)
    from 0, so that 14.7 against 15.1 MB does not look like a fourfold difference."""
    lo, hi = ax.get_ylim()
    if unit == "%":
        mid = (lo + hi) / 2
        lo, hi = (lo, hi) if hi - lo >= 5 else (mid - 2.5, mid + 2.5)
        lo, hi = (0, 5) if hi <= 5 else (max(lo, 0), min(hi, 100))
    elif unit == "MB":
        lo, hi = 0, max(1.1 * hi, 1e-9)
    ax.set_ylim(lo, hi)


def _value(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1 else f"{v:.2f}"


def histogram_svg(values: Sequence[tuple[str, str, list[float]]]) -> str:
    """Per-client P-FL test accuracy (%) of each run (`(name, colour, values)`), overlaid."""
    plt = _pyplot()
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=(6.5, 2.8))
        _histogram(ax, values)
        fig.tight_layout()
        return _svg(fig, plt)


def _histogram(ax, values: Sequence[tuple[str, str, list[float]]]) -> None:
    for name, colour, v in values:
        if v:
            ax.hist(v, bins=20, range=(0, 100), color=colour, alpha=0.35, label=name)
            ax.hist(v, bins=20, range=(0, 100), color=colour, histtype="step", linewidth=1.2)
    ax.set_xlabel("P-FL test accuracy of a client (%)", fontsize=8.5)
    ax.set_ylabel("clients", fontsize=8.5)
    ax.set_title("per-client P-FL, final round", fontsize=9.5)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=8, frameon=False)


def _svg(fig, plt) -> str:
    """The figure as an SVG element to inline: no XML prolog or DOCTYPE (not allowed inside HTML) and no RDF
    metadata (it names external vocabularies, and carries no information); fixed hash salt, no date: the same
    figure gives the same bytes."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return re.sub(r"<metadata>.*?</metadata>\s*", "", text[text.index("<svg") :], flags=re.S)


def _with_titles(svg: str, tips: dict[str, list[str]]) -> str:
    """Each marker `<use>` of the line with gid `g` wrapped as `<g><title>tips[g][i]</title><use/></g>`; a line
    whose markers do not match its tips one for one (none drawn, say) is left without."""
    for gid, titles in tips.items():
        start = svg.find(f'<g id="{gid}">')
        if start < 0:
            continue
        end = svg.find("</g>", start)  # the inner group, of the markers, closes first
        pieces = re.split(r"(<use [^>]*/>)", svg[start:end])  # text, marker, text, marker, …, text
        if len(pieces) != 2 * len(titles) + 1:
            continue
        for k, title in enumerate(titles):
            pieces[2 * k + 1] = f"<g><title>{html.escape(title)}</title>{pieces[2 * k + 1]}</g>"
        svg = svg[:start] + "".join(pieces) + svg[end:]
    return svg
