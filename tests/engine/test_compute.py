"""`pflbed.compute`: a run's training work in sample passes, the unit `pflbed tune` budgets in."""

import pytest

from pflbed import compute
from pflbed.config import validate_config
from pflbed.data import load_source
from pflbed.federation import build_federation, sample_clients
from pflbed.results.experiment import run

from ..tiny import TINY


def _passes(cfg: dict) -> int:
    before = compute.total()
    run(validate_config(cfg), write=False, progress=False)
    return compute.total() - before


def _fedavg_passes(cfg) -> int:
    """FedAvg's local training by hand: every round's sampled clients × local epochs × their training samples."""
    fed = build_federation(load_source(cfg.dataset), cfg.federation, cfg.seed)
    return sum(cfg.train.local_epochs * fed.num_train(c) for r in range(1, cfg.train.rounds + 1)
               for c in sample_clients(cfg.seed, r, fed.participated, cfg.federation.sample_fraction))  # fmt: skip


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_fedavg_run_counts_every_sampled_client_s_training_samples_per_epoch(epochs):
    cfg = {**TINY, "algorithm": {"name": "fedavg"}, "train": {**TINY["train"], "local_epochs": epochs}}
    assert _passes(cfg) == _fedavg_passes(validate_config(cfg)) > 0


@pytest.mark.parametrize(("algorithm", "times"), [
    ({"name": "fedprox"}, 1), ({"name": "pfedme", "K": 1}, 1), ({"name": "perfedavg"}, 2),
    ({"name": "perfedavg", "variant": "hf"}, 3),
])  # fmt: skip
def test_a_plans_batches_count_as_the_forwards_on_them_whatever_its_phase(algorithm, times):
    """A phase on an objective (FedProx) or a step rule counts each batch it draws once per forward on it:
    pFedMe at K = 1 and FedProx as FedAvg; Per-FedAvg's steps take two batches (HF: three) of one gradient each,
    so its τ = local epochs' worth of steps draws twice (three times) FedAvg's batches. A count of samples: an int
    (`summary.json` shows it)."""
    cfg = {**TINY, "algorithm": algorithm}
    passes = _passes(cfg)
    assert passes == times * _fedavg_passes(validate_config(cfg)) > 0 and isinstance(passes, int)


def test_the_worker_processes_training_is_counted_in_the_run_s_process():
    cfg = {**TINY, "algorithm": {"name": "fedavg"}}
    procs = {**cfg, "executor": {**TINY["executor"], "name": "procs", "workers": 2}}
    assert _passes(procs) == _passes(cfg) == _fedavg_passes(validate_config(cfg))


def test_gradient_steps_on_one_batch_count_as_passes_and_fine_tuning_counts():
    """pFedMe takes K steps on each batch it draws: K passes; FedAvg+FT's final fine-tuning is training too."""
    one = _passes({**TINY, "algorithm": {"name": "pfedme", "K": 1}})
    assert _passes({**TINY, "algorithm": {"name": "pfedme", "K": 3}}) == 3 * one
    plain = {**TINY, "algorithm": {"name": "fedavg"}}
    assert _passes({**plain, "eval": {**TINY["eval"], "finetune": ["ft"]}}) > _passes(plain)


@pytest.mark.parametrize("fraction", [1 / 6, 0.5])
def test_batched_clients_count_what_the_loop_counts_a_plans_own_work_once(fraction):
    """FedALA's plan learns its weights (counted) before its training: a batched round counts what the loop does,
    a lone client's plan (one client a round) run, not built again."""
    cfg = {**TINY, "algorithm": {"name": "fedala"}, "federation": {**TINY["federation"], "sample_fraction": fraction}}
    loop = _passes(cfg)
    assert _passes({**cfg, "executor": {**TINY["executor"], "batch_clients": True}}) == loop > _fedavg_passes(
        validate_config(cfg))  # fmt: skip
