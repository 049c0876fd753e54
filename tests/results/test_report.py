"""`pflbed report`: the tables hold the runs' figures, the curves the runs' records (round 0 only where logged, up
and down communication apart, in MB), the config shows what differs from the defaults and between the runs, the
partition heat-map's labels fit for 100 clients, the HTML is one file with every figure inlined and nothing fetched,
the Markdown's figures exist where it points, and a run that cannot be reported is one line."""

import base64
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import pflbed
from pflbed.cli import main
from pflbed.errors import PflbedError
from pflbed.results.config_diff import config_diff, diff_rows
from pflbed.results.report import comparison, curves_note, display_name, figures, panels, read_run
from pflbed.results.report_figures import curves_svg

RUN = {"dataset": {"name": "synthetic", "synthetic": {"n_train": 1000}}, "model": {"name": "mlp"},
       "federation": {"clients": 5}, "train": {"rounds": 4}, "eval": {"every": 2, "finetune": ["ft"]},
       "executor": {"threads": 1}}  # fmt: skip
# RUN's keys that are not pflbed's defaults (train.rounds 30, model cnn, …); algorithm.name fedavg is the default
CHANGED = {"dataset.name", "dataset.synthetic.n_train", "model.name", "federation.clients", "train.rounds",
           "eval.every", "eval.finetune", "executor.threads"}  # fmt: skip


pytestmark = pytest.mark.xdist_group("report-runs")  # one worker trains the module's runs, once


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("report")
    pflbed.run({**RUN, "algorithm": {"name": "fedavg"}}, base / "fedavg")
    pflbed.run({**RUN, "algorithm": {"name": "fedselect"}}, base / "fedselect")
    return [base / "fedavg", base / "fedselect"]


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _copy_with_records(run, dest, edit):
    """A copy of `run` whose metrics.jsonl is `edit(records)`."""
    shutil.copytree(run, dest)
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edit(_records(run))))
    return dest


def _panel(data, key):
    return next(p for p in panels(data) if p.key == key)


def test_comparison_rows_are_the_summaries(runs):
    data = [read_run(p) for p in runs]
    header, rows = comparison(data)
    for r, row in zip(data, rows, strict=True):
        cell = dict(zip(header, row, strict=True))
        f = r.summary["final"]
        assert cell["run"] == r.path.name and cell["algorithm"] == display_name(r.summary["algorithm"])
        assert cell["P-FL"] == f"{100 * f['pfl_acc']:.2f}" and cell["P-FL std"] == f"{100 * f['pfl_acc_std']:.2f}"
        assert cell["selected round"] == str(r.summary["selected"]["round"])
        assert cell["G-FL"] == (f"{100 * f['gfl_acc']:.2f}" if f.get("gfl_acc") is not None else "—")
        comm = r.summary["communication"]
        assert cell["MB per round, up / down"] == (f"{comm['up_bytes_per_round'] / 1e6:.3g} / "
                                                   f"{comm['down_bytes_per_round'] / 1e6:.3g}")  # fmt: skip
    fedavg = dict(zip(header, rows[0], strict=True))
    assert fedavg["P-FL after fine-tuning"] == f"{100 * data[0].summary['final']['ft']['pfl_acc']:.2f}"


def test_the_table_speaks_words_and_names_algorithms_as_their_papers_do(runs):
    """Issue 49: "new clients M ft best" and "fedselect" beside "FedAvg" read badly: the headers are words and the
    algorithm column gives the paper's name, the same in every report."""
    header, rows = comparison([read_run(p) for p in runs])
    jargon = [h for h in header if re.search(r"\b(ft|lp|p10|M|best)\b|^[+±]|/round| s$", h)]
    assert not jargon, jargon
    assert [row[1] for row in rows] == ["FedAvg", "FedSelect"]
    assert (display_name("fedrod"), display_name("knnper"), display_name("lg_fedavg")) == (
        "FedRoD (linear)", "kNN-Per", "LG-FedAvg")  # fmt: skip
    assert display_name("local") == "LocalOnly" and display_name("mine") == "mine"  # no paper name; unknown


def test_curves_are_the_records_and_round_0_is_not_made_up(runs):
    """pflbed evaluates after rounds 2 and 4 here, never before training: the curves start at round 2."""
    r = read_run(runs[0])
    records = _records(runs[0])
    assert r.curve("pfl_acc") == ([x["round"] for x in records], [x["pfl_acc"] for x in records])
    assert r.curve("pfl_acc")[0] == [2, 4]
    p = _panel([r], "pfl_acc")
    assert p.series[0].rounds == [2, 4] and p.series[0].values == [100 * x["pfl_acc"] for x in records]
    assert "No run logged an evaluation before training" in curves_note([r])


def test_a_logged_round_0_is_plotted(runs, tmp_path):
    """A record of round 0 (the model before training) is a point of every curve it has figures for."""
    zero = {"round": 0, "gfl_acc": 0.1, "pfl_acc": 0.125, "pfl_val": 0.1, "up_bytes_per_round": 0,
            "down_bytes_per_round": 0}  # fmt: skip
    run = read_run(_copy_with_records(runs[0], tmp_path / "zero", lambda recs: [zero, *recs]))
    p = _panel([run], "pfl_acc")
    assert p.series[0].rounds == [0, 2, 4] and p.series[0].values[0] == 12.5
    assert _panel([run], "gfl_acc").series[0].rounds[0] == 0
    assert "round 0 · P-FL test: 12.50 %" in curves_svg(panels([run]))
    assert "Round 0 (before training) is logged for zero" in curves_note([run])


def test_a_logged_loss_gets_its_own_panel(runs, tmp_path):
    """pflbed's records hold no loss; a record that does (`train_loss`) gets a panel, in its own unit."""
    run = read_run(_copy_with_records(runs[0], tmp_path / "loss", lambda recs: [
        {**r, "train_loss": 2.0 / r["round"]} for r in recs]))  # fmt: skip
    assert not any(p.ylabel == "loss" for p in panels([read_run(runs[0])]))
    loss = _panel([run], "train_loss")
    assert (loss.title, loss.ylabel, loss.series[0].rounds, loss.series[0].values) == ("train loss", "loss", [2, 4],
                                                                                      [1.0, 0.5])  # fmt: skip


def test_communication_up_and_down_are_apart_in_mb_from_the_records(runs, tmp_path):
    def distinct(recs):  # up ≠ down, and changing over rounds: a swap or a wrong scale shows
        return [{**r, "up_bytes_per_round": 2_500_000 * r["round"], "down_bytes_per_round": 7_000_000} for r in recs]

    data = [read_run(runs[0]), read_run(_copy_with_records(runs[1], tmp_path / "comm", distinct))]
    up, down = _panel(data, "up_bytes_per_round"), _panel(data, "down_bytes_per_round")
    assert up.title == "up (clients → server)" and down.title == "down (server → clients)"
    assert up.ylabel == down.ylabel == "MB per round" and up.unit == "MB"
    real = _records(runs[0])
    assert up.series[0].values == [x["up_bytes_per_round"] / 1e6 for x in real]
    assert down.series[0].values == [x["down_bytes_per_round"] / 1e6 for x in real]
    assert up.series[1].rounds == [2, 4] and up.series[1].values == [5.0, 10.0] and down.series[1].values == [7.0, 7.0]
    svg = curves_svg(panels(data))
    assert "comm · round 4 · up (clients → server): 10.00 MB" in svg
    assert "comm · round 4 · down (server → clients): 7.00 MB" in svg


def test_config_diff_lists_exactly_the_changed_keys(runs):
    """Every key of config.yaml is there (resolved); only those off their default are shown, nested ones dotted."""
    assert set(config_diff(read_run(runs[0]).config())) == CHANGED  # fedavg: the default algorithm
    fedselect = config_diff(read_run(runs[1]).config())
    assert set(fedselect) == CHANGED | {"algorithm.name"} and fedselect["dataset.synthetic.n_train"] == 1000
    planted = {"train": {"lr": 0.05, "rounds": 4}, "dataset": {"synthetic": {"n_train": 1000}}}  # lr: the default
    assert config_diff(planted) == {"train.rounds": 4, "dataset.synthetic.n_train": 1000}
    # an algorithm's options against that algorithm's defaults (fedselect's p defaults to 0.25)
    options = {"algorithm": {"name": "fedselect", "p": 0.25, "alpha": 0.5}}
    assert config_diff(options) == {"algorithm.name": "fedselect", "algorithm.alpha": 0.5}


def test_keys_that_differ_between_runs_are_marked(runs, tmp_path):
    header, rows = diff_rows([(p.name, read_run(p).config()) for p in runs])
    assert header == ["key", "fedavg", "fedselect", "default"]
    assert {row[0] for row, _ in rows} == CHANGED | {"algorithm.name"}
    assert [row for row, differs in rows if differs] == [["algorithm.name", "fedavg", "fedselect", "fedavg"]]
    out = tmp_path / "r.html"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    page = out.read_text()
    marked = re.findall(r"<tr class='differs'><td>([^<]+)</td>", page)
    assert marked == ["algorithm.name"]
    assert re.search(r"<details><summary>full config of fedselect</summary><pre>[^<]*algorithm:\n  name: fedselect",
                     page)  # the full config, folded away  # fmt: skip


def test_partition_heat_map_labels_fit_for_100_clients():
    from pflbed.config import validate_config
    from pflbed.data import load_source
    from pflbed.federation import build_federation
    from pflbed.results.partition_plot import partition_figure

    def labels(clients):
        cfg = validate_config({"dataset": {"name": "synthetic"}, "federation": {"clients": clients}})
        source = load_source(cfg.dataset)
        fig = partition_figure(source, build_federation(source, cfg.federation, cfg.seed))
        heat, bar = fig.axes[0], fig.axes[1]
        fig.draw_without_rendering()
        boxes = [t.get_window_extent() for t in heat.get_xticklabels() if t.get_text()]
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:], strict=False)), "client labels overlap"
        assert bar.get_ylabel() == "training samples"  # the colour bar reads off the counts
        return [t.get_text() for t in heat.get_xticklabels()]

    assert labels(5) == ["0", "1", "2", "3", "4"]  # few clients: every one named
    thinned = labels(100)
    assert 5 <= len(thinned) <= 25 and thinned[:2] in (["0", "5"], ["0", "10"])


def test_html_report_is_one_file_with_every_figure_inlined_and_nothing_fetched(runs, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    page = out.read_text()
    links = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]*)""", page)
    assert links and all(v.startswith(("data:", "#")) for v in links)  # embedded, or a reference inside the page
    assert not re.search(r"url\(\s*['\"]?(?!#|data:)|@import|<script|<link|<iframe", page, re.I)
    data = [read_run(p) for p in runs]
    figs = figures(data)
    assert "curves" in {f.name for f in figs} and "per-client" in {f.name for f in figs}
    svgs = [f for f in figs if isinstance(f.data, str)]
    assert page.count("<svg") == len(svgs) == 2 and "<?xml" not in page and "<!DOCTYPE svg" not in page
    images = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert len(images) == len(figs) - len(svgs) and all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    assert sum(f.name.startswith("partition-") for f in figs) == 1  # both runs share one federation
    artifacts = json.loads((runs[1] / "summary.json").read_text())["artifacts"]
    assert artifacts
    for rel in artifacts.values():  # the algorithm's own plots, byte for byte
        if rel.endswith(".png"):
            assert base64.b64encode((runs[1] / rel).read_bytes()).decode() in images
    points = sum(len(s.rounds) for p in panels(data) for s in p.series)
    assert len(re.findall(r"<g><title>[^<]+ · round \d+ · [^<]+</title><use ", page)) == points  # a tooltip each
    row = data[1].summary["final"]["pfl_acc"]
    assert f"<td>{100 * row:.2f}</td>" in page


def test_markdown_report_points_at_figures_that_exist(runs, tmp_path):
    out = tmp_path / "r.md"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    text = out.read_text()
    paths = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert paths and all((tmp_path / p).is_file() for p in paths)
    assert (tmp_path / "r_files" / "curves.svg").read_text().startswith("<svg")
    assert "| fedselect | FedSelect | synthetic | 4 |" in text
    assert "| **algorithm.name** ≠ | fedavg | fedselect | fedavg |" in text
    assert "| train.rounds | 4 | 4 | 30 |" in text


def test_an_unfinished_run_is_one_line_exit_2(tmp_path, runs, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.yaml").write_text("seed: 0\n")
    assert main(["report", str(runs[0]), str(tmp_path / "half"), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the run is not finished" in err and not (tmp_path / "r.html").exists()


def test_a_report_is_never_written_onto_a_directory_or_a_run_s_own_file(tmp_path, runs, capsys):
    """`-o RUN/summary.json` replaced the run's summary with the report; `-o DIR` failed with a bare "Is a
    directory" once every figure was drawn. Both are one line before anything is read; a file of its own inside a
    run directory is fine."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)  # the module's runs stay as they are, whatever happens here
    kept = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "metrics.csv",
                                                         "config.yaml")}  # fmt: skip
    for name in kept:
        assert main(["report", str(run), "-o", str(run / name)]) == 2
        assert capsys.readouterr().err == f"pflbed: error: -o {run / name}: is a run's own file; give the report " \
                                          "a name of its own\n"  # fmt: skip
    assert {name: (run / name).read_bytes() for name in kept} == kept
    assert main(["report", str(run), "-o", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"pflbed: error: -o {tmp_path}: is a directory; give the report's file " \
                                      "(.html or .md)\n"  # fmt: skip
    (tmp_path / "notes").mkdir()
    assert main(["report", str(run), "-o", str(tmp_path / "notes" / "summary.json")]) == 0  # no run's: a name
    assert main(["report", str(run), "-o", str(run / "report.md")]) == 0
    assert main(["report", str(run), "-o", str(tmp_path / "new" / "dirs" / "r.html")]) == 0  # made as needed
    assert (tmp_path / "new" / "dirs" / "r.html").is_file()
    capsys.readouterr()
    under_a_file = run / "metrics.csv" / "deeper" / "r.html"  # was "File exists" once every figure was drawn
    assert main(["report", str(run), "-o", str(under_a_file)]) == 2
    assert capsys.readouterr().err == f"pflbed: error: -o {under_a_file}: {run / 'metrics.csv'} is a file, not a " \
                                      "directory\n"  # fmt: skip


def test_a_report_of_no_run_or_in_an_unknown_format_is_one_line(tmp_path):
    from pflbed.results.report import write_report

    with pytest.raises(PflbedError) as e:
        write_report([], tmp_path / "r.html")
    assert str(e.value) == "report: name at least one run directory" and not (tmp_path / "r.html").exists()
    with pytest.raises(PflbedError) as e:
        write_report([tmp_path / "no run"], tmp_path / "r.pdf", "pdf")  # said before any run is read
    assert str(e.value) == "--format: unknown 'pdf'; choose html or md"


def test_a_run_given_twice_is_one_line_and_two_runs_of_one_name_are_told_apart(tmp_path, runs, capsys, monkeypatch):
    """The same run twice (`RUN RUN`, `RUN ./RUN/`) was drawn as two runs; two runs of one name are numbered."""
    monkeypatch.chdir(runs[0].parent)
    name = runs[0].name
    assert main(["report", name, str(runs[1]), f"./{name}/", "-o", str(tmp_path / "r.html")]) == 2
    assert capsys.readouterr().err == f"pflbed: error: {name}: given twice; name each run once\n"
    assert main(["report", name, str(runs[0]), "-o", str(tmp_path / "r.html")]) == 2
    assert capsys.readouterr().err == f"pflbed: error: {runs[0]}: given twice (as {name} too); name each run once\n"
    assert not (tmp_path / "r.html").exists()
    twin = tmp_path / "elsewhere" / name
    shutil.copytree(runs[0], twin)
    assert main(["report", name, str(twin), "-o", str(tmp_path / "r.md")]) == 0
    assert f"| {name} (1) |" in (tmp_path / "r.md").read_text() and f"| {name} (2) |" in (tmp_path / "r.md").read_text()


def test_the_note_says_when_each_run_was_evaluated_and_how_to_get_more_points(runs, tmp_path):
    """A 4-round run evaluated every 2 rounds draws 2-point curves: the note says so and how to get more; a run
    with enough points gets no such advice."""
    data = [read_run(p) for p in runs]
    note = curves_note(data)
    assert "fedavg, fedselect: evaluated every 2 rounds and after the last — 2 points (rounds 2, 4). " in note
    assert "run again with --set eval.every=1" in note
    dense = read_run(_copy_with_records(runs[0], tmp_path / "dense", lambda recs: [
        {**recs[-1], "round": k} for k in range(1, 7)]))  # fmt: skip
    assert "6 points (rounds 1, 2, 3, 4, 5, 6)" in curves_note([dense]) and "eval.every=1" not in curves_note([dense])


def test_identical_curves_stay_in_sight_and_are_named(runs, tmp_path):
    """Two runs with the same points (FedAvg's and FedRoD's communication): each run has its own line style and
    marker, the earlier is drawn wider beneath the later, and the note names them."""
    twin = read_run(_copy_with_records(runs[0], tmp_path / "twin", lambda recs: recs))
    data = [read_run(runs[0]), twin, read_run(runs[1])]
    pfl = _panel(data, "pfl_acc")
    assert len({(s.linestyle, s.marker) for s in pfl.series}) == 3 and len({s.colour for s in pfl.series}) == 3
    assert "P-FL test: fedavg, twin" in curves_note(data) and "Identical curves" in curves_note(data)
    assert "P-FL test:" not in curves_note([data[0], data[2]])  # different runs: nothing said
    widths = re.findall(r"stroke-width: ([\d.]+)", curves_svg([pfl]))
    assert "3.4" in widths and "1.4" in widths  # fedavg wider, beneath twin's dashed line


DAMAGED = [  # a run file truncated, overwritten or hand-edited: each was a traceback
    ("summary.json", '{"final": ', r"summary\.json: not valid JSON \(Expecting value, line 1\)"),
    ("summary.json", "[1, 2]", r"summary\.json: a JSON list, not an object"),
    ("summary.json", "{}", r"summary\.json: no algorithm \(str\) in it, as every pflbed summary has"),
    ("summary.json", b"\xff\xfe\x00", r"summary\.json: not text"),
    ("metrics.jsonl", '{"round": 2}\ngarbage\n', r"metrics\.jsonl: line 2 is not valid JSON \(Expecting value\)"),
    ("metrics.jsonl", "[1]\n", r"metrics\.jsonl: line 1 is a JSON list, not an object"),
    ("metrics.jsonl", '{"pfl_acc": 0.5}\n', r"metrics\.jsonl: record 1 has no round \(int\)"),
    ("metrics.jsonl", None, r"metrics\.jsonl: a directory, not a file"),  # its curves were left out unsaid
    ("config.yaml", "a: [\n", r"config\.yaml: not valid YAML \(line 2\)"),
    ("config.yaml", "- 1\n", r"config\.yaml: a YAML list, not a mapping of config sections"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "message"), DAMAGED)
def test_a_damaged_run_file_is_one_line_naming_it_for_every_command_reading_it(runs, tmp_path, capsys, name, content,
                                                                                message):  # fmt: skip
    """`report`, `personalize` (the summary, the records, the config) and `data new-client` (the config): exit 2,
    one line naming the file and what is wrong with it, nothing written."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    if content is None:
        (run / name).unlink()
        (run / name).mkdir()
    else:
        (run / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 32)), y=np.zeros(2, dtype=np.int64))
    out = str(tmp_path / "out")
    commands = {"report": ["report", str(run), "-o", str(tmp_path / "out" / "r.html")],
                "personalize": ["personalize", str(run), "--data", str(tmp_path / "x.npz"), "--out", out],
                "data new-client": ["data", "new-client", str(run), "--out", out]}  # fmt: skip
    for what, args in commands.items():
        if what == "data new-client" and name != "config.yaml":
            continue  # it reads the config alone
        capsys.readouterr()
        rc = main(args)
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "\n" not in err and re.search(rf"^pflbed: error: .*/run/{message}", err), (what, err)
        assert err.endswith("; the file is damaged (rerun the run, or restore the file)"), (what, err)
        assert not (tmp_path / "out").exists(), what


def test_a_summary_s_plots_are_taken_from_the_run_directory_only_and_odd_numbers_shown_as_dashes(runs, tmp_path):
    """A summary naming a plot outside its run (`../`, an absolute path) does not bring that file into a report; a
    timing that is not a number is a dash, not a crash."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    (tmp_path / "outside.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    summary = json.loads((run / "summary.json").read_text())
    summary["artifacts"] = {"a": "../outside.png", "b": str(tmp_path / "outside.png"), "c": 3}
    summary["timing"]["wall_s"] = "x"
    (run / "summary.json").write_text(json.dumps(summary))
    data = read_run(run)
    assert data.artifacts == {}
    assert comparison([data])[1][0][-1] == "—"


@pytest.mark.parametrize("entry", [("selected",), ("new_clients",), ("new_clients", "methods"), ("communication",),
                                   ("final", "ft"), ("privacy",), ("per_client",), ("per_client", "pfl_acc")])
def test_a_summary_s_entries_of_another_type_are_dashes_in_the_report_not_a_crash(runs, tmp_path, capsys, entry):
    """A hand-edited summary whose objects became lists (or a list a number): the report is written, the cells
    read from that entry are dashes (each was a traceback)."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    summary = json.loads((run / "summary.json").read_text())
    *parents, key = entry
    at = summary
    for k in parents:
        if not isinstance(at.get(k), dict):
            at[k] = {}
        at = at[k]
    at[key] = 3 if key == "pfl_acc" else [1]
    (run / "summary.json").write_text(json.dumps(summary))
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0, capsys.readouterr().err
    header, rows = comparison([read_run(run)])
    cells = dict(zip(header, rows[0], strict=True))
    if entry == ("selected",):
        assert cells["selected round"] == cells["P-FL at the selected round"] == "—"
    if entry == ("privacy",):
        assert cells["DP ε (δ)"] == "— (—)"


def test_report_prints_the_file_written_its_size_in_kib_and_the_seconds_it_took(tmp_path, monkeypatch, capsys):
    """A stand-in report of 600 KiB, written in 2.5 s of a stand-in clock: the line names all three."""
    import time

    import pflbed.results.report as module

    ticks = [100.0, 102.5]
    monkeypatch.setattr(time, "perf_counter", lambda: ticks.pop(0) if len(ticks) > 1 else ticks[0])

    def write_report(runs: list[Path], out: Path, fmt: str) -> Path:
        out.write_bytes(b"x" * (600 * 1024))
        return out

    monkeypatch.setattr(module, "write_report", write_report)
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"report: {out} (600 KiB, 2.5 s)\n"
