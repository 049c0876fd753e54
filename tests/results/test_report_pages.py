"""`pflbed report` on fabricated finished run directories (config.yaml, summary.json, metrics.jsonl written with
known figures): the comparison table shows each figure from its own summary field in its unit, the timing table
every timing key, the curves' panels and their note the records, and the Markdown a user pastes and the HTML page's
tables, headings, notes and folded configs are pinned whole; run names cannot inject markup into the page."""

import base64
import json
import re
from pathlib import Path

import pytest

from pflbed.errors import PflbedError
from pflbed.results import report
from pflbed.results.report import (
    STYLE,
    RunData,
    _epsilon,
    _inline_svg,
    _schedule,
    _timing_rows,
    coinciding,
    comparison,
    curves_note,
    figures,
    panels,
    read_run,
    render_html,
    render_markdown,
    write_report,
)
from pflbed.results.report_figures import Panel, run_colour, run_series

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8  # an algorithm's own plot: shown byte for byte, never decoded

ALPHA_CONFIG = ("seed: 0\ndataset:\n  name: cifar10\nalgorithm:\n  name: fedavg\ntrain:\n  rounds: 10\n"
                "eval:\n  every: 5\n")
BETA_CONFIG = "seed: 0\ndataset:\n  name: cifar10\nalgorithm:\n  name: fedrod\ntrain:\n  rounds: 10\n"

ALPHA_SUMMARY = {  # every figure distinct, exact in binary, so a field read from the wrong place shows
    "algorithm": "fedavg", "dataset": "cifar10", "rounds": 10,
    "final": {"gfl_acc": 0.5, "pfl_acc": 0.625, "pfl_acc_std": 0.125, "pfl_acc_p10": 0.375,
              "ft": {"pfl_acc": 0.6875}, "lp": {"pfl_acc": 0.65625}},
    "selected": {"round": 5, "pfl_acc": 0.59375},
    "new_clients": {"methods": {"ft": {"M": {"best": 0.53125}, "S": {"best": 0.25}}, "lp": {"M": {"best": 0.125}}}},
    "communication": {"up_bytes_per_round": 1_250_000, "down_bytes_per_round": 2_500_000},
    "timing": {"wall_s": 12.25, "train_s": 10.5},
    "per_client": {"pfl_acc": [0.5, 0.75]},
    "artifacts": {"mask": "plots/mask.png"},
    "privacy": {"epsilon": 2.5, "delta": 1e-05},
}  # fmt: skip
BETA_SUMMARY = {"algorithm": "fedrod", "dataset": "cifar10", "rounds": 10, "final": {"pfl_acc": 0.4375},
                "timing": {"train_s": 3.0, "eval_s": 1.5}}  # fmt: skip
ALPHA_RECORDS = [
    {"round": 5, "gfl_acc": 0.25, "pfl_acc": 0.5, "pfl_val": 0.375, "gfl_val": 0.125, "pfl_acc_p10": 0.0625,
     "train_loss": 2.5, "up_bytes_per_round": 1_000_000, "down_bytes_per_round": 3_000_000, "full_test": False},
    {"round": 10, "gfl_acc": 0.5, "pfl_acc": 0.625, "pfl_val": 0.5, "gfl_val": 0.25, "pfl_acc_p10": 0.375,
     "train_loss": 1.5, "up_bytes_per_round": 1_250_000, "down_bytes_per_round": 2_500_000, "full_test": True},
]  # fmt: skip
BETA_RECORDS = [{"round": 0, "pfl_acc": 0.125, "eval_loss": None}, {"round": 10, "pfl_acc": 0.4375, "eval_loss": 1.25}]


def _write_run(path, config, summary, records, files=None):
    """A finished run directory with exactly these files."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(config)
    (path / "summary.json").write_text(json.dumps(summary))
    if records is not None:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for rel, data in (files or {}).items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return path


@pytest.fixture
def no_data(tmp_path, monkeypatch):
    """No dataset can be found here (an empty cache, no $PFLBED_DATA): cifar10's partition cannot be rebuilt, so
    the page holds no heat-map, and nothing is downloaded (download is off unless a config turns it on)."""
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("PFLBED_DATA", raising=False)


@pytest.fixture
def pair(tmp_path, no_data):
    alpha = _write_run(tmp_path / "runs" / "alpha", ALPHA_CONFIG, ALPHA_SUMMARY, ALPHA_RECORDS,
                       {"plots/mask.png": PNG})  # fmt: skip
    beta = _write_run(tmp_path / "runs" / "beta", BETA_CONFIG, BETA_SUMMARY, BETA_RECORDS)
    return [read_run(alpha), read_run(beta)]


EXPECTED_MD = """\
# pflbed report: alpha, beta

## Comparison

| run | algorithm | dataset | rounds | G-FL | P-FL | P-FL std | P-FL, 10th-percentile client | selected round \
| P-FL at the selected round | P-FL after fine-tuning | P-FL after linear probing | new clients, fine-tuned \
| MB per round, up / down | wall time (s) | DP ε (δ) |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| alpha | FedAvg | cifar10 | 10 | 50.00 | 62.50 | 12.50 | 37.50 | 5 | 59.38 | 68.75 | 65.62 | 53.12 | 1.25 / 2.5 \
| 12.2 | 2.50 (1e-05) |
| beta | FedRoD (linear) | cifar10 | 10 | — | 43.75 | — | — | — | — | — | — | — | — / — | — | no DP |

Accuracies in %. G-FL: the generic model on the shared test set; P-FL: each client's personal model on its own test \
data, mean over clients (std: across clients); the selected round is the evaluation with the best P-FL on validation. \
After fine-tuning / linear probing: P-FL once each client has trained its copy of the final model (all of it / its \
head only: eval.finetune). New clients: clients held out of training, each fine-tuning the final model on its M share \
of training data (the second of eval.new_clients.fractions: all of it by default), scored on test at the epoch best \
on validation. Communication: MB (10⁶ bytes) per round, of the last round.

## Config

Keys whose value is not pflbed's default (nested keys dotted); the rest is at its default. Differ between the runs \
(marked ≠): algorithm.name.

| key | alpha | beta | default |
|---|---|---|---|
| dataset.name | cifar10 | cifar10 | digits |
| train.rounds | 10 | 10 | 30 |
| **algorithm.name** ≠ | fedavg | fedrod | fedavg |

<details><summary>full config of alpha</summary>

```yaml
seed: 0
dataset:
  name: cifar10
algorithm:
  name: fedavg
train:
  rounds: 10
eval:
  every: 5
```

</details>

<details><summary>full config of beta</summary>

```yaml
seed: 0
dataset:
  name: cifar10
algorithm:
  name: fedrod
train:
  rounds: 10
```

</details>

## Learning curves

Each point is an evaluation. alpha: evaluated every 5 rounds and after the last — 2 points (rounds 5, 10); beta: \
evaluated as logged — 2 points (rounds 0, 10). For more points, run again with --set eval.every=1 (an evaluation \
after every round; slower). Round 0 (before training) is logged for beta. Intermediate evaluations score a subsample \
of the shared test sets (eval.test_subsample). Communication in MB (10⁶ bytes) per round: up = clients → server, \
down = server → clients.

### learning curves

![learning curves](r_files/curves.svg)

## Clients

### per-client P-FL

![per-client P-FL](r_files/per-client.svg)

## The algorithm's own plots

### alpha: mask (mask.png)

![alpha: mask (mask.png)](r_files/alpha-mask.png)

## Timing (seconds)

| run | wall_s | train_s | eval_s |
|---|---|---|---|
| alpha | 12.25 | 10.50 | — |
| beta | — | 3.00 | 1.50 |
"""


def test_the_markdown_report_is_exactly_this(pair, tmp_path):
    """The Markdown a user pastes, whole: every figure from its summary field in its unit (% to 2 decimals, MB to 3
    significant digits, wall time to 0.1 s, ε to 2 decimals with δ), a dash for what a summary lacks, the config as
    its differences (the key the runs differ in marked), each full config folded, the curves' note (no hover advice:
    a Markdown figure is an image), the figures where they were written, the timing table over every timing key."""
    out = write_report([r.path for r in pair], tmp_path / "out" / "deep" / "r.md", "md")  # its folders made
    assert out == tmp_path / "out" / "deep" / "r.md"
    assert out.read_text() == EXPECTED_MD
    files = tmp_path / "out" / "deep" / "r_files"
    assert sorted(p.name for p in files.iterdir()) == ["alpha-mask.png", "curves.svg", "per-client.svg"]
    assert (files / "alpha-mask.png").read_bytes() == PNG
    assert (files / "curves.svg").read_text().startswith("<svg") and "P-FL test" in (files / "curves.svg").read_text()
    assert (files / "per-client.svg").read_text().startswith("<svg")


def _td(*cells):
    return "".join(f"<td>{c}</td>" for c in cells)


EXPECTED_HTML = "\n".join([
    "<!doctype html><html><head><meta charset='utf-8'><title>pflbed report: alpha, beta</title><style>STYLE</style>"
    "</head><body><h1>pflbed report: alpha, beta</h1>",
    "<h2>Comparison</h2>",
    "<table><thead><tr><th>run</th><th>algorithm</th><th>dataset</th><th>rounds</th><th>G-FL</th><th>P-FL</th>"
    "<th>P-FL std</th><th>P-FL, 10th-percentile client</th><th>selected round</th><th>P-FL at the selected round</th>"
    "<th>P-FL after fine-tuning</th><th>P-FL after linear probing</th><th>new clients, fine-tuned</th>"
    "<th>MB per round, up / down</th><th>wall time (s)</th><th>DP ε (δ)</th></tr></thead><tbody>"
    "<tr>" + _td("alpha", "FedAvg", "cifar10", "10", "50.00", "62.50", "12.50", "37.50", "5", "59.38", "68.75", "65.62",
                 "53.12", "1.25 / 2.5", "12.2", "2.50 (1e-05)") + "</tr>"
    "<tr>" + _td("beta", "FedRoD (linear)", "cifar10", "10", "—", "43.75", *["—"] * 7, "— / —", "—", "no DP") + "</tr>"
    "</tbody></table>",
    "<p class='note'>Accuracies in %. G-FL: the generic model on the shared test set; P-FL: each client&#x27;s "
    "personal model on its own test data, mean over clients (std: across clients); the selected round is the "
    "evaluation with the best P-FL on validation. After fine-tuning / linear probing: P-FL once each client has "
    "trained its copy of the final model (all of it / its head only: eval.finetune). New clients: clients held out of "
    "training, each fine-tuning the final model on its M share of training data (the second of "
    "eval.new_clients.fractions: all of it by default), scored on test at the epoch best on validation. "
    "Communication: MB (10⁶ bytes) per round, of the "
    "last round.</p>",
    "<h2>Config</h2>",
    "<p class='note'>Keys whose value is not pflbed&#x27;s default (nested keys dotted); the rest is at its default. "
    "Differ between the runs (highlighted): algorithm.name.</p>",
    "<table class='cfg'><thead><tr><th>key</th><th>alpha</th><th>beta</th><th>default</th></tr></thead><tbody>"
    "<tr>" + _td("dataset.name", "cifar10", "cifar10", "digits") + "</tr>"
    "<tr>" + _td("train.rounds", "10", "10", "30") + "</tr>"
    "<tr class='differs'>" + _td("algorithm.name", "fedavg", "fedrod", "fedavg") + "</tr></tbody></table>",
    f"<details><summary>full config of alpha</summary><pre>{ALPHA_CONFIG}</pre></details>",
    f"<details><summary>full config of beta</summary><pre>{BETA_CONFIG}</pre></details>",
    "<h2>Learning curves</h2>",
    "<p class='note'>Each point is an evaluation. alpha: evaluated every 5 rounds and after the last — 2 points "
    "(rounds 5, 10); beta: evaluated as logged — 2 points (rounds 0, 10). For more points, run again with --set "
    "eval.every=1 (an evaluation after every round; slower). Hover a point for its value, zoom the page for detail. "
    "Round 0 (before training) is logged for beta. Intermediate evaluations score a subsample of the shared test "
    "sets (eval.test_subsample). Communication in MB (10⁶ bytes) per round: up = clients → server, down = server → "
    "clients.</p>",
    "<svg…>",
    "<h2>Clients</h2>",
    "<svg…>",
    "<h2>The algorithm's own plots</h2>",
    "<h3>alpha: mask (mask.png)</h3>",
    "<img alt='alpha: mask (mask.png)' src='data:image/png;base64,…'>",
    "<h2>Timing (seconds)</h2>",
    "<table><thead><tr><th>run</th><th>wall_s</th><th>train_s</th><th>eval_s</th></tr></thead><tbody>"
    "<tr>" + _td("alpha", "12.25", "10.50", "—") + "</tr><tr>" + _td("beta", "—", "3.00", "1.50") + "</tr>"
    "</tbody></table>",
    "</body></html>",
])  # fmt: skip


def _skeleton(page):
    """The page with each inline SVG's drawing, the style sheet and the PNG bytes taken out (checked apart)."""
    page = page.replace(f"<style>{STYLE}</style>", "<style>STYLE</style>", 1)
    page = re.sub(r"<svg[^>]*>.*?</svg>\n?", "<svg…>", page, flags=re.S)
    return re.sub(r"base64,[^']*'", "base64,…'", page)


def test_the_html_page_s_tables_headings_notes_and_folded_configs_are_exactly_these(pair, tmp_path):
    """The page's structure whole (the SVG drawings apart): the same tables and figures as the Markdown, HTML-escaped,
    the rows whose values differ between runs in class `differs`, each full config in a `<details>` block, the
    curves' note with its hover advice (the SVG is inline, its tooltips show); each SVG fitted to the page's width
    but never above its own size, the algorithm's plot inlined byte for byte."""
    out = write_report([r.path for r in pair], tmp_path / "r.html")
    page = out.read_text()
    assert _skeleton(page) == EXPECTED_HTML
    assert "tr.differs td{background:" in STYLE  # the highlight the config table's `differs` rows rely on
    svgs = re.findall(r"<svg[^>]*>", page)
    assert len(svgs) == 2
    for tag in svgs:  # 1 pt = 4/3 px
        width = float(re.search(r'viewBox="0 0 ([\d.]+) [\d.]+"', tag).group(1))
        assert f'style="width:100%;height:auto;max-width:{width * 4 / 3:.0f}px"' in tag and 'width="' not in tag
    assert re.findall(r"base64,([^']*)'", page) == [base64.b64encode(PNG).decode()]


def test_inline_svg_without_a_size_is_left_as_it_is():
    assert _inline_svg('<svg viewBox="0 0 10 10"><g/></svg>') == '<svg viewBox="0 0 10 10"><g/></svg>'
    assert _inline_svg('<svg width="30pt" height="15pt" viewBox="0 0 30 15"/>') == (
        '<svg style="width:100%;height:auto;max-width:40px" viewBox="0 0 30 15"/>')  # fmt: skip


def _run(name, history, config="", summary=None):
    """A run's data as read (no files): what the curves, their note and the tables derive from."""
    return RunData(name, Path(name), config, summary or {}, history)


def _ev(*rounds, **figures):
    return [{"round": r, **figures} for r in rounds]


def test_the_comparison_row_reads_each_figure_from_its_own_summary_field(pair):
    """Each cell from its field (new clients: fine-tuning's best on the M share, not S, not linear probing; after
    fine-tuning / linear probing: final.ft / final.lp), in its unit; the DP column only when some run used DP."""
    header, rows = comparison(pair)
    assert dict(zip(header, rows[0], strict=True)) == {
        "run": "alpha", "algorithm": "FedAvg", "dataset": "cifar10", "rounds": "10", "G-FL": "50.00", "P-FL": "62.50",
        "P-FL std": "12.50", "P-FL, 10th-percentile client": "37.50", "selected round": "5",
        "P-FL at the selected round": "59.38", "P-FL after fine-tuning": "68.75", "P-FL after linear probing": "65.62",
        "new clients, fine-tuned": "53.12", "MB per round, up / down": "1.25 / 2.5", "wall time (s)": "12.2",
        "DP ε (δ)": "2.50 (1e-05)"}  # fmt: skip
    assert rows[1][-1] == "no DP"
    header, rows = comparison([pair[1]])  # no run used DP: no column for it
    assert header[-1] == "wall time (s)" and len(rows[0]) == len(header) == 15


def test_epsilon_is_the_guarantee_or_infinity_without_noise():
    assert _epsilon(None) == "no DP"
    assert _epsilon({"epsilon": None, "delta": 1e-05}) == "∞ (1e-05)"  # DP clipping without noise: no guarantee
    assert _epsilon({"epsilon": 3.14159, "delta": 0.001}) == "3.14 (0.001)"
    header, rows = comparison([_run("dp", [], summary={**BETA_SUMMARY, "privacy": {"epsilon": None, "delta": 1e-6}})])
    assert (header[-1], rows[0][-1]) == ("DP ε (δ)", "∞ (1e-06)")


def test_panels_are_the_records_in_their_units(pair):
    """Accuracies in %, losses as logged (each its own panel, sorted; a null loss is no point), communication in MB;
    a panel no run has data for is left out; each run in its own colour, line style and marker."""
    a, b = pair
    pct = [("gfl_acc", "G-FL test", [25.0, 50.0]), ("pfl_acc", "P-FL test", [50.0, 62.5]),
           ("pfl_val", "P-FL validation", [37.5, 50.0]), ("gfl_val", "G-FL validation", [12.5, 25.0]),
           ("pfl_acc_p10", "P-FL test, 10th-percentile client", [6.25, 37.5])]  # fmt: skip
    expected = [Panel(k, t, "accuracy %", "%", [run_series(0, "alpha", [5, 10], v)]) for k, t, v in pct]
    expected[1].series.append(run_series(1, "beta", [0, 10], [12.5, 43.75]))
    expected += [Panel("eval_loss", "eval loss", "loss", "", [run_series(1, "beta", [10], [1.25])]),
                 Panel("train_loss", "train loss", "loss", "", [run_series(0, "alpha", [5, 10], [2.5, 1.5])]),
                 Panel("up_bytes_per_round", "up (clients → server)", "MB per round", "MB",
                       [run_series(0, "alpha", [5, 10], [1.0, 1.25])]),
                 Panel("down_bytes_per_round", "down (server → clients)", "MB per round", "MB",
                       [run_series(0, "alpha", [5, 10], [3.0, 2.5])])]  # fmt: skip
    assert panels([a, b]) == expected
    assert b.curve("eval_loss") == ([10], [1.25])


def test_the_schedule_says_when_each_run_was_evaluated(tmp_path):
    """Runs of one schedule share a clause; more than 8 rounds are shown as first … last; "1 round", "1 point";
    fewer than 5 points in any run (not only the last) bring the advice to evaluate every round."""
    every = "eval:\n  every: {}\n"
    nine = _run("nine", _ev(*range(1, 10)), every.format(1))
    eight = _run("eight", _ev(*range(2, 18, 2)), every.format(2))
    four = [_run(n, _ev(5, 10, 15, 20), every.format(5)) for n in ("p", "q")]
    one = _run("one", _ev(3), "eval: {}\n")
    assert _schedule([nine]) == "nine: evaluated every 1 round and after the last — 9 points (rounds 1 … 9). "
    assert _schedule([eight]) == ("eight: evaluated every 2 rounds and after the last — 8 points "
                                  "(rounds 2, 4, 6, 8, 10, 12, 14, 16). ")  # fmt: skip
    advice = "For more points, run again with --set eval.every=1 (an evaluation after every round; slower). "
    assert _schedule([*four, nine]) == ("p, q: evaluated every 5 rounds and after the last — 4 points "
                                        "(rounds 5, 10, 15, 20); nine: evaluated every 1 round and after the last — "
                                        "9 points (rounds 1 … 9). " + advice)  # fmt: skip
    assert _schedule([one]) == "one: evaluated as logged — 1 point (rounds 3). " + advice
    five = _run("five", _ev(1, 2, 3, 4, 5), every.format(1))
    assert advice not in _schedule([five])


def test_coinciding_curves_are_the_same_points_to_9_decimals():
    """Runs drawn over each other are named per panel; values apart by less than 1e-9 coincide, by 1e-6 do not;
    the same values at other rounds do not."""
    a = _run("a", _ev(1, 2, pfl_acc=0.5, gfl_acc=0.25))
    b = _run("b", [{"round": 1, "pfl_acc": 0.5 + 1e-12, "gfl_acc": 0.25}, *_ev(2, pfl_acc=0.5, gfl_acc=0.25)])
    c = _run("c", _ev(1, 2, pfl_acc=0.5 + 1e-6, gfl_acc=0.25))
    d = _run("d", _ev(1, 3, pfl_acc=0.5, gfl_acc=0.25))
    assert coinciding(panels([a, b, c, d])) == ["G-FL test: a, b, c", "P-FL test: a, b"]
    assert coinciding(panels([a, d])) == []


def test_the_curves_note_whole(tmp_path):
    """Everything the note says, in order: the schedule, the hover advice (inline only), round 0, the subsample
    (only when a record says full_test false), the identical curves, the units of communication."""
    a = _run("a", _ev(0, 1, 2, 3, 4, pfl_acc=0.5, full_test=True), "eval:\n  every: 1\n")
    b = _run("b", _ev(0, 1, 2, 3, 4, pfl_acc=0.5), "eval:\n  every: 1\n")
    assert curves_note([a, b]) == (
        "Each point is an evaluation. a, b: evaluated every 1 round and after the last — 5 points (rounds 0, 1, 2, 3, "
        "4). Hover a point for its value, zoom the page for detail. Round 0 (before training) is logged for a, b. "
        "Identical curves, drawn over each other (told apart by line style and marker): P-FL test: a, b. "
        "Communication in MB (10⁶ bytes) per round: up = clients → server, down = server → clients.")  # fmt: skip
    c = _run("c", _ev(1, 2, 3, 4, 5, pfl_acc=0.5, gfl_acc=0.25, full_test=False), "eval:\n  every: 1\n")
    d = _run("d", _ev(1, 2, 3, 4, 5, pfl_acc=0.5, gfl_acc=0.25), "eval:\n  every: 1\n")
    assert curves_note([c, d], inline=False) == (
        "Each point is an evaluation. c, d: evaluated every 1 round and after the last — 5 points (rounds 1, 2, 3, 4, "
        "5). No run logged an evaluation before training (round 0), so each curve starts at its first evaluated round. "
        "Intermediate evaluations score a subsample of the shared test sets (eval.test_subsample). Identical curves, "
        "drawn over each other (told apart by line style and marker): G-FL test: c, d; P-FL test: c, d. "
        "Communication in MB (10⁶ bytes) per round: up = clients → server, down = server → clients.")  # fmt: skip


SYNTHETIC = "seed: {seed}\ndataset:\n  name: synthetic\n  synthetic:\n    n_train: {n}\n    n_test: 50\n" \
            "federation:\n  clients: {clients}\n"  # fmt: skip
REORDERED = "federation:\n  clients: 3\ndataset:\n  synthetic:\n    n_test: 50\n    n_train: 200\n  name: synthetic\n" \
            "seed: 0\n"  # fmt: skip


def test_one_heat_map_per_federation_named_by_its_runs(tmp_path, monkeypatch):
    """Runs of the same seed, dataset and federation (keys in any order) share one heat-map; a run differing in any
    of the three has its own. The per-client histogram gets each run's final per-client P-FL in %, in its colour."""
    from pflbed.results import report

    configs = {"a": SYNTHETIC.format(seed=0, n=200, clients=3), "b": REORDERED,
               "c": SYNTHETIC.format(seed=1, n=200, clients=3), "d": SYNTHETIC.format(seed=0, n=200, clients=4),
               "e": SYNTHETIC.format(seed=0, n=240, clients=3)}  # fmt: skip
    summary = {**BETA_SUMMARY, "dataset": "synthetic"}
    runs = [read_run(_write_run(tmp_path / k, v, summary, None)) for k, v in configs.items()]
    runs[0].summary["per_client"] = {"pfl_acc": [0.25, 0.5]}
    drawn = []
    monkeypatch.setattr(report, "histogram_svg", lambda values: drawn.append(values) or "<svg/>")
    figs = figures(runs)
    assert [(f.name, f.title, f.section) for f in figs] == [
        ("per-client", "per-client P-FL", "clients"),
        ("partition-a", "partition of a, b (one federation)", "clients"), ("partition-c", "partition of c", "clients"),
        ("partition-d", "partition of d", "clients"), ("partition-e", "partition of e", "clients")]  # fmt: skip
    assert all(f.data[:8] == b"\x89PNG\r\n\x1a\n" for f in figs[1:])
    assert drawn == [[("a", run_colour(0), [25.0, 50.0]), *((r.name, run_colour(i), []) for i, r in
                                                             enumerate(runs) if i)]]  # fmt: skip


HOSTILE = "<img src=x onerror=alert(1)>|x"  # a directory name (no "/"), markup and a Markdown cell separator


@pytest.fixture
def hostile(tmp_path, no_data):
    """A run whose directory name, config value, dataset name and plot name are markup."""
    config = BETA_CONFIG + "note: '</pre><script>alert(2)</script> & <home>'\n"
    summary = {**ALPHA_SUMMARY, "dataset": "<i>ds", "artifacts": {"<b>k/x": "plots/mask.png"}}
    return _write_run(tmp_path / "runs" / HOSTILE, config, summary, ALPHA_RECORDS, {"plots/mask.png": PNG})


def test_run_names_config_text_and_titles_cannot_inject_markup_into_the_page(hostile, tmp_path):
    """The HTML page escapes every name, config line and title: no element comes from a run's files."""
    page = write_report([hostile], tmp_path / "r.html").read_text()
    assert not re.search(r"<(script|img src=x|b>|i>)", page), re.search(r".{40}<(script|img src=x|b>|i>).{20}", page)
    escaped = "&lt;img src=x onerror=alert(1)&gt;|x"
    assert f"<title>pflbed report: {escaped}</title>" in page and f"<h1>pflbed report: {escaped}</h1>" in page
    assert f"<tr><td>{escaped}</td><td>FedAvg</td><td>&lt;i&gt;ds</td>" in page
    assert f"<th>key</th><th>{escaped}</th><th>default</th>" in page
    assert "<td>note</td><td>&lt;/pre&gt;&lt;script&gt;alert(2)&lt;/script&gt; &amp; &lt;home&gt;</td>" in page
    assert (f"<details><summary>full config of {escaped}</summary><pre>{BETA_CONFIG}note: &#x27;&lt;/pre&gt;"
            "&lt;script&gt;alert(2)&lt;/script&gt; &amp; &lt;home&gt;&#x27;\n</pre></details>") in page  # fmt: skip
    title = f"{escaped}: &lt;b&gt;k/x (mask.png)"
    assert f"<h3>{title}</h3>\n<img alt='{title}' src='data:image/png;base64," in page


def test_markdown_shows_markup_as_text_and_keeps_its_tables_and_links_whole(hostile, tmp_path):
    """The Markdown too: `<`, `>`, `&` as entities (a value `<home>` shown, not dropped as an unknown tag), a `|` in
    a run's name escaped in every table (the config table's header included: it splits no cell), the folded config
    in a fence it cannot close, the plot's file name plain (no space to end the link, no `/` into a missing
    folder)."""
    text = write_report([hostile], tmp_path / "r.md", "md").read_text()
    name = "&lt;img src=x onerror=alert(1)&gt;"
    assert text.startswith(f"# pflbed report: {name}|x\n")
    assert f"\n| {name}\\|x | FedAvg | &lt;i&gt;ds | 10 | 50.00 |" in text
    assert f"\n| key | {name}\\|x | default |\n|---|---|---|\n" in text
    assert "\n| note | &lt;/pre&gt;&lt;script&gt;alert(2)&lt;/script&gt; &amp; &lt;home&gt; | — |\n" in text
    assert f"\n<details><summary>full config of {name}|x</summary>\n\n```yaml\n{BETA_CONFIG}note:" in text
    assert f"\n| {name}\\|x | 12.25 | 10.50 |\n" in text  # the timing table
    title = f"{name}|x: &lt;b&gt;k/x (mask.png)"
    assert f"\n### {title}\n\n![{title}](r_files/img_src_x_onerror_alert_1_x-_b_k_x.png)\n" in text
    assert (tmp_path / "r_files" / "img_src_x_onerror_alert_1_x-_b_k_x.png").read_bytes() == PNG
    outside_fences = re.sub(r"```yaml\n.*?```", "", text, flags=re.S)  # the config, literal in its fence
    assert not re.search(r"<(?!/?details>|/?summary>)", outside_fences)  # no tag but the folds


def test_brackets_in_a_plot_s_title_do_not_end_its_markdown_image(tmp_path, no_data):
    """A plot key holding `[` or `]` is shown in the image's alt text escaped: an unescaped `]` ends the alt text
    and leaves the rest of the title and the link as text."""
    summary = {**ALPHA_SUMMARY, "artifacts": {"iou[0]": "plots/mask.png"}}
    run = _write_run(tmp_path / "runs" / "r", BETA_CONFIG, summary, ALPHA_RECORDS, {"plots/mask.png": PNG})
    text = write_report([run], tmp_path / "r.md", "md").read_text()
    assert "\n![r: iou\\[0\\] (mask.png)](r_files/r-iou_0.png)\n" in text


def test_markdown_folds_a_config_holding_backticks_in_a_longer_fence(pair, tmp_path):
    run = _run("ticks", [], "a: '```'\nb: '````x'\n", BETA_SUMMARY)
    text = render_markdown([run], [], tmp_path / "md" / "figures", tmp_path)  # its folder made, parents and all
    assert (tmp_path / "md" / "figures").is_dir()
    assert "\n`````yaml\na: '```'\nb: '````x'\n`````\n" in text


def test_renamed_runs_figures_get_plain_distinct_file_names(tmp_path, no_data):
    """Two runs of one name (a/run, b/run) are told apart as "run (1)", "run (2)" in every table, and their plots
    are files without spaces, each linked where it is."""
    runs = [_write_run(tmp_path / d / "run", ALPHA_CONFIG, ALPHA_SUMMARY, ALPHA_RECORDS, {"plots/mask.png": PNG})
            for d in ("a", "b")]  # fmt: skip
    text = write_report(runs, tmp_path / "r.md", "md").read_text()
    assert text.startswith("# pflbed report: run (1), run (2)\n")
    assert "\n| run (1) | FedAvg |" in text and "\n| run (2) | FedAvg |" in text
    links = re.findall(r"!\[([^\]]*)\]\(([^)]*)\)", text)
    assert links == [("learning curves", "r_files/curves.svg"), ("per-client P-FL", "r_files/per-client.svg"),
                     ("run (1): mask (mask.png)", "r_files/run_1_-mask.png"),
                     ("run (2): mask (mask.png)", "r_files/run_2_-mask.png")]  # fmt: skip
    assert all((tmp_path / p).is_file() for _, p in links)
    assert write_report(runs, tmp_path / "r.md", "md").read_text() == text  # written again over itself


def test_figure_file_names_stay_distinct():
    taken = set()
    assert [report._file_stem(n, taken) for n in ("a b", "a/b", "a_b", "..", "x.y")] == ["a_b", "a_b_2", "a_b_3",
                                                                                          "figure", "x.y"]  # fmt: skip
    assert report._file_stem("café-é", set()) == "caf_-"  # ASCII only: a link any Markdown renderer resolves
    assert report._file_stem("X.mask_X", set()) == "X.mask_X"


def test_read_run_names_what_is_missing_and_reads_a_run_without_records(tmp_path, monkeypatch):
    """No config.yaml: not a run directory (named); no metrics.jsonl: no curves, not an error; a run given as `.`
    is named by its path."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(PflbedError, match=r"/empty: not a pflbed run directory \(no config\.yaml\)$"):
        read_run(tmp_path / "empty")
    run = _write_run(tmp_path / "bare", BETA_CONFIG, BETA_SUMMARY, None)
    data = read_run(run)
    assert (data.name, data.history, data.artifacts, data.config_text) == ("bare", [], {}, BETA_CONFIG)
    monkeypatch.chdir(run)
    assert read_run(Path(".")).name == "."


def test_write_report_refuses_no_runs_and_an_unknown_format(pair, tmp_path):
    with pytest.raises(PflbedError, match=r"^report: name at least one run directory$"):
        write_report([], tmp_path / "r.html")
    with pytest.raises(PflbedError, match=r"^--format: unknown 'pdf'; choose html or md$"):
        write_report([pair[1].path], tmp_path / "r.pdf", "pdf")
    assert not (tmp_path / "r.pdf").exists()


def test_the_config_intro_says_whether_the_runs_differ(tmp_path):
    """Several runs of one config: said so; one run: nothing to compare, nothing said."""
    same = [_run(n, [], BETA_CONFIG, BETA_SUMMARY) for n in ("a", "b")]
    page = render_html(same, [])
    base = "Keys whose value is not pflbed&#x27;s default (nested keys dotted); the rest is at its default."
    assert f"<p class='note'>{base} The runs&#x27; configs are the same.</p>" in page
    assert "<tr class='differs'>" not in page
    assert f"<p class='note'>{base}</p>" in render_html(same[:1], [])
    other = _run("c", [], BETA_CONFIG.replace("fedrod", "ditto").replace("rounds: 10", "rounds: 12"), BETA_SUMMARY)
    assert f"<p class='note'>{base} Differ between the runs (highlighted): algorithm.name, train.rounds.</p>" in (
        render_html([same[0], other], []))  # fmt: skip
    assert "\n\nKeys whose value is not pflbed's default (nested keys dotted); the rest is at its default.\n\n" in (
        render_markdown(same[:1], [], tmp_path / "f", tmp_path))  # fmt: skip


def test_a_page_without_figures_has_no_figure_sections_and_every_timing_key(tmp_path):
    """A run without records, per-client figures or plots: the tables only; the timing table lists every timing key
    any run has, a dash where a run lacks it, to 2 decimals."""
    a = _run("a", [], BETA_CONFIG, {**BETA_SUMMARY, "timing": {"wall_s": 1.005, "train_s": 2}})
    b = _run("b", [], BETA_CONFIG, {**BETA_SUMMARY, "timing": {"eval_s": 0.125, "wall_s": "?"}})
    assert _timing_rows([a, b]) == (["run", "wall_s", "train_s", "eval_s"],
                                    [["a", "1.00", "2.00", "—"], ["b", "—", "—", "0.12"]])  # fmt: skip
    assert figures([a, b]) == []
    page = render_html([a, b], [])
    assert re.findall(r"<h2>[^<]*</h2>", page) == ["<h2>Comparison</h2>", "<h2>Config</h2>",
                                                   "<h2>Timing (seconds)</h2>"]  # fmt: skip
    text = render_markdown([a, b], [], tmp_path / "f", tmp_path)
    assert re.findall(r"^##? .*$", text, re.M) == ["# pflbed report: a, b", "## Comparison", "## Config",
                                                    "## Timing (seconds)"]  # fmt: skip


def _module_algorithm(monkeypatch, key, doc):
    """An algorithm registered under `key` whose file's docstring is `doc`."""
    import sys
    import types

    from pflbed.algorithms import ALGORITHMS

    module = types.ModuleType(f"fake_{key}", doc)
    cls = type("FakeAlgo", (), {"__module__": module.__name__})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(ALGORITHMS, key, cls)


def test_display_name_is_the_paper_s_name_of_at_most_three_words_before_the_first_dash(monkeypatch):
    """The head before the first " — " when it is a name (up to three words), else the class's name: a docstring
    without the dash, or whose head is a sentence, names no paper."""
    from pflbed.results.report import display_name

    assert display_name("sim_pfl") == "Sim-pFL"  # "Sim-pFL — the baseline of KT-pFL (… — …)": the first dash
    _module_algorithm(monkeypatch, "three", "Fed Three Words — A. Author, \"A paper\", 2024.")
    _module_algorithm(monkeypatch, "four", "One Two Three Four — A. Author, \"A paper\", 2024.")
    _module_algorithm(monkeypatch, "nodash", "Short name.\n\nMore.")
    assert [display_name(k) for k in ("three", "four", "nodash")] == ["Fed Three Words", "FakeAlgo", "FakeAlgo"]


def test_the_heat_map_is_a_png_at_its_dpi_whatever_matplotlib_s_settings(tmp_path):
    """The heat-map is drawn at partition_plot.DPI as a PNG even where a user's matplotlibrc sets another figure
    dpi or saves in another format by default; no figure is left open."""
    import struct

    import matplotlib
    import matplotlib.pyplot as plt

    from pflbed.results.report import partition_png

    run = _run("syn", [], SYNTHETIC.format(seed=0, n=200, clients=3), BETA_SUMMARY)
    size = lambda png: struct.unpack(">II", png[16:24])  # noqa: E731  the IHDR's width and height
    before = plt.get_fignums()  # figures another test in this process left open are not this one's
    plain = partition_png(run)
    with matplotlib.rc_context({"figure.dpi": 50, "savefig.format": "svg"}):
        other = partition_png(run)
    assert other[:8] == plain[:8] == b"\x89PNG\r\n\x1a\n" and size(other) == size(plain)
    assert plt.get_fignums() == before
