"""`pflbed data show`: what each client holds, as a table and a heat-map (FedBasis paper Fig. 6–8 style).

Point size ∝ the number of training samples of a class at a client; colour = the client's domain. Clients are
ordered by role (participated, then new) and domain, so label skew (P_m(y)) and domain skew (P_m(x)) are both
visible at a glance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from pflbed.data.arrays import DataSource
from pflbed.federation import Federation
from pflbed.results.console import console as make_console


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = client_counts(source, fed)
    order = _order(fed)
    domains = np.array([fed.clients[c].domain for c in order])
    fig_w = min(2 + 0.12 * len(order), 30)
    fig, ax = plt.subplots(figsize=(fig_w, 1.5 + 0.3 * source.num_classes))
    xs, ys = np.meshgrid(np.arange(len(order)), np.arange(source.num_classes), indexing="ij")
    sizes = counts[order] / max(counts.max(), 1) * 120
    colors = plt.get_cmap("tab10")(domains % 10)
    ax.scatter(xs.ravel(), ys.ravel(), s=sizes.ravel(), c=np.repeat(colors, source.num_classes, axis=0), alpha=0.8)
    n_part = len(fed.participated)
    ax.axvline(n_part - 0.5, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("client (left of the dashed line: participated; right: new)")
    if source.domain_names:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], marker="o", linestyle="", color=plt.get_cmap("tab10")(d % 10), label=name)
                   for d, name in enumerate(source.domain_names)]  # fmt: skip
        ax.legend(handles=handles, title="domain", loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_ylabel("class")
    ax.set_yticks(range(source.num_classes))
    ax.set_xlim(-1, len(order))
    ax.set_title(f"{source.name}: training samples per client and class")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
