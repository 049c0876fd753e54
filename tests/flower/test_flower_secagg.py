"""Secure aggregation (`sites.secagg`, `pflbed flower local --site-data … --secagg`): a real deployment whose server
learns only the rounds' mean updates gives the simulation's results up to SecAgg+'s quantization; what it cannot
carry is refused."""

import json
import math

import numpy as np
import pytest
import torch

from pflbed.cli import main
from pflbed.config import load_config, validate_config
from pflbed.errors import ConfigError
from pflbed.results.experiment import run

pytest.importorskip("flwr")  # the `flower` extra

from flwr.common import parameters_to_ndarrays  # noqa: E402

from pflbed.flower.executor import FlowerRoundError  # noqa: E402
from pflbed.flower.secagg_node import NoiseShare, site_update  # noqa: E402
from pflbed.flower.sites import export_sites  # noqa: E402

# the seeded noise named: the deployment is compared with the simulation, and a Flower run's default is the OS's
SETS = ["dataset.name=synthetic", "model.name=mlp", "federation.clients=3", "federation.alpha=0.5",
        "train.rounds=1", "train.batch_size=16", "train.lr=0.1", "eval.every=1", "eval.finetune=[]",
        "executor.threads=1", "algorithm.name=fedper", "privacy.clip=0.5", "privacy.noise_multiplier=0.3",
        "privacy.randomness=seeded"]  # fmt: skip
# SecAgg+'s quantization: each site's entry rounded to a step of 2·8/2²² (its range ±8 in 2²² levels); under DP the
# sites weigh equally, so the mean is off by less than one step (later rounds train from that start: SGD amplifies)
TOLERANCE = 2 * 8 / 2**22 * 1.05


def _args(sets):
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-1")
def test_a_secure_deployment_gives_the_simulations_dp_run_up_to_quantization(tmp_path):
    """FedPer under client-level DP on three sites of their own data, through SecAgg+, one round: the shared body
    equals the simulation's to within the quantization step, and ε is the same."""
    sim_cfg = load_config(None, SETS)
    sim = run(sim_cfg, write=False, progress=False)
    dirs = export_sites(sim_cfg, tmp_path / "sites")
    out = tmp_path / "run"
    sets = [s for s in SETS if not s.startswith("federation.clients")]
    main(["flower", "local", "--site-data", *map(str, dirs), "--secagg", "--out", str(out), *_args(sets)])
    summary = json.loads((out / "summary.json").read_text())
    server = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["server"]
    assert server.keys() == sim.server.keys()
    gap = max(float((server[k] - sim.server[k]).abs().max()) for k in server)
    assert 0 < gap < TOLERANCE  # quantized (not bit-equal), and close
    assert summary["privacy"] == sim.summary["privacy"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["pfl_acc"] for r in records] == pytest.approx([r["pfl_acc"] for r in sim.history], abs=0.02)


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-1")
def test_distributed_noise_on_a_secure_deployment_assembles_the_central_release(tmp_path):
    """`privacy.noise: distributed` with σ = 0 and every client sampled (q = 1, so the OS's sample is everyone's):
    each site sends (Σ_c Δ̃_c + 0)/qN with weight 1, the server multiplies the unmasked mean by the sites and the
    mechanism adds nothing, so the release is the central simulation's up to each site's quantization step (three
    sites: three steps). Wrong scaling (a mean instead of a sum, qN twice) is off by a factor; the noise shares
    themselves are `test_distributed_noise.py`'s."""
    common = [s for s in SETS if not s.startswith(("privacy.noise_multiplier", "privacy.randomness"))]
    common += ["privacy.noise_multiplier=0", "federation.sample_fraction=1.0"]
    sim = run(load_config(None, [*common, "privacy.randomness=seeded"]), write=False, progress=False)
    dirs = export_sites(load_config(None, common), tmp_path / "sites")
    out = tmp_path / "run"
    sets = [s for s in common if not s.startswith("federation.clients")] + ["privacy.noise=distributed"]
    main(["flower", "local", "--site-data", *map(str, dirs), "--secagg", "--out", str(out), *_args(sets)])
    summary = json.loads((out / "summary.json").read_text())
    server = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["server"]
    gap = max(float((server[k] - sim.server[k]).abs().max()) for k in server)
    assert 0 < gap < 3 * TOLERANCE
    assert summary["privacy"]["noise"] == "distributed" and summary["privacy"]["randomness"] == "os"


def _secure_in_process(tmp_path, sets, grid=None, executor=None, tamper=None, **privacy):
    """The run of `sets` simulated, and through SecAgg+ on one site per simulated client (its data), in this
    process (`FakeGrid`: the real protocol, the nodes' mod included, without a deployment);
    `grid`: the fake grid's other options (lost sites); `executor`, `privacy`: options of the secure run's own
    (a round timeout; distributed noise); `tamper(reply)`: each reply as the server gets it, changed in place."""
    from pflbed.flower.secagg import SecAggExecutor
    from pflbed.results.experiment import experiment

    from .site_setup import _server_task, _site_cfg, _sites, server_executor

    sim_cfg = load_config(None, sets)
    sim = run(sim_cfg, write=False, progress=False)
    _, fake = _sites(tmp_path, sim_cfg, **(grid or {}))
    cfg = _site_cfg(sim_cfg.model_dump(mode="json"))
    tree = cfg.model_dump(mode="json")
    cfg = validate_config({**tree, "privacy": {**tree["privacy"], **sim_cfg.privacy.model_dump(mode="json"), **privacy},
                           "executor": {**tree["executor"], **(executor or {})},
                           "sites": {**tree["sites"], "secagg": True}})  # fmt: skip
    ex = server_executor(fake, cfg, SecAggExecutor)
    sent = []  # each pflbed TRAIN content the sites get (`_Workflow`'s masked-vector stage): (node, its config)
    timeouts = []  # the timeout of each of the protocol's calls (its messages are TRAIN messages)
    real = fake.send_and_receive

    def watched(msgs, timeout=None):
        sent.extend((m.metadata.dst_node_id, dict(m.content["config"])) for m in msgs
                    if "config" in m.content and m.metadata.message_type == "train")  # fmt: skip
        timeouts.extend(timeout for m in msgs[:1] if m.metadata.message_type == "train")
        replies = real(msgs, timeout)
        for reply in replies if tamper else []:
            tamper(reply)
        return replies

    fake.send_and_receive = watched
    with _server_task():
        secure = experiment(cfg, ex.algo, ex, None, False, False)
    gap = max(float((secure.server[k] - sim.server[k]).abs().max()) for k in sim.server)
    secure.sent, secure.timing, secure.timeouts = sent, dict(ex.timing), timeouts
    return sim, secure, gap


def test_a_secure_run_in_process_gives_the_simulation_s_dp_run_up_to_quantization(tmp_path):
    """The deployment test above without processes: FedPer under client-level DP, one round through SecAgg+ —
    the shared body within one quantization step of the simulation's (not equal: quantized), the same ε."""
    sim, secure, gap = _secure_in_process(tmp_path, SETS)
    assert secure.server.keys() == sim.server.keys() and 0 < gap < TOLERANCE
    assert secure.summary["privacy"]["epsilon"] == sim.summary["privacy"]["epsilon"]


def test_distributed_noise_through_secagg_in_process_assembles_the_central_release(tmp_path):
    """As the deployment test of distributed noise (σ = 0, q = 1: each site sends Σ_c Δ̃_c / qN of weight 1, the
    server multiplies the unmasked mean by the sites), in process: the central release up to three steps."""
    common = [s for s in SETS if not s.startswith(("privacy.noise_multiplier", "privacy.randomness"))]
    common += ["privacy.noise_multiplier=0", "federation.sample_fraction=1.0"]
    sim, secure, gap = _secure_in_process(tmp_path, [*common, "privacy.randomness=seeded"], noise="distributed",
                                          randomness="os")  # fmt: skip
    assert 0 < gap < 3 * TOLERANCE
    assert secure.summary["privacy"]["noise"] == "distributed" and sim.summary["privacy"]["noise"] == "central"


def test_two_sites_are_enough_for_secure_aggregation_and_one_is_refused(tmp_path):
    """SecAgg+'s smallest deployment: two sites, each holding a share of the other's secrets (threshold 2). One
    site alone would hand the server its update as the "sum": refused in one line. The protocol's calls wait the
    run's round timeout."""
    sets = [s for s in SETS if not s.startswith("federation.clients")]
    sim, secure, gap = _secure_in_process(tmp_path / "two", [*sets, "federation.clients=2"],
                                          executor={"round_timeout": 45})  # fmt: skip
    assert 0 < gap < TOLERANCE and len({n for n, _ in secure.sent}) == 2
    assert len(secure.timeouts) == 4 and set(secure.timeouts) == {45}  # the protocol's four stages
    with pytest.raises(FlowerRoundError) as e:
        _secure_in_process(tmp_path / "one", [*sets, "federation.clients=1"])
    assert str(e.value) == "secure aggregation needs at least two sites"


def test_distributed_noise_with_a_site_idle_assembles_the_central_release(tmp_path, monkeypatch):
    """q < 1 under distributed noise (σ = 0): a site with no client sampled still sends its share of the noise with
    weight 1 and names no entry, and the server, taking it as idle, scales the unmasked mean by S·qN/m — the central
    release up to three steps (weights of the clients' counts, the idle site held to naming entries, or 1/q for q
    each stop the round or miss by a factor). The sample, which a Flower run draws from the OS, is drawn here from
    the simulation's seeded stream, so that both runs train the same clients."""
    import pflbed.engine.driver as driver

    drawn = []

    def seeded(*args, entropy=False, **kw):
        cids = real(*args, **kw)
        drawn.extend([cids] if entropy else [])
        return cids

    real = driver.sample_clients
    monkeypatch.setattr(driver, "sample_clients", seeded)
    common = [s for s in SETS if not s.startswith(("privacy.noise_multiplier", "privacy.randomness"))]
    common += ["privacy.noise_multiplier=0", "federation.sample_fraction=0.5"]
    sim, secure, gap = _secure_in_process(tmp_path, [*common, "privacy.randomness=seeded"], noise="distributed",
                                          randomness="os")  # fmt: skip
    assert len(drawn) == 1 and 0 < len(drawn[0]) < 3  # a site idle, a client trained
    assert sorted(c for _, conf in secure.sent for c in conf["cids"]) == drawn[0]
    assert 0 < gap < 3 * TOLERANCE


@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")  # Flower's 1/0: no weight replied
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # and then 0 · ∞
@pytest.mark.parametrize(("fraction", "line"), [
    (0.67, r"round 1: secure aggregation did not complete \(too few sites replied\)"),
    (0.34, r"round 1: no client replied \(failed: \[\d\]\)")])  # fmt: skip
def test_a_secure_round_whose_sampled_sites_are_lost_stops_in_one_line(fraction, line, tmp_path):
    """FedAvg on three sites, the sites of the sampled clients lost: two of three leave fewer than SecAgg+'s
    threshold (two), and the protocol cannot unmask; one leaves two idle sites, whose sum holds no client."""
    sets = [s for s in SETS if not s.startswith(("privacy.", "algorithm.name"))]
    with pytest.raises(FlowerRoundError, match=f"^{line}$"):
        _secure_in_process(tmp_path, [*sets, "algorithm.name=fedavg", f"federation.sample_fraction={fraction}"],
                           grid={"lost": {1: [0, 1, 2]}})  # fmt: skip


def _protocol_record(reply):
    """The SecAgg+ record of a site's reply as the server gets it (None for an error reply)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    return None if reply.has_error() else reply.content.config_records.get(RECORD_KEY_CONFIGS)


@pytest.mark.parametrize(("how", "site"), [("short", 0), ("short", 2), ("long", 2), ("reshaped", 2),
                                           ("float", 2), ("not_bytes", 2), ("missing", 2)])  # fmt: skip
def test_a_site_s_masked_vector_in_other_shapes_stops_the_round_naming_it(how, site, tmp_path):
    """The server checks each masked vector's arrays before SecAgg+ sums them: the weight factor, then one integer
    array per payload entry. Flower's sum would crash on an array fewer (a traceback), cut a later site's extra one
    silently, or broadcast a reshaped one; each stops the round here naming the site."""
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    def tamper(reply):
        record = _protocol_record(reply)
        if reply.metadata.src_node_id != 1000 + site or record is None or Key.MASKED_PARAMETERS not in record:
            return
        arrays = list(record[Key.MASKED_PARAMETERS])
        i = next(i for i, a in enumerate(arrays) if bytes_to_ndarray(a).ndim > 1)  # a weight matrix
        if how == "missing":
            del record[Key.MASKED_PARAMETERS]
            return
        record[Key.MASKED_PARAMETERS] = {
            "short": arrays[:-1], "long": [*arrays, arrays[-1]], "not_bytes": ["x"] * len(arrays),
            "reshaped": [*arrays[:i], ndarray_to_bytes(bytes_to_ndarray(arrays[i]).reshape(-1)), *arrays[i + 1:]],
            "float": [ndarray_to_bytes(bytes_to_ndarray(arrays[0]).astype(np.float64)), *arrays[1:]]}[how]  # fmt: skip

    entry = "entry 'blocks.fc1.1.weight'"  # FedPer's payload: the MLP's body, two matrices and their biases
    counts = "arrays, not 5 (the weight factor and one per payload entry)"
    line = {"short": f" has 4 {counts}", "long": f" has 6 {counts}",
            "reshaped": f"'s array for {entry} is of shape (12800,) and dtype kind 'i', not integers of shape "
                        "(200, 64)",
            "float": "'s array for the weight factor is of shape (1,) and dtype kind 'f', not integers of shape (1,)",
            "not_bytes": " is not a list of .npy arrays", "missing": " is not a list of .npy arrays"}[how]  # fmt: skip
    with pytest.raises(FlowerRoundError) as e:
        _secure_in_process(tmp_path, SETS, tamper=tamper)
    assert str(e.value) == f"site {site}, round 1: its masked update{line}"


def test_a_site_s_malformed_protocol_message_stops_the_round_in_one_line(tmp_path):
    """A site's reply to SecAgg+'s last stage without its key shares: Flower's workflow fails reading it, and the
    round stops in one line, the error named (not a traceback)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    def tamper(reply):
        record = _protocol_record(reply)
        if reply.metadata.src_node_id == 1001 and record is not None and Key.SHARE_LIST in record:
            del record[Key.SHARE_LIST]

    with pytest.raises(FlowerRoundError, match=r"^round 1: secure aggregation failed \(KeyError: .*\)$"):
        _secure_in_process(tmp_path, SETS, tamper=tamper)


def _setup(**over):
    """SecAgg+'s setup parameters as pflbed's server sets them for three sites, with `over` changed."""
    from flwr.app import ConfigRecord
    from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

    return ConfigRecord({Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: 3, Key.SHARE_NUMBER: 3, Key.THRESHOLD: 2,
                         Key.CLIPPING_RANGE: 8.0, Key.TARGET_RANGE: 2**22, Key.MOD_RANGE: 2**32,
                         Key.MAX_WEIGHT: 1.0, **over})  # fmt: skip


@pytest.mark.parametrize(("over", "line"), [
    ({"threshold": 1}, "threshold=1 for 3 sites; this site takes 2 to 3"),
    ({"threshold": 4}, "threshold=4 for 3 sites; this site takes 2 to 3"),
    ({"threshold": 2.0}, "threshold=2.0 for 3 sites; this site takes 2 to 3"),
    ({"share_num": 2}, "share_num=2 for 3 sites; this site takes only 3"),
    ({"clipping_range": 100.0}, "clipping_range=100.0 for 3 sites; this site takes only 8.0"),
    ({"target_range": 2**10}, "target_range=1024 for 3 sites; this site takes only 4194304"),
    ({"mod_range": 2**16}, "mod_range=65536 for 3 sites; this site takes only 4294967296"),
    ({"sample_num": 1, "share_num": 1, "threshold": 1}, "1 sites; this site takes part only with at least two")])
def test_a_site_takes_secagg_s_parameters_only_as_pflbed_s_server_sets_them(over, line):
    """The server sets SecAgg+'s parameters (setup stage); a site takes only those pflbed's server uses for the
    number of sites named. A threshold of 1 would let a server that tells the sites different stories about who
    dropped out gather both of one site's secrets (its update in clear); other ranges break the site's count of
    entries beyond the range. Five sites: threshold 2 (Flower's rounding) to 5."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    from pflbed.flower.secagg_node import check_setup
    from pflbed.flower.sites import SiteError

    check_setup(_setup())
    check_setup(_setup(**{Key.SAMPLE_NUMBER: 5, Key.SHARE_NUMBER: 5, Key.THRESHOLD: 2}))
    check_setup(_setup(**{Key.SAMPLE_NUMBER: 5, Key.SHARE_NUMBER: 5, Key.THRESHOLD: 5}))
    with pytest.raises(SiteError) as e:
        check_setup(_setup(**over))
    assert str(e.value) == f"SecAgg+ setup: {line}"


def test_a_server_setting_other_secagg_parameters_gets_no_site_to_take_part(tmp_path, monkeypatch):
    """A server whose SecAgg+ clips at ±100: every site refuses the setup stage (its error reply says why), and
    the round stops."""
    from pflbed.flower import secagg

    errors = []

    def tamper(reply):
        errors.extend([reply.error.reason] if reply.has_error() else [])

    monkeypatch.setattr(secagg, "CLIP_RANGE", 100.0)
    with pytest.raises(FlowerRoundError, match=r"^round 1: secure aggregation did not complete"):
        _secure_in_process(tmp_path, SETS, tamper=tamper)
    assert len(errors) == 3 and all("SiteError: SecAgg+ setup: clipping_range=100.0 for 3 sites" in e for e in errors)


def test_a_site_that_misstates_its_weight_through_the_protocol_stops_the_run_naming_it(tmp_path, monkeypatch):
    """The second site's node weighs its masked update one more than its clients' counts: the server, which sees
    only the sum, stops the round at the clear weight, naming the site and the round."""
    from pflbed.flower import secagg_node

    calls = []

    def lying(*args, **kw):
        fitres = real(*args, **kw)
        calls.append(1)
        fitres.num_examples += 1 if len(calls) == 2 else 0
        return fitres

    real = secagg_node.site_update
    monkeypatch.setattr(secagg_node, "site_update", lying)
    with pytest.raises(FlowerRoundError, match=r"^site 1, round 1: it weighs its update 2, the server expects 1 "):
        _secure_in_process(tmp_path, SETS)


def test_a_secure_run_without_dp_weighs_the_sites_by_their_samples(tmp_path):
    """FedAvg through SecAgg+ without DP, one round: each site's update weighs its clients' training samples, as the
    simulation's mean does, within the quantization bound of unequal weights, one step · max W / mean W (the
    module's docstring); a mean that weighed the sites equally would be off by the whole update's scale."""
    sets = [s for s in SETS if not s.startswith(("privacy.", "algorithm.name"))]
    sim, secure, gap = _secure_in_process(tmp_path, [*sets, "algorithm.name=fedavg"])
    weights = [len(np.load(tmp_path / "sites" / d / "train.npz")["y"]) for d in sorted(
        p.name for p in (tmp_path / "sites").iterdir())]  # fmt: skip
    assert len(set(weights)) > 1 and 0 < gap < TOLERANCE * max(weights) / np.mean(weights)


def test_a_secure_run_continues_each_site_s_kept_states_and_takes_a_site_with_no_client_sampled(tmp_path,
                                                                                                monkeypatch):
    """FedPer through SecAgg+ for three rounds, two of three clients sampled a round: a site with no client sampled
    sends zeros of weight 0 and the round goes on, and each sampled client's site is asked for the state version of
    its last accepted reply (a site that trained from a fresh head, version 0, would drift far from the simulation;
    the body is not compared here: the quantization error grows over rounds). The server's timings add up over the
    rounds (its clock here ticks one second a reading: each round's records and wait take one each)."""
    from pflbed.flower import secagg

    from ..fake_flower import ticking_time

    monkeypatch.setattr(secagg, "time", ticking_time())
    sets = [s for s in SETS if not s.startswith(("privacy.", "train.rounds"))]
    sim, secure, gap = _secure_in_process(tmp_path, [*sets, "train.rounds=3", "federation.sample_fraction=0.67"])
    last = dict.fromkeys(range(3), 0)  # each client's round of its last accepted reply: the version its site keeps
    idle = 0
    for rnd in (1, 2, 3):
        confs = [c for _, c in secure.sent if c["round"] == rnd]
        assert len(confs) == 3  # every site takes part in every round, sampled clients or not
        idle += sum(not c["cids"] for c in confs)
        for c in confs:
            assert list(c["versions"]) == [last[cid] for cid in c["cids"]], (rnd, c)
        for c in confs:
            last.update(dict.fromkeys(c["cids"], rnd))
    assert idle and math.isfinite(secure.summary["final"]["pfl_acc"]) and gap > 0
    assert secure.timing["server_records_s"] == 3 and secure.timing["wait_s"] == 3


def test_a_site_sends_its_weighted_mean_update_and_zeros_when_it_has_no_client():
    w = {"a": torch.tensor([1.0, 1.0]), "b": torch.zeros(3)}
    r1, r2 = {"a": torch.tensor([2.0, 1.0])}, {"a": torch.tensor([1.0, 4.0])}  # b: not updated (FedBABU's head)
    fitres = site_update(w, [(r1, 1), (r2, 3)], {})
    a, b = parameters_to_ndarrays(fitres.parameters)
    assert np.allclose(a, [0.25, 2.25]) and np.allclose(b, 0) and fitres.num_examples == 4
    assert json.loads(fitres.metrics["keys"]) == ["a"]
    empty = site_update(w, [], {})
    assert [x.shape for x in parameters_to_ndarrays(empty.parameters)] == [(2,), (3,)] and empty.num_examples == 0
    # distributed noise (σ = 0, qN = 2): the clients' changes summed, unweighted, over qN; weight 1; b not updated
    noised = site_update(w, [(r1, 1), (r2, 3)], {}, NoiseShare(0.0, 2.0))
    a, b = parameters_to_ndarrays(noised.parameters)
    assert np.allclose(a, [0.5, 1.5]) and np.allclose(b, 0) and noised.num_examples == 1


def test_a_site_counts_every_entry_of_its_update_beyond_secagg_s_range():
    """`beyond_range`, in clear: the entries SecAgg+ would clip (|·| > 8, over every entry of the update, ±8 itself
    kept), which the server turns into a stopped round rather than a silently clipped mean."""
    payload = {"a": torch.zeros(3), "b": torch.zeros(2)}
    reply = {"a": torch.tensor([9.0, -8.0, 8.5]), "b": torch.tensor([-20.0, 1.0])}
    assert site_update(payload, [(reply, 1)], {}).metrics["beyond_range"] == 3


def test_what_secure_aggregation_cannot_carry_is_refused(capsys):
    base = {"dataset": {"name": "synthetic"}, "executor": {"name": "flower"}}
    with pytest.raises(ConfigError, match="secagg applies to sites.local=true"):
        validate_config({**base, "sites": {"secagg": True}})
    sites = {"local": True, "secagg": True, "input_shape": [1, 8, 8], "num_classes": 10}
    with pytest.raises(ConfigError, match="sites.secagg: SecAgg\\+ gives the server only the mean .* ktpfl needs"):
        validate_config({**base, "sites": sites, "algorithm": {"name": "ktpfl"}})
    validate_config({**base, "sites": sites, "algorithm": {"name": "fedrep"}})
    assert main(["flower", "local", "--secagg"]) == 2
    assert capsys.readouterr().err == ("pflbed: error: --secagg needs --site-data: secure aggregation protects the "
                                       "sites' updates, and without --site-data the server holds all the data\n")


def test_a_site_s_secure_update_is_its_clients_weighted_mean_from_the_shared_payload(tmp_path, monkeypatch):
    """`client.secure_train` in this process (the deployments above run it in their nodes): a site of three clients
    updates each from the round's shared payload and its state of the version asked for, sends `site_update` of
    their replies, keeps their new states and the version the server may still ask for; it checks the payload for
    each client in its round and with its kept state (`payload_fits` reads them: L2GD's structure is the round's);
    without a state store it refuses."""
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.compat.common.recorddict_compat import recorddict_to_fitres
    from flwr.supercore.task_identity import TaskIdentity

    from pflbed.engine.executor import update_client
    from pflbed.engine.guard import first_nonfinite
    from pflbed.flower import client, secagg_node, site_message, site_node
    from pflbed.flower.project import config_json
    from pflbed.flower.records import to_record
    from pflbed.flower.sites import SiteError

    from ..fake_flower import FakeGrid
    from .site_setup import _discover, _site_cfg, _sites, _tree

    tree = _tree("fedper", eval={"every": 2, "finetune": []})  # a state per client: its head
    tree["federation"]["clients"] = 5  # 1 + 1 + 3
    dirs, _ = _sites(tmp_path, validate_config(tree))
    nodes = {0: {"data": str(dirs[0])}, 1: {"data": str(dirs[1])}, 2: {"data": str(dirs[2]), "clients": 3}}
    grid = FakeGrid(partitions=3, node_configs={k: {**v, "state-dir": str(tmp_path / f"s{k}")}
                                                for k, v in nodes.items()})  # fmt: skip
    cfg = _site_cfg(tree)
    sizes = json.dumps(_discover(grid, cfg))
    ctx = Context(run_id=1, node_id=1, state=RecordDict(), run_config={},
                  node_config={**grid.node_configs[2], "partition-id": 2, "num-partitions": 3})  # fmt: skip
    algo, stored = site_node.site_algorithm_of(ctx, config_json(cfg), sizes)
    cids, payload = [2, 3, 4], algo.configure(1, algo.init_server(), [2])[2]
    assert len({algo.ctx.client_data(c).num_train for c in cids}) > 1  # their weights differ
    saved = {k: getattr(TaskIdentity, k) for k in ("_run_id", "_task_id", "_node_id")}
    for k in saved:
        setattr(TaskIdentity, k, 1)
    try:
        content = RecordDict({secagg_node.SHARED: to_record(payload), "config": ConfigRecord({"site-sizes": sizes})})
        msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
    finally:
        for k, v in saved.items():
            setattr(TaskIdentity, k, v)
    msg.metadata.__dict__["_message_id"] = "m1"
    first = min(payload)
    checked = []
    monkeypatch.setattr(client, "check_payload", lambda *a: checked.append(a) or site_message.check_payload(*a))
    for rnd in (1, 2, 3):  # round 3: a finite payload that training overflows, every reply and state non-finite,
        if rnd == 3:  # said in clear (a non-finite payload is refused before any client trains: below)
            payload = {k: v.clone().fill_(3e38) if k == first else v for k, v in payload.items()}
            msg.content[secagg_node.SHARED] = to_record(payload)
        versions = {c: rnd - 1 for c in cids}
        expected = {c: update_client(algo, rnd, c, payload, stored.load(c, rnd - 1)) for c in cids}
        weighted = [(expected[c][0], secagg_node.client_weight(algo, algo.ctx.client_data(c).num_train)) for c in cids]
        flags = {f"{kind}/{c}": bad for c in cids for kind, bad in (("nonfinite", first_nonfinite(expected[c][1])),
                 (secagg_node.NONFINITE_REPLY, first_nonfinite(expected[c][0]))) if bad is not None}  # fmt: skip
        assert len(flags) == (6 if rnd == 3 else 0)
        want = site_update(payload, weighted, flags)
        kept_before = {c: stored.load(c, rnd - 1) for c in cids}
        checked.clear()
        got = recorddict_to_fitres(client.secure_train(msg, algo, stored, rnd, cids, versions).content, False)
        assert [(a[1], a[2]) for a in checked] == [(rnd, c) for c in cids] and all(a[0] is algo for a in checked)
        for a in checked:
            assert a[3].keys() == payload.keys() and all(torch.equal(a[3][k], payload[k]) for k in payload)
            assert a[4].keys() == kept_before[a[2]].keys()
            assert all(torch.equal(a[4][k], v) for k, v in kept_before[a[2]].items())
        assert got.num_examples == want.num_examples == sum(w for _, w in weighted)
        assert got.metrics == want.metrics
        for a, b in zip(parameters_to_ndarrays(got.parameters), parameters_to_ndarrays(want.parameters), strict=True):
            assert np.array_equal(a, b, equal_nan=True)
        for c in cids:
            kept = stored.load(c, rnd)
            for k, v in expected[c][1].items():
                torch.testing.assert_close(kept[k], v, rtol=0, atol=0, equal_nan=True)
    assert all(stored.load(c, 2) is not None for c in cids)  # round 2's states kept: the server's version at round 3
    msg.content[secagg_node.SHARED] = to_record({k: v.clone().fill_(math.nan) if k == first else v
                                                 for k, v in payload.items()})  # fmt: skip
    with pytest.raises(SiteError, match=f"^the server's TRAIN message: the payload of client 2 has a non-finite entry "
                                        f"in '{first}'$"):  # fmt: skip
        client.secure_train(msg, algo, stored, 3, cids, {c: 2 for c in cids})
    dp = validate_config({**cfg.model_dump(mode="json"), "privacy": {"clip": 0.5, "noise_multiplier": 0.5,
                                                                      "noise": "distributed"},
                          "sites": {**cfg.sites.model_dump(mode="json"), "secagg": True}})  # fmt: skip
    algo_dp, stored_dp = site_node.site_algorithm_of(ctx, config_json(dp), sizes)
    msg.content[secagg_node.SHARED] = to_record(algo_dp.configure(1, algo_dp.init_server(), [2])[2])
    noisy = recorddict_to_fitres(client.secure_train(msg, algo_dp, stored_dp, 1, cids, dict.fromkeys(cids, 0)).content,
                                 False)  # fmt: skip
    assert noisy.num_examples == 1  # the site's share of distributed noise: its update weighs 1, clients or not
    with pytest.raises(ValueError, match=r"^secure aggregation keeps the clients' states on the sites \(sites.local"):
        client.secure_train(msg, algo, None, 3, cids, {c: 2 for c in cids})


def test_a_site_flagging_another_site_s_client_stops_the_run_naming_itself_not_the_other(tmp_path, monkeypatch):
    """The first site's node flags client 2 (the third site's) as diverged in clear: the run stopped blaming that
    client's site; now it stops naming the site that sent the flag."""
    from pflbed.flower import secagg_node

    calls = []

    def framing(*args, **kw):
        fitres = real(*args, **kw)
        calls.append(1)
        fitres.metrics.update({"nonfinite/2": "w"} if len(calls) == 1 else {})
        return fitres

    real = secagg_node.site_update
    monkeypatch.setattr(secagg_node, "site_update", framing)
    with pytest.raises(FlowerRoundError) as e:
        _secure_in_process(tmp_path, SETS)
    assert str(e.value) == ("site 0, round 1: its clear metrics are refused (it sends 'nonfinite/2', which is not a "
                            "figure of its own clients)")
