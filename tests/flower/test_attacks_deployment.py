"""Issue 48's acceptance: the attacks of a malicious server and of a malicious site, tried on a real loopback
deployment (SuperLink and SuperNodes as processes, TLS and SuperNode authentication on), each refused with one
line, the honest sites' results and files unchanged.

The in-process tests on the faked runtime (`test_attacks_server.py`, `test_attacks_site.py`) show each defense; these
show them where they must hold: across Flower's real runtime, whose error replies, process boundaries and message
encoding the fake does not have, with the modified component a module Flower ships in the app and loads as it
loads pflbed's (`attack_apps`). Three deployments: one whose ServerApp attacks honest sites; two whose ClientApp
attacks on some nodes (and is pflbed's on every other) under pflbed's own ServerApp — one run through to the
attack that stops it, and one stopped at start-up.

What each attempt got back is printed (`pytest -s`), and shown with any failure."""

import json
import re
import shutil
import uuid

import numpy as np
import pytest
import torch

from pflbed.config import load_config
from pflbed.results.checkpoint import load_checkpoint

from .processes import marked_processes

pytest.importorskip("flwr")  # the `flower` extra

from flwr.app import Error, Message, MessageType  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from pflbed.flower import client  # noqa: E402
from pflbed.flower.local import failure_reason  # noqa: E402
from pflbed.flower.sites import describe_sites, export_sites  # noqa: E402

from ..fake_flower import FakeGrid  # noqa: E402
from .attack_apps import deploy, tree_digest, write_attack_app  # noqa: E402
from .site_setup import run_sites  # noqa: E402

SITES = 3
SETS = ["dataset.name=synthetic", "model.name=mlp", f"federation.clients={SITES}", "federation.alpha=0.5",
        "train.rounds=1", "train.batch_size=16", "train.lr=0.1", "eval.every=1", "eval.finetune=[]",
        "executor.threads=1", "algorithm.name=fedavg"]  # fmt: skip


def _site_local(dirs, sets=()):
    """The config `pflbed flower local --site-data` runs over `dirs`."""
    shape, classes = describe_sites(dirs)
    return load_config(None, [*SETS, "executor.name=flower", f"executor.supernodes={len(dirs)}", "sites.local=true",
                              f"sites.input_shape={list(shape)}", f"sites.num_classes={classes}", *sets])  # fmt: skip


def _one_line(reason):
    """The refusal inside Flower's error reason (`<class 'X'>:<'the line'>`): one line, or an AssertionError."""
    assert reason is not None and "\n" not in reason, reason
    found = re.fullmatch(r"<class '[\w.]+'>:<'(.*)'>", reason)
    assert found, reason
    return found.group(1)


def _masked(line, path):
    """`line` with the path the server itself sent masked, or the start of it where the line shortens a long value:
    what is left is all the site said of the file."""
    for n in range(len(path), 20, -1):
        if path[:n] in line:
            return line.replace(path[:n], "<path>")
    return line


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-0")
def test_a_modified_server_is_refused_by_every_site_and_reads_or_writes_nothing_there(tmp_path, monkeypatch,
                                                                                         deployment_mark):  # fmt: skip
    """The modified ServerApp (`attack_apps/malicious_server.py`) against three honest sites — site 1 requiring
    client-level DP (`max-epsilon`), site 2 SecAgg (`require-secagg`) in their node configs: every attempt gets
    an error reply of one line naming what was refused; asking for a file of the site and for one that is not there
    gets the same line (the site is no oracle for its files); the partition question every server asks is
    answered; and every site's state and data directories, the sites' HOME and their working directory are byte for
    byte as they were."""
    dirs = export_sites(load_config(None, SETS), tmp_path / "sites")
    cfg = _site_local(dirs)
    states = [tmp_path / f"site-{k}-states" for k in range(SITES)]
    secret = states[0] / "0123456789abcdef" / "client-0" / "round-1.pt"  # a client state as a site keeps it
    secret.parent.mkdir(parents=True)
    torch.save({"w": torch.arange(6.0)}, secret)
    missing = secret.with_name("round-2.pt")
    for d in states[1:]:
        d.mkdir()
        (d / "kept.txt").write_text("a site's own file\n")
    home, cwd = tmp_path / "home", tmp_path / "cwd"  # the processes' HOME and working directory
    home.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    nodes = [{"partition-id": k, "num-partitions": SITES, "data": str(d), "state-dir": str(states[k])}
             for k, d in enumerate(dirs)]  # fmt: skip
    nodes[1]["max-epsilon"] = 8.0
    nodes[2]["require-secagg"] = True
    sizes = [[len(np.load(d / "train.npz")["y"])] for d in dirs]
    before = {p: tree_digest(p) for p in (*states, *dirs, home, cwd)}
    out = tmp_path / "run"
    attacks = json.dumps({"secret": str(secret), "missing": str(missing), "sizes": json.dumps(sizes)})
    app = write_attack_app(tmp_path / "app", cfg, out, serverapp="malicious_server", run_config={"attacks": attacks})
    deploy(tmp_path / "flower", app, nodes, env={"HOME": str(home)})
    assert not (left := marked_processes(deployment_mark)), left
    assert (out / "attempts.json").is_file(), (tmp_path / "flower" / "run.log").read_text()[-3000:]
    got = json.loads((out / "attempts.json").read_text())
    assert got.pop("partitions") == {"sites": list(range(SITES))}  # the control: an honest question is answered
    print(f"attempts answered in {got.pop('seconds')} s")
    lines = {name: _one_line(r["reason"]) for name, r in got.items()}
    print(json.dumps(lines, indent=1))
    for how in ("states query", "train"):  # 1: the same answer for a file there and one not there
        there, absent = lines[f"{how}, init_from secret"], lines[f"{how}, init_from missing"]
        assert _masked(there, str(secret)) == _masked(absent, str(missing)), (there, absent)
    assert "'states' query" in lines["states query, init_from secret"]
    assert "model.init_from" in lines["train, init_from secret"]
    for key in ("algorithm.K", "train.local_epochs", "sites.input_shape", "executor.state_dir", "dataset.path"):
        assert key in lines[f"site query, {key}"], lines[f"site query, {key}"]  # 2
    assert "training samples" in lines["train, site-sizes"]
    assert "privacy.clip" in lines["site query, no DP"] and "max-epsilon" in lines["site query, no DP"]  # 4
    assert "sites.secagg" in lines["train, no SecAgg"] and "require-secagg" in lines["train, no SecAgg"]
    assert {p: tree_digest(p) for p in before} == before


ATTACKER = 2  # the malicious site (one client per site: its client is client 2)


class _Lost(FakeGrid):
    """The fake runtime in which site ATTACKER's replies to a round's work never arrive (its node is up otherwise):
    the run a refused site must give the others, every round."""

    def send_and_receive(self, msgs, timeout=None):
        lost = {id(m) for m in msgs if m.metadata.message_type == MessageType.TRAIN
                and m.metadata.dst_node_id == self.nodes[ATTACKER]}  # fmt: skip
        out = super().send_and_receive([m for m in msgs if id(m) not in lost], timeout)
        for m in (m for m in msgs if id(m) in lost):
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            out.append(Message(Error(ErrorCode.NODE_UNAVAILABLE, "lost"), reply_to=m))
        return out


def _pt_files(root):
    """Every state file under `root` (relative path → its tensors)."""
    return {str(p.relative_to(root)): torch.load(p, weights_only=True) for p in sorted(root.rglob("*.pt"))}


def _refusals(log):
    return [line.split("pflbed: refused: ", 1)[1] for line in log.read_text(errors="replace").splitlines()
            if "pflbed: refused: " in line]  # fmt: skip


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-0")
def test_a_modified_site_is_refused_round_after_round_and_the_honest_sites_train_as_without_it(
    tmp_path, deployment_mark
):
    """pflbed's ServerApp over three sites, site 2 running the modified ClientApp (`attack_apps/malicious_site.py`,
    `attack="replies"`), and three nodes joining in round 1, each with a node config claiming site 1 (a copy of
    its data, a state directory of its own): one answering honestly (8.), two reporting a count of -250 and of 0
    training samples (5.). Each of site 2's five rewritten replies is refused with one line naming the site and the
    fault, and the site is left out of that round; each late claim is refused with one line, and its node is sent
    nothing more; site 2's figures in the final evaluation (accuracy 7.5) stop the run with one line naming the site.
    The run is the one in which site 2's replies were lost (in-process): the same records of rounds 2 and 4 (P-FL,
    and site 2's client under `failed_clients`), and the honest sites' state files bit for bit — they trained every
    round on the same models, which the attacker never entered."""
    dirs = export_sites(load_config(None, SETS), tmp_path / "sites")
    shutil.copytree(dirs[1], tmp_path / "stolen")  # site 1's data, in the hands of the node claiming it
    # FedRoD: each client keeps a personal head (state files worth comparing), and its generic model makes the final
    # evaluation also ask for +FT, which is how the attacker tells it from the honest ones of rounds 2 and 4; a
    # checkpoint every round: the last one (round 4) says which clients' states the server accepted
    cfg = _site_local(dirs, ["algorithm.name=fedrod", "train.rounds=5", "eval.every=2", "eval.finetune=[ft]",
                             "train.checkpoint_every=1"])  # fmt: skip
    out = tmp_path / "run"
    work = tmp_path / "flower"
    nodes = [{"partition-id": k, "num-partitions": SITES, "data": str(d), "state-dir": str(work / f"site-{k}-states")}
             for k, d in enumerate(dirs)]  # fmt: skip
    nodes[ATTACKER]["attack"] = "replies"
    claims = [{}, {"attack": "counts", "claim": -250}, {"attack": "counts", "claim": 0}]
    late = [{"partition-id": 1, "num-partitions": SITES, "data": str(tmp_path / "stolen"),
             "state-dir": str(work / f"claimant-{i}-states"), **claim} for i, claim in enumerate(claims)]  # fmt: skip
    app = write_attack_app(tmp_path / "app", cfg, out, clientapp="malicious_site")

    def round_one_sent():  # the start-up question is answered: the late nodes claim a site already bound
        return "Receiving: train message" in (work / "supernode-0.log").read_text()

    deploy(work, app, nodes, late=late, join_when=round_one_sent)
    assert not (left := marked_processes(deployment_mark)), left
    run_log = work / "run.log"
    assert not (out / "summary.json").exists()
    assert failure_reason(run_log) == (
        "pflbed.flower.executor.FlowerRoundError: site 2: its evaluation is refused: the round's figures give client "
        "2 a test accuracy of 7.5, outside [0, 1]"
    ), run_log.read_text()[-3000:]
    lines = _refusals(run_log)
    print("\n".join(lines))
    replies = [line for line in lines if line.startswith("site 2, round")]
    faults = ["changes the model by", "of shape [2, ", "lacks keys", "has key 'extra', which the server did not send",
              "of dtype torch.int64"]  # fmt: skip
    assert len(replies) == 5, lines
    for rnd, (line, fault) in enumerate(zip(replies, faults, strict=True), start=1):
        assert line.startswith(f"site 2, round {rnd}: client 2's reply ") and fault in line, line
        assert line.endswith("; its clients are left out of the round"), line
    claimed = sorted(line for line in lines if not line.startswith("site 2, round"))
    bound = cfg.sites.max_client_samples
    assert len(claimed) == 3, lines
    assert claimed[1:] == [f"site 1: num_train[0]={n}; a count is an integer from 1 to sites.max_client_samples="
                           f"{bound}; its claim is refused" for n in (-250, 0)]  # fmt: skip
    assert re.fullmatch(r"site 1: node \d+ claims it (while node \d+ serves it|without the token it presented at "
                        r"start-up)", claimed[0]), claimed[0]  # fmt: skip
    for k in range(SITES, SITES + len(late)):  # each late node: asked which site it serves (again, if its answer
        log = (work / f"supernode-{k}.log").read_text()  # came after the server stopped waiting), then sent nothing
        assert log.count("Receiving: ") == log.count("Receiving: query message") >= 1, k
    # the run in which site 2's replies were lost, in this process: the same honest sites' states, bit for bit
    client.algorithm.cache_clear()
    lost = {k: tmp_path / f"lost-{k}-states" for k in range(SITES)}
    grid = _Lost(partitions=SITES, node_configs={k: {"data": str(d), "state-dir": str(lost[k])}
                                                  for k, d in enumerate(dirs)})  # fmt: skip
    baseline = run_sites(cfg, grid)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["failed_clients"] for r in records] == [{"1": [2], "2": [2]}, {"3": [2], "4": [2]}]
    assert records == baseline.history[:2]  # round 5's record is the evaluation refused
    for k in range(SITES):
        if k == ATTACKER:
            continue
        deployed, expected = _pt_files(work / f"site-{k}-states"), _pt_files(lost[k])
        assert sorted(deployed) == sorted(expected) and any("round-5.pt" in p for p in deployed), (deployed, expected)
        for path, tensors in expected.items():
            assert tensors.keys() == deployed[path].keys()
            assert all(torch.equal(tensors[t], deployed[path][t]) for t in tensors), path
    last = load_checkpoint(out)  # round 4: round 5's evaluation stopped it
    versions = {c: int(s["site.version"]) for c, s in last["clients"].items()}
    assert last["round"] == 4 and versions == {0: 4, 1: 4}  # client 2's state: never accepted


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-0")
def test_a_site_claiming_a_count_out_of_bounds_at_start_up_stops_the_run_before_any_work(tmp_path, deployment_mark):
    """Site 2 reports 10¹⁵ training samples for its client — its weight in every mean, which would make the model
    its reply: the ServerApp stops at start-up with one line naming the site and the bound, before any round."""
    dirs = export_sites(load_config(None, SETS), tmp_path / "sites")
    cfg = _site_local(dirs)
    out, work = tmp_path / "run", tmp_path / "flower"
    nodes = [{"partition-id": k, "num-partitions": SITES, "data": str(d), "state-dir": str(work / f"site-{k}-states")}
             for k, d in enumerate(dirs)]  # fmt: skip
    nodes[ATTACKER] |= {"attack": "counts", "claim": 10**15}
    app = write_attack_app(tmp_path / "app", cfg, out, clientapp="malicious_site")
    deploy(work, app, nodes)
    assert not (left := marked_processes(deployment_mark)), left
    assert failure_reason(work / "run.log") == (
        "pflbed.flower.sites.SiteError: site 2: num_train[0]=1000000000000000; a count is an integer from 1 to "
        f"sites.max_client_samples={cfg.sites.max_client_samples}"
    ), (work / "run.log").read_text()[-3000:]
    assert not (out / "checkpoints").exists()
    for k in range(SITES):  # asked the start-up question, then nothing: no site did any work
        log = (work / f"supernode-{k}.log").read_text()
        assert log.count("Receiving: ") == log.count("Receiving: query message") >= 1, k
