"""`summary.json` and the printed results table (schema: docs/guide/metrics.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pflbed.results.console import console as make_console
from pflbed.version import __version__

_PFL_KEYS = ("pfl_acc", "pfl_acc_std", "pfl_acc_min", "pfl_acc_p10", "pfl_val")


def select_round(history: list[dict[str, Any]], key: str | None = None) -> dict[str, Any]:
    """The evaluation with the best *validation* accuracy (P-FL val, else G-FL val; or the record field `key`);
    earliest on ties."""
    key = key or ("pfl_val" if any(h.get("pfl_val") is not None for h in history) else "gfl_val")
    best = max(history, key=lambda h: (h.get(key) if h.get(key) is not None else float("-inf"), -h["round"]))
    return {"round": best["round"], "criterion": key, "gfl_acc": best.get("gfl_acc"), "pfl_acc": best.get("pfl_acc")}


def build_summary(
    cfg,
    fed,
    history: list[dict[str, Any]],
    finetuned: dict[str, dict],
    per_client: dict[int, float],
    timing: dict[str, float],
    new_clients: dict[str, Any] | None = None,
) -> dict[str, Any]:
    last = history[-1]
    final = {k: last.get(k) for k in ("gfl_acc", "gfl_val", *_PFL_KEYS)}
    for method, stats in finetuned.items():
        final[method] = {k: stats.get(k) for k in _PFL_KEYS}
    if "diag" in last:  # the algorithm's own diagnostics at the final round (e.g. FedBasis's collapse signals)
        final["diag"] = last["diag"]
    return {
        "pflbed_version": __version__,
        "algorithm": cfg.algorithm.name,
        "dataset": cfg.dataset.name,
        "model": cfg.model.name,
        **({"init_from": init_record(cfg)} if cfg.model.init_from else {}),
        "seed": cfg.seed,
        "rounds": cfg.train.rounds,
        "clients": {"participated": len(fed.participated), "new": len(fed.new)},
        "pfl_test": cfg.eval.pfl_test,
        "final": final,
        "selected": select_round(history),
        "per_client": {"cid": list(per_client), "pfl_acc": list(per_client.values())},
        "new_clients": new_clients,
        "communication": {k: last.get(k) for k in ("up_bytes_per_round", "down_bytes_per_round")},
        **({"privacy": {k: v for k, v in last["privacy"].items() if k != "epsilon_by_round"}}
           if "privacy" in last else {}),  # the guarantee after the last round
        "timing": timing,
    }


def init_record(cfg) -> dict[str, Any]:
    """The starting weights a run loaded (`model.init_from`): the file, its SHA-256 and the blocks — the config
    names a path, the hash says which weights it held — and, for weights `pflbed pretrain` made, how (`pretraining`).
    """
    from pflbed.models.pretrained import model_file  # late: printing a summary needs no torch

    f = model_file(cfg.model.init_from)
    record = {"path": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "blocks": cfg.model.init_blocks}
    how = pretraining_record(f.parent / "summary.json")
    return {**record, "pretraining": how} if how is not None else record


def pretraining_record(path: Path) -> dict[str, Any] | None:
    """From the `summary.json` `pflbed pretrain` writes beside its weights: the source (dataset, split, domains and
    sample counts), the epochs run, the epoch kept and its held-out accuracy. Why: a result that starts from
    pretrained weights depends on them, so its summary says what they were trained on and how well. None for
    weights from elsewhere (no such file, too large, or not a pretraining summary)."""
    try:
        if path.stat().st_size > 1_000_000:
            return None
        blob = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(blob, dict) and isinstance(blob.get("source"), dict) and isinstance(blob.get("epochs"), list)):
        return None
    return {"source": blob["source"], "epochs": len(blob["epochs"]), "selected_epoch": blob.get("selected_epoch"),
            "val_acc": blob.get("val_acc")}  # fmt: skip


_LABELS = {"fedavg": "FedAvg", "local": "Local"}


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.2f}"


def print_table(summary: dict[str, Any], console: Console | None = None, command_s: float | None = None) -> None:
    """The results as printed after a run; `command_s`: the command's wall time so far, printed on the time line."""
    console = console or make_console()
    name = _LABELS.get(summary["algorithm"], summary["algorithm"])
    f = summary["final"]
    t = Table(
        title=f"{name} on {summary['dataset']} ({summary['model']}, seed {summary['seed']}, "
        f"{summary['rounds']} rounds) — accuracy %, final round"
    )
    for col in ("method", "G-FL", "P-FL mean", "± std", "min", "p10"):
        t.add_column(col, justify="left" if col == "method" else "right")
    t.add_row(
        name,
        _pct(f["gfl_acc"]),
        _pct(f["pfl_acc"]),
        _pct(f["pfl_acc_std"]),
        _pct(f["pfl_acc_min"]),
        _pct(f["pfl_acc_p10"]),
    )
    for method in ("ft", "lp"):
        if method in f:
            m = f[method]
            t.add_row(
                f"{name}+{method.upper()}",
                "",
                _pct(m["pfl_acc"]),
                _pct(m["pfl_acc_std"]),
                _pct(m["pfl_acc_min"]),
                _pct(m["pfl_acc_p10"]),
            )
    console.print(t)
    s, tm = summary["selected"], summary["timing"]
    console.print(
        f"selected on validation ({s['criterion']}): round {s['round']} — G-FL {_pct(s['gfl_acc'])}, "
        f"P-FL {_pct(s['pfl_acc'])}"
    )
    if (line := starting_weights_line(summary)) is not None:
        console.print(line)
    print_new_clients(summary, console)
    if p := summary.get("privacy"):
        eps = "∞ (no noise)" if p["epsilon"] is None else f"{p['epsilon']:.2f}"
        console.print(f"client-level DP: ε = {eps} at δ = {p['delta']:g} after {p['rounds']} rounds (σ = "
                      f"{p['noise_multiplier']:.3f}, C = {p['clip']:g}, q = {p['sampling_rate']:g}, Poisson, "
                      f"{p['accountant'].upper()}{_noise_source(p)})")  # fmt: skip
    console.print(time_line(tm, command_s))


def starting_weights_line(summary: dict[str, Any]) -> str | None:
    """What the starting weights alone scored before training (`init_from.test_acc`), printed under the results
    they are read against; None for a run from scratch or a summary written before the figure was recorded."""
    acc = (summary.get("init_from") or {}).get("test_acc")
    if acc is None:
        return None
    if "why" in acc:
        return f"starting weights alone: not scored ({acc['why']})"
    domains = "".join(f", {name} {_pct(v)}" for name, v in acc.get("domains", {}).items())
    return f"starting weights alone, before training: G-FL {_pct(acc['global'])}{domains}"


def time_line(timing: dict[str, float], command_s: float | None = None) -> str:
    """The printed time line. `timing.wall_s` covers the rounds and the final stages (fine-tuning, new clients,
    artifacts, the summary) over all of a run's sessions, as bench tables report it; not the start-up before the
    first round (imports, data, federation, model, Flower's runtime), which can take longer than a short run, so the
    line names what it covers and, from the CLI, adds the command's time until the line is printed (`command_s`)."""
    covered = "wall in the rounds and final stages" + ("" if command_s is not None else " (start-up not counted)")
    line = (f"time: {timing['wall_s']:.1f} s {covered}, {timing['train_s']:.1f} s training "
            f"({timing['s_per_round']:.2f} s/round), {timing['eval_s']:.1f} s evaluation")  # fmt: skip
    return line if command_s is None else f"{line}; {command_s:.1f} s since the command started"


def _noise_source(p: dict[str, Any]) -> str:
    """Where the run's noise came from, for the printout (`privacy.randomness`); nothing for a summary written
    before it was recorded."""
    how = p.get("randomness")
    return "" if how is None else ", noise from the OS" if how == "os" else ", seeded noise"


def print_new_clients(summary: dict[str, Any], console: Console) -> None:
    """The new-client table shaped like the FedBasis paper's Table 2: rows methods, columns size × Last/Best/Δ."""
    nc = summary.get("new_clients")
    if not nc:
        return
    name = _LABELS.get(summary["algorithm"], summary["algorithm"])
    sizes = list(nc["sizes"])
    t = Table(title=f"new clients ({nc['clients']}): accuracy %, {nc['epochs']} epochs, lr chosen on validation "
                    f"from {nc['lrs']}")  # fmt: skip
    t.add_column("method")
    for size in sizes:
        for col in ("Last", "Best", "Δ"):
            t.add_column(f"{size} {col}", justify="right")
    if nc["zero_shot"]:
        t.add_row(f"{name} (zero-shot)", *[c for _ in sizes for c in (_pct(nc["zero_shot"]["acc"]), "—", "—")])
    for method, per_size in nc["methods"].items():
        cells = []
        for size in sizes:
            r = per_size[size]
            cells += [_pct(r["last"]), _pct(r["best"]), f"{100 * r['delta']:+.2f}"]
        t.add_row(f"{name}+{method.upper()}", *cells)
    console.print(t)
