"""The round driver (engine/driver.py): whose replies a round aggregates and with which weights, a round that
samples no one, what the algorithm is told, on what and by whom a round is scored, and what a record counts under DP
(releases, replays, ε). The rounds' results end to end are every algorithm's tests; these pin the driver's own
rules, with an executor that can lose clients as a Flower deployment does."""

import copy
import re
import time
import types

import numpy as np
import pytest
import torch

from pflbed import privacy, rng
from pflbed.algorithms.training import weighted_mean
from pflbed.config import validate_config
from pflbed.engine import build, wire
from pflbed.engine import driver as driver_module
from pflbed.engine.build import prepare
from pflbed.engine.driver import Driver
from pflbed.engine.executor import LoopExecutor
from pflbed.errors import DivergedError, PflbedError
from pflbed.results import experiment as runner

from ..tiny import TINY

DP = {"clip": 0.5, "noise_multiplier": 0.8}


def _cfg(rounds=3, privacy=None, test_subsample=None, **federation):
    """FedAvg on the tiny federation, every client sampled, scored every 2 rounds (no fine-tuning stage)."""
    return validate_config({**TINY, "algorithm": {"name": "fedavg"}, "train": {**TINY["train"], "rounds": rounds},
                            "federation": {**TINY["federation"], "sample_fraction": 1.0, **federation},
                            "eval": {**TINY["eval"], "every": 2, "finetune": [], "test_subsample": test_subsample},
                            **({"privacy": privacy} if privacy else {})})  # fmt: skip


class _Replies(list):
    """A round's replies with the clients that did not reply (`Executor.stream`'s `failed`)."""

    failed: list[int]


class _Losing(LoopExecutor):
    """The loop, except that in round r the clients `lost[r]` never reply (a node that died)."""

    def __init__(self, algo, lost: dict[int, list[int]]) -> None:
        super().__init__(algo)
        self.lost = lost
        self.asked: list[int] = []

    def stream(self, rnd, payloads):
        self.asked.append(rnd)
        lost = self.lost.get(rnd, [])
        out = _Replies(super().stream(rnd, {c: p for c, p in payloads.items() if c not in lost}))
        out.failed = [c for c in payloads if c in lost]
        return out


def test_lost_clients_are_left_out_of_the_weighted_mean_and_listed_once_in_the_next_record():
    """Rule (`Driver.train_round`): the server's mean is over the clients that replied, weighted by their training
    sizes |D_m|; the lost ones, per round, go into the next record's `failed_clients` and not into the one after;
    the uploaded bytes count the replies that came."""
    algo = prepare(_cfg())
    cids = list(algo.ctx.federation.participated)
    lost = {1: [cids[1]], 2: [cids[0], cids[2]]}
    driver = Driver(algo, _Losing(algo, lost))
    server = algo.init_server()

    reference = LoopExecutor(copy.deepcopy(algo))
    arrived = [c for c in cids if c not in lost[1]]
    replies = reference.run(1, {c: p for c, p in algo.configure(1, server, cids).items() if c in arrived})
    sizes = {c: algo.ctx.federation.num_train(c) for c in arrived}
    assert len(set(sizes.values())) > 1  # unequal sizes: the weights matter
    want = weighted_mean(replies, sizes)

    rounds = list(driver.rounds(server))
    got = rounds[0].server
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    reply_bytes = wire.num_bytes(next(iter(replies.values())))
    assert rounds[0].comm["up_bytes_per_round"] == len(arrived) * reply_bytes
    assert rounds[0].comm["down_bytes_per_round"] == len(cids) * reply_bytes  # every sampled client was sent one
    assert rounds[1].comm["up_bytes_per_round"] == (len(cids) - 2) * reply_bytes
    records = [r.record for r in rounds]
    assert records[0] is None  # scored every 2 rounds and after the last
    assert records[1]["failed_clients"] == {"1": lost[1], "2": lost[2]}
    assert "failed_clients" not in records[2]  # round 3 lost no one, and rounds 1–2 were listed already


def test_a_round_that_samples_no_one_keeps_the_server_and_asks_no_client():
    """Poisson sampling may draw no client: without DP the round leaves the server state as it was (nothing to
    average) and runs no client; the round's record still comes on schedule."""
    algo = prepare(_cfg(sampling="poisson", sample_fraction=1e-9))
    executor = _Losing(algo, {})
    server = algo.init_server()
    rounds = list(Driver(algo, executor).rounds(server))
    assert executor.asked == []
    for r in rounds:
        assert all(torch.equal(r.server[k], server[k]) for k in server)
        assert r.comm == {"up_bytes_per_round": 0, "down_bytes_per_round": 0}
    assert [r.rnd for r in rounds if r.record is not None] == [2, 3]


def test_the_rounds_number_reaches_configure_and_the_aggregator_and_each_phase_is_timed(monkeypatch):
    """Rounds-dependent rules (schedules, SCAFFOLD's and FedDyn's state, KT-pFL's coefficients) read the round they
    are told; a round's training and evaluation seconds are its own (within the whole call's)."""
    algo = prepare(_cfg())
    told = []
    configure, aggregator = algo.configure, algo.aggregator
    monkeypatch.setattr(algo, "configure", lambda rnd, *a: told.append(("configure", rnd)) or configure(rnd, *a))
    monkeypatch.setattr(algo, "aggregator", lambda rnd, *a: told.append(("aggregate", rnd)) or aggregator(rnd, *a))
    t0 = time.perf_counter()
    rounds = list(Driver(algo, LoopExecutor(algo)).rounds(algo.init_server()))
    wall = time.perf_counter() - t0
    assert told == [(step, rnd) for rnd in (1, 2, 3) for step in ("configure", "aggregate")]
    assert all(r.train_s > 0 and r.eval_s >= 0 and r.train_s + r.eval_s <= wall for r in rounds)
    assert sum(r.train_s + r.eval_s for r in rounds) <= wall


def test_under_dp_a_round_that_samples_no_one_releases_the_noise_alone_and_counts_it(monkeypatch):
    """`privacy`: with no client drawn the release is w + z/qN (never w bare, which would tell that no one was
    sampled), the payload's shape taken from a client it would have been sent to; the release is counted."""
    cfg = _cfg(rounds=1, privacy=DP, sampling="poisson", sample_fraction=1e-9)
    algo = prepare(cfg)
    told = []
    configure = algo.configure
    monkeypatch.setattr(algo, "configure", lambda rnd, *a: told.append((rnd, a[1])) or configure(rnd, *a))
    executor = _Losing(algo, {})
    driver = Driver(algo, executor)
    w0 = algo.init_server()
    server, comm = driver.train_round(1, w0)
    assert executor.asked == [] and comm["up_bytes_per_round"] == 0
    assert told == [(1, []), (1, [algo.ctx.federation.participated[0]])]
    z = driver.dp.draw(cfg.seed, 1, w0)
    m_bar = driver.dp.expected_clients
    for k in w0:
        torch.testing.assert_close(server[k], w0[k] + z[k] / m_bar, rtol=1e-6, atol=0)
    assert driver.draws == {1: 1} and driver.ledger.releases == 1


def _scored(monkeypatch, algo):
    """`driver.evaluate` recorded: (context, forward, per-client result) per call, scored with the loop's forwards."""
    calls = []
    real = driver_module.evaluate

    def evaluate(algo, server, state, ctx, forward):
        out = real(algo, server, state, ctx, None)
        calls.append((ctx, forward, out[1]))
        return out

    monkeypatch.setattr(driver_module, "evaluate", evaluate)
    return calls


def test_rounds_are_scored_on_the_subsample_then_the_full_sets_with_the_executors_forwards_and_diagnostics(
    monkeypatch,
):
    """Rule (`Driver.evaluate`, DESIGN §6): an intermediate evaluation scores on `eval.test_subsample`'s balanced
    view, the final one on the full sets; with the executor's own forwards (procs: its idle workers); the round's
    per-client accuracies come with it; the algorithm's diagnostics of the round, on the executor's client states,
    go into the record under `diag`."""
    algo = prepare(_cfg(test_subsample=5))
    calls = _scored(monkeypatch, algo)
    executor = LoopExecutor(algo)
    executor.forward = forward = object()
    told = []
    monkeypatch.setattr(algo, "diagnostics", lambda rnd, server, state: told.append((rnd, server, state)) or {"r": rnd})
    driver = Driver(algo, executor)
    rounds = list(driver.rounds(algo.init_server()))
    quick, full = driver.quick.federation.global_test, algo.ctx.federation.global_test
    assert len(quick) == 5 * algo.ctx.federation.num_classes < len(full)  # 5 of each class
    assert [(ctx, f) for ctx, f, _ in calls] == [(driver.quick, forward), (None, forward)]
    assert [r.per_client for r in rounds] == [None, calls[0][2], calls[1][2]] and calls[1][2]
    assert [r.record["full_test"] for r in rounds[1:]] == [False, True]
    assert told == [(2, rounds[1].server, executor.state), (3, rounds[2].server, executor.state)]
    assert [r.record["diag"] for r in rounds[1:]] == [{"r": 2}, {"r": 3}]


class _Sites(_Losing):
    """An executor whose sites hold the test data and score the server state themselves (Flower deployments)."""

    def __init__(self, algo) -> None:
        super().__init__(algo, {})
        self.scored = []

    def evaluate_on_sites(self, server, quick):
        self.scored.append((server, quick))
        return {"pfl_acc": 0.25 * len(self.scored)}, {0: 0.5}


def test_where_the_sites_score_the_driver_asks_them_and_computes_no_diagnostics(monkeypatch):
    """With the data on the sites, the round's scores are theirs (subsampled in between, full at the end), and the
    server computes no diagnostics: those read client states it does not have."""
    algo = prepare(_cfg())
    calls = _scored(monkeypatch, algo)
    monkeypatch.setattr(algo, "diagnostics", lambda *a: pytest.fail("diagnostics without the client states"))
    executor = _Sites(algo)
    driver = Driver(algo, executor)
    rounds = list(driver.rounds(algo.init_server()))
    assert calls == []
    assert executor.scored == [(rounds[1].server, driver.quick), (rounds[2].server, None)]
    assert [r.record["pfl_acc"] for r in rounds[1:]] == [0.25, 0.5] and rounds[2].per_client == {0: 0.5}
    assert all("diag" not in r.record for r in rounds[1:])


def test_under_dp_each_record_gives_epsilon_after_every_round_since_the_last_record():
    """`privacy` in a record: ε after each round since the previous evaluation (rounds 1–2, then 3 alone)."""
    algo = prepare(_cfg(privacy=DP))
    rounds = list(Driver(algo, LoopExecutor(algo)).rounds(algo.init_server()))
    by_round = [list(r.record["privacy"]["epsilon_by_round"]) for r in rounds[1:]]
    assert by_round == [["1", "2"], ["3"]]
    assert [r.record["privacy"]["noise_draws"] for r in rounds[1:]] == [2, 3]


def _dp(randomness, **federation):
    return prepare(_cfg(privacy={**DP, "randomness": randomness}, **federation))


def test_a_seeded_dp_rounds_replay_is_one_draw_and_an_os_one_draws_again_each_counted_in_the_ledger(tmp_path):
    """`privacy.Ledger` through the driver: a round replayed (a resume) under `seeded` randomness releases the same
    noise again, one draw; under `os` every release is a fresh draw. A resumed run starts from the ledger's count,
    earlier attempts included, and its records' ε count them."""
    algo = _dp("seeded")
    driver = Driver(algo, LoopExecutor(algo))  # its ledger in memory
    server = algo.init_server()
    driver.train_round(1, server)
    driver.train_round(1, server)
    assert driver.draws == {1: 1}

    algo = _dp("os")
    path = tmp_path / "privacy_ledger.jsonl"
    crashed = privacy.Ledger(path, "os")
    for rnd in (1, 1, 2):  # round 1 released, replayed after a crash, round 2 released: then a crash again
        crashed.release(rnd)
    driver = Driver(algo, LoopExecutor(algo), privacy.Ledger(path, "os", fresh=False))
    assert driver.draws == {1: 2, 2: 3}
    (replayed, _) = driver.rounds(algo.init_server(), first=2)  # resumed from round 1's checkpoint
    eps = replayed.record["privacy"]["epsilon_by_round"]
    assert replayed.record["privacy"]["noise_draws"] == 4
    assert eps == {"1": driver.dp.epsilon(2), "2": driver.dp.epsilon(4)}


def test_under_os_randomness_the_round_sample_comes_from_the_os(monkeypatch):
    """`privacy.randomness: os`: who is drawn must be unknown to anyone holding the config (which holds the seed),
    so the driver's Poisson sample reads the OS source (here replaced: it picks the second client alone; the noise,
    drawn from it too, stays finite)."""
    algo = _dp("os", sample_fraction=0.5)
    fed = algo.ctx.federation
    monkeypatch.setattr(rng, "os_uniform", lambda n: np.array([0.01 if i == 1 else 0.99 for i in range(n)]))
    told = []
    configure = algo.configure
    monkeypatch.setattr(algo, "configure", lambda rnd, *a: told.append(a[1]) or configure(rnd, *a))
    Driver(algo, LoopExecutor(algo)).train_round(1, algo.init_server())
    assert told == [[fed.participated[1]]]


def test_the_summary_s_times_add_up_each_phase_and_round_to_four_places(monkeypatch, tmp_path):
    """`timing` in summary.json: train_s and eval_s are the sums of every round's own (eval_s also the final
    fine-tuning), new_clients_s its stage, s_per_round train_s over the rounds, wall_s the run's whole span (a
    checkpoint holds the span so far, for a resumed run to add to), each rounded to 4 places. The driver's rounds
    report fixed times here, and the experiment reads a clock that advances by exactly 1 s a reading."""
    from types import SimpleNamespace

    from pflbed.results.checkpoint import load_checkpoint
    from pflbed.results.experiment import run

    real_rounds = Driver.rounds

    def fixed_times(self, server, first):
        for r in real_rounds(self, server, first):
            r.train_s, r.eval_s = 0.123456, 0.01
            yield r

    ticks = iter(range(100, 1000))  # a clock that does not start at 0
    monkeypatch.setattr(Driver, "rounds", fixed_times)
    monkeypatch.setattr(runner, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    cfg = validate_config({**TINY, "train": {**TINY["train"], "checkpoint_every": 0}, "eval": {"every": 4}})
    summary = run(cfg, tmp_path / "run", progress=False).summary
    timing = summary["timing"]
    rounds = cfg.train.rounds
    assert timing["train_s"] == round(rounds * 0.123456, 4) and timing["s_per_round"] == round(0.123456, 4)
    assert timing["eval_s"] == round(rounds * 0.01 + 1.0, 4)  # the fine-tuning stage: one reading apart
    assert timing["new_clients_s"] == 1.0
    saved = load_checkpoint(tmp_path / "run")["timing"]["wall_s"]  # after the last round, before the stages
    assert 0 < saved < timing["wall_s"] <= 10  # readings: the start, the checkpoint, two per stage, the end


def test_the_initial_model_is_drawn_from_the_run_s_seed():
    """Same seed, same initial parameters; another seed, other ones (the INIT stream is keyed by the seed)."""
    params = [prepare(validate_config({**TINY, "seed": s})).ctx.initial_params for s in (0, 0, 1)]
    assert params[0].keys() == params[2].keys()
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    assert all(not torch.equal(params[0][k], params[2][k]) for k in params[0] if params[0][k].numel() > 1)


def test_torch_threads_are_the_config_s_else_the_caller_s_else_the_model_size_policy(monkeypatch):
    monkeypatch.setattr(build, "choose_threads", lambda model: 3)
    try:
        for executor, threads, want in [({"threads": 2}, None, 2), ({"threads": 2}, 4, 2), ({}, 4, 4), ({}, None, 3)]:
            torch.set_num_threads(1)
            prepare(validate_config({**TINY, "executor": executor}), threads)
            assert torch.get_num_threads() == want, (executor, threads)
    finally:
        torch.set_num_threads(1)


def test_where_the_sites_personalize_the_experiment_asks_them_once_per_method_in_order(monkeypatch):
    """An executor whose clients' data is on the sites (Flower's site-local one) personalizes there: the experiment
    hands it the trained server state, each method and its index (the index keys the method's streams), and
    reports what it returns, as the loop's own personalization would."""
    from pflbed.evaluation.evaluate import evaluate_personalized
    from pflbed.results.experiment import run

    cfg = validate_config({**TINY, "eval": {"every": 2, "finetune": ["ft", "lp"]}, "executor": {"threads": 1}})
    here = run(cfg, write=False, progress=False)
    asked = []

    class OnSites(LoopExecutor):
        def personalize_on_sites(self, server, method, i):
            asked.append((method, i, all(torch.equal(server[k], here.server[k]) for k in here.server)))
            return evaluate_personalized(self.algo, server, method,
                                         lambda c: rng.generator(cfg.seed, rng.FINETUNE, i, c))  # fmt: skip

    monkeypatch.setattr(runner, "make_executor", lambda algo, pool=None: (OnSites(algo, strict=True), None))
    there = run(cfg, write=False, progress=False)
    assert asked == [("ft", 0, True), ("lp", 1, True)]
    for s in (here.summary, there.summary):
        s.pop("timing")
    assert there.summary == here.summary


def test_run_hands_on_its_threads_pool_and_record_callback(monkeypatch):
    given, records = [], []
    real = runner.make_executor
    monkeypatch.setattr(runner, "make_executor", lambda algo, pool=None: given.append(pool) or real(algo))
    try:
        result = runner.run(validate_config(TINY), write=False, progress=False, threads=3, pool="the caller's",
                          on_record=records.append)  # fmt: skip
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(1)
    assert given == ["the caller's"] and records == result.history and len(records) == 2


def test_a_written_run_says_where_it_is_and_logs_to_tensorboard_only_when_asked(tmp_path):
    from pflbed.results.experiment import run

    result = run(validate_config({**TINY, "executor": {"threads": 1}}), tmp_path / "run", progress=False)
    assert result.out == tmp_path / "run" and (result.out / "summary.json").exists()
    assert not (tmp_path / "run" / "tensorboard").exists()
    assert run(validate_config(TINY), write=False, progress=False).out is None


def _short(rounds: int = 2):
    return validate_config({**TINY, "train": {**TINY["train"], "rounds": rounds}, "executor": {"threads": 1}})


def _early_clock(monkeypatch):
    """The engine's clock read 1,000 s early: a progress line stamped from when `run` was called then reads
    ≥ 1,000 s, one stamped from any later start reads the seconds the run took."""
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() - 1e3))


def _stamps(lines: list[str]) -> list[float]:
    return [float(x[1:].split(" s]")[0]) for x in lines if x.startswith("[")]


def _timed(out: str) -> list[str]:
    """The stamped progress lines of `out`, without their stamps."""
    return [x.split(" s] ", 1)[1] for x in out.splitlines() if x.startswith("[")]


def test_run_by_default_writes_under_runs_shows_progress_and_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "0")
    runner.run(_short())
    assert (tmp_path / "runs" / "fedavg-synthetic-seed0" / "summary.json").exists()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "fedavg on synthetic: 2 rounds; loading the data…" and _stamps(lines)
    with pytest.raises(PflbedError, match="choose another --out \\(or pass --force"):
        runner.run(_short())


def test_resuming_says_so_and_the_lines_count_from_when_run_was_called(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "0")
    _early_clock(monkeypatch)
    runner.run(_short(), tmp_path / "r", resume=True)  # nothing to resume yet: the run starts
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "fedavg on synthetic: 2 rounds, resuming; loading the data…"
    assert min(_stamps(lines)) >= 1e3
    rounds = [x.split(",")[0].split(" G-FL")[0] for x in _timed(out)]
    assert rounds[:2] == ["fedavg on synthetic: round 1/2", "fedavg on synthetic: round 2/2 evaluated:"]


def _stopped_after_round_1(path, executor=None, **kwargs):
    """A 3-round run stopped at round 2's evaluation, before its checkpoint: round 1's is the last one kept."""

    class Stop(Exception):
        pass

    def stop(record):
        if record["round"] == 2:
            raise Stop

    cfg = validate_config({**_short(3).to_dict(), "eval": {"every": 1, "finetune": []},
                           **({"executor": executor} if executor else {})})  # fmt: skip
    with pytest.raises(Stop):
        runner.run(cfg, path, progress=False, on_record=stop, **kwargs)
    return cfg


def test_a_run_resumed_from_its_checkpoint_says_after_which_round(tmp_path, monkeypatch, capsys):
    cfg = _stopped_after_round_1(tmp_path / "r")
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "0")
    resumed = runner.run(cfg, tmp_path / "r", resume=True)
    lines = _timed(capsys.readouterr().out)
    assert lines[0] == "fedavg on synthetic: resumed after round 1/3" and lines[1].startswith("fedavg on synthetic: "
                                                                                              "round 2/3 evaluated")
    assert [r["round"] for r in resumed.history] == [1, 2, 3]
    per_client = resumed.summary["per_client"]  # the last evaluation's, each client's
    assert per_client["cid"] == list(range(6)) and len(per_client["pfl_acc"]) == 6


def test_a_hosted_run_is_the_same_experiment_run_inside_its_host(tmp_path, monkeypatch, capsys):
    """`executor.name: flower` hands the experiment to its host (by default Flower's simulation): here a
    host that runs it with the in-process executor, so it must give the loop's figures, written, reported and
    timed as a loop run's are."""
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "0")
    plain = runner.run(_short(), tmp_path / "loop", progress=False)
    hosted_cfg = validate_config({**_short().to_dict(), "executor": {"name": "flower", "threads": 1}})
    algos, records = [], []

    def host(algo, experiment):
        algos.append(algo)
        return experiment(LoopExecutor(algo, strict=True))

    _early_clock(monkeypatch)
    hosted = runner.run(hosted_cfg, tmp_path / "hosted", host=host, on_record=records.append)
    assert len(algos) == 1 and algos[0].ctx.cfg is hosted_cfg
    assert hosted.history == plain.history == records and (tmp_path / "hosted" / "summary.json").exists()
    assert min(_stamps(capsys.readouterr().out.splitlines())) >= 1e3
    hosted_cfg = _stopped_after_round_1(tmp_path / "stopped", {"name": "flower", "threads": 1}, host=host)
    resumed = runner.run(hosted_cfg, tmp_path / "stopped", host=host, resume=True)
    lines = _timed(capsys.readouterr().out)
    assert lines[0] == "fedavg on synthetic: resumed after round 1/3" and len(resumed.history) == 3


def test_a_run_over_an_earlier_one_counts_only_its_own_privacy_releases(tmp_path):
    """`--force` reuses the directory, privacy ledger's file included: the new run's ε must not count the earlier
    run's releases, while a resumed run's must (test_privacy)."""
    cfg = validate_config({**_short().to_dict(), "privacy": DP})
    first = runner.run(cfg, tmp_path / "r", progress=False)
    lines = (tmp_path / "r" / privacy.LEDGER).read_text().splitlines()
    again = runner.run(cfg, tmp_path / "r", progress=False, force=True)
    assert (tmp_path / "r" / privacy.LEDGER).read_text().splitlines() == lines and len(lines) == 2
    assert again.summary["privacy"] == first.summary["privacy"]


def test_resuming_with_nothing_written_starts_the_run() -> None:

    assert (runner.run(_short(), write=False, progress=False, resume=True).history
            == runner.run(_short(), write=False, progress=False).history)  # fmt: skip


def _poison_from(round_: int, monkeypatch) -> None:
    """FedAvg's aggregate turned to NaN from round `round_` on."""
    from pflbed.algorithms.fedavg import FedAvg

    aggregator = FedAvg.aggregator

    def poisoned(self, rnd, server, weights):
        mean = aggregator(self, rnd, server, weights)
        if rnd >= round_:
            result = mean.result
            mean.result = lambda: {k: v * float("nan") for k, v in result().items()}
        return mean

    monkeypatch.setattr(FedAvg, "aggregator", poisoned)


def _kept(rnd: int, logged: int, checkpoint: int, path) -> str:
    where = re.escape(str(path))
    return (rf"^diverged in round {rnd}: .*; metrics up to round {logged} are in {where}/metrics.jsonl, the last good "
            rf"state \(round {checkpoint}\) in {where}/checkpoints/last.pt — ")


def test_a_diverged_run_names_its_last_evaluation_and_checkpoint(tmp_path, monkeypatch):
    _poison_from(3, monkeypatch)
    cfg = validate_config({**_short(3).to_dict(), "eval": {"every": 1, "finetune": []}})
    with pytest.raises(DivergedError, match=_kept(3, 2, 2, tmp_path / "r")):
        runner.run(cfg, tmp_path / "r", progress=False)


def test_a_resumed_run_that_diverges_names_the_checkpoint_it_resumed_from(tmp_path, monkeypatch):
    cfg = _stopped_after_round_1(tmp_path / "r")
    _poison_from(2, monkeypatch)
    with pytest.raises(DivergedError, match=_kept(2, 1, 1, tmp_path / "r")):
        runner.run(cfg, tmp_path / "r", progress=False, resume=True)


def test_personalizing_new_clients_reports_each_step_of_its_work(tmp_path, monkeypatch, capsys):
    from pflbed.evaluation.newclients import work

    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "0")
    cfg = validate_config({**_short().to_dict(), "federation": {**TINY["federation"], "new_clients": 2},
                           "eval": {"every": 2, "finetune": [], "new_clients": {"epochs": 1, "lrs": [0.05]}}})
    runner.run(cfg, write=False)
    total = work(runner.prepare(cfg))
    stage = "fedavg on synthetic: personalizing 2 new clients: "
    steps = [x.split(stage, 1)[1].split(",")[0] for x in capsys.readouterr().out.splitlines() if stage in x]
    steps = [s for s in steps if "done" not in s]
    assert total > 1 and steps == [f"{i}/{total}" for i in range(1, total + 1)]
