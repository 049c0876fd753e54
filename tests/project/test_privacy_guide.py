"""The privacy guide (docs/guide/privacy.md): every `pflbed` command of its bash blocks runs as written, with only
short settings appended (one round, fewer clients, no fine-tuning), and the noise-to-signal figure it quotes for its
first example is that of the command as written — under 1, so that run is not warned."""

import importlib.util
from pathlib import Path

import pytest

from pflbed import privacy
from pflbed.cli import main
from pflbed.config import load_config
from pflbed.data.fmnist import HOW_TO_GET, find_fmnist

from ..doc_commands import commands, expanded, with_sets

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide" / "privacy.md"
# appended to a command in this test only: the same keys and combinations, run small
SHORT = {"run": ["train.rounds=1", "federation.clients=40", "eval.finetune=[]", "executor.threads=1"],
         "sites": ["federation.clients=2"],
         "local": ["train.rounds=1", "eval.finetune=[]", "executor.threads=1"]}  # fmt: skip


def sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


GUIDE_COMMANDS = commands(GUIDE.read_text())


def test_the_guide_shows_the_commands_this_test_runs():
    assert [argv[:2] for argv in GUIDE_COMMANDS] == [["run", "--set"], ["run", "--set"], ["flower", "sites"],
                                                     ["flower", "local"]]  # fmt: skip


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-1")
def test_the_guides_commands_run_as_written(tmp_path, monkeypatch):
    """In order, in one directory (the deployment reads the sites the command before it wrote)."""
    if any("dataset.name=fmnist" in sets(argv) for argv in GUIDE_COMMANDS) and find_fmnist() is None:
        pytest.skip(f"Fashion-MNIST is not on this machine: {HOW_TO_GET}")
    monkeypatch.chdir(tmp_path)
    for argv in GUIDE_COMMANDS:
        if argv[0] == "flower" and importlib.util.find_spec("flwr") is None:
            pytest.skip("the flower extra: pip install -e '.[flower]'")
        short = SHORT.get(argv[0] if argv[0] == "run" else argv[1], [])
        assert main(with_sets(expanded(argv), *short)) == 0, argv


def test_the_guides_first_example_is_not_swamped_by_its_noise_and_its_figure_is_quoted():
    """The figure for the command as written (its 50 rounds, its 1000 clients, FedPer's shared entries on LeNet-5)
    is below 1, and it is the one the guide quotes."""
    if find_fmnist() is None:
        pytest.skip(f"Fashion-MNIST is not on this machine: {HOW_TO_GET}")
    from pflbed.engine.build import prepare

    cfg = load_config(None, sets(GUIDE_COMMANDS[0]))
    algo = prepare(cfg, threads=1)
    fed = algo.ctx.federation
    mech = privacy.mechanism(cfg, len(fed.participated))
    first = fed.participated[0]
    shared = algo.configure(1, algo.init_server(), [first])[first]
    entries = sum(v.numel() for v in shared.values() if v.is_floating_point())
    figure = mech.noise_to_signal(entries)
    assert figure < privacy.NOISE_SWAMPS and mech.noise_warning(entries) is None
    row = f"| {mech.expected_clients:g} | {mech.sigma:.3f} | {entries:,} | {figure:.2f} |"
    assert row in GUIDE.read_text(), row  # the table's row for this command
