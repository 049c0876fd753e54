"""Client-level DP as deployed (`privacy.randomness`, the release ledger, `privacy.accountant`) and the algorithms'
DP edge cases: the noise and the sample of a deployment cannot be recomputed from its config, no noise draw is
released twice across a resume, FedDyn's release does not read the round's count, pFedMe's `train_clients: all` is
refused under SecAgg+, L2GD runs under DP."""

import json
import math

import pytest
import torch

from pflbed import privacy
from pflbed.algorithms.base import Tensors
from pflbed.cli import main
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.driver import Driver
from pflbed.engine.executor import LoopExecutor, update_client
from pflbed.errors import ConfigError
from pflbed.federation import sample_clients
from pflbed.results.experiment import run

from ..tiny import TINY

DP = {"clip": 0.5, "noise_multiplier": 0.8}
SEEDED, OS = {**DP, "randomness": "seeded"}, {**DP, "randomness": "os"}


def config(name="fedavg", privacy_=SEEDED, **sections):
    return validate_config({**TINY, "algorithm": {"name": name}, "privacy": privacy_, **sections})


def _norm(t: Tensors) -> float:
    return math.sqrt(sum(float((v.double() ** 2).sum()) for v in t.values()))


# --- 11: where the noise and the sample come from --------------------------------------------------------------


def test_randomness_defaults_to_the_os_in_a_flower_run_and_is_named_in_the_record():
    assert config(privacy_=DP).privacy_randomness() == "seeded"  # research: reproducible
    flower = {**TINY["executor"], "name": "flower"}
    assert config(privacy_=DP, executor=flower).privacy_randomness() == "os"  # never the seed unless named
    assert config(privacy_=SEEDED, executor=flower).privacy_randomness() == "seeded"
    with pytest.raises(ConfigError, match=r"^privacy: randomness needs privacy.clip"):
        config(privacy_={"randomness": "os"})
    with pytest.raises(ConfigError, match=r"^privacy.randomness: Input should be 'seeded' or 'os'"):
        config(privacy_={**DP, "randomness": "urandom"})
    assert privacy.mechanism(config(privacy_=OS), 6).record(2, since=0)["randomness"] == "os"


def _one_round(privacy_: dict) -> tuple[float, float]:
    """One DP round of FedAvg: (‖what the seeded noise leaves of the release once the clipped updates are taken
    out‖, ‖the seeded noise‖) — the first is ~0 when the noise is the seed's, the noise's size otherwise."""
    cfg = config(privacy_=privacy_, train={**TINY["train"], "rounds": 1})
    algo = prepare(cfg)
    ex = LoopExecutor(algo)
    sampled: list[int] = []
    stream = ex.stream
    ex.stream = lambda rnd, payloads: (sampled.extend(payloads), stream(rnd, payloads))[1]
    w0 = algo.init_server()
    for _ in range(20):  # a round that samples someone (Poisson may draw no one)
        server, _ = Driver(algo, ex).train_round(1, w0)
        if sampled:
            break
    mech = privacy.mechanism(cfg, len(algo.ctx.federation.participated))
    clipped = {c: update_client(algo, 1, c, w0, algo.init_client(c))[0] for c in sampled}  # deterministic
    z = privacy.noise(cfg.seed, 1, w0, mech.sigma * mech.clip)
    left = {k: (server[k] - w0[k]) * mech.expected_clients - z[k] - sum(clipped[c][k] - w0[k] for c in sampled)
            for k in w0}  # fmt: skip
    return _norm(left), _norm(z)


def test_a_deployments_noise_is_not_the_seeds_and_a_research_runs_is():
    """Subtracting `noise(seed, round)` from a release recovers the round's sum of clipped updates under `seeded`
    (to float rounding), and leaves noise of the full size under `os`. Planted: `Mechanism.draw` ignoring
    `randomness` (always the seed's) turns the `os` half red."""
    left, z = _one_round(SEEDED)
    assert left < 1e-3 * z
    left, z = _one_round(OS)
    assert left > 0.5 * z


def test_the_same_config_twice_is_bit_identical_when_seeded_and_not_from_the_os(tmp_path):
    """Two research runs of one config end with the same server and summary; two `os` runs do not (their noise and
    samples are fresh), and both record where their randomness came from."""
    ends = {}
    for how, p in (("seeded", SEEDED), ("os", OS)):
        a, b = (run(config(privacy_=p), tmp_path / f"{how}{i}", progress=False) for i in (0, 1))
        ends[how] = all(torch.equal(a.server[k], b.server[k]) for k in a.server)
        assert a.summary["privacy"]["randomness"] == how
        records = [json.loads(x) for x in (tmp_path / f"{how}0" / "metrics.jsonl").read_text().splitlines()]
        assert all(r["privacy"]["randomness"] == how for r in records)
        if how == "seeded":
            assert {k: v for k, v in a.summary.items() if k != "timing"} == \
                {k: v for k, v in b.summary.items() if k != "timing"}  # fmt: skip
    assert ends == {"seeded": True, "os": False}


def test_os_sampling_is_poisson_at_rate_q_and_not_the_seeds():
    participated = list(range(200))
    sizes, same = [], 0
    for r in range(1, 101):
        drawn = sample_clients(0, r, participated, 0.1, poisson=True, entropy=True)
        sizes.append(len(drawn))
        same += drawn == sample_clients(0, r, participated, 0.1, poisson=True)
    assert abs(sum(sizes) / len(sizes) - 20) < 2 and len(set(sizes)) > 5 and same == 0
    assert sample_clients(0, 3, participated, 0.1, True, entropy=True) != \
        sample_clients(0, 3, participated, 0.1, True, entropy=True)  # fmt: skip
    fixed = sample_clients(0, 3, participated, 0.1, poisson=False, entropy=True)
    assert len(fixed) == 20 == len(set(fixed))
    assert len(sample_clients(0, 3, participated, 0.001, poisson=False, entropy=True)) == 1  # at least one, no more


class _Lost:
    """An executor's round in which every sampled client was lost: no reply, all of them `failed`."""

    def __init__(self, cids: list[int]) -> None:
        self.failed = cids

    def __iter__(self):
        return iter(())


def test_the_driver_samples_from_the_os_under_os_randomness():
    """Planted: the driver's `sample_clients` without `entropy` (the seed's sample) turns this red."""
    fed = {**TINY["federation"], "clients": 24}
    for p, same_as_seed in ((SEEDED, True), (OS, False)):
        algo = prepare(config(privacy_=p, federation=fed))
        ex, drawn = LoopExecutor(algo), {}
        ex.stream = lambda rnd, payloads, drawn=drawn: _Lost(drawn.setdefault(rnd, sorted(payloads)))
        driver, server = Driver(algo, ex), algo.init_server()
        for rnd in (1, 2, 3):
            driver.train_round(rnd, server)
        seed = {r: sample_clients(0, r, algo.ctx.federation.participated, 0.5, True) for r in drawn}
        assert (drawn == seed) is same_as_seed


def test_os_noise_for_an_entry_on_a_device_without_float64_is_drawn_on_the_cpu_and_lands_on_the_entry_s(monkeypatch):
    """Box–Muller runs in float64 where the device has it (CPU, CUDA), else on the CPU (MPS has no float64): the
    meta device stands in for such a device, and the draw's logarithm is seen on the CPU."""
    drawn_on, log1p = [], torch.log1p
    monkeypatch.setattr(torch, "log1p", lambda x: drawn_on.append(x.device.type) or log1p(x))
    z = privacy.os_noise({"a": torch.zeros(5, device="meta", dtype=torch.float16)}, 1.0)["a"]
    assert (z.device.type, z.dtype, z.shape) == ("meta", torch.float16, (5,)) and drawn_on == ["cpu"]


def test_os_noise_is_standard_normal_times_std():
    z = privacy.os_noise({"a": torch.zeros(200_001), "b": torch.zeros(3, dtype=torch.float64)}, 2.0)
    assert z["a"].dtype == torch.float32 and z["b"].dtype == torch.float64 and z["a"].shape == (200_001,)
    assert abs(float(z["a"].mean())) < 0.02 and abs(float(z["a"].std()) - 2.0) < 0.02
    assert abs(float((z["a"] / 2).pow(4).mean()) - 3.0) < 0.1  # Gaussian kurtosis
    assert not torch.equal(privacy.os_noise({"a": torch.zeros(8)}, 1.0)["a"], privacy.os_noise({"a": torch.zeros(8)},
                           1.0)["a"])  # fmt: skip


# --- 12: no noise draw released twice across a resume ------------------------------------------------------------


class Stop(Exception):
    pass


def _stopped_then_resumed(tmp_path, p, monkeypatch):
    """A 4-round run (checkpoint every round) stopped by an exception in round 2's evaluation callback — after
    round 2's release left (its evaluation ran), before its checkpoint — then resumed: it replays round 2. The noise
    draws of `os_noise`, in order."""
    draws: list[Tensors] = []
    os_noise = privacy.os_noise
    monkeypatch.setattr(privacy, "os_noise", lambda like, std: draws.append(os_noise(like, std)) or draws[-1])
    cfg = config(privacy_=p, train={**TINY["train"], "checkpoint_every": 1})
    out = tmp_path / p["randomness"]

    def stop(record):
        if record["round"] == 2:
            raise Stop

    with pytest.raises(Stop):
        run(cfg, out, progress=False, on_record=stop)
    assert [json.loads(x)["round"] for x in (out / privacy.LEDGER).read_text().splitlines()] == [1, 2]
    result = run(cfg, out, progress=False, resume=True)
    ledger = [json.loads(x) for x in (out / privacy.LEDGER).read_text().splitlines()]
    assert [e["round"] for e in ledger] == [1, 2, 2, 3, 4] and [e["replay"] for e in ledger].count(True) == 1
    return result, draws, cfg


def test_a_resumed_deployment_draws_fresh_noise_for_a_replayed_round_and_epsilon_counts_it(tmp_path, monkeypatch):
    """Under `os`, the replay of round 2 is a second release with a fresh draw: five releases, five distinct draws,
    and ε is the accountant's for five steps, not four. Planted: ε counting rounds (not the ledger's draws) turns
    this red."""
    result, draws, cfg = _stopped_then_resumed(tmp_path, OS, monkeypatch)
    assert len(draws) == 5
    flat = [torch.cat([d[k].flatten() for k in sorted(d)]) for d in draws]
    assert all(not torch.equal(flat[i], flat[j]) for i in range(5) for j in range(i))
    mech = privacy.mechanism(cfg, 6)
    assert result.summary["privacy"]["noise_draws"] == 5
    assert result.summary["privacy"]["epsilon"] == pytest.approx(mech.epsilon(5)) and mech.epsilon(5) > \
        mech.epsilon(4)  # fmt: skip
    records = [json.loads(x) for x in (tmp_path / "os" / "metrics.jsonl").read_text().splitlines()]
    by_round = {int(r): e for rec in records for r, e in rec["privacy"]["epsilon_by_round"].items()}
    assert by_round == pytest.approx({1: mech.epsilon(1), 2: mech.epsilon(3), 3: mech.epsilon(4),
                                      4: mech.epsilon(5)})  # fmt: skip


def test_a_resumed_research_run_replays_the_same_draw_and_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    """Under `seeded`, a replay is the same computation with the same draw: the ledger lists it, ε counts the round
    once, and the summary equals an uninterrupted run's."""
    result, draws, cfg = _stopped_then_resumed(tmp_path, SEEDED, monkeypatch)
    assert draws == []
    straight = run(cfg, tmp_path / "straight", progress=False)
    assert {k: v for k, v in result.summary.items() if k != "timing"} == \
        {k: v for k, v in straight.summary.items() if k != "timing"}  # fmt: skip
    assert result.summary["privacy"]["noise_draws"] == 4


def test_a_release_is_in_the_ledger_before_the_new_state_leaves(tmp_path, monkeypatch):
    """The ledger's line for round t is on disk when round t's server state is first sent: to the next round's
    clients and to the evaluation. Planted: counting the release after the evaluation (in `Driver.rounds`) turns
    this red."""
    import pflbed.engine.driver as driver_module

    out = tmp_path / "r"
    seen: list[tuple[str, int, list[int]]] = []

    def ledger() -> list[int]:
        path = out / privacy.LEDGER
        return [json.loads(x)["round"] for x in path.read_text().splitlines()] if path.exists() else []

    stream, evaluate = LoopExecutor.stream, driver_module.evaluate

    def spy_stream(self, rnd, payloads):
        seen.append(("payloads", rnd, ledger()))
        return stream(self, rnd, payloads)

    def spy_evaluate(algo, server, *args):
        seen.append(("evaluation", max(ledger(), default=0), ledger()))
        return evaluate(algo, server, *args)

    monkeypatch.setattr(LoopExecutor, "stream", spy_stream)
    monkeypatch.setattr(driver_module, "evaluate", spy_evaluate)
    run(config(privacy_=OS, federation={**TINY["federation"], "sample_fraction": 1.0}), out, progress=False)
    payloads = [(rnd, rounds) for what, rnd, rounds in seen if what == "payloads"]
    assert payloads == [(r, list(range(1, r))) for r in range(1, 5)]
    evaluations = [rounds for what, _, rounds in seen if what == "evaluation"]
    assert evaluations and all(rounds == list(range(1, len(rounds) + 1)) for rounds in evaluations)
    assert [len(r) for r in evaluations] == [2, 4]


def test_the_ledger_counts_a_torn_line_and_seeded_replays_once(tmp_path):
    path = tmp_path / privacy.LEDGER
    ledger = privacy.Ledger(path, "seeded")
    assert [ledger.release(r) for r in (1, 2, 2, 3)] == [1, 2, 2, 3] and ledger.releases == 4
    with open(path, "a") as f:
        f.write('{"round": 4, "rele')  # a crash mid-line: counted
    again = privacy.Ledger(path, "os", fresh=False)
    assert again.draws == 4 and again.release(4) == 5
    assert again.draws_by_round() == {1: 1, 2: 2, 3: 3, 4: 5}
    third = privacy.Ledger(path, "os", fresh=False)  # the release after the torn line is a line of its own
    assert third.releases == 6 and third.draws == 5 and third.entries[-1] == (4, "os")  # that line parses
    assert privacy.Ledger(path, "os").draws == 0 and not path.exists()  # a new run starts its own


def test_each_ledger_line_names_its_round_its_count_and_whether_it_replays_and_is_fsynced(tmp_path, monkeypatch):
    """A release's line: its round, its number among the run's releases, where its randomness came from, and
    whether it replays a round already released; each is fsynced, and the file's new directory entry once."""
    synced = []
    monkeypatch.setattr(privacy.os, "fsync", lambda fd: synced.append(fd))
    path = tmp_path / privacy.LEDGER
    ledger = privacy.Ledger(path, "os")
    for r in (1, 2, 2):
        ledger.release(r)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"round": 1, "release": 1, "randomness": "os", "replay": False},
        {"round": 2, "release": 2, "randomness": "os", "replay": False},
        {"round": 2, "release": 3, "randomness": "os", "replay": True},
    ]  # fmt: skip
    assert len(synced) == 4  # three lines, and the directory after the first
    assert ledger.draws_by_round() == {1: 1, 2: 3} and ledger.draws == 3  # under `os` a replay is a draw of its own


# --- 13: FedDyn's server step under DP ---------------------------------------------------------------------------


def test_feddyns_dp_server_step_does_not_read_how_many_clients_replied():
    """Under DP the replies' mean is the release; FedDyn's h step must use qN, not |P_t|: the same release from two
    or from four repliers gives the same new server state. Without DP, Algorithm 1's |P_t|/m stays. Planted: the old
    `share = len(self.mean.w) / m` under DP turns this red."""
    for p, same in ((DP, True), ({}, False)):
        algo = prepare(config("feddyn", p, federation={**TINY["federation"], "sampling": "poisson"}))
        server = algo.init_server()
        release = {k: v + 0.01 * torch.ones_like(v) for k, v in algo.model_part(server).items()}
        new = []
        for cids in ([0, 1], [0, 1, 2, 3]):
            agg = algo.aggregator(1, server, dict.fromkeys(cids, 1.0))
            for c in cids:
                agg.add(c, release)
            new.append(agg.result())
        assert all(torch.equal(new[0][k], new[1][k]) for k in new[0]) is same
        if p:  # h moved by α·q·(release − θ): the expected share, qN/m = q
            k = next(iter(algo.params))
            h = new[0][f"h/{k}"]
            torch.testing.assert_close(h, -algo.opts.alpha * 0.5 * (release[k] - server[k]))


# --- 14: pFedMe's train_clients: all under SecAgg+ ---------------------------------------------------------------


def test_pfedme_training_every_client_is_refused_under_secagg_with_one_line_and_exit_2(capsys):
    """SecAgg+ gives every site one payload; pFedMe's `train_clients: all` sends the unsampled clients another.
    Planted: without the check in `validate_config` this is accepted (red)."""
    sites = {"local": True, "secagg": True, "input_shape": [1, 8, 8], "num_classes": 10}
    base = {"dataset": {"name": "synthetic"}, "executor": {"name": "flower"}, "sites": sites}
    with pytest.raises(ConfigError, match=r"^algorithm.train_clients: all does not apply with sites.secagg=true"):
        validate_config({**base, "algorithm": {"name": "pfedme", "train_clients": "all"}})
    validate_config({**base, "algorithm": {"name": "pfedme"}})  # sampled: one payload for everyone
    validate_config({**base, "sites": {**sites, "secagg": False}, "algorithm": {"name": "pfedme",
                     "train_clients": "all"}})  # fmt: skip
    sets = ["dataset.name=synthetic", "executor.name=flower", "sites.local=true", "sites.secagg=true",
            "sites.input_shape=[1,8,8]", "sites.num_classes=10", "algorithm.name=pfedme",
            "algorithm.train_clients=all"]  # fmt: skip
    assert main(["run", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "algorithm.train_clients" in err


# --- 15: L2GD under DP, and the integer-entry check -------------------------------------------------------------


def test_l2gd_runs_under_dp_its_run_lengths_neither_clipped_nor_noised(tmp_path):
    """L2GD sends its round's run lengths as integers beside x̄: an instruction, never replied. Planted: the old
    check refusing every integer payload entry (with a BatchNorm hint) turns this red."""
    noisy = run(config("l2gd", {**DP, "noise_multiplier": 5.0}), tmp_path / "dp", progress=False)
    plain = run(validate_config({**TINY, "algorithm": {"name": "l2gd"}, "federation": {**TINY["federation"],
                "sampling": "poisson"}}), tmp_path / "plain", progress=False)  # fmt: skip
    assert noisy.summary["privacy"]["noise_draws"] == TINY["train"]["rounds"]
    assert noisy.server.keys() == plain.server.keys()
    assert all(not torch.equal(noisy.server[k], plain.server[k]) for k in plain.server)  # every entry noised


def test_an_integer_entry_is_refused_by_name_and_dtype_and_only_batchnorm_gets_the_batchnorm_hint(tmp_path):
    bn = {**TINY, "model": {"name": "lenet5_bn"}, "dataset": {"name": "synthetic", "synthetic": {"shape": [1, 28, 28]}},
          "privacy": DP, "train": {**TINY["train"], "rounds": 1}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"num_batches_tracked \(int64\).*; use a model without BatchNorm"):
        run(validate_config(bn), tmp_path / "bn", progress=False)
    from pflbed.algorithms.fedavg import FedAvg
    from pflbed.engine.build import check_dp_payload

    class Counted(FedAvg):  # an undeclared integer entry that is no BatchNorm counter
        def configure(self, rnd, server, cids):
            return {c: {**server, "count": torch.tensor(rnd, dtype=torch.int32)} for c in cids}

    with pytest.raises(ConfigError, match=r"sends integer entries that cannot be clipped or noised: count \(int32\)$"):
        check_dp_payload(Counted(prepare(config()).ctx))
    with pytest.raises(ValueError, match=r"reply entries n \(int64\), extra \(not in the payload\) are not float"):
        privacy.clip_reply({"n": torch.tensor(3)}, {"n": torch.tensor(4), "extra": torch.ones(1)}, 1.0)


# --- the accountants ---------------------------------------------------------------------------------------------


def test_prv_is_offered_tighter_than_rdp_and_recorded():
    """Opacus's PRV accountant at σ = 1.229, q = 0.1, 50 steps, δ = 1e-5: ε 3.53 where RDP gives 4.0."""
    rdp = privacy.Mechanism(1.0, 1.229, 0.1, 100, 1e-5)
    prv = privacy.Mechanism(1.0, 1.229, 0.1, 100, 1e-5, accountant="prv")
    assert rdp.epsilon(50) == pytest.approx(4.0, abs=0.01) and prv.epsilon(50) == pytest.approx(3.53, abs=0.01)
    assert prv.record(50, since=49)["accountant"] == "prv"
    assert config(privacy_={**DP, "accountant": "prv"}).privacy.accountant == "prv"
    with pytest.raises(ConfigError, match=r"^privacy: accountant needs privacy.clip"):
        config(privacy_={"accountant": "prv"})


def test_prv_beyond_its_range_falls_back_to_rdps_bound(monkeypatch):
    from opacus.accountants import PRVAccountant

    monkeypatch.setattr(PRVAccountant, "get_epsilon", lambda self, delta, **kw: math.inf)
    privacy._epsilon.cache_clear()
    try:
        got = privacy.Mechanism(1.0, 0.9, 0.1, 100, 1e-5, accountant="prv").epsilon(7)
        assert got == privacy.Mechanism(1.0, 0.9, 0.1, 100, 1e-5).epsilon(7) and math.isfinite(got)
    finally:
        privacy._epsilon.cache_clear()


def test_the_sigma_search_stops_within_an_absolute_0_005_below_the_target():
    for target in (1.0, 4.0):
        sigma = privacy.noise_multiplier(target, 1e-5, 0.1, 50)
        assert target - 0.005 <= privacy.Mechanism(1.0, sigma, 0.1, 100, 1e-5).epsilon(50) <= target


def test_a_deployment_killed_mid_run_and_resumed_counts_every_release_of_its_ledger(tmp_path):
    """SIGKILL at some point after a checkpoint and a later release, then `--resume`: every round is in the ledger,
    the rounds released after the checkpoint twice, and ε is the accountant's for all the ledger's releases."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from pflbed.results.checkpoint import checkpoint_path

    sets = ["dataset.name=synthetic", "model.name=mlp", "federation.clients=8", "federation.sample_fraction=0.5",
            "train.rounds=20", "train.checkpoint_every=5", "eval.every=10", "eval.finetune=[]", "train.lr=0.02",
            "algorithm.name=fedavg", "privacy.clip=0.5", "privacy.noise_multiplier=1.0", "privacy.randomness=os"]
    args = [a for s in sets for a in ("--set", s)]
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "pflbed", "run", *args, "--no-progress", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    ledger, deadline = out / privacy.LEDGER, time.time() + 120
    while proc.poll() is None and time.time() < deadline and not (
            checkpoint_path(out).exists() and ledger.exists() and len(ledger.read_text().splitlines()) >= 7):
        time.sleep(0.01)  # fmt: skip
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "summary.json").exists(), "the run finished before it could be killed"
    checkpointed = torch.load(checkpoint_path(out), weights_only=True)["round"]
    before = [privacy._entry(x)[0] for x in ledger.read_text().splitlines()]  # None: a line the kill tore
    assert len(before) > checkpointed  # a release the resume will replay

    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    rounds = [privacy._entry(x)[0] for x in ledger.read_text().splitlines()]
    assert rounds[: len(before)] == before and sorted(set(rounds) - {None}) == list(range(1, 21))
    assert len(rounds) == 20 + len(before) - checkpointed  # each replayed round released twice
    summary = json.loads((out / "summary.json").read_text())["privacy"]
    mech = privacy.Mechanism(0.5, 1.0, 0.5, 8, 1e-5, randomness="os")
    assert summary["noise_draws"] == len(rounds) and summary["epsilon"] == pytest.approx(mech.epsilon(len(rounds)))


def test_the_integer_entry_line_names_three_then_an_ellipsis_and_the_batchnorm_hint_word_for_word(tmp_path):
    from pflbed.algorithms.fedavg import FedAvg
    from pflbed.engine.build import check_dp_payload

    def counted(names):
        class Counted(FedAvg):
            def configure(self, rnd, server, cids):
                return {c: {**server, **{k: torch.tensor(rnd, dtype=torch.int32) for k in names}} for c in cids}

        return Counted(prepare(config()).ctx)

    head = "privacy.clip: fedavg on mlp sends integer entries that cannot be clipped or noised: "
    for names, listed in [("abc", "a (int32), b (int32), c (int32)"), ("abcd", "a (int32), b (int32), c (int32) …")]:
        with pytest.raises(ConfigError) as info:
            check_dp_payload(counted(names))
        assert str(info.value) == head + listed
    with pytest.raises(ConfigError) as info:
        check_dp_payload(counted(["bn.num_batches_tracked"]))
    assert str(info.value) == head + ("bn.num_batches_tracked (int32); use a model without BatchNorm, or fedbn, which "
                                      "keeps BatchNorm on the clients")  # fmt: skip
