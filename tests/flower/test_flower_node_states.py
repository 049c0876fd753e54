"""Client states kept on the SuperNodes (`executor.state_dir`, `flower/node_states.py`): the loop's results, a node
that restarts continues its clients, a late reply's state is not used, and a resumed run re-sends what it holds."""

import pytest
import torch

from pflbed.federation import sample_clients
from pflbed.results.experiment import run

from ..tiny import PARITY_CASES, figures, loop_run, parity_config, same_tensors

flwr = pytest.importorskip("flwr")  # the `flower` extra; CI installs it

from pflbed.flower.executor import FlowerRoundError  # noqa: E402
from pflbed.flower.node_states import NodeStates  # noqa: E402
from pflbed.flower.project import config_json  # noqa: E402

from ..fake_flower import FakeGrid, FakeSimulation  # noqa: E402


def _flower(name, state_dir, **train):
    executor = {"name": "flower", "threads": 1} | ({"state_dir": str(state_dir)} if state_dir else {})
    return parity_config(name, executor, **train)


def _loop(name, **train):
    return loop_run(name, **train)


@pytest.mark.parametrize("name", PARITY_CASES)
def test_states_on_nodes_equal_loop_and_are_on_disk(name, tmp_path):
    """Same summary and server state as `loop`; the states are files on the nodes, equal to the loop's."""
    torch.set_num_threads(1)
    cfg = _flower(name, tmp_path)
    got = run(cfg, write=False, progress=False, simulation=FakeSimulation(FakeGrid()))
    loop = _loop(name)
    assert figures(got.summary) == figures(loop.summary)
    assert same_tensors(got.server, loop.server)
    disk = NodeStates(tmp_path, config_json(cfg), None)
    trained = {int(d.name.split("-")[1]): sorted(d.glob("round-*.pt"), key=lambda p: int(p.stem[6:]))
               for d in disk.dir.glob("client-*")}  # fmt: skip
    assert trained and all(1 <= len(v) <= 2 for v in trained.values())  # the last two versions at most
    for cid, versions in trained.items():
        assert same_tensors(torch.load(versions[-1], weights_only=True), loop.executor.states[cid])


@pytest.mark.parametrize("on_nodes", [False, True], ids=["states-on-server", "states-on-nodes"])
def test_a_restarted_node_serves_its_partition_again_and_continues(on_nodes, tmp_path):
    """Nodes of partitions 0-2 restart after round 2 (new node ids, nothing in memory): the server finds them
    again and the run equals loop — with states on the nodes, read back from their files."""
    torch.set_num_threads(1)
    grid = FakeGrid(restart={3: [0, 1, 2]})
    got = run(_flower("fedper", tmp_path if on_nodes else None), write=False, progress=False,
              simulation=FakeSimulation(grid))  # fmt: skip
    assert grid.nodes[:3] != [1000, 1001, 1002]  # the restarts happened
    loop = _loop("fedper")
    assert figures(got.summary) == figures(loop.summary)
    assert all("failed_clients" not in h for h in got.history)


def test_a_late_reply_is_dropped_with_the_state_its_node_wrote(tmp_path):
    """A node that replies after the round timeout has already written the client's new state; the server, which
    dropped the reply, expects the previous one (a client trained before and after: its node must still have
    it): the run equals one where that client was lost outright."""
    torch.set_num_threads(1)
    cfg = _flower("fedper", tmp_path)
    sampled = {r: sample_clients(cfg.seed, r, list(range(6)), cfg.federation.sample_fraction) for r in (1, 2, 3, 4)}
    rnd, cid = next((r, c) for r in (2, 3) for c in sampled[r] if c in sampled[r - 1] and c in sampled[r + 1])
    lost = {rnd: [cid]}
    late = run(cfg, write=False, progress=False, simulation=FakeSimulation(FakeGrid(late=lost)))
    gone = run(_flower("fedper", None), write=False, progress=False, simulation=FakeSimulation(FakeGrid(lost=lost)))
    assert {str(rnd): [cid]} in [h.get("failed_clients") for h in late.history]
    assert figures(late.summary) == figures(gone.summary)
    assert same_tensors(late.server, gone.server)


def test_a_node_that_lost_its_state_directory_stops_the_run_with_a_clear_message(tmp_path):
    import shutil

    grid = FakeGrid()
    real = grid.send_and_receive

    def wipe_after_round_2(msgs, timeout=None):
        if grid.trained == 2:
            shutil.rmtree(tmp_path, ignore_errors=True)
        return real(msgs, timeout)

    grid.send_and_receive = wipe_after_round_2
    lost = (r"node \d+: .*MissingStateError: client \d+'s state of round 2 is not in this node's state directory "
            r"\(was it lost or changed\?\)$")
    with pytest.raises(FlowerRoundError, match=lost):
        run(_flower("fedper", tmp_path), write=False, progress=False, simulation=FakeSimulation(grid))


def test_a_resumed_run_sends_the_states_it_holds(tmp_path, monkeypatch):
    """Killed after round 1's checkpoint; the nodes lose their state directory; resumed, the server sends each
    client the checkpoint's state with its next work, and only then (a client of the checkpoint trains twice in
    rounds 2 to 4: its second round starts from the state its node kept), and the run ends as an uninterrupted
    loop run."""
    import shutil

    import pflbed.results.experiment as experiment_mod

    torch.set_num_threads(1)
    states = tmp_path / "states"
    cfg = _flower("fedper", states, checkpoint_every=1)
    sampled = {r: set(sample_clients(cfg.seed, r, list(range(6)), cfg.federation.sample_fraction)) for r in range(1, 5)}
    again = sampled[1] & (sampled[2] | sampled[3] | sampled[4])  # in the checkpoint (trained), and trained again
    assert any(sum(c in sampled[r] for r in (2, 3, 4)) > 1 for c in again)
    real_save = experiment_mod.save_checkpoint

    def save_then_die(path, rnd, *a, **k):
        real_save(path, rnd, *a, **k)
        if rnd == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(experiment_mod, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path / "run", progress=False, simulation=FakeSimulation(FakeGrid()))
    monkeypatch.setattr(experiment_mod, "save_checkpoint", real_save)
    shutil.rmtree(states)
    grid, sent = FakeGrid(), []
    real = grid.send_and_receive

    def watched(msgs, timeout=None):
        sent.extend(k for m in msgs if m.metadata.message_type == "train" for k in m.content.array_records
                    if k.startswith("state/"))  # fmt: skip
        return real(msgs, timeout)

    grid.send_and_receive = watched
    got = run(cfg, tmp_path / "run", progress=False, resume=True, simulation=FakeSimulation(grid))
    assert figures(got.summary) == figures(_loop("fedper").summary)
    assert len(sent) == len(set(sent)) and {f"state/{c}" for c in again} <= set(sent)  # once, then the node's own


def test_a_node_keeps_its_states_where_its_node_config_says_else_where_the_config_does(tmp_path):
    """`state-dir` in a node's config wins over `executor.state_dir` (each node its own disk); without either the
    states travel with the messages."""
    from flwr.app import Context, RecordDict

    from pflbed.config import validate_config
    from pflbed.engine.build import prepare
    from pflbed.flower import client

    from ..tiny import TINY

    def context(node_config):
        return Context(run_id=1, node_id=1, state=RecordDict(), run_config={}, node_config=node_config)

    cfg = validate_config({**TINY, "executor": {"name": "flower", "state_dir": str(tmp_path / "run")}})
    algo, cj = prepare(cfg, threads=1), config_json(cfg)
    assert client.node_states(context({"state-dir": str(tmp_path / "node")}), cj, algo).dir.parent == tmp_path / "node"
    assert client.node_states(context({}), cj, algo).dir.parent == tmp_path / "run"
    plain = validate_config({**TINY, "executor": {"name": "flower"}})
    assert client.node_states(context({"state-dir": str(tmp_path / "node")}), config_json(plain),
                              prepare(plain, threads=1)) is None  # fmt: skip
