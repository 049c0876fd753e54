"""Every `pflbed` command a documentation page shows in a bash block, and every Python block, runs as written, from
a working directory of its own, with only short settings appended (one round, no fine-tuning, one new-client
epoch): the page's promise to a reader who copies it. A page that gains commands or code without a test that runs
them fails the first test."""

import importlib.util
import json
import shutil

import pytest

from pflbed.cli import _parser, main
from pflbed.data.fmnist import HOW_TO_GET, find_fmnist

from ..doc_commands import ROOT, commands, expanded, page_commands, page_python, with_sets

# appended to a command in these tests only: the same keys and combinations, run small
SHORT = {"run": ["train.rounds=1", "train.local_epochs=1", "eval.finetune=[]", "executor.threads=1",
                 "eval.new_clients.epochs=1", "eval.new_clients.lrs=[0.01]", "eval.new_clients.fractions=[1.0]"],
         "local": ["train.rounds=1", "eval.finetune=[]", "executor.threads=1"],
         "pretrain": ["pretrain.epochs=1"]}  # fmt: skip
# every page with commands, and the tests that run them (this file's, unless named with their tests/ file)
RUN_BY = {
    "README.md": ["test_the_readme_shows_getting_started_s_fashion_mnist_commands"],
    "docs/getting-started.md": ["test_getting_started_s_digits_commands_run_as_written",
                                "test_getting_started_s_fashion_mnist_commands_run_as_written"],
    "docs/guide/after-the-run.md": ["test_after_the_run_s_commands_run_as_written"],
    "docs/guide/benchmarks.md": ["results/test_bench.py::test_the_benchmarks_guide_s_small_trial_runs_as_written"],
    "docs/guide/flower.md": ["test_the_flower_guide_s_simulation_runs_as_written",
                             "test_the_flower_guide_s_deployments_run_as_written"],
    "docs/guide/plugins.md": ["project/test_plugins.py::test_the_plugins_guide_s_package_runs_as_written"],
    "docs/guide/privacy.md": ["project/test_privacy_guide.py::test_the_guides_commands_run_as_written"],
    "docs/guide/tuning.md": ["results/test_tune.py::test_the_tuning_guide_s_small_study_runs_as_written",
                             "test_the_tuning_guide_s_worker_commands_run_as_written"],
}  # fmt: skip
# every page with Python blocks, and the tests that run them
PYTHON_RUN_BY = {
    "README.md": ["test_the_readme_s_python_is_getting_started_s"],
    "docs/getting-started.md": ["test_getting_started_s_python_runs_as_written"],
    "docs/guide/after-the-run.md": ["test_after_the_run_s_python_runs_as_written"],
    "docs/guide/plugins.md": ["project/test_plugins.py::test_the_plugins_guide_s_package_runs_as_written"],
    "docs/index.md": ["project/test_docs.py::test_the_home_page_s_python_example_runs"],
}


def short(argv: list[str]) -> list[str]:
    """`argv` expanded as the shell does, with the short settings of its command appended."""
    kind = argv[1] if argv[0] in ("flower", "data") else argv[0]
    return with_sets(expanded(argv), *SHORT.get(kind, []))


def run_all(argv_list: list[list[str]]) -> None:
    for argv in argv_list:
        assert main(short(argv)) == 0, argv


def needs_fmnist() -> None:
    if find_fmnist() is None:
        pytest.skip(f"Fashion-MNIST is not on this machine: {HOW_TO_GET}")


def needs_flower() -> None:
    if importlib.util.find_spec("flwr") is None:
        pytest.skip("the flower extra: pip install -e '.[flower]'")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A reader's working directory: a clone's `benchmarks/` (the configs a page names) and nothing else."""
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_page_with_commands_names_the_tests_that_run_them():
    """A page's commands are found in its bash blocks; each page that has any is in `RUN_BY`, and each test named
    there exists (here, or in the file it names)."""
    import importlib

    pages = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
    assert sorted(p for p in pages if page_commands(p)) == sorted(RUN_BY)
    assert sorted(p for p in pages if page_python(p)) == sorted(PYTHON_RUN_BY)
    for tests in [*RUN_BY.values(), *PYTHON_RUN_BY.values()]:
        for test in tests:
            file, _, name = test.rpartition("::")
            module = f"tests.{file.removesuffix('.py').replace('/', '.')}" if file else __name__
            assert callable(getattr(importlib.import_module(module), name, None)), test


def _getting_started() -> tuple[list[list[str]], list[list[str]]]:
    """The page's Fashion-MNIST commands (before its first section) and its digits ones (the sections)."""
    text = (ROOT / "docs" / "getting-started.md").read_text()
    head, sections = text.split("\n## ", 1)
    return commands(head), commands(sections)


def test_the_readme_shows_getting_started_s_fashion_mnist_commands():
    """The README's commands are the getting started page's first ones, which the next tests run."""
    assert page_commands("README.md") == _getting_started()[0]


def test_the_readme_s_python_is_getting_started_s():
    assert page_python("README.md") == page_python("docs/getting-started.md")


def test_getting_started_s_python_runs_as_written(workdir, capsys):
    """The Python API's first example (1 round for its 20): a run in `runs/x`, its P-FL printed."""
    (code,) = page_python("docs/getting-started.md")
    assert code.count('"rounds": 20') == 1
    exec(code.replace('"rounds": 20', '"rounds": 1'), {})  # noqa: S102  (the page's own code)
    summary = json.loads((workdir / "runs" / "x" / "summary.json").read_text())
    assert capsys.readouterr().out == f"{summary['final']['pfl_acc']}\n"


def test_after_the_run_s_python_runs_as_written(workdir):
    """On the run the page's reader has (`pflbed run`'s default, short), and `my_digits.npz`, samples of their own:
    here some of the digits' held-out ones, raw."""
    import numpy as np

    from pflbed.data import load_digits_source
    from pflbed.federation.new_client import raw_samples

    (code,) = page_python("docs/guide/after-the-run.md")
    assert main(with_sets(["run", "--no-progress"], *SHORT["run"])) == 0
    source = load_digits_source()
    np.savez(workdir / "my_digits.npz", x=raw_samples(source, source.test.x[:12]), y=source.test.y[:12].numpy())
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102  (the page's own code)
    assert namespace["labels"].shape == (12,) and namespace["head"] is not None


def test_getting_started_s_fashion_mnist_commands_run_as_written(workdir):
    needs_fmnist()
    fmnist, _ = _getting_started()
    assert [argv[:2] for argv in fmnist] == [["run", "-c"], ["run", "-c"], ["data", "list"], ["data", "export"]]
    run_all(fmnist)
    assert sorted(p.name for p in (workdir / "runs").iterdir()) == ["fedavg-fmnist-seed0", "local-fmnist"]
    assert len(json.loads((workdir / "split.json").read_text())["clients"]) == 100


def test_getting_started_s_digits_commands_run_as_written(workdir):
    """The first comparison (two runs, one report) and the first personalized new client, in order."""
    _, digits = _getting_started()
    assert [argv[0] for argv in digits] == ["run", "run", "report", "run", "data", "personalize"]
    run_all(digits)
    assert (workdir / "report.html").is_file()
    assert sorted(p.name for p in (workdir / "new-client").iterdir()) == ["test.npz", "train.npz", "val.npz"]
    assert "test_acc" in json.loads((workdir / "runs" / "new-client" / "summary.json").read_text())


def test_after_the_run_s_commands_run_as_written(workdir):
    """The page's new client's files are a held-out client of the run the page names (`pflbed run`'s default
    directory); then its personalization, a pretraining and a run started from it."""
    after = page_commands("docs/guide/after-the-run.md")
    assert [argv[0] for argv in after] == ["personalize", "pretrain", "run"]
    run = after[0][1]
    assert run == "runs/fedavg-digits-seed0"
    assert main(with_sets(["run", "--no-progress"], "federation.new_clients=2", *SHORT["run"])) == 0  # its default
    assert main(["data", "new-client", run, "--out", "client"]) == 0
    for split, name in (("train", "new_client"), ("val", "new_val"), ("test", "new_test")):
        shutil.copy(workdir / "client" / f"{split}.npz", workdir / f"{name}.npz")
    run_all(after[:1])
    assert json.loads((workdir / "runs" / "new-client" / "summary.json").read_text())["method"] == "native"
    needs_fmnist()
    run_all(after[1:])
    summary = json.loads((workdir / "runs" / "fedavg-fmnist-rot4-seed0" / "summary.json").read_text())
    assert summary["init_from"]["path"] == "pretrained/lenet5-rot0/model.pt"
    assert summary["init_from"]["blocks"] == ["body"]


def test_the_flower_guide_s_simulation_runs_as_written(workdir):
    needs_flower()
    simulation = [argv for argv in page_commands("docs/guide/flower.md") if argv[0] == "run"]
    assert simulation == [["run", "--set", "executor.name=flower", "--set", "executor.workers=2"]]
    run_all(simulation)
    assert (workdir / "runs" / "fedavg-digits-seed0" / "summary.json").is_file()


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-1")
def test_the_flower_guide_s_deployments_run_as_written(workdir):
    """In order, in one directory (the site-local deployments read the sites the command before them wrote)."""
    needs_flower()
    deployments = [argv for argv in page_commands("docs/guide/flower.md") if argv[0] == "flower"]
    assert [argv[1] for argv in deployments] == ["local", "local", "local", "sites", "local", "local"]
    run_all(deployments)
    assert sorted(p.name for p in (workdir / "runs").iterdir()) == ["flower-auth", "flower-local",
                                                                     "flower-local-tls", "sites", "sites-secure"]


def test_the_tuning_guide_s_worker_commands_run_as_written(workdir, monkeypatch):
    """`suite.yaml` is any suite: here a small one. On one machine, the main command and a worker run one after
    the other (the page starts the first in the background). The several machines' pair runs in a directory of its
    own, on a SQLite file in place of the PostgreSQL server the page names, which a test machine has not (the URL
    parses as the page writes it)."""
    import yaml

    tuning = page_commands("docs/guide/tuning.md")
    workers = [argv for argv in tuning if argv[:3] == ["tune", "-c", "suite.yaml"]]
    assert len(workers) == 4 and len(tuning) == 5  # the fifth: the small study test_tune runs
    suite = yaml.safe_load((ROOT / "benchmarks" / "suites" / "tune_digits.yaml").read_text())
    suite.update(seeds=[0], methods={"FedAvg": suite["methods"]["FedAvg"]}, tune={**suite["tune"], "budget": 2})
    suite["base"]["train"]["rounds"] = 2
    for machines, pair in (("one", workers[:2]), ("several", workers[2:])):
        (workdir / machines).mkdir()
        monkeypatch.chdir(workdir / machines)
        (workdir / machines / "suite.yaml").write_text(yaml.safe_dump(suite))
        for argv in pair:
            assert ("--storage" in argv) == (machines == "several"), argv
            if "--storage" in argv:
                at = argv.index("--storage") + 1
                assert _parser().parse_args(argv).storage == argv[at] == "postgresql://user:pass@db-host/pflbed"
                argv = [*argv[:at], f"sqlite:///{workdir / 'shared.db'}", *argv[at + 1 :]]
            assert main(argv) == 0, argv
        assert (workdir / machines / "runs" / "tune" / "tune_digits" / "table.md").is_file()
