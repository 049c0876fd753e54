"""`pflbed data show`: what each client holds, as a table and a heat-map (also the report's partition figure).

The heat-map has a cell per client and class, coloured by the client's training samples of the class (white: none),
with a colour bar of the counts; with several domains a strip above it gives each client's domain. Clients are
ordered by role (participated, then new) and domain, so label skew (P_m(y)) and domain skew (P_m(x)) are both
visible at a glance. A heat-map rather than FedBasis-style bubbles (Fig. 6–8): bubbles of 100 clients × 10 classes
merge into each other, cells do not, and a colour bar reads off counts that bubble areas only suggest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from pflbed.data.arrays import DataSource
from pflbed.federation import Federation
from pflbed.results.console import console as make_console

DPI = 100  # the heat-map's PNG; the report shows it at this size (11 in wide at most: 1100 px)
NICE_STEPS = (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10_000)


def client_counts(source: DataSource, fed: Federation) -> np.ndarray:
    """[clients, classes] training-sample counts."""
    y = source.train.y
    return np.stack([np.bincount(y[c.train].numpy(), minlength=source.num_classes) for c in fed.clients])


def _order(fed: Federation) -> list[int]:
    return sorted(range(len(fed.clients)), key=lambda c: (c in set(fed.new), fed.clients[c].domain, c))


def print_partition(source: DataSource, fed: Federation, console: Console | None = None) -> None:
    counts = client_counts(source, fed)
    names = source.domain_names
    t = Table(title=f"{source.name}: {len(fed.participated)} participated + {len(fed.new)} new clients")
    for col in ("client", "role", "domain", "train", "val", "test", "class counts"):
        t.add_column(col, justify="left" if col in ("role", "domain", "class counts") else "right")
    new = set(fed.new)
    for c in _order(fed):
        cl = fed.clients[c]
        dom = names[cl.domain] if names else ""
        cc = " ".join(f"{k}:{n}" for k, n in enumerate(counts[c]) if n)
        t.add_row(str(c), "new" if c in new else "participated", dom, str(len(cl.train)), str(len(cl.val)),
                  str(len(cl.test)), cc)  # fmt: skip
    (console or make_console()).print(t)
    if fed.domain_test:
        sizes = ", ".join(f"{names[d] if names else d}: {len(t)}/{len(v)}"
                          for d, (t, v) in enumerate(zip(fed.domain_test, fed.domain_val, strict=True)))  # fmt: skip
        (console or make_console()).print(f"shared test/val sets per domain (class-balanced): {sizes}")


def plot_partition(source: DataSource, fed: Federation, path: Path) -> Path:
    """The heat-map (`partition_figure`) as a PNG at `path`."""
    fig = partition_figure(source, fed)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def tick_step(n: int, axis_inches: float, label_inches: float) -> int:
    """The smallest round step between labelled ticks that gives each label `label_inches` of the axis: with 100
    clients on 9 inches every client's number would overlap its neighbours', every 5th or 10th does not."""
    per_item = axis_inches / max(n, 1)
    return next((s for s in NICE_STEPS if s * per_item >= label_inches), NICE_STEPS[-1])


def partition_figure(source: DataSource, fed: Federation):  # -> matplotlib Figure (imported late: slow)
    """Classes × clients, each cell the client's training samples of the class (white: none), with a colour bar
    of the counts. The figure is sized to the data — a cell per client of ~0.09 in up to 11 in wide, so that in the
    report (which shows it at its size) it is neither a stamp for 5 clients nor shrunk to illegible for 500 — and
    the tick labels are thinned to what fits (`tick_step`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    counts = client_counts(source, fed)
    order = _order(fed)
    n, k = len(order), source.num_classes
    domains = np.array([fed.clients[c].domain for c in order])
    strip = len(set(domains.tolist())) > 1 and bool(source.domain_names)
    width = min(max(4.5 + 0.09 * n, 6.0), 11.0)
    heat_h = min(max(0.22 * k, 1.8), 9.0)
    height = heat_h + 1.4 + (0.6 if strip else 0)
    fig = plt.figure(figsize=(width, height), layout="constrained")
    grid = fig.add_gridspec(2 if strip else 1, 2, width_ratios=[1, 0.025],
                            height_ratios=[0.25, heat_h] if strip else None)  # fmt: skip
    ax = fig.add_subplot(grid[-1, 0])
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")  # masked cells, the zero counts: white
    image = ax.imshow(np.ma.masked_equal(counts[order].T, 0), aspect="auto", cmap=cmap, origin="lower",
                      interpolation="nearest", vmin=1)  # fmt: skip
    fig.colorbar(image, cax=fig.add_subplot(grid[-1, 1])).set_label("training samples", fontsize=9)
    if fed.new:
        ax.axvline(len(fed.participated) - 0.5, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("client" + (" (left of the dashed line: participated; right: new)" if fed.new else ""))
    ax.set_ylabel("class")
    title = f"{source.name}: training samples per client and class ({n} clients, {k} classes)"
    if strip:
        top = fig.add_subplot(grid[0, 0], sharex=ax)
        palette = plt.get_cmap("tab10")
        top.imshow(domains[None, :] % 10, aspect="auto", cmap=palette, vmin=0, vmax=9, interpolation="nearest")
        top.set_yticks([])
        top.tick_params(labelbottom=False, bottom=False)
        top.set_ylabel("domain", rotation=0, ha="right", va="center", fontsize=8)
        handles = [Line2D([], [], marker="s", linestyle="", color=palette(d % 10), label=name)
                   for d, name in enumerate(source.domain_names)]  # fmt: skip
        top.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.05), ncol=min(len(handles), 8),
                   fontsize=8, frameon=False, handletextpad=0.2, columnspacing=1.0)  # fmt: skip
        fig.suptitle(title, fontsize=10)
    else:
        ax.set_title(title, fontsize=10)
    fig.draw_without_rendering()  # lays the figure out: the axis' size is known from here on
    box = ax.get_window_extent().transformed(fig.dpi_scale_trans.inverted())  # the axis' inches, after layout
    xs = range(0, n, tick_step(n, box.width, 0.1 + 0.07 * len(str(max(order, default=0)))))
    ax.set_xticks(list(xs), [str(order[i]) for i in xs], fontsize=8)
    ys = range(0, k, tick_step(k, box.height, 0.16))
    ax.set_yticks(list(ys), [str(c) for c in ys], fontsize=8)
    return fig
