"""`pflbed report`: the tables hold the runs' figures, the curves the runs' records, the HTML is one file with every
figure embedded, the Markdown's figures exist where it points, and a run that cannot be reported is one line."""

import base64
import json
import re

import pytest

import pflbed
from pflbed.cli import main
from pflbed.results.report import comparison, figures, read_run

RUN = {"dataset": {"name": "synthetic"}, "model": {"name": "mlp"}, "federation": {"clients": 5},
       "train": {"rounds": 4}, "eval": {"every": 2, "finetune": ["ft"]}, "executor": {"threads": 1}}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("report")
    pflbed.run({**RUN, "algorithm": {"name": "fedavg"}}, base / "fedavg")
    pflbed.run({**RUN, "algorithm": {"name": "fedselect"}}, base / "fedselect")
    return [base / "fedavg", base / "fedselect"]


def test_comparison_rows_are_the_summaries(runs):
    data = [read_run(p) for p in runs]
    header, rows = comparison(data)
    for r, row in zip(data, rows, strict=True):
        cell = dict(zip(header, row, strict=True))
        f = r.summary["final"]
        assert cell["run"] == r.path.name and cell["algorithm"] == r.summary["algorithm"]
        assert cell["P-FL"] == f"{100 * f['pfl_acc']:.2f}" and cell["± std"] == f"{100 * f['pfl_acc_std']:.2f}"
        assert cell["selected round"] == str(r.summary["selected"]["round"])
        assert cell["G-FL"] == (f"{100 * f['gfl_acc']:.2f}" if f.get("gfl_acc") is not None else "—")
    fedavg = dict(zip(header, rows[0], strict=True))
    assert fedavg["+FT P-FL"] == f"{100 * data[0].summary['final']['ft']['pfl_acc']:.2f}"


def test_curves_are_the_records(runs):
    r = read_run(runs[0])
    records = [json.loads(x) for x in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert r.curve("pfl_acc") == ([x["round"] for x in records], [x["pfl_acc"] for x in records])
    assert r.curve("pfl_acc")[0] == [2, 4]


def test_html_report_is_one_file_with_every_figure_embedded(runs, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    page = out.read_text()
    assert not re.search(r"""(src|href)=['"](?!data:)""", page)  # nothing fetched from anywhere
    images = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    figs = figures([read_run(p) for p in runs])
    assert len(images) == len(figs) and all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    names = {f.name for f in figs}
    assert {"curve-gfl_acc", "curve-pfl_acc", "curve-pfl_val", "per-client", "communication"} <= names
    assert sum(n.startswith("partition-") for n in names) == 1  # both runs share one federation
    artifacts = json.loads((runs[1] / "summary.json").read_text())["artifacts"]
    assert artifacts
    for rel in artifacts.values():  # the algorithm's own plots, byte for byte
        if rel.endswith(".png"):
            assert base64.b64encode((runs[1] / rel).read_bytes()).decode() in images
    row = read_run(runs[1]).summary["final"]["pfl_acc"]
    assert f"<td>{100 * row:.2f}</td>" in page
    assert "algorithm:\n  name: fedselect" in page  # the config


def test_markdown_report_points_at_figures_that_exist(runs, tmp_path):
    out = tmp_path / "r.md"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    text = out.read_text()
    paths = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert paths and all((tmp_path / p).is_file() for p in paths)
    assert "| fedselect | fedselect | synthetic | 4 |" in text


def test_an_unfinished_run_is_one_line_exit_2(tmp_path, runs, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.yaml").write_text("seed: 0\n")
    assert main(["report", str(runs[0]), str(tmp_path / "half"), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the run is not finished" in err and not (tmp_path / "r.html").exists()
