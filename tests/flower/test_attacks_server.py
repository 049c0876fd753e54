"""A site-local node against a malicious server: every message is held against what a server may decide for a site
(`flower.site_policy`) before the node builds, reads or writes anything. Each attack is one a server could send
today through Flower's messages; the planted server here skips pflbed's own validation (`site_setup._tampered`)."""

import hashlib
import json
import re
import time
import traceback

import pytest
import torch

from pflbed.config import validate_config

from ..tiny import TINY

flwr = pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402

from pflbed.flower import client, site_node, site_policy  # noqa: E402
from pflbed.flower.sites import SiteError, offsets  # noqa: E402

from .site_setup import _site_cfg, _sites, _tampered, _tree, run_sites  # noqa: E402

SITE = {"data": "/nonexistent/site.npz", "partition-id": 0, "num-partitions": 1}


def _tree_of(cfg, **changes):
    """`cfg`'s JSON tree with dotted keys changed (a server that skips validation)."""
    tree = cfg.model_dump(mode="json")
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for p in parents:
            node = node[p]
        node[leaf] = value
    return tree


def _json(cfg, **changes):
    return json.dumps(_tree_of(cfg, **changes), sort_keys=True)


def _cfg(name="fedavg", **algo):
    tree = _tree(name, eval={"every": 2, "finetune": []})
    tree["algorithm"] = {**tree["algorithm"], **algo}
    return _site_cfg(tree)


def _send(node_config, kind, group, config=None, arrays=None, **records):
    """One message to a node's ClientApp, as Flower's runtime delivers it: (reply, the error's last line or None).
    `records`: the config record's fields besides the config; `arrays`: the message's tensor records."""
    from flwr.supercore.task_identity import TaskIdentity

    from pflbed.flower.records import to_record

    content = RecordDict({"config": ConfigRecord({"pflbed-config": config, **records})} if config else {})
    for name, tensors in (arrays or {}).items():
        content[name] = to_record(tensors)
    saved = {k: getattr(TaskIdentity, k) for k in ("_run_id", "_task_id", "_node_id")}
    for k in saved:
        setattr(TaskIdentity, k, 1)
    try:
        msg = Message(content, dst_node_id=1000, message_type=kind, group_id=group)
    finally:
        for k, v in saved.items():
            setattr(TaskIdentity, k, v)
    msg.metadata.__dict__["_message_id"] = "m1"
    ctx = Context(run_id=1, node_id=1000, state=RecordDict(), run_config={}, node_config=dict(node_config))
    try:
        return client.app(msg, ctx), None
    except Exception:
        return None, traceback.format_exc().strip().splitlines()[-1]


# --- 1. queries ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group, with_config", [("states", True), ("partitions", True), ("site", False),
                                                ("", False), ("anything", True)])  # fmt: skip
def test_a_site_answers_no_query_but_its_partition_and_the_start_up_question(group, with_config, monkeypatch):
    """Any other query is refused with one line naming it, before the config is read or anything is built."""
    built = []
    monkeypatch.setattr(client, "algorithm", lambda c: built.append(c))
    plain = validate_config({**_tree("fedavg"), "executor": {"name": "flower", "state_dir": "/tmp/x"}})
    reply, error = _send(SITE, MessageType.QUERY, group, _json(plain) if with_config else None, cids=[0], versions=[1])
    assert reply is None and f"not a {group!r} query" in error and error.startswith("pflbed.flower.sites.SiteError")
    assert not built
    reply, error = _send(SITE, MessageType.QUERY, "partitions")
    assert error is None and reply.content["node"]["partition-id"] == 0


def test_a_node_without_a_partition_in_its_node_config_serves_partition_0_of_1():
    reply, error = _send({}, MessageType.QUERY, "partitions")
    assert error is None and dict(reply.content["node"]) == {client.PARTITION: 0, client.PARTITIONS: 1}


def test_a_node_asked_for_client_states_it_does_not_keep_says_so():
    """A node that is not a site, of a run whose states travel with the messages (`executor.state_dir` unset)."""
    plain = validate_config({**_tree("fedavg"), "executor": {"name": "flower"}})
    reply, error = _send({"partition-id": 0}, MessageType.QUERY, "states", _json(plain), cids=[0], versions=[0])
    assert reply is None and error == "ValueError: client states were asked of a node, but executor.state_dir is unset"


def test_the_ditto_state_copy_is_refused_and_says_the_same_for_an_existing_and_a_missing_file(tmp_path):
    """The attack: a QUERY for states whose config is not site-local and loads, as initial weights, the file where
    the site keeps a client's personal model (its path follows from the config and the state directory). Ditto's
    client state starts from the initial weights, so the node would send the personal model back. Refused, and
    with the same line whether the file exists or not (no probing of the site's disk)."""
    tree = _tree("ditto", train={**TINY["train"], "rounds": 2}, eval={"every": 2, "finetune": []})
    _, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg(tree)
    run_sites(cfg, grid)
    node = grid.node_configs[0]
    key = hashlib.sha256(_tampered(cfg).encode()).hexdigest()[:16]  # the run key: the config's hash
    stolen = sorted((tmp_path / "states-0" / key).glob("client-*/round-*.pt"))[-1]  # a personal model kept there
    cid = int(stolen.parent.name.removeprefix("client-"))
    plain = validate_config({**tree, "executor": {"name": "flower", "threads": 1}})
    errors = []
    for path in (stolen, stolen.with_name("round-9.pt")):
        attack = _json(plain, **{"model.init_from": str(path), "executor.state_dir": "pflbed-states"})
        reply, error = _send(node, MessageType.QUERY, "states", attack, cids=[cid], versions=[0])
        assert reply is None
        errors.append(error)
    assert "not a 'states' query" in errors[0] and errors[0] == errors[1]


def test_a_query_makes_a_site_download_and_cache_nothing(tmp_path, monkeypatch):
    """A QUERY naming a download into a server-chosen directory, or a dataset whose federation the node would cache
    under its home: nothing is written."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PFLBED_CACHE", str(home / "cache"))
    node = {"data": str(tmp_path / "site.npz")}
    plain = validate_config({**_tree("fedavg"), "executor": {"name": "flower", "state_dir": "s"}})
    download = _json(plain, **{"dataset.name": "mnist", "dataset.download": True, "dataset.path": str(tmp_path / "dl")})
    for config in (download, _json(plain, **{"dataset.name": "digits"})):
        reply, error = _send(node, MessageType.QUERY, "states", config, cids=[0], versions=[0])
        assert reply is None and "not a 'states' query" in error
    assert not list(home.iterdir()) and not (tmp_path / "dl").exists()


@pytest.mark.parametrize("kind", [MessageType.TRAIN, MessageType.EVALUATE])
def test_train_and_evaluate_on_a_site_never_build_the_server_s_config(kind, monkeypatch):
    """A site never falls back to the simulated client's `algorithm(config)`: a run that is not site-local is
    refused."""
    built = []
    monkeypatch.setattr(client, "algorithm", lambda c: built.append(c))
    plain = validate_config({**_tree("fedavg"), "executor": {"name": "flower"}})
    fields = {"cids": [0], "versions": [0], "round": 1, "site-sizes": "[[1]]"}
    if kind == MessageType.EVALUATE:
        fields = {**fields, "round": True, "methods": "[]"}
    reply, error = _send(SITE, kind, "1", _json(plain), **fields)
    assert reply is None and "not site-local" in error and not built


def test_the_start_up_question_passes_the_same_checks(tmp_path):
    """The site-local run's first message (group `site`: what the site holds) is held against the site's policy
    like every other: a size beyond its bound is refused before the site reads its data."""
    reply, error = _send(SITE, MessageType.QUERY, "site", _json(_cfg(), **{"train.rounds": 10**6}))
    assert reply is None and "sets train.rounds=1e+06, above this site's bound max-rounds=10000" in error


def test_the_site_s_check_is_cached_per_node_config_and_config():
    """Every TRAIN message carries the config: the second check of the same one is a look-up."""
    config = _json(_cfg(), seed=11)
    first = site_policy.check(SITE, config)
    assert site_policy.check(dict(SITE), config) is first
    assert site_policy.check({**SITE, "max-rounds": 50}, config) is not first


# --- 2. the allow-list and the bounds -----------------------------------------------------------------------------

REFUSED = [("dataset.path", "/etc"), ("dataset.download", True), ("dataset.hf.id", "/srv/hf"),
           ("model.init_from", "/root/weights.pt"), ("federation.manifest", "/srv/manifest.json"),
           ("executor.state_dir", "/tmp/elsewhere"), ("dataset.synthetic.n_train", 1_000_000),
           ("pretrain.epochs", 3), ("federation.public", 10), ("federation.new_clients", 1),
           ("federation.protocol", "pflbed"), ("federation.pflbed.val", 0.1), ("unknown", 1)]  # fmt: skip


@pytest.mark.parametrize("key, value", REFUSED, ids=[k for k, _ in REFUSED])
def test_a_site_refuses_a_key_off_the_allow_list(key, value):
    """Each key a server may not decide for a site, set to anything but its default: one line naming it, from the
    site's own check (before the config is even validated)."""
    tail = r"may not decide for a site \(a path, a download or data the site does not hold\): the site refuses the run$"
    with pytest.raises(SiteError, match=rf"^the server's config sets {key}=.*{tail}"):
        site_policy.check(SITE, _json(_cfg(), **{key: value}))


HOW_IT_COMPUTES = [("executor.precision", "bf16"), ("executor.tf32", True), ("executor.tf32", False),
                   ("executor.deterministic", False)]  # fmt: skip


@pytest.mark.parametrize("key, value", HOW_IT_COMPUTES, ids=[f"{k}={v}" for k, v in HOW_IT_COMPUTES])
def test_a_site_takes_the_server_s_choice_of_how_every_site_computes(key, value):
    """The run's arithmetic is one experiment's, the same on every site: its precision (bf16, TF32) and kernels
    are the server's to decide (none names a path, a download or data)."""
    section, field = key.split(".")
    assert getattr(getattr(site_policy.check(SITE, _json(_cfg(), **{key: value})), section), field) == value


def test_a_refusal_shows_a_long_value_cut_to_one_short_line():
    """A value is shown as its repr, cut after 57 characters: a server's megabyte string is not echoed back."""
    value = "/" + "x" * 100
    with pytest.raises(SiteError) as e:
        site_policy.check(SITE, _json(_cfg(), **{"dataset.path": value}))
    assert f"dataset.path={repr(value)[:57]}..., which" in str(e.value) and repr(value) not in str(e.value)
    for n, shown in ((58, "x" * 58 + "'"), (59, "x" * 56 + r"\.\.\.")):  # a repr of 60 characters whole, of 61 cut
        with pytest.raises(SiteError, match=rf"sets dataset.path='{shown}, which"):
            site_policy.check(SITE, _json(_cfg(), **{"dataset.path": "x" * n}))


@pytest.mark.parametrize("config, message", [("{not json", "is not JSON"), ("[" * 100_000, "is not JSON"),
                                             ("[1, 2]", "is not a mapping of config keys")])  # fmt: skip
def test_a_config_that_is_not_a_json_mapping_is_refused_in_one_line(config, message):
    with pytest.raises(SiteError, match=rf"^the server's config {message}$"):
        site_policy.check(SITE, config)


def test_a_node_is_a_site_when_its_node_config_names_data_of_its_own():
    assert not site_policy.holds_data({}) and not site_policy.holds_data({"max-rounds": 5})
    assert site_policy.holds_data({"data": "/d"}) and site_policy.holds_data({"dataset": "fmnist"})


def test_a_site_accepts_what_a_server_may_decide():
    """Keys on the allow-list at non-default values pass, as do integer algorithm options at their defaults however
    large (FedPAC's qp_max_iter: 20000)."""
    cfg = _cfg()
    changes = {"seed": 7, "train.lr": 0.2, "train.rounds": 100, "eval.every": 3, "federation.alpha": 0.5,
               "federation.sample_fraction": 0.5, "sites.test": "/server/test.npz", "executor.round_timeout": 30.0,
               "model.init_blocks": ["body"], "dataset.normalize": "imagenet", "privacy.delta": 1e-6}  # fmt: skip
    assert site_policy.check(SITE, _json(cfg, **changes)).seed == 7
    fedpac = site_policy.check(SITE, _json(_cfg("fedpac"), **{"algorithm.qp_max_iter": 20_000}))
    assert fedpac.algorithm_options() == {"qp_max_iter": 20_000}  # sent, at its default
    # only integers are sizes: a string option, and a float one above max-option, pass
    other = {"algorithm.aggregation": "weighted", "algorithm.alpha_lr": 5000.0}
    assert site_policy.check(SITE, _json(_cfg("fedbasis"), **other)).algorithm_options()["alpha_lr"] == 5000.0


BOUNDED = [
    ("fedbasis-K", "fedbasis", {"algorithm.K": 2**31 - 1}, "algorithm.K", "max-option"),
    ("fedrod_hyper-hidden", "fedrod_hyper", {"algorithm.hidden": 2**31 - 1}, "algorithm.hidden", "max-option"),
    ("rounds", "fedavg", {"train.rounds": 10**6}, "train.rounds", "max-rounds"),
    ("local_epochs", "fedavg", {"train.local_epochs": 100_000}, "train.local_epochs", "max-epochs"),
    ("ft_epochs", "fedavg", {"eval.ft_epochs": 1000}, "eval.ft_epochs", "max-epochs"),
    ("new_clients_epochs", "fedavg", {"eval.new_clients.epochs": 1000}, "eval.new_clients.epochs", "max-epochs"),
    ("option_after_a_default", "fedbasis", {"algorithm.K": 4, "algorithm.kmeans_iters": 5000},  # K: its default
     "algorithm.kmeans_iters", "max-option"),
    ("clients", "fedavg", {"federation.clients": 20_000}, "federation.clients", "max-clients"),
    ("num_classes", "fedavg", {"sites.num_classes": 5000}, "sites.num_classes", "max-classes"),
    ("input_shape", "fedavg", {"sites.input_shape": [3, 10**6, 10**6]}, "sites.input_shape", "max-sample"),
    ("image_size", "fedavg", {"dataset.image_size": 4096}, "dataset.image_size", "max-sample"),
    ("hf.image_size", "fedavg", {"dataset.hf.image_size": 4096}, "dataset.hf.image_size", "max-sample"),
    ("parameters", "fedavg", {"sites.input_shape": [1, 1000, 1000]}, "model.name=mlp", "max-parameters"),
]


@pytest.mark.parametrize("algo, changes, key, bound", [b[1:] for b in BOUNDED], ids=[b[0] for b in BOUNDED])
def test_a_site_refuses_a_size_beyond_its_bound_before_building_anything(algo, changes, key, bound, monkeypatch):
    """Each size the server chooses, beyond the node's default bound: one line naming the key and the node config
    that would raise it, before the site reads its data or builds a model."""
    monkeypatch.setattr(site_node, "read_site", lambda *a: pytest.fail("the site read its data"))
    monkeypatch.setattr(site_node, "site_algorithm", lambda *a: pytest.fail("the site built the run"))
    config = _json(_cfg(algo), **changes)
    ctx = Context(run_id=1, node_id=1, state=RecordDict(), run_config={}, node_config=SITE)
    with pytest.raises(SiteError, match=rf"sets {key}.*above this site's bound {bound}="):
        site_node.site_algorithm_of(ctx, config, "[[1]]")


AT_BOUND = [  # (id, algorithm, changes, node key, the largest size the config then asks of it, the key named)
    ("rounds", "fedavg", {"train.rounds": 2}, "max-rounds", 2, "train.rounds"),
    ("epochs", "fedavg", {"eval.new_clients.epochs": 30}, "max-epochs", 30, "eval.new_clients.epochs"),
    ("clients", "fedavg", {}, "max-clients", 4, "federation.clients"),
    ("classes", "fedavg", {}, "max-classes", 10, "sites.num_classes"),
    ("image_size", "fedavg", {"dataset.image_size": 40}, "max-sample", 3 * 40 * 40, "dataset.image_size"),
    ("option", "fedbasis", {"algorithm.K": 5}, "max-option", 5, "algorithm.K"),
]


@pytest.mark.parametrize("algo, changes, bound, size, key", [b[1:] for b in AT_BOUND], ids=[b[0] for b in AT_BOUND])
def test_a_bound_takes_a_size_up_to_and_including_itself(algo, changes, bound, size, key):
    config = _json(_cfg(algo), **changes)
    assert site_policy.check({**SITE, bound: size}, config)
    refused = rf"^the server's config sets {key}.* above this site's bound {bound}={size - 1} "
    with pytest.raises(SiteError, match=refused):
        site_policy.check({**SITE, bound: size - 1}, config)
    assert site_policy.check({**SITE, "max-rounds": 1}, _json(_cfg(), **{"train.rounds": 1}))  # 1 is a bound too


def test_the_parameter_bound_counts_the_run_s_model_for_its_samples_and_classes():
    """The parameters of the model the run builds (its input shape and its classes), counted as the model counts
    them; a model that cannot take the run's samples is refused in one line."""
    from pflbed.models import build_model

    cfg = _cfg()
    model = build_model(cfg.model.name, tuple(cfg.sites.input_shape), cfg.sites.num_classes)
    n = sum(p.numel() for p in model.parameters())
    assert site_policy.check({**SITE, "max-parameters": n}, _json(cfg))
    with pytest.raises(SiteError, match=rf"model.name=mlp \(its parameters\)={n}, above .* max-parameters={n - 1} "):
        site_policy.check({**SITE, "max-parameters": n - 1}, _json(cfg))
    with pytest.raises(SiteError, match=r"^model.name=lenet5 cannot take samples of shape \[5\]: Expected 3D"):
        site_policy.check(SITE, _json(cfg, **{"model.name": "lenet5", "sites.input_shape": [5]}))


def test_a_site_s_node_config_raises_its_bounds_and_flower_parses_the_keys():
    """`max-rounds=…` and the other keys as Flower's own node-config parser reads them (`--node-config`)."""
    from flwr.common.config import parse_config_args

    node = parse_config_args(['data="/d" max-rounds=2000000 max-epochs=200000 require-secagg=false max-epsilon=8 '
                              'max-clip=1.0 max-delta=1e-5'])  # fmt: skip
    assert node["max-rounds"] == 2_000_000 and node["require-secagg"] is False and node["max-clip"] == 1.0
    config = _json(_cfg(), **{"train.rounds": 10**6, "train.local_epochs": 100_000})
    with pytest.raises(SiteError, match="max-rounds"):
        site_policy.check(SITE, config)
    assert site_policy.check({"data": "/d", "max-rounds": 2_000_000, "max-epochs": 200_000}, config)
    with pytest.raises(SiteError, match=r"^max-rounds='many' in the node config"):
        site_policy.check({"data": "/d", "max-rounds": "many"}, config)


def test_a_site_refuses_phantom_sites_in_site_sizes(monkeypatch):
    """200,000 phantom sites of one client each (the run has 4 clients): refused before the site builds anything."""
    monkeypatch.setattr(site_node, "read_site", lambda *a: pytest.fail("the site read its data"))
    ctx = Context(run_id=1, node_id=1, state=RecordDict(), run_config={}, node_config=SITE)
    t0 = time.perf_counter()
    with pytest.raises(SiteError, match=r"site-sizes: 200000 sites holding 200000 clients, .* federation.clients=4"):
        site_node.site_algorithm_of(ctx, _json(_cfg()), json.dumps([[1]] * 200_000))
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("sizes, match", [("[[3], [1], [1], [1], [1]]", "5 clients"), ("[[]]", "non-empty"),
                                          ("[[1], [2], [-1], [4]]", "non-negative"), ('{"0": [1]}', "a list"),
                                          ("[[1], [2], [3], [true]]", "non-negative")],
                         ids=["too_many_clients", "empty_site", "negative", "not_a_list", "bool"])  # fmt: skip
def test_a_site_refuses_malformed_site_sizes(sizes, match):
    with pytest.raises(SiteError, match=rf"^site-sizes: .*{match}"):
        site_node.site_sizes(SITE, _cfg(), sizes)


def test_site_sizes_take_their_bounds_themselves():
    """As many sites as the node's max-clients, clients holding no sample yet, and a node config without a
    partition-id (site 0) pass; a partition-id past the last site is refused in one line."""
    cfg, four = _cfg(), "[[1], [0], [2], [3]]"
    assert site_node.site_sizes({**SITE, "max-clients": 4}, cfg, four) == [[1], [0], [2], [3]]
    with pytest.raises(SiteError, match=r"^site-sizes: 4 sites holding 4 clients, .*max-clients=3\)$"):
        site_node.site_sizes({**SITE, "max-clients": 3}, cfg, four)
    assert site_node.site_sizes({"data": "/d"}, cfg, "[[1, 1, 1, 1]]") == [[1, 1, 1, 1]]
    with pytest.raises(SiteError, match=r"^site-sizes: 4 sites, but this is site 4 \(partition-id\)$"):
        site_node.site_sizes({**SITE, "partition-id": 4}, cfg, four)


def test_a_site_refuses_site_sizes_that_miscount_its_own_clients(tmp_path):
    """The server's site-sizes must say what this site reported: its own entry is its clients' sample counts."""
    tree = _tree("fedavg", eval={"every": 2, "finetune": []})
    _, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg(tree)
    node = {**grid.node_configs[1], "partition-id": 1}
    ctx = Context(run_id=1, node_id=1, state=RecordDict(), run_config={}, node_config=node)
    own = site_node.site_report(ctx, _tampered(cfg))["num_train"]
    good = [[10], own, [10], [10]]
    assert site_node.site_algorithm_of(ctx, _tampered(cfg), json.dumps(good))[0]
    with pytest.raises(SiteError, match=r"site 1: the server counts \[\d+\] training samples .* the site holds"):
        site_node.site_algorithm_of(ctx, _tampered(cfg), json.dumps([[10], [own[0] * 1000], [10], [10]]))


@pytest.mark.parametrize("kind", [MessageType.TRAIN, MessageType.EVALUATE])
def test_a_site_trains_and_evaluates_only_its_own_clients(kind, tmp_path):
    """A server naming another site's client (client 0, to site 1) is refused in one line before the site reads a
    payload or a state; an evaluation asked of a node holding no data of its own (in a run that is not
    site-local), likewise."""
    from .site_setup import _discover

    tree = _tree("fedavg", eval={"every": 2, "finetune": []})
    _, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg(tree)
    sizes = json.dumps(_discover(grid, cfg))
    node = {**grid.node_configs[1], "partition-id": 1, "num-partitions": 4}
    asked = {"cids": [0], "versions": [0], "round": 1, "site-sizes": sizes}
    if kind == MessageType.EVALUATE:
        asked, arrays = {**asked, "round": True, "methods": "[]"}, {"server": {}}
    else:
        arrays = {"payload/0": {}}
    reply, error = _send(node, kind, "1", _tampered(cfg), arrays, **asked)
    assert reply is None and error == ("pflbed.flower.sites.SiteError: the server asked this site for clients [0], "
                                       "which it does not hold")  # fmt: skip
    if kind == MessageType.EVALUATE:
        plain = validate_config({**tree, "executor": {"name": "flower"}})
        reply, error = _send({"partition-id": 1}, kind, "evaluate", _json(plain), arrays, **asked)
        assert reply is None and error == ("pflbed.flower.sites.SiteError: an evaluation was asked of a node that "
                                           "holds no data of its own")  # fmt: skip


def test_site_offsets_are_a_running_sum():
    """Linear in the sites: 30,000 sites at once (a quadratic sum took tens of seconds)."""
    sizes = [[1, 2]] * 30_000
    t0 = time.perf_counter()
    first = offsets(sizes)
    assert time.perf_counter() - t0 < 1.0
    assert first[:3] == [0, 2, 4] and first[-1] == 2 * 29_999 and offsets([]) == []


# --- 3b. every field of a TRAIN or EVALUATE message -----------------------------------------------------------------


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """A site-local run of two rounds with a final fine-tuning; site 1's start-up question (QUERY), last TRAIN and
    EVALUATE message as the honest server sent them, and a function replaying one to site 1's node: (reply, the
    error's last line or None, the client updates and evaluations it ran)."""
    return _captured(tmp_path_factory.mktemp("honest"), "fedavg")


@pytest.fixture(scope="module")
def honest_gpfl(tmp_path_factory):
    """`honest` for GPFL, whose clients keep their head and label prior."""
    return _captured(tmp_path_factory.mktemp("honest-gpfl"), "gpfl")


@pytest.fixture(scope="module")
def honest_lg(tmp_path_factory):
    """`honest` for LG-FedAvg, whose clients keep their representation (the body)."""
    return _captured(tmp_path_factory.mktemp("honest-lg"), "lg_fedavg")


def _captured(tmp, name):
    import copy

    from .site_setup import run_sites

    tree = _tree(name, train={**TINY["train"], "rounds": 2}, eval={"every": 2, "finetune": ["ft"]})
    cfg = _site_cfg(tree)
    _, grid = _sites(tmp, cfg)
    sent = {}
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        for m in msgs:
            if m.metadata.dst_node_id == grid.nodes[1] and m.metadata.message_type in ("query", "train", "evaluate"):
                sent[m.metadata.message_type] = copy.deepcopy(m)
        return real(msgs, timeout)

    grid.send_and_receive = send
    run_sites(cfg, grid)

    node = {client.PARTITION: 1, client.PARTITIONS: grid.parts, **grid.node_configs[1]}

    def context():
        return Context(run_id=1, node_id=grid.nodes[1], state=RecordDict(), run_config={}, node_config=node)

    def replay(kind, change, monkeypatch):
        ran = []
        for fn in ("update_client", "evaluate_site"):
            real_fn = getattr(client, fn)
            monkeypatch.setattr(client, fn, lambda *a, _f=real_fn, _n=fn, **k: ran.append(_n) or _f(*a, **k))
        msg = copy.deepcopy(sent[kind])
        change(msg.content, msg.content["config"])
        try:
            return client.app(msg, context()), None, ran
        except Exception:
            return None, traceback.format_exc().strip().splitlines()[-1], ran

    def site():
        """Site 1's algorithm and state store, as its node builds them for the captured TRAIN message."""
        conf = sent["train"].content["config"]
        return site_node.site_algorithm_of(context(), str(conf["pflbed-config"]), str(conf["site-sizes"]))

    replay.sent, replay.context, replay.site = sent, context, site
    return replay


def _set(**fields):
    return lambda content, conf: conf.update(fields)


def _drop(name, record=False):
    return lambda content, conf: content.pop(name) if record else conf.pop(name)


def _add(name, tensors):
    from pflbed.flower.records import to_record

    return lambda content, conf: content.__setitem__(name, to_record(tensors))


FIELDS_T = "it sends pflbed-config, round, cids, site-sizes, versions"
FIELDS_E = "it sends pflbed-config, round, cids, site-sizes, versions, methods"
PAIRS = "are not distinct [index, name] pairs"
RUNS = "ask for more than the run's personalizations [(0, 'ft')]"
MESSAGES = [
    ("train", _set(cids=[1, 1, 1]), "TRAIN message: cids [1, 1, 1] are not distinct client ids"),
    ("train", _set(cids=[True]), "TRAIN message: cids [True] are not distinct client ids"),
    ("train", _set(cids=1), "TRAIN message: cids 1 are not distinct client ids"),
    ("train", _set(round=-5), "TRAIN message: round -5 is not one of the run's (1 to 2)"),
    ("train", _set(round=0), "TRAIN message: round 0 is not one of the run's (1 to 2)"),
    ("train", _set(round=3, versions=[2]), "TRAIN message: round 3 is not one of the run's (1 to 2)"),
    ("train", _set(round="2"), "TRAIN message: round '2' is not one of the run's (1 to 2)"),
    ("train", _set(round=2.0), "TRAIN message: round 2.0 is not one of the run's (1 to 2)"),
    ("train", _set(versions=[2]), "TRAIN message: versions [2] are not, per client, a round from 0 to 1"),
    ("train", _set(versions=[-1]), "TRAIN message: versions [-1] are not, per client, a round from 0 to 1"),
    ("train", _set(versions=[0, 0]), "TRAIN message: versions [0, 0] are not, per client, a round from 0 to 1"),
    ("train", _set(versions=["1"]), "TRAIN message: versions ['1'] are not, per client, a round from 0 to 1"),
    ("train", _set(versions=0), "TRAIN message: versions 0 are not, per client, a round from 0 to 1"),
    ("train", _set(methods="[]"), f"TRAIN message sets 'methods' in its config: {FIELDS_T}"),
    ("train", _drop("versions"), f"TRAIN message lacks 'versions' in its config: {FIELDS_T}"),
    ("train", _add("state/1", {"w": torch.zeros(1)}), "TRAIN message holds a record 'state/1', which a site does "
                                                      "not take"),  # fmt: skip
    ("train", _add("payload/2", {"w": torch.zeros(1)}), "TRAIN message holds a record 'payload/2', which a site "
                                                        "does not take"),  # fmt: skip
    ("train", _drop("payload/1", record=True), "TRAIN message holds no 'payload/1'"),
    ("train", _drop("config", record=True), "TRAIN message holds no config"),
    ("train", lambda content, conf: content.__setitem__("m", MetricRecord({"x": 1})),
     "TRAIN message holds a record 'm', which a site does not take"),
    ("train", lambda content, conf: content.__setitem__("c", ConfigRecord({"x": 1})),
     "TRAIN message holds a record 'c', which a site does not take"),
    ("evaluate", _set(methods=json.dumps([[0, "ft"]] * 5)),
     f"EVALUATE message: methods {json.dumps([[0, 'ft']] * 5)!r} {PAIRS}"),
    ("evaluate", _set(methods='[[0, "lp"]]'), f"EVALUATE message: methods '[[0, \"lp\"]]' {RUNS}"),
    ("evaluate", _set(methods='[[7, "ft"]]'), f"EVALUATE message: methods '[[7, \"ft\"]]' {RUNS}"),
    ("evaluate", _set(methods='[[0, "bogus"]]'), f"EVALUATE message: methods '[[0, \"bogus\"]]' {RUNS}"),
    ("evaluate", _set(methods='[[[0], "ft"]]'), f"EVALUATE message: methods '[[[0], \"ft\"]]' {PAIRS}"),
    ("evaluate", _set(methods='[[0, "ft", 1]]'), f"EVALUATE message: methods '[[0, \"ft\", 1]]' {PAIRS}"),
    ("evaluate", _set(methods='[[true, "ft"]]'), f"EVALUATE message: methods '[[true, \"ft\"]]' {PAIRS}"),
    ("evaluate", _set(methods="5"), f"EVALUATE message: methods '5' {PAIRS}"),
    ("evaluate", _set(methods="[" * 100_000), f"EVALUATE message: methods '{'[' * 59} {PAIRS}"),
    ("evaluate", _set(round=1), "EVALUATE message: round 1 is not true or false"),
    ("evaluate", _set(round="yes"), "EVALUATE message: round 'yes' is not true or false"),
    ("evaluate", _set(cids=[1, 1]), "EVALUATE message: cids [1, 1] are not distinct client ids"),
    ("evaluate", _set(versions=[3]), "EVALUATE message: versions [3] are not, per client, a round from 0 to 2"),
    ("evaluate", _set(extra=1), f"EVALUATE message sets 'extra' in its config: {FIELDS_E}"),
    ("evaluate", _drop("methods"), f"EVALUATE message lacks 'methods' in its config: {FIELDS_E}"),
    ("evaluate", _add("state/1", {"w": torch.zeros(1)}), "EVALUATE message holds a record 'state/1', which a site "
                                                         "does not take"),  # fmt: skip
    ("evaluate", _drop("server", record=True), "EVALUATE message holds no 'server'"),
    ("evaluate", _drop("config", record=True), "EVALUATE message holds no config"),
    ("evaluate", _drop("pflbed-config"), f"EVALUATE message lacks 'pflbed-config' in its config: {FIELDS_E}"),
]


@pytest.mark.parametrize(("kind", "change", "line"), MESSAGES)
def test_a_site_takes_a_train_or_evaluate_message_only_as_an_honest_server_sends_it(kind, change, line, honest,
                                                                                    monkeypatch):  # fmt: skip
    """Every field the server chooses besides the config, held to what an honest server sends (`site_message`)
    before the site reads a payload or a state: a client named twice was trained twice; any round was taken (a
    negative one failed after training); a state sent for a client replaced its personal model with the server's;
    any number of fine-tunings, of methods the run does not name, were run in one message; and text where numbers
    go raised a traceback. Each refused in one line naming the field, with no update or evaluation run."""
    reply, error, ran = honest(kind, lambda content, conf: None, monkeypatch)  # the honest message: taken
    assert error is None and ran == (["update_client"] if kind == "train" else ["evaluate_site"] * 2)
    reply, error, ran = honest(kind, change, monkeypatch)
    assert (reply, error, ran) == (None, f"pflbed.flower.sites.SiteError: the server's {line}", [])


@pytest.mark.parametrize(("change", "line"), [
    (_set(cids=[0]), "sets 'cids' in its config: it sends pflbed-config"),
    (_drop("pflbed-config"), "lacks 'pflbed-config' in its config: it sends pflbed-config"),
    (_add("payload/1", {"w": torch.zeros(1)}), "holds a record 'payload/1', which a site does not take"),
])  # fmt: skip
def test_a_site_s_start_up_question_holds_the_run_s_config_alone(change, line, honest, monkeypatch):
    """The start-up question carries the config record and the config in it, nothing else; the partition question
    carries no record at all (a site reads nothing else of either, and refuses what it would not read)."""
    assert honest.sent["query"].metadata.group_id == "site"
    reply, error, _ = honest("query", lambda content, conf: None, monkeypatch)
    assert error is None and "report" in reply.content["site"]
    assert honest("query", change, monkeypatch)[:2] == (None, f"pflbed.flower.sites.SiteError: the server's QUERY "
                                                              f"message {line}")  # fmt: skip
    assert _send(SITE, MessageType.QUERY, "partitions")[1] is None
    assert _send(SITE, MessageType.QUERY, "partitions", None, {"x": {}}) == (None, "pflbed.flower.sites.SiteError: "
                                                                           "the server's QUERY message holds a "
                                                                           "record 'x', which a site does not take")


def test_a_secure_round_s_message_holds_its_one_shared_payload_and_nothing_else(honest):
    """SecAgg+'s masked-update step carries the round's one payload (`shared`) and the protocol's own record of
    the stage (checked by its mod); a client's payload or state beside them is refused, as is `shared` in a plain
    round."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    from pflbed.flower.records import to_record
    from pflbed.flower.secagg_node import SHARED
    from pflbed.flower.site_message import train_fields

    conf = honest.sent["train"].content["config"]
    algo, _ = honest.site()

    def content(*names):
        out = RecordDict({"config": ConfigRecord(dict(conf))})
        for name in names:
            out[name] = ConfigRecord({}) if name == RECORD_KEY_CONFIGS else to_record({"w": torch.zeros(1)})
        return out

    assert train_fields(content(SHARED, RECORD_KEY_CONFIGS), algo, True) == (2, [1], {1: 1})
    assert train_fields(content("payload/1"), algo, False) == (2, [1], {1: 1})
    for names, secure, why in [((SHARED, RECORD_KEY_CONFIGS, "state/1"), True, "holds a record 'state/1'"),
                               ((SHARED, "payload/1"), True, "holds a record 'payload/1'"),
                               ((RECORD_KEY_CONFIGS,), True, "holds no 'shared'"),
                               (("payload/1", SHARED), False, "holds a record 'shared'"),
                               (("payload/1", RECORD_KEY_CONFIGS), False, f"holds a record '{RECORD_KEY_CONFIGS}'")]:
        with pytest.raises(SiteError, match=f"^the server's TRAIN message {re.escape(why)}"):
            train_fields(content(*names), algo, secure)


def test_a_site_runs_only_the_personalizations_its_algorithm_offers_for_the_view_sent(honest, monkeypatch):
    """The methods a site takes are the algorithm's `finetune_methods` of the server view in the message and the
    run's `eval.finetune`, not the config's list alone: kNN-Per's "knn" new-client rule offers none, for one."""
    from pflbed.algorithms.base import Algorithm

    seen = []

    def offers_none(self, server, methods):
        seen.append((sorted(server), methods))
        return []

    monkeypatch.setattr(Algorithm, "finetune_methods", offers_none)
    view = []
    reply, error, ran = honest("evaluate", lambda content, conf: view.extend(sorted(content["server"])), monkeypatch)
    assert (reply, ran) == (None, []) and error == ("pflbed.flower.sites.SiteError: the server's EVALUATE message: "
                                                    "methods '[[0, \"ft\"]]' ask for more than the run's "
                                                    "personalizations []")  # fmt: skip
    assert view and seen == [(view, ["ft"])]  # the view's entries, the config's list


def _payload(change, record="payload/1"):
    """A change of client 1's payload (or of another tensor `record`): `change(tensors)` returns the tensors the
    server sends instead."""
    from pflbed.flower.records import from_record, to_record

    return lambda content, conf: content.__setitem__(record, to_record(change(from_record(content[record]))))


def _first(tensors):
    return sorted(tensors)[0]


PAYLOADS = [
    ("an extra key", lambda p: {**p, "zzz": torch.ones(3)},
     "has key 'zzz', which this algorithm's server does not send"),
    ("a key dropped", lambda p: {k: v for k, v in p.items() if k != _first(p)}, "lacks 'blocks.classifier.bias'"),
    ("a key widened", lambda p: {**p, _first(p): p[_first(p)].expand(2, -1).clone()},
     "has 'blocks.classifier.bias' of shape [2, 10], expected [10]"),
    ("float64", lambda p: {**p, _first(p): p[_first(p)].double()},
     "has 'blocks.classifier.bias' of dtype torch.float64, expected torch.float32"),
    ("an extra key of NaN", lambda p: {**p, "zzz": torch.full((3,), float("nan"))},  # the structure is said first
     "has key 'zzz', which this algorithm's server does not send"),
    ("a NaN", lambda p: {**p, _first(p): p[_first(p)] * float("nan")}, "has a non-finite entry in "
                                                                       "'blocks.classifier.bias'"),  # fmt: skip
    ("an inf", lambda p: {**p, _first(p): p[_first(p)] + float("inf")}, "has a non-finite entry in "
                                                                         "'blocks.classifier.bias'"),  # fmt: skip
]


@pytest.mark.parametrize(("change", "line"), [p[1:] for p in PAYLOADS], ids=[p[0] for p in PAYLOADS])
def test_a_site_trains_only_on_a_payload_its_algorithm_s_server_sends(change, line, honest, monkeypatch):
    """A client's payload is held to the structure the algorithm's server sends that client in that round
    (`Algorithm.payload_fits`) and to finite values, before the client trains: a key widened or dropped failed
    inside the update with a traceback, a NaN trained a NaN model and stored it as the client's."""
    reply, error, ran = honest("train", _payload(change), monkeypatch)
    assert (reply, error, ran) == (None, f"pflbed.flower.sites.SiteError: the server's TRAIN message: the payload of "
                                         f"client 1 {line}", [])  # fmt: skip


@pytest.mark.parametrize(("change", "line"), [p[1:] for p in PAYLOADS], ids=[p[0] for p in PAYLOADS])
def test_a_site_evaluates_only_on_a_view_its_algorithm_s_server_sends(change, line, honest, monkeypatch):
    """An EVALUATE message's server view is held to the structure the algorithm's server sends the site
    (`Algorithm.view_fits`) and to finite values, before the site evaluates: a key widened or dropped failed inside
    the evaluation with a traceback."""
    reply, error, ran = honest("evaluate", _payload(change, "server"), monkeypatch)
    assert (reply, error, ran) == (None, f"pflbed.flower.sites.SiteError: the server's EVALUATE message: its server "
                                         f"view {line}", [])  # fmt: skip


def test_a_view_is_checked_for_the_site_s_clients(honest, monkeypatch):
    """`check_view` asks the algorithm about the message's clients: a view holds their own entries."""
    from pflbed.flower import site_message
    from pflbed.flower.site_message import check_view

    asked = []
    monkeypatch.setattr(site_message, "check_view", lambda algo, view, cids: asked.append((sorted(view), cids)))
    reply, error, ran = honest("evaluate", lambda content, conf: None, monkeypatch)
    assert error is None and len(ran) == 2 and asked == [(sorted(honest.sent["evaluate"].content["server"]), [1])]

    class Asked:
        def view_fits(self, *args):
            self.args = args
            return "is planted"

    algo, view = Asked(), {"w": torch.zeros(1)}
    with pytest.raises(SiteError, match="^the server's EVALUATE message: its server view is planted$"):
        check_view(algo, view, [1, 3])
    assert algo.args == (view, [1, 3])


def test_a_view_naming_a_client_s_personal_entries_does_not_replace_them_in_its_scores(honest_lg, monkeypatch):
    """LG-FedAvg's personal model is the client's state with the view over it: a view holding the client's
    representation's keys made the site score the server's representation as the client's personal model. Refused
    since the view is not one LG-FedAvg's server sends; without the check (planted here) the scores change."""
    from pflbed.flower import site_message
    from pflbed.flower.records import from_record

    conf = honest_lg.sent["evaluate"].content["config"]
    _, stored = honest_lg.site()
    state = stored.load(1, conf["versions"][0])
    personal = sorted(set(state) - set(from_record(honest_lg.sent["evaluate"].content["server"])))
    assert "blocks.fc1.1.weight" in personal
    swap = _payload(lambda v: {**v, **{k: torch.zeros_like(state[k]) for k in personal}}, "server")
    reply, error, ran = honest_lg("evaluate", swap, monkeypatch)
    assert (reply, ran) == (None, []) and error == ("pflbed.flower.sites.SiteError: the server's EVALUATE message: "
                                                    f"its server view has key '{personal[0]}', which this "
                                                    "algorithm's server does not send")  # fmt: skip
    monkeypatch.setattr(site_message, "check_view", lambda *a: None)
    scores = [json.loads(honest_lg("evaluate", change, monkeypatch)[0].content["scores"]["json"])[""]["test"]
              for change in (lambda content, conf: None, swap)]  # fmt: skip
    assert scores[0] != scores[1]


def test_a_payload_is_checked_for_its_own_client_round_and_state():
    """`check_payload` asks the algorithm about the round, the client and the client's state it was given: FedSelect's
    payloads depend on the state, KT-pFL's on the round, FedFomo's on the client."""
    from pflbed.flower.site_message import check_payload

    class Asked:
        def payload_fits(self, *args):
            self.args = args
            return "is planted"

    algo, payload, state = Asked(), {"w": torch.zeros(1)}, {"s": torch.ones(1)}
    with pytest.raises(SiteError, match="^the server's TRAIN message: the payload of client 7 is planted$"):
        check_payload(algo, 3, 7, payload, state)
    assert algo.args == (3, 7, payload, state)


def test_a_payload_naming_a_client_s_personal_entries_does_not_get_them_back(honest_gpfl, monkeypatch):
    """GPFL's update starts from the payload with the client's head over it, and replies the payload's keys: a
    server that adds the head's keys to the payload got back the client's personal head, trained a round further
    (the head the site then stores as the client's). Refused since the payload is not one GPFL's server sends;
    without the check (planted here) the reply carries it."""
    from pflbed.flower.records import from_record

    conf = honest_gpfl.sent["train"].content["config"]
    _, stored = honest_gpfl.site()
    state = stored.load(1, conf["versions"][0])
    personal = sorted(set(state) - set(from_record(honest_gpfl.sent["train"].content["payload/1"])))
    assert "prior" in personal and "blocks.classifier.weight" in personal
    take_state = _payload(lambda p: {**p, **{k: torch.zeros_like(state[k]) for k in personal}})
    reply, error, ran = honest_gpfl("train", take_state, monkeypatch)
    assert (reply, ran) == (None, []) and error == (f"pflbed.flower.sites.SiteError: the server's TRAIN message: the "
                                                    f"payload of client 1 has key '{personal[0]}', which this "
                                                    "algorithm's server does not send")  # fmt: skip
    monkeypatch.setattr(client, "check_payload", lambda *a: None)
    reply, error, _ = honest_gpfl("train", take_state, monkeypatch)
    leaked, kept = from_record(reply.content["reply/1"]), stored.load(1, conf["round"])
    head = [k for k in personal if k.startswith("blocks.classifier.")]
    assert error is None and head and all(torch.equal(leaked[k], kept[k]) for k in head)


def test_a_secure_round_s_shared_payload_is_held_to_each_client_s(honest, monkeypatch):
    """Under SecAgg+ the round's one payload is checked for each of the site's clients before it trains."""
    from types import SimpleNamespace

    from pflbed.flower.records import from_record, to_record
    from pflbed.flower.secagg_node import SHARED

    conf = honest.sent["train"].content["config"]
    algo, stored = honest.site()
    payload = from_record(honest.sent["train"].content["payload/1"])
    ran = []
    monkeypatch.setattr(client, "update_client", lambda *a: ran.append(a) or 1 / 0)
    for sent, expected in [({**payload, "zzz": torch.ones(1)}, SiteError), (payload, ZeroDivisionError)]:
        msg = SimpleNamespace(content=RecordDict({"config": ConfigRecord(dict(conf)), SHARED: to_record(sent)}))
        with pytest.raises(expected):
            client.secure_train(msg, algo, stored, 2, [1], {1: 1})
    assert len(ran) == 1  # the honest payload reached the update; the other did not


# --- 4. DP and SecAgg required by the site ------------------------------------------------------------------------

DP = {"privacy.clip": 0.5, "privacy.noise_multiplier": 1.0}
REQUIRED = [
    ("secagg_off", {"require-secagg": True}, {},
     r"^sites.secagg: this site requires secure aggregation \(.*\), and the server's run does not use it$"),
    ("privacy_off_clip", {"max-clip": 1.0}, {},
     r"^privacy.clip: this site requires client-level DP \(max-clip=1 in its node config\), and the server's run "
     r"has none$"),
    ("privacy_off_epsilon", {"max-epsilon": 8}, {}, r"^privacy.clip: this site requires .*\(max-epsilon=8"),
    ("clip_above", {"max-clip": 1.0}, {**DP, "privacy.clip": 3.4e38}, r"^privacy.clip=3.4e\+38 is above .*max-clip=1"),
    ("epsilon_above", {"max-epsilon": 8}, {**DP, "privacy.noise_multiplier": 0.3}, r"ε after 4 rounds is .* max-eps"),
    ("epsilon_infinite", {"max-epsilon": 8}, {**DP, "privacy.noise_multiplier": 0.0}, r"ε after 4 rounds is inf"),
    ("delta_above", {"max-delta": 1e-6}, DP, r"^privacy.delta=1e-05 is above this site's max-delta=1e-06"),
    ("seeded_noise", {"max-clip": 1.0}, {**DP, "privacy.randomness": "seeded"},
     r"^privacy.randomness: this site requires client-level DP, .*\(seeded\), which anyone who knows the config "
     r"can subtract$"),
]


@pytest.mark.parametrize("need, changes, match", [r[1:] for r in REQUIRED], ids=[r[0] for r in REQUIRED])
def test_a_site_refuses_a_run_without_the_privacy_it_requires(need, changes, match):
    with pytest.raises(SiteError, match=match):
        site_policy.check({**SITE, **need}, _json(_cfg(), **changes))


def test_a_site_accepts_a_run_with_the_privacy_it_requires():
    """SecAgg on; DP within the clip, δ and ε asked (ε from σ given, and from a target ε)."""
    cfg = _cfg()
    need = {**SITE, "require-secagg": True, "max-clip": 1.0, "max-epsilon": 8, "max-delta": 1e-5}
    dp = {**DP, "sites.secagg": True, "privacy.noise_multiplier": 2.0}
    assert site_policy.check(need, _json(cfg, **dp)).sites.secagg
    target = {**dp, "privacy.noise_multiplier": None, "privacy.target_epsilon": 6.0}
    assert site_policy.check(need, _json(cfg, **target)).privacy.target_epsilon == 6.0
    with pytest.raises(SiteError, match="max-epsilon=5"):
        site_policy.check({**need, "max-epsilon": 5}, _json(cfg, **target))


@pytest.mark.parametrize("key", ["max-clip", "max-epsilon", "max-delta"])
@pytest.mark.parametrize("value", [0, -1.0, "8", True])
def test_a_privacy_cap_in_the_node_config_must_be_a_positive_number(key, value):
    with pytest.raises(SiteError, match=rf"^{key}={value!r} in the node config: a positive number is needed$"):
        site_policy.check({**SITE, key: value}, _json(_cfg(), **DP))


def test_require_secagg_in_the_node_config_must_be_true_or_false():
    with pytest.raises(SiteError, match=r"^require-secagg='yes' in the node config: true or false is needed$"):
        site_policy.check({**SITE, "require-secagg": "yes"}, _json(_cfg(), **{"sites.secagg": True}))


def test_a_privacy_cap_takes_a_run_up_to_and_including_itself():
    """The clip and the ε at exactly the site's caps pass, a hair above is refused. The ε is the run's own: its
    mechanism over its clients, after its rounds, as the server reports it."""
    from pflbed.privacy import mechanism

    cfg = _cfg()
    assert site_policy.check({**SITE, "max-clip": 0.5}, _json(cfg, **DP))
    run = validate_config(_tree_of(cfg, **DP))
    eps = mechanism(run, run.federation.clients).epsilon(run.train.rounds)
    assert site_policy.check({**SITE, "max-epsilon": eps}, _json(cfg, **DP))
    with pytest.raises(SiteError, match=r"ε after 4 rounds is .* above this site's max-epsilon"):
        site_policy.check({**SITE, "max-epsilon": eps * (1 - 1e-9)}, _json(cfg, **DP))
