"""The leaderboard page (docs/results/leaderboard.md), written from a finished `pflbed tune` study's table.json: one
table per sort key (P-FL, G-FL, new clients) in tabs, what tuning changed in the ordering computed from the same
numbers, and each method's chosen configuration with a link to its algorithm's page; and each algorithm's row, which
its page shows (`docs/generate.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from scipy.stats import kendalltau

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "suites" / "leaderboard_fmnist.yaml"
TABLE = ROOT / "benchmarks" / "results" / "leaderboard_fmnist" / "table.json"
KEYS = {"P-FL": "P-FL", "G-FL": "G-FL", "New": "new clients"}  # column → tab title


def rows() -> list[dict[str, Any]]:
    """The study's rows, each with its algorithm's name (from the suite's `set`); none before a table exists."""
    if not TABLE.is_file():
        return []
    suite = yaml.safe_load(SUITE.read_text())
    out = json.loads(TABLE.read_text())["methods"]
    for r in out:
        r["algorithm"] = suite["methods"][r["method"]]["set"]["algorithm.name"]
    return out


def _anchor(method: str) -> str:
    return "config-" + "".join(c if c.isalnum() else "-" for c in method.lower()).strip("-")


def _fig(v: list[float] | None) -> str:
    return "—" if v is None else f"{v[0]:.2f} ± {v[1]:.2f}"


def _tuned(r: dict[str, Any], col: str) -> float:
    v = r["tuned"].get(col)
    return -1.0 if v is None else v[0]


def _table(rs: list[dict[str, Any]], key: str) -> list[str]:
    cols = [c for c in KEYS if any(c in r["default"] for r in rs)]
    head = ["rank", "method"] + [f"{c} {w}" for c in cols for w in ("default", "tuned")]
    head += ["search compute (base runs)", "trials (complete / pruned)", "seeds (default / tuned)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(sorted(rs, key=lambda r: -_tuned(r, key)), 1):
        name = f"[{r['method']}](#{_anchor(r['method'])})"
        cells = [str(i), name] + [_fig(r[w].get(c)) for c in cols for w in ("default", "tuned")]
        spent = f"{r['compute']['base_runs']:.2f} of {r['budget']:g}" + ("" if r["finished"] else " (short)")
        s = r["seeds"]
        cells += [spent, f"{r['complete'] + r['pruned']} ({r['complete']} / {r['pruned']})",
                  f"{s['default']} / {s['tuned']} of {s['of']}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ordering(rs: list[dict[str, Any]]) -> list[str]:
    """What tuning changed in the P-FL ordering, from the numbers: the rank correlation, the movers, the gains."""
    both = [r for r in rs if r["default"].get("P-FL") and r["tuned"].get("P-FL")]
    if len(both) < 3:
        return ["Too few methods with default and tuned figures yet to compare their orderings."]
    rank = {w: {r["method"]: i for i, r in enumerate(sorted(both, key=lambda r: -r[w]["P-FL"][0]), 1)}
            for w in ("default", "tuned")}  # fmt: skip
    tau = kendalltau([rank["default"][r["method"]] for r in both], [rank["tuned"][r["method"]] for r in both])[0]
    gains = sorted(((r["tuned"]["P-FL"][0] - r["default"]["P-FL"][0], r["method"]) for r in both), reverse=True)
    moves = sorted(((rank["default"][m] - rank["tuned"][m], m) for m in rank["default"]), reverse=True)
    top = [m for m, _ in sorted(rank["tuned"].items(), key=lambda x: x[1])[:3]]
    top_default = [m for m, _ in sorted(rank["default"].items(), key=lambda x: x[1])[:3]]
    out = [f"- Over the {len(both)} methods with both figures, Kendall's τ between the default and the tuned P-FL "
           f"orderings is {tau:.2f} (1: the same order).",
           f"- Top three by P-FL, default: {', '.join(top_default)}; tuned: {', '.join(top)}.",
           "- Largest gains from tuning (P-FL points): "
           + ", ".join(f"{m} {g:+.2f}" for g, m in gains[:5]) + "; smallest: "
           + ", ".join(f"{m} {g:+.2f}" for g, m in gains[-3:]) + ".",
           "- Methods tuning moved by three places or more: "
           + (", ".join(f"{m} {rank['default'][m]} → {rank['tuned'][m]}" for d, m in moves if abs(d) >= 3) or "none")
           + "."]  # fmt: skip
    worse = [r for r in both if r["tuned"]["P-FL"][0] < r["default"]["P-FL"][0]]
    first = yaml.safe_load(SUITE.read_text())["tune"].get("first", "default")
    if worse and first == "default":
        out.append(f"- Tuned below default in P-FL: {_n(len(worse))} ("
                   + ", ".join(f"{r['method']} {r['tuned']['P-FL'][0] - r['default']['P-FL'][0]:+.2f}" for r in worse)
                   + "). Each study's first trial ran the default (`tune.first: default`); where it completed, the "
                   "choice scored at least its figure on the trials' validation data (default trial → chosen: "
                   + ", ".join(f"{r['method']} {_trial(r)} → {100 * r['best_value']:.2f}" for r in worse)
                   + "). A choice equal to the default trial's figure is that trial, which differs from the default "
                   "only in keys the default leaves outside the space (drawn); otherwise what the trial federation's "
                   "validation data preferred did not carry over to the reported seeds' tests.")  # fmt: skip
    if worse and first == "sampled":
        few = sum(r["complete"] <= 4 for r in worse)
        out.append(f"- Tuned below default in P-FL: {_n(len(worse))} ("
                   + ", ".join(f"{r['method']} {r['complete']}" for r in worse) + " complete trials). "
                   f"{few} of them completed four trials or fewer. This board's studies drew every trial, the first "
                   "included (`tune.first: sampled`), so a costly method's choice was among a few start-up draws, "
                   "and no study ever tried its default. `pflbed tune` now runs the default as each study's first "
                   "trial (`tune.first: default`), and the board is to be re-run with it.")  # fmt: skip
    return out


def _n(k: int) -> str:
    return f"{k} method" + ("" if k == 1 else "s")


def _trial(r: dict[str, Any]) -> str:
    """The default trial's objective (%), or its state when it has none (pruned; absent in a study from before)."""
    t = r.get("default_trial")
    if t is None:
        return "not run"
    if t["value"] is None:
        return t["state"].lower()
    return f"{100 * t['value']:.2f}" + (" (pruned)" if t["state"] == "PRUNED" else "")


def _stopped(r: dict) -> str:
    """", stopped at round r" for a best trial scored on the rounds it ran (a first trial that alone spent the
    budget)."""
    cut = r.get("best_truncated")
    if not cut:
        return ""
    on = "" if cut["scored_on"] == r["objective"] else f", scored on {cut['scored_on']}"
    return f", stopped at round {cut['round']} where it spent the budget{on}"


def page() -> str:
    rs = rows()
    head = ["<!-- generated by docs/generate.py from benchmarks/results/leaderboard_fmnist/table.json -->", "",
            "# Leaderboard: every algorithm, tuned with the same compute", ""]  # fmt: skip
    if not rs:
        return "\n".join(head + ["The leaderboard study has not written its table yet (`pflbed tune -c "
                                 "benchmarks/suites/leaderboard_fmnist.yaml --out "
                                 "benchmarks/results/leaderboard_fmnist`)."]) + "\n"  # fmt: skip
    table = json.loads(TABLE.read_text())
    done = sum(r["finished"] for r in rs)
    spent = [r["compute"]["base_runs"] for r in rs]
    intro = [
        f"{len(rs)} methods, each searched with the same training compute by [`pflbed tune`](../guide/tuning.md), "
        "then its default and its chosen configuration re-run over seeds "
        f"{', '.join(map(str, table['seeds']))}. The setting and the protocol are in "
        "`benchmarks/suites/leaderboard_fmnist.yaml`; the studies, trials and re-runs in "
        "`benchmarks/results/leaderboard_fmnist/` (`table.md` there adds the objective, the chosen values and the "
        "wall times; `report.html` the plots).",
        "",
        f"Test figures (%), mean ± population std over the seeds: P-FL and G-FL at the round selected on "
        "validation (FedAvg+FT / +LP: after their final fine-tuning), new clients fine-tuned on all their "
        "training data at the learning rate and epoch chosen on their validation data. Trials ran on seed "
        f"{table['trial_seed']}, on data without any sample the reported seeds test on. Compute in base runs (the "
        "sample passes of FedAvg's training in one base-configuration run); a study that has not spent its budget "
        f"is marked short ({done} of {len(rs)} have). Spent: {min(spent):.2f}–{max(spent):.2f} base runs against "
        f"a budget of {rs[0]['budget']:g}: a trial is cut at its first evaluation past the budget, so a study ends "
        "within one evaluation interval of its trials' training per process running them, "
        "and a study's first trial, where it alone spends the budget, is stopped there and scored on the rounds it "
        "ran. Ranked by the tuned figure; each method links to its chosen configuration below.",
        "",
    ]  # fmt: skip
    tabs = []
    for key, title in KEYS.items():
        if any(key in r["default"] for r in rs):
            tabs += [f'=== "by {title}"', ""] + ["    " + line for line in _table(rs, key)] + [""]
    configs = ["## Chosen configurations", ""]
    for r in sorted(rs, key=lambda r: r["method"].lower()):
        chosen = ", ".join(f"`{k}={v:.4g}`" if isinstance(v, float) else f"`{k}={v}`" for k, v in r["chosen"].items())
        configs += [f'### {r["method"]} {{ #{_anchor(r["method"])} }}', "",
                    f"[`{r['algorithm']}`](../algorithms/{r['algorithm']}.md); best trial "
                    + ("—" if r["best_trial"] is None else f"#{r['best_trial']} ({r['objective']} "
                       f"{100 * r['best_value']:.2f}{_stopped(r)})") + f": {chosen or 'none yet'}."
                    + (" The default configuration: its tuned figures are the default's re-runs."
                       if r.get("chosen_is_default") else ""), ""]  # fmt: skip
    return "\n".join(head + intro + tabs + ["## What tuning changed in the ordering", "", *_ordering(rs), ""]
                     + configs)  # fmt: skip


def algorithm_rows(name: str) -> list[str]:
    """The leaderboard rows of algorithm `name` (FedAvg+FT / +LP with FedAvg), for its page."""
    rs = [r for r in rows() if r["algorithm"] == name]
    if not rs:
        return []
    out = ["| method | P-FL default | P-FL tuned | G-FL default | G-FL tuned | new clients default | "
           "new clients tuned | chosen |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rs:
        figs = [_fig(r[w].get(c)) for c in KEYS for w in ("default", "tuned")]
        link = f"[{r['method']}](../results/leaderboard.md#{_anchor(r['method'])})"
        chosen = ", ".join(f"{k.split('.', 1)[1]}={v:.4g}" if isinstance(v, float) else f"{k.split('.', 1)[1]}={v}"
                           for k, v in r["chosen"].items())  # fmt: skip
        out.append("| " + " | ".join([link, *figs, chosen or "—"]) + " |")
    return out
