"""pflbed on Flower's simulation runtime (`executor.name: flower`) gives the loop executor's results, bit for bit.

One simulation (`FlowerSimulation`, started once for the module) serves every experiment here: starting Flower's
runtime and Ray costs seconds.
"""

import json
import logging
import subprocess
import sys
import tomllib

import pytest
import torch

from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError
from pflbed.federation import sample_clients
from pflbed.results.experiment import run

from ..tiny import PARITY_CASES, TINY, loop_run, parity_config
from ..tiny import figures as _figures
from ..tiny import same_tensors as _same
from .processes import marked_processes

flwr = pytest.importorskip("flwr")  # the `flower` extra; CI installs it, so these tests run there

from pflbed.algorithms.training import WeightedMean  # noqa: E402
from pflbed.engine.executor import update_client  # noqa: E402
from pflbed.flower import client  # noqa: E402
from pflbed.flower.executor import FlowerClientError, FlowerRoundError  # noqa: E402
from pflbed.flower.simulation import FlowerSimulation, simulate  # noqa: E402

from ..fake_flower import FakeGrid, FakeSimulation, ticking_time  # noqa: E402


@pytest.fixture(scope="module")
def sim():
    with FlowerSimulation(supernodes=3, workers=2) as s:
        yield s


@pytest.mark.xdist_group("flower-simulation")  # one Ray runtime (`sim`) for them all
@pytest.mark.parametrize("name", PARITY_CASES)
def test_flower_simulation_equals_loop_bit_for_bit(name, sim):
    """Same summary, server state and client states as `loop` at one thread per process: the ClientApp runs the
    loop's own `update_client` on what crossed as Flower records (NumPy arrays: exact for every dtype used)."""
    torch.set_num_threads(1)
    loop = loop_run(name)
    flower = run(parity_config(name, {"name": "flower", "threads": 1}), write=False, progress=False, simulation=sim)
    assert _figures(flower.summary) == _figures(loop.summary)
    assert _same(flower.server, loop.server)
    assert all(_same(flower.executor.states[c], loop.executor.states[c]) for c in loop.executor.states)


def _fedavg(**train):
    return parity_config("fedavg", {"name": "flower", "threads": 1}, **train)


def test_lost_clients_are_left_out_and_the_mean_is_over_those_that_replied(monkeypatch):
    """Rule (driver.train_round): a round whose client 2 is lost aggregates the others' replies with their own
    weights renormalized (Σ over repliers), keeps client 2's state as it was, and the next record lists it. The
    server's seconds count the round's messages, its wait and each reply taken (its clock here ticks one second a
    reading)."""
    from pflbed.flower import executor

    monkeypatch.setattr(executor, "time", ticking_time())
    torch.set_num_threads(1)
    cfg = _fedavg(rounds=1)
    cids = sample_clients(cfg.seed, 1, list(range(6)), cfg.federation.sample_fraction)
    lost = cids[1]
    got = run(cfg, write=False, progress=False, simulation=FakeSimulation(FakeGrid(lost={1: [lost]})))
    algo = prepare(cfg)
    server = algo.init_server()
    payloads = algo.configure(1, server, cids)
    mean = WeightedMean({c: algo.ctx.federation.num_train(c) for c in cids if c != lost})
    for c in cids:
        if c != lost:
            mean.add(c, update_client(algo, 1, c, payloads[c], algo.init_client(c))[0])
    assert _same(got.server, mean.result())
    assert got.history[-1]["failed_clients"] == {"1": [lost]}
    assert got.executor.timing["server_records_s"] == 1 + len(cids) - 1 and got.executor.timing["wait_s"] == 1
    assert lost not in got.executor.states or _same(got.executor.states[lost], algo.init_client(lost))
    full = run(parity_config("fedavg", {"threads": 1}, rounds=1), write=False, progress=False)
    assert not _same(got.server, full.server)  # losing a client changes the round (the test can fail)
    assert "failed_clients" not in full.history[-1]


def test_failures_are_listed_per_round_until_the_next_record():
    cfg = _fedavg(rounds=3)  # evaluated at rounds 2 and 3
    r1 = sample_clients(cfg.seed, 1, list(range(6)), cfg.federation.sample_fraction)
    r3 = sample_clients(cfg.seed, 3, list(range(6)), cfg.federation.sample_fraction)
    got = run(cfg, write=False, progress=False, simulation=FakeSimulation(FakeGrid(lost={1: r1[:1], 3: r3[1:2]})))
    assert [h.get("failed_clients") for h in got.history] == [{"1": r1[:1]}, {"3": r3[1:2]}]


def test_a_round_without_any_reply_stops_the_run():
    cfg = _fedavg(rounds=1)
    cids = sample_clients(cfg.seed, 1, list(range(6)), cfg.federation.sample_fraction)
    with pytest.raises(FlowerRoundError, match="round 1: no client replied"):
        run(cfg, write=False, progress=False, simulation=FakeSimulation(FakeGrid(lost={1: cids})))


def test_an_exception_in_a_client_update_stops_the_run_with_its_traceback(monkeypatch):
    """A bug is not a lost node: the run stops and says which client failed and where."""

    def broken(algo, rnd, cid, payload, state):
        raise ValueError(f"broken update of client {cid}")

    monkeypatch.setattr(client, "update_client", broken)
    with pytest.raises(FlowerClientError, match=r"(?s)clients \[\d+\] \(round 1\):.*ValueError: broken update"):
        run(_fedavg(rounds=1), write=False, progress=False, simulation=FakeSimulation(FakeGrid()))


@pytest.mark.parametrize("what", ["reply", "state"])
def test_a_client_s_non_finite_reply_or_state_stops_the_run_as_diverged_naming_round_and_client(what, monkeypatch):
    """The nodes run the server's own clients, and their states come back to the server: a NaN in one's reply or
    new state in round 2 stops the run as a diverged one, naming the round, the client and the entry."""
    from pflbed.errors import DivergedError

    cfg = parity_config("fedper", {"name": "flower", "threads": 1}, rounds=2)  # FedPer: the head is a state
    first = sample_clients(cfg.seed, 2, list(range(6)), cfg.federation.sample_fraction)[0]
    real = client.update_client

    def nan(algo, rnd, cid, payload, state):
        reply, new = real(algo, rnd, cid, payload, state)
        if (rnd, cid) == (2, first):
            bad = reply if what == "reply" else new
            key = sorted(bad)[0]
            bad[key] = torch.full_like(bad[key], float("nan"))
        return reply, new

    monkeypatch.setattr(client, "update_client", nan)
    with pytest.raises(DivergedError, match=rf"^diverged in round 2: client {first}'s {what} has non-finite values "
                                            r"in '[^']+' — lower train.lr"):  # fmt: skip
        run(cfg, write=False, progress=False, simulation=FakeSimulation(FakeGrid()))


def test_nodes_must_serve_one_complete_set_of_partitions(monkeypatch):
    grid = FakeGrid(partitions=3)
    grid.nodes = grid.nodes[:2]  # partition 2's node never connects
    monkeypatch.setattr("pflbed.flower.executor.time.sleep", lambda s: None)
    monkeypatch.setattr("pflbed.flower.executor.time.monotonic", iter(range(0, 10**6, 100)).__next__)
    with pytest.raises(FlowerRoundError, match=r"^after 120 s, SuperNodes serve partitions \[0, 1\] of \[3\]: some "
                                               r"nodes are missing$"):  # fmt: skip
        run(_fedavg(rounds=1), write=False, progress=False, simulation=FakeSimulation(grid))
    grid.nodes = []  # no node at all: nothing says how many partitions there are
    with pytest.raises(FlowerRoundError, match=r"^after 120 s, SuperNodes serve partitions \[\] of an unknown number: "
                                               r"some nodes are missing$"):  # fmt: skip
        run(_fedavg(rounds=1), write=False, progress=False, simulation=FakeSimulation(grid))


def test_a_node_connecting_while_the_server_starts_is_waited_for(monkeypatch):
    """Nodes connect while the ServerApp starts: the server asks again (0.2 s apart) until every partition is
    served, then runs as with every node there from the start."""
    grid = FakeGrid(partitions=3)
    every, calls, real = list(grid.nodes), [], grid.get_node_ids
    grid.nodes = every[:2]

    def connecting():
        calls.append(len(grid.nodes))
        if len(calls) == 3:
            grid.nodes = every
        return real()

    monkeypatch.setattr(grid, "get_node_ids", connecting)
    late = run(_fedavg(rounds=1), write=False, progress=False, simulation=FakeSimulation(grid))
    assert calls[:3] == [2, 2, 2] and late.summary["final"] == run(
        _fedavg(rounds=1), write=False, progress=False, simulation=FakeSimulation(FakeGrid(partitions=3))
    ).summary["final"]


def test_nodes_that_answer_a_state_read_without_the_states_stop_the_run(tmp_path):
    """With the states on the nodes, the server reads them to evaluate; a node whose answer lacks a state asked for
    stops the run naming the clients, not later as a missing key."""
    grid = FakeGrid()
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        replies = real(msgs, timeout)
        for m, r in zip(msgs, replies, strict=True):
            if m.metadata.group_id == "states" and not r.has_error():
                for key in list(r.content.array_records):
                    r.content.pop(key)
        return replies

    grid.send_and_receive = send
    cfg = parity_config("fedper", {"name": "flower", "threads": 1, "state_dir": str(tmp_path)}, rounds=1)
    with pytest.raises(FlowerRoundError, match=r"^the nodes holding the states of clients \[\d+(, \d+)*\] did not "
                                               r"answer$"):  # fmt: skip
        run(cfg, write=False, progress=False, simulation=FakeSimulation(grid))


def test_nodes_connecting_up_to_the_start_s_deadline_are_waited_for(monkeypatch):
    """Nodes connect while the ServerApp starts: the server asks again until every partition is served, up to
    120 s; a node connecting at exactly 120 s is still taken (the clock ticks 60 s per reading here)."""
    grid = FakeGrid(partitions=3)
    calls = []
    everyone = grid.get_node_ids

    def late():
        calls.append(1)
        return everyone() if len(calls) >= 3 else everyone()[:2]

    grid.get_node_ids = late
    monkeypatch.setattr("pflbed.flower.executor.time.sleep", lambda s: None)
    monkeypatch.setattr("pflbed.flower.executor.time.monotonic", iter(range(0, 10**6, 60)).__next__)
    got = run(_fedavg(rounds=1), write=False, progress=False, simulation=FakeSimulation(grid))
    assert got is not None and len(calls) >= 3


def test_nodes_that_disagree_on_the_number_of_partitions_stop_the_run():
    grid = FakeGrid(partitions=3, node_configs={1: {client.PARTITIONS: 4}})
    with pytest.raises(FlowerRoundError, match=r"^the SuperNodes disagree on the number of partitions: \[3, 4\]$"):
        run(_fedavg(rounds=1), write=False, progress=False, simulation=FakeSimulation(grid))


def test_each_node_is_asked_its_partition_once():
    """The partition question goes to each node once (a node that restarts is a new node and is asked too), not
    before every round."""
    grid = FakeGrid(partitions=3, restart={3: [1]})
    asked = []
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        asked.extend(m.metadata.dst_node_id for m in msgs if m.metadata.group_id == "partitions")
        return real(msgs, timeout)

    grid.send_and_receive = send
    run(_fedavg(rounds=4), write=False, progress=False, simulation=FakeSimulation(grid))
    assert sorted(asked) == [1000, 1001, 1002, 1003]  # partition 1's node restarted as node 1003 before round 3


def test_the_partition_question_waits_a_finite_time_and_a_round_its_timeout(tmp_path):
    """The partition question waits a finite time for its nodes (Flower's Grid waits forever on `timeout=None`: a
    node that connected but never answers would hold the server's start); a round's work, and the reads of states
    kept on the nodes, wait `executor.round_timeout`."""
    grid, waits = FakeGrid(), []
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        waits.extend((m.metadata.group_id, timeout) for m in msgs)
        return real(msgs, timeout)

    grid.send_and_receive = send
    cfg = parity_config("fedper", {"name": "flower", "threads": 1, "round_timeout": 50.0,
                                   "state_dir": str(tmp_path)}, rounds=1)  # fmt: skip
    run(cfg, write=False, progress=False, simulation=FakeSimulation(grid))
    asked = {group: {t for g, t in waits if g == group} for group, _ in waits}
    assert set(asked) == {"partitions", "1", "states"} and asked["1"] == asked["states"] == {50.0}, waits
    assert all(t is not None and 0 < t <= 120 for t in asked["partitions"]), waits


def test_clientapps_ask_ray_for_a_share_of_the_gpu_only_for_a_gpu_run(monkeypatch):
    """Ray sets CUDA_VISIBLE_DEVICES to empty in a worker that asks for no GPU, so a GPU run's ClientApps each ask
    for 1 / workers of it; a CPU run's ask for none. A simulation serves only runs on its kind of device."""
    backends = []
    monkeypatch.setattr("pflbed.flower.simulation.run_simulation", lambda **kw: backends.append(kw["backend_config"]))
    for gpu, share in ((True, 1 / 3), (False, 0.0)):
        with FlowerSimulation(supernodes=4, workers=3, gpu=gpu) as s:
            s.thread.join()
        assert backends.pop()["client_resources"] == {"num_cpus": 1, "num_gpus": share}
    gpu_sim = FlowerSimulation.__new__(FlowerSimulation)  # not started: the check comes first
    gpu_sim.gpu_share = 0.5
    with pytest.raises(ValueError, match="gpu=True cannot serve a run on cpu"):
        simulate(prepare(_fedavg(rounds=1)), lambda ex: None, gpu_sim)


def test_a_simulation_whose_runtime_stopped_says_why_instead_of_waiting_for_it(monkeypatch):
    def stops(**kw):
        raise RuntimeError("Ray could not start")

    monkeypatch.setattr("pflbed.flower.simulation.run_simulation", stops)
    with FlowerSimulation(supernodes=2, workers=1) as sim:
        sim.thread.join()
        with pytest.raises(RuntimeError, match=r"^the Flower simulation stopped: RuntimeError\('Ray could not "
                                               r"start'\)$"):  # fmt: skip
            sim.run(_standing_in("cpu"), lambda ex: None)


def test_a_simulation_left_open_does_not_keep_python_from_exiting():
    """A program that never closes its simulation (an error before `close`, no `with`) still ends: the thread
    serving it is a daemon. Here the runtime never returns, as a running one does not."""
    code = ("import threading, pflbed.flower.simulation as s\n"
            "s.run_simulation = lambda **kw: threading.Event().wait()\n"
            "s.FlowerSimulation(supernodes=2, workers=1)\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _standing_in(device: str):
    """An algorithm as `simulate` reads it: its device, config and clients (6), on a device it need not have."""
    from types import SimpleNamespace

    return SimpleNamespace(ctx=SimpleNamespace(device=torch.device(device), cfg=_fedavg(rounds=1),
                                               federation=SimpleNamespace(clients=list(range(6)))))  # fmt: skip


class _Served:
    """A running simulation as `simulate` uses it: `run` records what it was handed. `gpu_share` as the real one's,
    or absent (any object with `run`: then a CPU simulation)."""

    def __init__(self, *share: float):
        if share:
            self.gpu_share = share[0]
        self.handed = None

    def run(self, algo, experiment):
        self.handed = (algo, experiment)
        return "value"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("share", [(), (0.0,), (0.5,)])
def test_a_simulation_serves_only_runs_on_its_kind_of_device_and_is_handed_the_run_s_own(device, share):
    sim, algo = _Served(*share), _standing_in(device)
    experiment = lambda ex: None  # noqa: E731
    gpu = bool(share) and share[0] > 0
    if gpu == (device == "cuda"):
        assert simulate(algo, experiment, sim) == "value" and sim.handed == (algo, experiment)
    else:
        with pytest.raises(ValueError, match=f"^a Flower simulation started with gpu={gpu} cannot serve a run on "
                                             f"{device}$"):  # fmt: skip
            simulate(algo, experiment, sim)
        assert sim.handed is None


@pytest.mark.parametrize(("workers", "cores", "used"), [
    (None, 8, 4), (None, 2, 2), (None, None, 1), (3, 8, 3), (9, 1, 4), (0, 3, 3),
])  # fmt: skip
def test_a_simulation_runs_a_clientapp_process_per_worker_asked_else_per_core_never_more_than_supernodes(
        monkeypatch, workers, cores, used):
    """`executor.workers` ClientApp processes (unset or 0: one per core; a machine that cannot tell its cores: 1),
    never more than SuperNodes (4 here): Ray is started with that many CPUs, each ClientApp asking for one."""
    backends = []
    monkeypatch.setattr("pflbed.flower.simulation.run_simulation", lambda **kw: backends.append(kw))
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    with FlowerSimulation(supernodes=4, workers=workers) as s:
        s.thread.join()
    (kw,) = backends
    assert (s.workers, kw["num_supernodes"]) == (used, 4)
    # Ray with no dashboard (no port, no process of its own) and the ClientApps' output kept out of the terminal
    assert kw["backend_config"]["init_args"] == {"num_cpus": used, "include_dashboard": False, "log_to_driver": False,
                                                 "logging_level": logging.ERROR}  # fmt: skip
    assert kw["backend_config"]["client_resources"] == {"num_cpus": 1, "num_gpus": 0.0}  # no GPU unless asked
    assert kw["client_app"] is client.app


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(("supernodes", "workers", "expected"), [(None, None, (6, None)), (2, 3, (2, 3))])
def test_a_run_without_a_simulation_starts_one_of_its_config_s_size_and_device_and_closes_it(
        monkeypatch, supernodes, workers, expected, device):
    """`executor.supernodes` SuperNodes (unset: one per client, 6 here), `executor.workers` ClientApp processes, and
    a share of the GPU for a GPU run; it serves the run, its value comes back, and it is closed after it."""
    started = []

    class Recorded:
        def __init__(self, supernodes, workers, gpu):
            started.append(self)
            self.args, self.closed = (supernodes, workers, gpu), False

        def run(self, algo, experiment):
            self.algo = algo
            return experiment("executor")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.closed = True

    monkeypatch.setattr("pflbed.flower.simulation.FlowerSimulation", Recorded)
    algo = _standing_in(device)
    algo.ctx.cfg = parity_config("fedavg", {"name": "flower", "threads": 1, "supernodes": supernodes,
                                            "workers": workers})  # fmt: skip
    assert simulate(algo, lambda ex: (ex, "value")) == ("executor", "value")
    (sim,) = started
    assert (sim.args, sim.closed, sim.algo) == ((*expected, device == "cuda"), True, algo)


def test_flower_s_notice_that_run_simulation_is_deprecated_is_left_out_and_nothing_else(monkeypatch):
    """Every simulation start would print it (pflbed needs the in-process entry point); Flower's other deprecation
    notices and lines still show. Logged with Flower's own functions, so a change of their wording shows here."""
    from flwr.supercore.logger import FLOWER_LOGGER, log, warn_deprecated_feature

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage().split("\n")[0])
    FLOWER_LOGGER.addHandler(handler)
    try:
        warn_deprecated_feature("The `run_simulation` function is deprecated and will be removed")
        warn_deprecated_feature("Passing `enable_tf_gpu_growth=True` is deprecated.")
        log(logging.INFO, "Starting Flower simulation: `run_simulation` called")
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    assert seen == ["DEPRECATED FEATURE: Passing `enable_tf_gpu_growth=True` is deprecated.",
                    "Starting Flower simulation: `run_simulation` called"]


def test_flower_options_need_the_flower_executor_and_the_extra(monkeypatch):
    for key, value in (("supernodes", 2), ("round_timeout", 5.0), ("state_dir", "states")):
        with pytest.raises(ConfigError, match=f"{key} applies to executor.name=flower"):
            validate_config({**TINY, "executor": {key: value}})
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "flwr" else object())
    with pytest.raises(ConfigError, match=r"needs the flower extra: pip install 'pflbed\[flower\]'"):
        validate_config({**TINY, "executor": {"name": "flower"}})


@pytest.mark.deployment
@pytest.mark.xdist_group("deployments-0")
def test_local_deployment_with_tls_auth_and_node_states_equals_loop_and_leaves_no_process(tmp_path, deployment_mark):
    """`pflbed flower local --tls --auth` with states on the nodes: a real SuperLink and 2 SuperNodes (separate
    processes, TLS with a generated CA, registered node keys, client states in files on the nodes) give the loop's
    summary, write the usual run directory, and every process they started is gone afterwards."""
    from pflbed.cli import main

    torch.set_num_threads(1)
    out, states = tmp_path / "run", tmp_path / "states"
    sets = ["dataset.name=synthetic", "model.name=mlp", "federation.clients=6", "federation.partition=dirichlet",
            "federation.alpha=1.0", "federation.sample_fraction=0.5", "train.rounds=2", "train.batch_size=16",
            "train.lr=0.1", "eval.every=2", "eval.finetune=[]", "executor.threads=1", "algorithm.name=fedper",
            f"executor.state_dir={states}"]  # fmt: skip
    args = ["flower", "local", "--supernodes", "2", "--tls", "--auth", "--out", str(out)]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    assert not (left := marked_processes(deployment_mark)), left  # every process it started is gone
    assert (out / "config.yaml").exists() and (out / "metrics.jsonl").exists()
    assert "https://" in (out / "flower" / "superlink.log").read_text()  # TLS was on
    assert (out / "flower" / "register.log").read_text().count("registered successfully") == 2  # both node keys
    assert len(list(states.glob("*/client-*/round-*.pt"))) >= 3  # the sampled clients' states, on the nodes
    cfg = validate_config({**TINY, "train": {**TINY["train"], "rounds": 2}, "algorithm": {"name": "fedper"},
                           "executor": {"threads": 1}})  # fmt: skip
    loop = run(cfg, write=False, progress=False)
    assert _figures(json.loads((out / "summary.json").read_text())) == _figures(json.loads(json.dumps(loop.summary)))


def test_flower_app_replaces_a_project_only_when_forced_and_never_another_project_s(tmp_path, capsys):
    """`flower app --out DIR` wrote over whatever pyproject.toml DIR held: `--out .` in a user's own repository
    replaced theirs, and a second project replaced the first (and a site's filled-in site.toml) unasked. Now an
    earlier pflbed project goes only with --force, with its site.toml when the new one has none; another project's
    pyproject.toml (or one that is no TOML) never; other files stay."""
    from pflbed.cli import main

    def refused(out, *flags, message):
        assert main(["flower", "app", "--out", str(out), *flags]) == 2
        assert capsys.readouterr().err == f"pflbed: error: --out {out}: {message}\n"

    app, local = tmp_path / "app", ["--set", "sites.local=true", "--set", "sites.input_shape=[1,8,8]", "--set",
                                    "sites.num_classes=10", "--set", "federation.clients=3"]  # fmt: skip
    assert main(["flower", "app", "--out", str(app), *local]) == 0
    (app / "notes.md").write_text("mine")
    first = {name: (app / name).read_text() for name in ("pyproject.toml", "site.toml")}
    refused(app, message="holds a Flower app project already (pyproject.toml, site.toml); --force replaces it")
    assert {name: (app / name).read_text() for name in first} == first
    (app / "pyproject.toml").unlink()
    refused(app, message="holds a Flower app project already (site.toml); --force replaces it")
    assert main(["flower", "app", "--out", str(app), "--set", "seed=3", "--force"]) == 0
    assert sorted(p.name for p in app.iterdir()) == ["notes.md", "pyproject.toml"]  # no stale site.toml
    assert '\\"seed\\": 3' in (app / "pyproject.toml").read_text()
    for text in ('[project]\nname = "theirs"\n', "not [[ toml", '[tool.flwr.app.components]\nserverapp = "x:app"\n',
                 "tool = 1\n", '[tool.flwr.app]\ncomponents = "pflbed.flower.server:app"\n'):
        (app / "pyproject.toml").write_text(text)
        for flags in ((), ("--force",)):
            refused(app, *flags, message="holds the pyproject.toml of another project; choose another --out")
        assert (app / "pyproject.toml").read_text() == text
    (tmp_path / "file").write_text("mine")
    refused(tmp_path / "file", "--force", message="is a file; give the directory to write the project into")
    assert (tmp_path / "file").read_text() == "mine"
    refused(tmp_path / "file" / "under", message=f"{tmp_path / 'file'} is a file, not a directory")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")  # its pyproject.toml went among a run's files
    refused(tmp_path / "run", "--force", message="is a run's or a pretrained model's directory; write the project "
                                                 "elsewhere")  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml"]
    from pflbed.config import validate_config
    from pflbed.errors import PflbedError
    from pflbed.flower.project import write_app

    cfg = validate_config({"executor": {"name": "flower"}})
    write_app(tmp_path / "api", cfg, tmp_path / "run")
    with pytest.raises(PflbedError, match="holds a Flower app project already"):  # the API asks for force too
        write_app(tmp_path / "api", cfg, tmp_path / "run")


def test_flower_app_writes_a_project_flower_accepts(tmp_path, capsys):
    from flwr.common.config import validate_config as flwr_validate

    from pflbed.cli import main

    app = tmp_path / "projects" / "app"  # its parent made too
    (tmp_path / "c.yaml").write_text("train: {rounds: 5, local_epochs: 2}\n")  # --set wins over the file
    assert main(["flower", "app", "-c", str(tmp_path / "c.yaml"), "--out", str(app), "--set", "train.rounds=3"]) == 0
    assert capsys.readouterr().out == f"Flower app project: {app}/pyproject.toml (docs/guide/flower.md)\n"
    conf = tomllib.loads((app / "pyproject.toml").read_text())
    ok, errors, _ = flwr_validate(conf, check_module=True, project_dir=app)
    assert ok, errors
    assert conf["project"]["description"] == "A pflbed experiment (fedavg on digits, seed 0) as a Flower app"
    run_config = conf["tool"]["flwr"]["app"]["config"]
    pflbed_cfg = json.loads(run_config["config"])
    assert pflbed_cfg["train"]["rounds"] == 3 and pflbed_cfg["executor"]["name"] == "flower"
    assert pflbed_cfg["train"]["local_epochs"] == 2
    assert run_config["out"] == "runs/fedavg-digits-seed0" and run_config["resume"] is False
    assert not (app / "site.toml").exists()  # the data is the server's: no site config
    capsys.readouterr()
    assert main(["flower", "app", "--out", str(app), "--run-dir", str(tmp_path / "r"), "--set", "seed=2",
                 "--force"]) == 0  # fmt: skip
    run_config = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert run_config["out"] == str(tmp_path / "r") and json.loads(run_config["config"])["seed"] == 2
