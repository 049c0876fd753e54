"""A tiny, fast experiment config shared by the end-to-end tests (strict executor on), and what the executor parity
tests (procs, Flower) share."""

import functools

import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.config import validate_config
from pflbed.results.experiment import run

TINY = {
    "dataset": {"name": "synthetic"},
    "model": {"name": "mlp"},
    "federation": {"clients": 6, "partition": "dirichlet", "alpha": 1.0, "sample_fraction": 0.5},
    "train": {"rounds": 4, "batch_size": 16, "lr": 0.1},
    "eval": {"every": 2, "finetune": []},
    "executor": {"strict": True},
}

# Public data for the distillation family. Their default zoo (ResNet-18, ShuffleNetV2…) would make the parity tests
# minutes long: two light architectures keep the heterogeneous path (one model per architecture in each worker)
# at a fraction of the cost, and few server steps keep FedDF's server distillation short. One of them has dropout,
# so the parity also checks that FedDF's server distillation draws its masks from its own seeded stream (without
# the reseed, the masks depend on whatever the last client left in torch's global RNG: red there).
FED = {**TINY["federation"], "public": 64}
LIGHT = {"architectures": ["alexnet_small_x025", "mlp"], "server_steps": 3}

# The executor parity matrices (procs, Flower simulation, states on nodes, batched clients, the meta device) compare
# where clients run, not how well they learn: 800 training samples instead of 2000 keep the paths a case takes
# (several batches an epoch, every round's state carried to the next) at 40 % of the local steps. Not for a
# site-local deployment's config: a site refuses a server that sizes its data.
DATA = {**TINY["dataset"], "synthetic": {"n_train": 800}}


# The zoo's dropout model, AlexNet, at 1/16 of its width (FC 256): the same layers and dropout masks as
# `alexnet_small_x025` at a fifth of its cost per float64 step, for the batched tests that compare every step's masks
# in one process. A test takes it with the `alexnet_tiny` fixture (conftest), which registers it for that test alone.
ALEXNET_TINY = "alexnet_tiny"

# Non-default options that change what crosses the executors (a client state holding a whole model) or what a
# client draws from its generator: the parity tests run these beside every algorithm's defaults. Case name →
# (algorithm, options) or (algorithm, options, config sections replaced).
VARIANTS = {
    "fedrod+local-body": ("fedrod", {"pfl_body": "local"}),
    "fedrod_hyper+local-body": ("fedrod_hyper", {"pfl_body": "local"}),
    "pfedme+all-clients": ("pfedme", {"train_clients": "all"}),  # unsampled clients train too, and reply nothing
    # crop offsets and flips drawn from each client's generator between its batches, wherever the client runs
    "fedavg+augment": ("fedavg", {}, {"dataset": {**DATA, "augment": ["crop", "flip"]}}),
    # client-level DP: clipped where the client runs, Poisson sampling, noised by the server (test_privacy.py); the
    # seeded stream named, since a Flower run draws from the OS by default (test_privacy_deployed.py)
    "fedper+dp": ("fedper", {}, {"privacy": {"clip": 0.5, "noise_multiplier": 0.8, "randomness": "seeded"}}),
    # FedProto's heterogeneous clients (its `models`; LIGHT's architectures differ in embedding size, which its
    # prototypes cannot bridge): two architectures of one embedding size, the run's own and a BatchNorm one that
    # the algorithm initialises from its own seeded stream in every process
    "fedproto+heterogeneous": ("fedproto", {"models": ["lenet5", "lenet5_bn"]}, {"model": {"name": "lenet5"}}),
}
PARITY_CASES = sorted(ALGORITHMS) + sorted(VARIANTS)


def figures(summary):
    """A summary's results: everything but timing and provenance."""
    return {k: v for k, v in summary.items() if k not in ("timing", "provenance")}


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@functools.cache
def loop_run(name, **train):
    """The `loop` run of `parity_config(name, {"threads": 1}, **train)` — the reference of the executor parity tests
    (procs, Flower simulation, states on nodes), computed once per test process: the loop is deterministic at one
    thread (`test_cli.test_same_config_and_seed_give_identical_summary`), and each module would otherwise train
    the same reference again. Callers only read it."""
    return run(parity_config(name, {"threads": 1}, **train), write=False, progress=False)


def parity_config(name, executor, evaluation=None, **train):
    """TINY for algorithm `name` (or a case of VARIANTS) on `executor` (on DATA, with FED's public data and LIGHT's
    options where they apply), with `evaluation` and `train` overrides: the config of the executor parity tests."""
    name, options, *sections = VARIANTS.get(name, (name, {}))
    fields = ALGORITHMS[name].Config.model_fields
    algorithm = {"name": name, **{k: v for k, v in LIGHT.items() if k in fields}, **options}
    return validate_config({**TINY, "dataset": DATA, "federation": FED, "train": {**TINY["train"], **train},
                            "algorithm": algorithm,
                            "eval": {**TINY["eval"], **(evaluation or {})}, "executor": executor,
                            **(sections[0] if sections else {})})  # fmt: skip
