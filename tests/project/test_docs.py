"""The documentation site: its generated pages are those of the code, every algorithm and every config key has its
page or row, and the site builds with `mkdocs build --strict` (the `docs` extra; CI installs it)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pflbed.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))

import generate  # noqa: E402  (docs/generate.py)


def test_the_committed_generated_pages_are_those_of_the_code():
    stale = [str(p.relative_to(ROOT)) for p, text in generate.pages().items() if not p.is_file() or p.read_text()
             != text]  # fmt: skip
    assert not stale, f"stale pages: {stale}; run python docs/generate.py"


def test_every_algorithm_has_a_page_in_the_site_s_navigation_and_every_config_key_a_row():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    algorithms = next(v for item in nav for k, v in item.items() if k == "Algorithms")
    pages = {next(iter(i.values())) if isinstance(i, dict) else i for i in algorithms}
    assert {f"algorithms/{n}.md" for n in ALGORITHMS} <= pages
    reference = (ROOT / "docs" / "reference" / "config.md").read_text()
    keys = [k for k, *_ in generate.config_keys()]
    assert len(keys) > 90 and all(f"| `{k}` |" in reference for k in keys)
    assert "| `sites.local` |" in reference and "| `executor.precision` |" in reference


def test_the_command_line_reference_is_the_parser_s_every_command_and_option():
    """Read from the parser: each command's heading and description, each option as typed with its default (a
    required one says so), and text that Markdown would take for an HTML tag escaped outside code."""
    import argparse

    from pflbed.cli import _parser

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert page == generate.cli_page()
    sections = dict(s.split("\n", 1) for s in page.split("\n## ")[1:])
    root = sections.pop("pflbed")
    assert root.startswith("\nPersonalized federated learning benchmark. `pflbed --version` prints its version.\n")
    assert "| `pflbed tune` | fair hyperparameter search (Optuna): the same training compute per method, chosen on " \
           "validation, then default vs tuned over seeds |" in root  # fmt: skip
    assert root.count("| `pflbed ") == 10
    assert list(sections) == ["pflbed run", "pflbed bench", "pflbed tune", "pflbed flower local", "pflbed flower app",
                              "pflbed flower sites", "pflbed pretrain", "pflbed personalize", "pflbed report",
                              "pflbed algorithms", "pflbed config", "pflbed data"]  # fmt: skip
    commands = generate._commands(_parser(), ["pflbed"])
    for words, parser in commands:
        rows = sections[" ".join(words)]
        assert rows.startswith(f"\n{parser.description}\n"), words
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert all(f"`{o}" in rows for o in action.option_strings), (words, action.dest)
    assert len(commands) == len(sections)
    bench = sections["pflbed bench"]
    assert "| `-c CONFIG`, `--config CONFIG` | required | suite YAML file, or a suite's results directory" in bench
    assert "| `--jobs N` | `1` |" in bench and "| `--shard I/N` | `1/1` |" in bench and "| `--list` |  |" in bench
    assert "| `RUN …` | required | finished run directories |" in sections["pflbed report"]
    assert "| `{list,show,export,new-client}` | required |" in sections["pflbed data"]
    assert "| `OUT/RUN` |  | export: OUT" in sections["pflbed data"]
    assert "| `--method {native,ft,lp}` | `native` |" in sections["pflbed personalize"]
    assert "into &lt;run>/tensorboard/" in (ROOT / "docs" / "reference" / "config.md").read_text()
    assert generate._cell("a <run> `<code>` b | c\nd < 1") == "a &lt;run> `<code>` b \\| c d < 1"


def test_a_page_goes_stale_when_the_code_changes(monkeypatch):
    """The freshness check can fail: an option description changed in the code makes its page stale."""
    from pflbed.algorithms.fedper import FedPer

    field = FedPer.Config.model_fields["personal_blocks"]
    monkeypatch.setattr(field, "description", "changed")
    page = generate.algorithm_page("fedper")
    assert "changed" in page and page != (ROOT / "docs" / "algorithms" / "fedper.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra: pip install -e '.[docs]'")
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1",
                                                                           **__import__("os").environ})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    html = (tmp_path / "site" / "algorithms" / "fedbasis" / "index.html").read_text()
    assert "Learning Shareable Bases" in html


def test_the_readme_is_a_landing_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = [t for t in re.findall(r"\]\(([^)]+)\)", text) if not t.startswith(("http://", "https://", "#"))]
    assert len(links) > len(ALGORITHMS)  # every algorithm links to its page
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, missing


@pytest.mark.parametrize(("row", "key"), [
    ("| LG-FedAvg+FT | 1 |", "lgfedavg"), ("| **FedRoD (hyper)** | 1 |", "fedrodhyper"), ("| FedRoD-hyper | 1 |",
     "fedrodhyper"), ("| FedRoD (linear) | 1 |", "fedrod"), ("| FedSelect α = 0.3 | 1 |", "fedselect"),
    ("| KT-pFL − FedMD | 1 |", None), ("| [FedRoD-hyper](../results/leaderboard.md#config-fedrod-hyper) | 1 |",
     "fedrodhyper"), ("| [FedAvg+FT](../results/leaderboard.md#config-fedavg-ft) | 1 |", "fedavg"),
    ("| Per-FedAvg, α 0.003 | 1 |", "perfedavg"), ("| `fedavg` | 1 |", "fedavg"),
])  # fmt: skip
def test_a_results_row_is_attributed_to_the_algorithm_it_names(row, key):
    assert generate._row_key(row) == key


def test_an_algorithm_page_repeats_exactly_the_results_rows_that_name_it():
    """Rows of docs/results/*.md reach the page of the algorithm they name, and no other algorithm's rows do."""
    page = generate.algorithm_page("fedselect")
    measured = page.split("## Measured results", 1)[1]
    assert "| FedSelect α = 0.3 | **93.20 ± 1.55** |" in measured  # docs/results/fedselect.md
    assert "](../results/fedselect.md#fedselect-fashion-mnist-10-clients-2-classes" in measured
    rows = [r for r in measured.splitlines() if r.startswith("|") and not r.startswith("|---")]
    headers = {r for r in rows if generate._row_key(r) in ("method", "cells", "algorithm")}
    assert rows and all(generate._row_key(r) == "fedselect" for r in rows if r not in headers)


def _code_block(page: str, heading: str | None, lang: str) -> str:
    """The first `lang` code block of `page` (under `## heading` when given), as the reader sees it."""
    text = (ROOT / "docs" / page).read_text()
    if heading is not None:
        text = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return text.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def test_the_home_page_s_python_example_runs(tmp_path, monkeypatch):
    """docs/index.md's example, with a new client's raw samples as `x`, `y` (and 1 round instead of 20):
    `personalize` returns a `Personalized`, whose labels come from `predict` and whose model is `.model`."""
    from pflbed.data import load_digits_source
    from pflbed.federation.new_client import raw_samples
    from pflbed.results.trained import Personalized

    monkeypatch.chdir(tmp_path)
    code = _code_block("index.md", None, "python")
    assert '"rounds": 20' in code
    source = load_digits_source()
    namespace = {"x": raw_samples(source, source.test.x[:40]), "y": source.test.y[:40].numpy()}
    exec(code.replace('"rounds": 20', '"rounds": 1'), namespace)  # noqa: S102  (the page's own code)
    client = namespace["client"]
    assert isinstance(client, Personalized) and isinstance(client.model, __import__("torch").nn.Module)
    assert client.predict(namespace["x"]).shape == (40,)


def test_code_blocks_wrap_long_lines_on_the_site():
    """Long command lines are not hidden behind a horizontal scroll bar: a stylesheet registered in mkdocs.yml
    makes code blocks wrap."""
    sheets = yaml.safe_load((ROOT / "mkdocs.yml").read_text()).get("extra_css") or []
    css = "".join((ROOT / "docs" / s).read_text() for s in sheets)
    assert ".md-typeset pre > code" in css and "white-space: pre-wrap" in css


def test_the_benchmark_configs_cite_pages_and_sections_that_exist():
    readme = (ROOT / "README.md").read_text()
    for config in sorted((ROOT / "benchmarks").glob("*/*.yaml")):
        comments = " ".join(line for line in config.read_text().splitlines() if line.lstrip().startswith("#"))
        for page in re.findall(r"docs/[\w/.-]+\.md", comments):
            assert (ROOT / page).is_file(), f"{config.name} cites {page}"
        for section in re.findall(r"README's \"([^\"]+)\"", comments):
            assert section in readme, f"{config.name} cites the README's {section!r}, which it no longer has"


def test_ci_runs_exactly_the_readme_s_set_up_and_test_command_and_the_docs_show_it():
    """The Quickstart's second command is what CI runs (its timing is the one the README states), and the getting
    started page and the home page show the same command."""
    fence = re.compile(r"```bash\n(.*?)```", re.S)
    readme = fence.findall((ROOT / "README.md").read_text())[0].splitlines()
    command = next(line for line in readme if "pytest" in line)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci
    for page in ("getting-started.md", "index.md"):
        shown = fence.findall((ROOT / "docs" / page).read_text())[0]
        assert command in [line.split("  #")[0].strip() for line in shown.splitlines()], page


def test_ci_runs_the_deployment_suite_that_the_default_run_leaves_out():
    """The real Flower deployments are out of the default run (`addopts`), so CI runs them itself, with the command
    the README and the getting started page give: dropping it from CI would leave them unrun."""
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-m 'not deployment'" in addopts
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for page in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        command = re.search(r"`(python -m pytest -m deployment[^`]*)`", page.read_text()).group(1)
        assert command in ci, page.name


def test_the_leaderboard_ranks_by_each_figure_links_each_row_and_states_the_ordering_change(tmp_path, monkeypatch):
    """From a table.json: one tab per figure, each ranked by the tuned figure (not the default), every row linking
    to its chosen configuration, each algorithm page showing its rows, and the ordering change computed."""
    import json

    import leaderboard  # docs/leaderboard.py

    def row(method, algo, d, t, g):
        return {"method": method, "objective": "pfl_val", "budget": 10, "complete": 3, "pruned": 2,
                "best_trial": 1, "best_value": 0.9, "chosen": {"train.lr": 0.05}, "finished": True,
                "compute": {"base_runs": 10.2}, "default": {"P-FL": [d, 1.0], "G-FL": [g, 1.0]},
                "tuned": {"P-FL": [t, 0.5], "G-FL": [100 - g, 1.0]}, "seeds": {"default": 3, "tuned": 3, "of": 3},
                "algorithm": algo}  # fmt: skip

    rows = [row("FedAvg", "fedavg", 80, 85, 70), row("Ditto", "ditto", 90, 84, 60), row("FedPer", "fedper", 70, 90, 80)]
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"seeds": [0, 1, 2], "trial_seed": 100, "methods": rows}))
    monkeypatch.setattr(leaderboard, "TABLE", table)
    monkeypatch.setattr(leaderboard, "rows", lambda: rows)
    page = leaderboard.page()
    pfl = page.split('=== "by P-FL"')[1].split("===")[0]
    order = [line.split("|")[2].strip() for line in pfl.splitlines() if line.strip().startswith("| 1 ")
             or line.strip().startswith(("| 2 ", "| 3 "))]  # fmt: skip
    assert order == ["[FedPer](#config-fedper)", "[FedAvg](#config-fedavg)", "[Ditto](#config-ditto)"]
    gfl = page.split('=== "by G-FL"')[1].split("##")[0]
    assert gfl.index("[Ditto]") < gfl.index("[FedAvg]") < gfl.index("[FedPer]")  # tuned G-FL 40, 30, 20
    assert "### Ditto { #config-ditto }" in page and "(../algorithms/ditto.md)" in page
    assert "Kendall's τ between the default and the tuned P-FL orderings is -1.00" in page  # reversed
    assert "default: Ditto, FedAvg, FedPer; tuned: FedPer, FedAvg, Ditto" in page
    assert "Spent: 10.20–10.20 base runs against a budget of 10" in page
    assert "best trial #1 (pfl_val 90.00):" in page and "stopped at round" not in page
    rows[0]["best_truncated"] = {"round": 8, "scored_on": "pfl_val"}  # a first trial that alone spent the budget
    assert "best trial #1 (pfl_val 90.00, stopped at round 8 where it spent the budget):" in leaderboard.page()
    assert "Largest gains from tuning (P-FL points): FedPer +20.00, FedAvg +5.00, Ditto -6.00" in page
    mine = "\n".join(leaderboard.algorithm_rows("fedavg"))
    assert "| [FedAvg](../results/leaderboard.md#config-fedavg) | 80.00 ± 1.00 | 85.00 ± 0.50 | 70.00 ± 1.00 |" in mine
    rows[1]["default_trial"] = {"number": 0, "state": "COMPLETE", "value": 0.85}  # Ditto: tuned below default
    for first, said in (("default", "Tuned below default in P-FL: 1 method (Ditto -6.00). Each study's first trial "
                         "ran the default (`tune.first: default`); where it completed, the choice scored at least its "
                         "figure on the trials' validation data (default trial → chosen: Ditto 85.00 → 90.00)"),
                        ("sampled", "Tuned below default in P-FL: 1 method (Ditto 3 complete trials)")):  # fmt: skip
        suite = tmp_path / f"{first}.yaml"
        suite.write_text(f"tune: {{first: {first}}}\n")
        monkeypatch.setattr(leaderboard, "SUITE", suite)
        assert said in " ".join(leaderboard.page().split()), first
