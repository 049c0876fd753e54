"""Client-level DP (`pflbed.privacy`, `privacy.*`): the mechanism checked by hand on a tiny federation, the
algorithms' declarations checked against what they send, the accounting against Opacus's own figure."""

import json
import math
import re

import pytest
import torch

from pflbed import privacy, rng
from pflbed.algorithms import ALGORITHMS
from pflbed.algorithms.common import ClientContext
from pflbed.config import load_config, validate_config
from pflbed.engine.build import prepare
from pflbed.engine.driver import Driver
from pflbed.engine.executor import LoopExecutor, update_client
from pflbed.errors import ConfigError, DivergedError
from pflbed.federation import sample_clients

from ..tiny import TINY

DP = {"clip": 0.5, "noise_multiplier": 0.8}
SUPPORTED = sorted(n for n, c in ALGORITHMS.items() if c.dp_refused is None)


def config(name="fedavg", privacy_=DP, **sections):
    tree = {**TINY, "algorithm": {"name": name}, "privacy": privacy_, **sections}
    return validate_config(tree)


def test_clip_scales_the_update_to_norm_c_and_keeps_a_small_one_bit_for_bit():
    w = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[0.0]])}
    big = {"a": torch.tensor([4.0, 6.0]), "b": torch.tensor([[12.0]])}  # Δ = (3, 4, 12): norm 13
    clipped = privacy.clip_reply(w, big, 1.3)
    assert torch.allclose(clipped["a"], torch.tensor([1.3, 2.4]))
    assert torch.allclose(clipped["b"], torch.tensor([[1.2]]))
    assert math.isclose(privacy.update_norm(w, clipped), 1.3, rel_tol=1e-6)
    small = {"a": torch.tensor([1.5, 2.0]), "b": torch.tensor([[0.5]])}
    assert privacy.clip_reply(w, small, 1.3) is small


def test_clip_refuses_a_reply_that_is_not_an_update_of_the_payload_entry_for_entry():
    w = {"a": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"^privacy: reply entries extra \(not in the payload\) are not float updates"):
        privacy.clip_reply(w, {"a": torch.ones(2), "extra": torch.ones(1)}, 1.0)
    assert privacy.clip_reply({**w, "fixed": torch.ones(1)}, {"a": torch.ones(2) * 3}, 1.0)["a"].norm() == \
        pytest.approx(1.0)  # a payload may hold more than the reply updates (FedBABU's fixed head)
    with pytest.raises(ValueError, match=r"^privacy: reply entries extra \(not in the payload\), n \(int64\) are not "
                                         r"float updates of payload entries; an algorithm with such replies must not "
                                         r"declare DP support \(dp_refused\)$"):  # fmt: skip
        privacy.clip_reply({"n": torch.tensor(3)}, {"extra": torch.ones(1), "n": torch.tensor(4)}, 1.0)


def test_noise_to_signal_at_one_expected_client_and_at_none():
    one = privacy.Mechanism(clip=1.0, sigma=0.5, rate=0.5, clients=2, delta=1e-5, rounds=4)  # qN = 1
    assert one.noise_to_signal(16) == pytest.approx(0.5 * 4 / 2, rel=1e-12)  # σ√d / (qN√T)
    assert privacy.Mechanism(clip=1.0, sigma=0.5, rate=0.5, clients=0, delta=1e-5).noise_to_signal(16) == math.inf


def test_a_reply_exactly_at_the_clip_norm_is_returned_as_it_is():
    reply = {"a": torch.tensor([3.0, 4.0])}  # Δ of norm 5 exactly
    assert privacy.clip_reply({"a": torch.zeros(2)}, reply, 5.0) is reply


def test_seeded_noise_is_the_same_whatever_torch_s_default_dtype_and_device_and_lands_on_the_entry_s_device():
    like = {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float64)}
    want = privacy.noise(7, 2, like, 0.5)
    assert [want[k].dtype for k in ("w", "b")] == [torch.float32, torch.float64]
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with torch.device("meta"):
            got = privacy.noise(7, 2, like, 0.5)
    finally:
        torch.set_default_dtype(before)
    assert all(torch.equal(got[k], want[k]) for k in like)
    on_meta = privacy.noise(7, 2, {k: v.to("meta") for k, v in like.items()}, 0.5)
    assert {v.device.type for v in on_meta.values()} == {"meta"}


def test_one_round_by_hand_clip_each_client_then_sum_then_one_noise_over_the_expected_count():
    """w_1 = w_0 + (Σ_k clip(Δ_k) + z_1) / (qN), z_1 from the (seed, round) stream: recomputed here from the
    clients' own unclipped updates. Planted: clipping the sum instead of each update, noise per client, weights by
    size, a denominator of the actual count — each gives another w_1."""
    for seed in range(20):  # a seed whose first Poisson draw is neither empty nor qN: the denominator matters
        cfg = config(seed=seed, train={**TINY["train"], "rounds": 1})
        algo = prepare(cfg)
        fed = algo.ctx.federation
        m_bar = cfg.federation.sample_fraction * len(fed.participated)
        cids = sample_clients(cfg.seed, 1, fed.participated, cfg.federation.sample_fraction, poisson=True)
        if 0 < len(cids) != m_bar:
            break
    w0 = algo.init_server()
    raw = {}
    for c in cids:  # the clients' updates, unclipped (the algorithm's own client_update)
        state = algo.init_client(c)
        gen = torch.Generator().manual_seed(rng.derive_seed(cfg.seed, rng.CLIENT, 1, c))
        rng.seed_global(rng.derive_seed(cfg.seed, rng.CLIENT, 1, c), torch.device("cpu"))
        reply, _ = algo.client_update(w0, state, algo.ctx.client_data(c), ClientContext(1, c, gen))
        raw[c] = {k: reply[k] - w0[k] for k in reply}
    norms = {c: math.sqrt(sum(float((d**2).sum()) for d in raw[c].values())) for c in cids}
    assert all(n > DP["clip"] for n in norms.values())  # every client is clipped: the clip is tested
    g = torch.Generator().manual_seed(rng.derive_seed(cfg.seed, rng.PRIVACY, 1))
    z = {k: torch.randn(w0[k].shape, generator=g) * DP["noise_multiplier"] * DP["clip"] for k in sorted(w0)}
    expected = {k: w0[k] + (sum(raw[c][k] * (DP["clip"] / norms[c]) for c in cids) + z[k]) / m_bar for k in w0}
    server, _ = Driver(algo, LoopExecutor(algo)).train_round(1, w0)
    for k in w0:
        torch.testing.assert_close(server[k], expected[k], rtol=1e-5, atol=1e-6)
    # the noise is the round's own: the same round draws the same numbers, the next round others
    k = sorted(w0)[0]
    assert torch.equal(privacy.noise(cfg.seed, 1, w0, 1.0)[k], privacy.noise(cfg.seed, 1, w0, 1.0)[k])
    assert not torch.equal(privacy.noise(cfg.seed, 1, w0, 1.0)[k], privacy.noise(cfg.seed, 2, w0, 1.0)[k])


def test_the_update_leaves_the_client_clipped_in_update_client():
    """Clipping happens where the client runs (every executor and a Flower node call `update_client`)."""
    cfg = config()
    algo = prepare(cfg)
    w0 = algo.init_server()
    reply, _ = update_client(algo, 1, 0, w0, algo.init_client(0))
    assert privacy.update_norm(w0, reply) <= DP["clip"] * (1 + 1e-6)


def test_personal_entries_get_no_noise_and_no_clip():
    """FedPer's head stays on the client: under DP (huge noise, tiny clip) each client's head after its first round
    equals the head it trains without DP (the same start, the same batches); only the shared body is noised.
    Planted: noising or clipping the client's state turns this red."""
    loud = {"clip": 1e-3, "noise_multiplier": 50.0}
    heads = []
    for p in (loud, {}):
        cfg = config("fedper", p, train={**TINY["train"], "rounds": 1}, federation={**TINY["federation"],
                     "sampling": "poisson"})  # fmt: skip
        algo = prepare(cfg)
        ex = LoopExecutor(algo)
        server, _ = Driver(algo, ex).train_round(1, algo.init_server())
        heads.append((ex.states, server))
    (dp_states, dp_server), (plain_states, plain_server) = heads
    assert dp_states.keys() == plain_states.keys() and dp_states
    for c in dp_states:
        assert all(torch.equal(dp_states[c][k], plain_states[c][k]) for k in dp_states[c]), c
    assert all(not torch.equal(dp_server[k], plain_server[k]) for k in dp_server)  # the body is noised


@pytest.mark.parametrize("name", SUPPORTED)
def test_a_declared_algorithm_replies_updates_of_one_shared_payload_and_reads_only_their_mean(name):
    """The declaration `dp_refused = None` checked against what the algorithm does: each client's payload is the
    same shared entries, its reply updates exactly those (float), and the server rule gives the same new state
    when every reply is replaced by the replies' uniform mean — so noising the mean protects all it reads."""
    cfg = validate_config({**TINY, "algorithm": {"name": name}, "federation": {**TINY["federation"],
                          "sample_fraction": 1.0}})  # fmt: skip
    algo = prepare(cfg)
    fed = algo.ctx.federation
    server = algo.init_server()
    cids = fed.participated[:3]
    payloads = algo.configure(1, server, cids)
    replies = {}
    for c in cids:
        p = payloads[c]
        assert p.keys() == payloads[cids[0]].keys() and all(torch.equal(p[k], payloads[cids[0]][k]) for k in p)
        replies[c], _ = update_client(algo, 1, c, p, algo.init_client(c))
        assert replies[c] and replies[c].keys() <= p.keys(), name
        assert all(v.is_floating_point() for v in replies[c].values()), name
    mean = {k: sum(replies[c][k] for c in cids) / len(cids) for k in replies[cids[0]]}
    uniform = dict.fromkeys(cids, 1.0)
    direct = algo.aggregate(1, server, replies, uniform)
    via_mean = algo.aggregate(1, server, {c: mean for c in cids}, uniform)
    assert direct.keys() == via_mean.keys()
    for k in direct:
        torch.testing.assert_close(direct[k], via_mean[k], rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")


@pytest.mark.parametrize("name", sorted(n for n, c in ALGORITHMS.items() if c.dp_refused is not None))
def test_an_algorithm_without_the_declaration_is_refused_with_its_reason(name):
    with pytest.raises(ConfigError, match=rf"privacy.clip: client-level DP does not apply to {name}: "):
        config(name)
    assert len(ALGORITHMS[name].dp_refused) > 20


def test_privacy_keys_are_checked_together():
    with pytest.raises(ConfigError, match="noise_multiplier needs privacy.clip"):
        config(privacy_={"noise_multiplier": 1.0})
    with pytest.raises(ConfigError, match="exactly one of"):
        config(privacy_={"clip": 1.0})
    with pytest.raises(ConfigError, match="exactly one of"):
        config(privacy_={"clip": 1.0, "noise_multiplier": 1.0, "target_epsilon": 2.0})
    with pytest.raises(ConfigError, match="federation.sampling: privacy's accountant assumes Poisson"):
        config(federation={**TINY["federation"], "sampling": "fixed"})
    with pytest.raises(ConfigError, match="privacy.target_epsilon: 0.001 is out of reach"):
        config(privacy_={"clip": 1.0, "target_epsilon": 0.001})


def test_epsilon_is_the_accountants_own_for_the_same_q_sigma_and_steps():
    from opacus.accountants import RDPAccountant

    mech = privacy.Mechanism(clip=1.0, sigma=1.1, rate=0.3, clients=50, delta=1e-5)
    acc = RDPAccountant()
    for _ in range(7):
        acc.step(noise_multiplier=1.1, sample_rate=0.3)
    assert mech.epsilon(7) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)
    assert mech.epsilon(7) < mech.epsilon(8)
    assert math.isinf(privacy.Mechanism(1.0, 0.0, 0.3, 50, 1e-5).epsilon(3))
    assert mech.epsilon(0) == 0.0 and privacy.Mechanism(1.0, 0.0, 0.3, 50, 1e-5).epsilon(0) == 0.0  # nothing released
    one = privacy.Mechanism(clip=1.0, sigma=1.0, rate=0.3, clients=50, delta=1e-5)  # σ = 1: an accountant's ε, finite
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.3)
    assert one.epsilon(1) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12) and 0 < one.epsilon(1) < math.inf
    record = privacy.Mechanism(1.0, 0.0, 0.3, 50, 1e-5).record(3, since=1)  # no noise: ε = ∞, written null
    assert record["epsilon"] is None and record["epsilon_by_round"] == {"2": None, "3": None}
    assert json.loads(json.dumps(record, allow_nan=False)) == record


def test_target_epsilon_derives_sigma_that_reaches_it(monkeypatch):
    rounds = TINY["train"]["rounds"]  # the runs' below: each σ is searched for once (a search takes seconds)
    sigma = privacy.noise_multiplier(4.0, 1e-5, 0.5, rounds)
    eps = privacy.Mechanism(1.0, sigma, 0.5, 20, 1e-5).epsilon(rounds)
    assert 4.0 * 0.99 <= eps <= 4.0
    # PRV's ε of the same σ is lower: a run it accounts reaches its target with less noise
    assert privacy.Mechanism(1.0, sigma, 0.5, 20, 1e-5, accountant="prv").epsilon(rounds) < eps
    # a run's σ is derived by its own accountant: Opacus's search is told which (its PRV search, 15 s, not run here)
    from opacus.accountants import utils

    searched = []
    monkeypatch.setattr(utils, "get_noise_multiplier", lambda **kw: searched.append(kw) or 1.5)
    privacy.noise_multiplier.cache_clear()
    try:
        for accountant in ("rdp", "prv"):
            cfg = config(privacy_={"clip": 1.0, "target_epsilon": 4.0, "accountant": accountant})
            assert privacy.mechanism(cfg, 6).sigma == 1.5
    finally:
        privacy.noise_multiplier.cache_clear()  # the searches' stand-in answers must not outlive the test
    asked = [(k["accountant"], k["target_epsilon"], k["target_delta"], k["sample_rate"], k["steps"]) for k in searched]
    assert asked == [(a, 4.0, cfg.privacy.delta, 0.5, rounds) for a in ("rdp", "prv")]


def test_poisson_sampling_draws_each_client_independently_with_probability_q():
    participated = list(range(200))
    sizes = [len(sample_clients(0, r, participated, 0.1, poisson=True)) for r in range(1, 201)]
    assert abs(sum(sizes) / len(sizes) - 20) < 1.5 and len(set(sizes)) > 5  # varies round to round, mean qN
    assert sample_clients(0, 3, participated, 0.1, poisson=True) == sample_clients(0, 3, participated, 0.1, True)


def test_a_round_that_draws_no_one_still_releases_noise():
    """Under DP a round with no client releases w + z/qN, never w bare (that would tell that no one was drawn)."""
    cfg = config()
    mech = privacy.Mechanism(1.0, 2.0, 0.5, 6, 1e-5)
    w = {"a": torch.zeros(3)}
    out = list(mech.replies(cfg.seed, 4, w, iter(()), 0))
    assert [c for c, _ in out] == [-1]
    torch.testing.assert_close(out[0][1]["a"], privacy.noise(cfg.seed, 4, w, 2.0)["a"] / 3.0)


def test_batched_clients_give_the_loops_dp_run(tmp_path, monkeypatch):
    """Batched clients clip where they finish (`engine.batched`), and so does a client that trains alone, its
    round's only one (Poisson sampling gives client 5 two such rounds here); procs and Flower: the `fedper+dp` case
    of the parity tests (tests/tiny.py's VARIANTS)."""
    from pflbed.engine import batched as engine_batched
    from pflbed.results.experiment import run

    alone, real = [], engine_batched.BatchedExecutor.alone

    def counted(self, plan, cid, *args):
        alone.append(cid)
        return real(self, plan, cid, *args)

    monkeypatch.setattr(engine_batched.BatchedExecutor, "alone", counted)
    base = {**TINY, "privacy": DP, "executor": {**TINY["executor"], "name": "loop"}}
    loop = run(validate_config(base), tmp_path / "loop")
    batched = run(validate_config({**base, "executor": {**TINY["executor"], "batch_clients": True}}), tmp_path / "b")
    for k in loop.server:  # batched clients round differently (tests/engine/test_batched.py)
        torch.testing.assert_close(batched.server[k], loop.server[k], rtol=1e-4, atol=1e-5)
    assert loop.summary["privacy"] == batched.summary["privacy"]
    assert alone == [5, 5]


def test_epsilon_is_logged_every_evaluation_and_in_the_summary(tmp_path):
    from pflbed.results.experiment import run

    result = run(config(), tmp_path / "r")
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    eps = [r["privacy"]["epsilon"] for r in records if "privacy" in r]
    assert len(eps) == len([r for r in records if "round" in r]) >= 2 and eps == sorted(eps)
    assert result.summary["privacy"]["epsilon"] == eps[-1]
    by_round = {int(r): e for rec in records if "privacy" in rec for r, e in rec["privacy"]["epsilon_by_round"].items()}
    assert sorted(by_round) == list(range(1, TINY["train"]["rounds"] + 1))  # every round, each once
    assert all(by_round[r] < by_round[r + 1] for r in range(1, TINY["train"]["rounds"]))
    mech = privacy.Mechanism(DP["clip"], DP["noise_multiplier"], 0.5, 6, 1e-5)
    assert eps[-1] == pytest.approx(mech.epsilon(TINY["train"]["rounds"]))


def test_integer_entries_in_what_clients_receive_are_refused_before_the_run(tmp_path):
    """BatchNorm's batch counters cannot be clipped or noised: FedAvg on a BatchNorm model is refused with one line,
    before a run directory exists; FedBN, which keeps BatchNorm on the clients, runs."""
    from pflbed.results.experiment import run

    bn = {**TINY, "model": {"name": "lenet5_bn"}, "dataset": {"name": "synthetic", "synthetic": {"shape": [1, 28, 28]}},
          "privacy": DP, "train": {**TINY["train"], "rounds": 1}}  # fmt: skip
    with pytest.raises(ConfigError, match="fedavg on lenet5_bn sends integer entries .*num_batches_tracked"):
        run(validate_config(bn), tmp_path / "avg")
    assert not (tmp_path / "avg").exists()
    assert run(validate_config({**bn, "algorithm": {"name": "fedbn"}}), tmp_path / "bn").summary["privacy"]


# FedPer on the default federation (20 clients of digits) at q = 0.1 (qN = 2 clients per round), ε = 4 over 50
# rounds (σ = 1.229): it diverges in round 15, and in round 29 at lr 0.001 (docs/guide/privacy.md's table).
SWAMPED = ["algorithm.name=fedper", "privacy.clip=1.0", "privacy.target_epsilon=4", "train.rounds=50",
           "federation.sample_fraction=0.1", "executor.threads=1"]  # fmt: skip


def test_the_noise_to_signal_figure_is_the_noise_over_the_clients_best_case():
    """σ√d/(qN√T): the noise's norm over T rounds, σC√(Td)/qN, against T·C (every update at the clip, all aligned).
    C cancels; four times the clients per round, or sixteen times the rounds, quarter or halve it."""
    mech = privacy.Mechanism(clip=2.0, sigma=1.5, rate=0.1, clients=40, delta=1e-5, rounds=9)
    assert mech.noise_to_signal(400) == pytest.approx(1.5 * 20 / (4 * 3))
    assert privacy.Mechanism(0.1, 1.5, 0.1, 40, 1e-5, rounds=9).noise_to_signal(400) == mech.noise_to_signal(400)
    assert privacy.Mechanism(2.0, 1.5, 0.1, 160, 1e-5, rounds=9).noise_to_signal(400) == pytest.approx(0.625)
    assert privacy.Mechanism(2.0, 1.5, 0.1, 40, 1e-5, rounds=144).noise_to_signal(400) == pytest.approx(0.625)
    assert mech.noise_warning(400) is not None and mech.noise_warning(64) is not None  # 2.5, and 1.0: the bound
    assert mech.noise_warning(63) is None  # 0.992
    assert privacy.Mechanism(1.0, 1.5, 0.1, 40, 1e-5).noise_to_signal(400) == pytest.approx(7.5)  # T unknown: 1


def test_a_run_whose_noise_swamps_the_updates_is_warned_once_before_its_first_client_trains(capsys, monkeypatch):
    """The setting that diverged: the warning gives the noise per entry, the clients per round and the figure, at the
    first release, before round 1's clients train (the loop executor's replies are drawn lazily), and only once."""
    cfg = load_config(None, SWAMPED)
    algo = prepare(cfg)
    ex = LoopExecutor(algo)
    stream, err = ex.stream, []

    def watched(rnd, payloads):  # a generator, as the loop's: its body runs when the mechanism draws the replies
        err.append((rnd, capsys.readouterr().err))  # what was printed before the round's first client trains
        yield from stream(rnd, payloads)

    monkeypatch.setattr(ex, "stream", watched)
    driver = Driver(algo, ex)
    server, _ = driver.train_round(1, algo.init_server())
    driver.train_round(2, server)
    err.append((None, capsys.readouterr().err))
    warnings = [line for _, chunk in err for line in chunk.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("pflbed: warning: privacy noise of std 0.615 per entry and round")
    assert "with qN = 2 clients per round (σC/qN: σ = 1.229, C = 1)" in warnings[0]
    assert "noise-to-signal σ√d/(qN√T) = 37.3 (d = 183,680 shared entries, T = 50 rounds) ≥ 1" in warnings[0]
    assert "federation.sample_fraction" in warnings[0]
    assert err[0][0] == 1 and "pflbed: warning:" in err[0][1]  # round 1 drew clients; none had trained yet


def test_a_run_whose_noise_the_updates_outweigh_is_not_warned(capsys):
    """Where noise-to-signal is below 1 there is no warning: here 100 clients per round (q = 1), σ = 0.8: 0.94."""
    cfg = config(privacy_={"clip": 1.0, "noise_multiplier": 0.8}, federation={**TINY["federation"],
                 "clients": 100, "sample_fraction": 1.0})  # fmt: skip
    algo = prepare(cfg)
    driver = Driver(algo, LoopExecutor(algo))
    entries = sum(v.numel() for v in algo.init_server().values())
    assert 0.9 < driver.dp.noise_to_signal(entries) < 1  # 0.94
    driver.train_round(1, algo.init_server())
    assert "warning" not in capsys.readouterr().err


def test_a_divergence_under_dp_names_the_noise_and_the_clients_per_round():
    """A client that diverges under DP is reported with the noise that preceded it: under DP the noise is the first
    suspect, not only the learning rate."""
    from pflbed.results.experiment import run

    cfg = config(train={**TINY["train"], "lr": 1e30})
    with pytest.raises(DivergedError) as e:
        run(cfg, write=False, progress=False)
    assert "non-finite values" in str(e.value)
    assert re.search(r"after privacy noise of std 0\.133 per entry and round with qN = 3 clients per round \(σC/qN: "
                     r"σ = 0\.8, C = 0\.5\), noise-to-signal σ√d/\(qN√T\) = [\d.]+ \(d = [\d,]+ shared entries, T = 4 "
                     r"rounds\)(;.*)? — the noise outweighs .* whatever the learning rate", str(e.value))
    assert "lower train.lr" not in str(e.value)  # the noise named as the cause, not the learning rate


def test_under_distributed_noise_the_server_rescales_the_replies_and_draws_only_for_a_round_without_one():
    """Rule (`Mechanism.replies`, noise: distributed): the replies already hold the sites' noise, so the server adds
    none and rescales them to the release, r'_k = w + (m/qN)(r_k − w); a round without a reply asked no site, and
    the server draws z itself: the pseudo-reply w + z/qN, z from the run's (seed, round) stream."""
    mech = privacy.Mechanism(clip=1.0, sigma=0.5, rate=0.5, clients=8, delta=1e-5, noise="distributed")  # qN = 4
    w = {"w": torch.tensor([1.0, 2.0])}
    replies = [(0, {"w": torch.tensor([2.0, 4.0])}), (5, {"w": torch.tensor([0.0, 2.0])})]
    out = list(mech.replies(7, 2, w, iter(replies), 2))  # m/qN = 1/2
    assert [c for c, _ in out] == [0, 5]
    assert [r["w"].tolist() for _, r in out] == [[1.5, 3.0], [0.5, 2.0]]
    ((cid, alone),) = mech.replies(7, 2, w, iter([]), 0)
    assert cid == -1 and torch.equal(alone["w"], w["w"] + privacy.noise(7, 2, w, 0.5)["w"] / 4)


@pytest.mark.parametrize("sigma", [0.01, 100.0])
def test_a_divergence_under_dp_keeps_its_round_and_names_the_noise_as_the_cause_only_where_it_swamps(sigma):
    def diverging():
        raise DivergedError(3, "client 2's update")
        yield

    mech = privacy.Mechanism(clip=1.0, sigma=sigma, rate=0.5, clients=8, delta=1e-5, rounds=4)  # σ√d/(qN√T) = σ/4
    with pytest.raises(DivergedError) as e:
        list(mech.replies(0, 3, {"w": torch.zeros(4)}, diverging(), 1))
    assert e.value.round == 3 and e.value.where.startswith("client 2's update, after privacy noise of std")
    assert e.value.hint == (privacy.SWAMPED if sigma == 100.0 else DivergedError(3, "").hint)


def test_the_record_says_every_figure_of_the_guarantee_under_its_name():
    """What `metrics.jsonl` and `summary.json` say of a run's privacy (`Mechanism.record`): each figure under its
    name, ε after each round since the previous evaluation, the draws counted (one a round unless the ledger says
    otherwise)."""
    mech = privacy.Mechanism(clip=0.5, sigma=1.2, rate=0.25, clients=40, delta=1e-5, randomness="os",
                             accountant="rdp", noise="distributed", rounds=9)  # fmt: skip
    eps = {r: mech.epsilon(n) for r, n in {2: 2, 3: 4}.items()}
    assert mech.record(3, since=1, draws={3: 4}) == {
        "epsilon": eps[3], "delta": 1e-5, "noise_multiplier": 1.2, "clip": 0.5, "sampling_rate": 0.25,
        "expected_clients": 10.0, "rounds": 3, "noise_draws": 4, "accountant": "rdp", "randomness": "os",
        "noise": "distributed", "sampling": "poisson", "epsilon_by_round": {"2": eps[2], "3": eps[3]},
    }  # fmt: skip
