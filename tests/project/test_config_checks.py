"""Each check across a config's fields (the sections' validators), at its edge: the config it refuses, with its whole
one-line message, beside its nearest neighbour that passes. A check dropped, or its comparison moved by one step
(`<` for `<=`, `and` for `or`), turns one side of a row.

(mutmut leaves decorated functions, the validators, unmutated: `benchmarks/decorated_mutants.py` plants their wrong
versions against this file.)"""

import importlib.util

import pytest

from pflbed.config import SYNTHETIC_MAX_VALUES, load_config, max_threads
from pflbed.errors import ConfigError

HALF = SYNTHETIC_MAX_VALUES // 2
FLOWER = ["executor.name=flower"]
LOCAL = [*FLOWER, "sites.local=true", "sites.input_shape=[1, 8, 8]", "sites.num_classes=10"]

# name -> (refused settings, its message, the neighbour that passes)
CASES = {
    # executor
    "batched clients outside the loop": (
        ["executor.name=procs", "executor.batch_clients=true"],
        "executor: batch_clients applies to executor.name=loop or auto (batched clients run in the loop executor)",
        ["executor.name=loop", "executor.batch_clients=true"]),
    "batched clients' size with them off": (
        ["executor.batch_clients=false", "executor.batch_max_clients=4"],
        "executor: batch_max_clients applies to batched clients (executor.batch_clients, executor.name=loop)",
        ["executor.batch_max_clients=4"]),
    "batched clients' size outside the loop": (
        ["executor.name=procs", "executor.batch_max_clients=4"],
        "executor: batch_max_clients applies to batched clients (executor.batch_clients, executor.name=loop)",
        ["executor.name=auto", "executor.batch_max_clients=4"]),
    "compiled steps with batching off": (
        ["executor.batch_clients=false", "executor.compile=default"],
        "executor: compile applies to batched clients (executor.batch_clients, executor.name=loop)",
        ["executor.compile=default"]),
    "compiled steps outside the loop": (
        ["executor.name=procs", "executor.compile=default"],
        "executor: compile applies to batched clients (executor.batch_clients, executor.name=loop)",
        ["executor.name=loop", "executor.compile=reduce-overhead"]),
    "a SuperNode count without Flower": (
        ["executor.supernodes=2"], "executor: supernodes applies to executor.name=flower",
        [*FLOWER, "executor.supernodes=2"]),
    "a round timeout without Flower": (
        ["executor.round_timeout=10"], "executor: round_timeout applies to executor.name=flower",
        [*FLOWER, "executor.round_timeout=10"]),
    "threads past 4 per core": (
        [f"executor.threads={max_threads() + 1}"],
        f"executor.threads: must be unset (auto) or 1 to {max_threads()} (4 × this machine's cores) "
        f"(got {max_threads() + 1})",
        [f"executor.threads={max_threads()}"]),
    "no workers": (
        ["executor.workers=0"],
        f"executor.workers: must be unset (auto) or 1 to {max_threads()} (4 × this machine's cores) (got 0)",
        ["executor.workers=1"]),
    # dataset
    "a size-0 synthetic input": (
        ["dataset.synthetic.shape=[3, 0]"],
        "dataset.synthetic.shape: every size must be at least 1 (got [3, 0])", ["dataset.synthetic.shape=[3, 1]"]),
    "too many synthetic values": (
        ["dataset.synthetic.shape=[1]", f"dataset.synthetic.n_train={HALF + 1}", f"dataset.synthetic.n_test={HALF}"],
        f"dataset.synthetic: (n_train + n_test) × the shape's size must be at most {SYNTHETIC_MAX_VALUES:,} values "
        "(4 GiB of float32)",
        ["dataset.synthetic.shape=[1]", f"dataset.synthetic.n_train={HALF}", f"dataset.synthetic.n_test={HALF}"]),
    "a zero std": (
        ["dataset.hf.normalize=[0.5, 0.0]"],
        "dataset.hf.normalize: the std (second value) must be > 0 (got [0.5, 0.0])",
        ["dataset.hf.normalize=[0.5, 1.0e-9]"]),
    "one split twice": (
        ["dataset.hf.splits=[train, train]"],
        "dataset.hf.splits: two different, non-empty split names: [train, test] (or one: [train]) (got ['train', "
        "'train'])",
        ["dataset.hf.splits=[train, validation]"]),
    "an empty split name": (
        ["dataset.hf.splits=[train, '']"],
        "dataset.hf.splits: two different, non-empty split names: [train, test] (or one: [train]) (got ['train', ''])",
        ["dataset.hf.splits=[train]"]),
    "a Hub dataset from nowhere": (
        ["dataset.name=hf"],
        "dataset: dataset.name hf needs dataset.hf.id (a Hub id in the Hugging Face cache, or a local directory) or "
        "dataset.path (a save_to_disk directory)",
        ["dataset.name=hf", "dataset.hf.id=user/data"]),
    "an augmentation twice": (
        ["dataset.augment=[flip, flip]"], "dataset.augment: each of crop, flip at most once (got ['flip', 'flip'])",
        ["dataset.augment=[flip, crop]"]),
    # new clients' evaluation
    "no fraction of a new client's data": (
        ["eval.new_clients.fractions=[]"], "eval.new_clients: fractions: one to three values in (0, 1]",
        ["eval.new_clients.fractions=[1.0]"]),
    "four fractions": (
        ["eval.new_clients.fractions=[0.1, 0.2, 0.5, 1.0]"],
        "eval.new_clients: fractions: one to three values in (0, 1]", ["eval.new_clients.fractions=[0.2, 0.5, 1.0]"]),
    "a fraction of none": (
        ["eval.new_clients.fractions=[0.0, 1.0]"], "eval.new_clients: fractions: one to three values in (0, 1]",
        ["eval.new_clients.fractions=[1.0e-9, 1.0]"]),
    "a fraction past all": (
        ["eval.new_clients.fractions=[1.01]"], "eval.new_clients: fractions: one to three values in (0, 1]",
        ["eval.new_clients.fractions=[1.0]"]),
    "a zero learning rate to try": (
        ["eval.new_clients.lrs=[0.1, 0.0]"], "eval.new_clients: lrs must be > 0",
        ["eval.new_clients.lrs=[0.1, 1.0e-9]"]),
    # PFLBED's split and the standard protocol
    "PFLBED's shares past the whole": (
        ["federation.protocol=pflbed", "federation.pflbed.test=0.16"],
        "federation.pflbed: participated + new + val + test = 1.01 exceeds 1",
        ["federation.protocol=pflbed", "federation.pflbed.test=0.15"]),
    "no participated share": (
        ["federation.protocol=pflbed", "federation.pflbed.participated=0"],
        "federation.pflbed: participated must be > 0",
        ["federation.protocol=pflbed", "federation.pflbed.participated=1.0e-9"]),
    "new clients from no share": (
        ["federation.protocol=pflbed", "federation.pflbed.new=0", "federation.pflbed.new_clients_per_domain=1"],
        "federation.pflbed: new clients need new > 0",
        ["federation.protocol=pflbed", "federation.pflbed.new=0", "federation.pflbed.new_clients_per_domain=0"]),
    "a standard setting under PFLBED": (
        ["federation.protocol=pflbed", "federation.clients=7"],
        "federation: clients is not read by protocol pflbed; its clients are pflbed.clients_per_domain per domain",
        ["federation.protocol=pflbed", "federation.pflbed.clients_per_domain=7"]),
    "a PFLBED setting under the standard protocol": (
        ["federation.pflbed.new=0.1"],
        "federation: pflbed.new is read only by protocol pflbed; set protocol: pflbed",
        ["federation.pflbed.new=0.2"]),
    "no data left to train on": (
        ["federation.val_fraction=0.5", "federation.test_fraction=0.5"],
        "federation: val_fraction + test_fraction must be < 1",
        ["federation.val_fraction=0.49", "federation.test_fraction=0.5"]),
    "no participated client": (
        ["federation.clients=4", "federation.new_clients=4"],
        "federation: new_clients must leave at least one participated client",
        ["federation.clients=4", "federation.new_clients=3"]),
    "a reduced pool and a manifest": (
        ["federation.exclude_test_of=[1]", "federation.manifest=m.json"],
        "federation: exclude_test_of draws a federation from a reduced pool; a manifest fixes one",
        ["federation.manifest=m.json"]),
    # privacy
    "noise without a clip": (
        ["privacy.noise_multiplier=1.0"],
        "privacy: noise_multiplier needs privacy.clip (the norm each client's update is clipped to)",
        ["privacy.clip=1.0", "privacy.noise_multiplier=1.0"]),
    "a target ε without a clip": (
        ["privacy.target_epsilon=3"],
        "privacy: target_epsilon needs privacy.clip (the norm each client's update is clipped to)",
        ["privacy.clip=1.0", "privacy.target_epsilon=3"]),
    "randomness without a clip": (
        ["privacy.randomness=os"],
        "privacy: randomness needs privacy.clip (the norm each client's update is clipped to)",
        ["privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.randomness=os"]),
    "an accountant without a clip": (
        ["privacy.accountant=prv"],
        "privacy: accountant needs privacy.clip (the norm each client's update is clipped to)",
        ["privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.accountant=prv"]),
    "sites' noise without a clip": (
        ["privacy.noise=distributed"],
        "privacy: noise needs privacy.clip (the norm each client's update is clipped to)",
        [*LOCAL, "sites.secagg=true", "privacy.clip=1.0", "privacy.noise_multiplier=1.0",
         "privacy.noise=distributed"]),
    "a clip with no noise": (
        ["privacy.clip=1.0"],
        "privacy: clip needs exactly one of privacy.noise_multiplier and privacy.target_epsilon",
        ["privacy.clip=1.0", "privacy.target_epsilon=3"]),
    "a clip with two noises": (
        ["privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.target_epsilon=3"],
        "privacy: clip needs exactly one of privacy.noise_multiplier and privacy.target_epsilon",
        ["privacy.clip=1.0", "privacy.noise_multiplier=0"]),
    "a fixed sample under privacy": (
        ["privacy.clip=1.0", "privacy.noise_multiplier=1.0", "federation.sampling=fixed"],
        "config: federation.sampling: privacy's accountant assumes Poisson sampling of clients; use "
        "federation.sampling=poisson (the default with privacy)",
        ["privacy.clip=1.0", "privacy.noise_multiplier=1.0", "federation.sampling=poisson"]),
    "sites' noise without SecAgg+": (
        [*LOCAL, "privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.noise=distributed"],
        "config: privacy.noise: distributed needs sites.secagg=true (the sites' noise shares are hidden from the "
        "server only inside SecAgg+'s masked sum)",
        [*LOCAL, "privacy.clip=1.0", "privacy.noise_multiplier=1.0"]),
    "sites' noise from the seed": (
        [*LOCAL, "sites.secagg=true", "privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.noise=distributed",
         "privacy.randomness=seeded"],
        "config: privacy.randomness: seeded does not apply with privacy.noise=distributed (the sites draw their noise "
        "shares from the operating system)",
        [*LOCAL, "sites.secagg=true", "privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.noise=distributed",
         "privacy.randomness=os"]),
    # sites
    "a site's shape with the data on the server": (
        ["sites.input_shape=[1, 8, 8]"], "sites: input_shape applies to sites.local=true", LOCAL),
    "the sites' classes with the data on the server": (
        ["sites.num_classes=10"], "sites: num_classes applies to sites.local=true", LOCAL),
    "a server test set with the data on the server": (
        ["sites.test=t.npz"], "sites: test applies to sites.local=true", [*LOCAL, "sites.test=t.npz"]),
    "SecAgg+ with the data on the server": (
        ["sites.secagg=true"],
        "sites: secagg applies to sites.local=true: with the data on the server, it would protect nothing the server "
        "does not hold already",
        [*LOCAL, "sites.secagg=true"]),
    "sites of unknown shape": (
        [*FLOWER, "sites.local=true", "sites.num_classes=10"],
        "sites: local needs sites.input_shape and sites.num_classes (what the server knows of the sites' data)",
        LOCAL),
    "sites of unknown classes": (
        [*FLOWER, "sites.local=true", "sites.input_shape=[1, 8, 8]"],
        "sites: local needs sites.input_shape and sites.num_classes (what the server knows of the sites' data)",
        LOCAL),
    "a 5-d sample": (
        [*LOCAL, "sites.input_shape=[1, 1, 1, 1, 1]"],
        "sites: input_shape must be 1 to 4 positive sizes, e.g. [1, 28, 28]",
        [*LOCAL, "sites.input_shape=[1, 1, 1, 1]"]),
    "a sample of no dimensions": (
        [*LOCAL, "sites.input_shape=[]"],
        "sites: input_shape must be 1 to 4 positive sizes, e.g. [1, 28, 28]", [*LOCAL, "sites.input_shape=[5]"]),
    "a size-0 sample": (
        [*LOCAL, "sites.input_shape=[1, 0]"],
        "sites: input_shape must be 1 to 4 positive sizes, e.g. [1, 28, 28]", [*LOCAL, "sites.input_shape=[1, 1]"]),
    "sites without Flower": (
        ["sites.local=true", "sites.input_shape=[1, 8, 8]", "sites.num_classes=10"],
        "config: executor.name does not apply with sites.local=true: sites.local needs executor.name=flower", LOCAL),
    "the sites' states chosen by the server": (
        [*LOCAL, "executor.state_dir=s"],
        "config: executor.state_dir does not apply with sites.local=true: a site keeps its clients' states in its "
        "own state-dir node config; the server does not choose it",
        [*FLOWER, "executor.state_dir=s"]),
    "new clients with the data on the sites": (
        [*LOCAL, "federation.new_clients=1"],
        "config: federation.new_clients does not apply with sites.local=true: a site that joins after training "
        "personalizes on its own (pflbed personalize)",
        [*FLOWER, "federation.new_clients=1"]),
    "PFLBED's shared sets on the sites": (
        [*LOCAL, "federation.protocol=pflbed"],
        "config: federation.protocol does not apply with sites.local=true: PFLBED's shared domain val/test sets are "
        "not on the sites",
        [*FLOWER, "federation.protocol=pflbed"]),
    "public data on the sites": (
        [*LOCAL, "federation.public=1"],
        "config: federation.public does not apply with sites.local=true: public data is not on the sites",
        [*FLOWER, "federation.public=1"]),
    "a manifest of the sites' data": (
        [*LOCAL, "federation.manifest=m.json"],
        "config: federation.manifest does not apply with sites.local=true: the sites hold the data",
        [*FLOWER, "federation.manifest=m.json"]),
    "the global test set on the sites": (
        [*LOCAL, "eval.pfl_test=global"],
        "config: eval.pfl_test does not apply with sites.local=true: a site scores its clients on its own test data",
        [*FLOWER, "eval.pfl_test=global"]),
    "initial weights on the sites": (
        [*LOCAL, "model.init_from=w.pt"],
        "config: model.init_from does not apply with sites.local=true: the sites would each need the weights file",
        [*FLOWER, "model.init_from=w.pt"]),
    "client data on the server": (
        [*LOCAL, "dataset.path=data"],
        "config: dataset.path does not apply with sites.local=true: the server holds no client data",
        [*FLOWER, "dataset.path=data"]),
    # the whole config
    "more SuperNodes than clients": (
        [*FLOWER, "federation.clients=4", "executor.supernodes=5"],
        "config: executor.supernodes: 5 SuperNodes for 4 clients (node k serves the clients whose id is k modulo 5, "
        "so 1 would serve none); at most 4",
        [*FLOWER, "federation.clients=4", "executor.supernodes=4"]),
    "more SuperNodes than clients, new ones counted": (
        [*FLOWER, "federation.clients=4", "federation.new_clients=1", "executor.supernodes=6"],
        "config: executor.supernodes: 6 SuperNodes for 5 clients (node k serves the clients whose id is k modulo 6, "
        "so 1 would serve none); at most 5",
        [*FLOWER, "federation.clients=4", "federation.new_clients=1", "executor.supernodes=5"]),
    "the global test set under PFLBED": (
        ["federation.protocol=pflbed", "eval.pfl_test=global"],
        "config: eval.pfl_test: global is not read by federation.protocol pflbed, which scores each client on its "
        "domain's shared test set, weighted by its training classes",
        ["federation.protocol=pflbed", "eval.pfl_test=local"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_each_check_refuses_its_case_and_passes_its_neighbour(case):
    refused, message, passes = CASES[case]
    with pytest.raises(ConfigError) as e:
        load_config(None, refused)
    assert str(e.value) == message
    load_config(None, passes)


def test_supernodes_are_only_counted_where_the_clients_are_known():
    """Under PFLBED (clients per domain) and with the data on the sites, the server cannot count the clients: any
    number of SuperNodes passes."""
    load_config(None, [*FLOWER, "federation.protocol=pflbed", "executor.supernodes=1000"])
    load_config(None, [*LOCAL, "federation.clients=4", "executor.supernodes=1000"])


def test_defaults_that_fill_themselves_in():
    """Tiny-ImageNet's images are 64 px unless set; `none` and null augmentations are none; privacy is on only
    with a clip."""
    assert load_config(None, ["dataset.name=tinyimagenet"]).dataset.image_size == 64
    assert load_config(None, ["dataset.name=tinyimagenet", "dataset.image_size=32"]).dataset.image_size == 32
    assert load_config(None, ["dataset.name=cifar10"]).dataset.image_size == 32
    assert load_config(None, ["dataset.augment=none"]).dataset.augment == []
    assert load_config(None, ["dataset.augment=null"]).dataset.augment == []
    assert load_config(None, ["dataset.augment=[crop]"]).dataset.augment == ["crop"]
    assert not load_config(None, []).privacy.enabled
    assert load_config(None, ["privacy.clip=1.0", "privacy.noise_multiplier=0"]).privacy.enabled


@pytest.mark.parametrize(("extra", "sets", "message"), [
    ("tensorboard", ["log.tensorboard=true"],
     "log: tensorboard needs the tensorboard extra: pip install 'pflbed[tensorboard]'"),
    ("opacus", ["privacy.clip=1.0", "privacy.noise_multiplier=1.0"],
     "privacy: privacy needs the privacy extra (Opacus's accountants): pip install 'pflbed[privacy]'"),
    ("flwr", FLOWER, "executor: executor.name=flower needs the flower extra: pip install 'pflbed[flower]'"),
    ("datasets", ["dataset.name=hf", "dataset.hf.id=user/data"],
     "dataset: dataset.name hf needs the hf extra: pip install 'pflbed[hf]'"),
])  # fmt: skip
def test_a_setting_whose_extra_is_missing_says_which_to_install(monkeypatch, extra, sets, message):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == extra else find_spec(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert str(e.value) == message
    load_config(None, [])  # a run that does not use the extra needs it not
    monkeypatch.undo()
    load_config(None, sets)


@pytest.mark.parametrize(("sets", "poisson", "randomness"), [
    ([], False, "seeded"),
    (["federation.sampling=poisson"], True, "seeded"),
    (["privacy.clip=1.0", "privacy.noise_multiplier=1.0"], True, "seeded"),  # privacy's accountant needs Poisson
    ([*FLOWER, "federation.sampling=fixed"], False, "os"),  # a deployment: never from the seed unless asked
    ([*FLOWER, "privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.randomness=seeded"], True, "seeded"),
])  # fmt: skip
def test_sampling_and_randomness_default_to_what_the_run_needs(sets, poisson, randomness):
    cfg = load_config(None, sets)
    assert cfg.poisson_sampling() is poisson
    assert cfg.privacy_randomness() == randomness
