"""How long the server of a site-local deployment waits for its sites, and what it says when it stops waiting.

A server that waited without bound for a site that never connects, or a node that never answers, would hang the
deployment with no line saying which site is missing; one that asked too often would load every node. Each wait on
the grid here is bounded and each poll paced: start-up questions wait 120 s, a mid-run question 30 s, an
evaluation what is left of `executor.round_timeout` (120 s unset), never under 1 s. The server's clock is faked
(`Clock`): a sleep moves it on by one second, so the deadlines are reached at once and exactly."""

import re

import pytest

from pflbed.config import validate_config

from ..tiny import TINY

flwr = pytest.importorskip("flwr")

from flwr.app import Error, Message  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from pflbed.flower import client, site_executor  # noqa: E402
from pflbed.flower.executor import FlowerRoundError  # noqa: E402
from pflbed.flower.site_executor import discover_sites  # noqa: E402
from pflbed.flower.sites import SiteError  # noqa: E402

from .site_setup import _server_task, _site_cfg, _sites, _tree, server_executor  # noqa: E402

LATE = 1  # the site whose node is late, down or failing


class Clock:
    """`site_executor`'s `time`: each sleep moves the clock on by one second, whatever it asked for, and what it
    asked for is recorded."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += 1.0


@pytest.fixture(autouse=True)
def _server():
    """Messages stamped as the ServerApp's."""
    with _server_task():
        yield


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(site_executor, "time", c)
    return c


def _recorded(grid, clock):
    """Every call of the grid's `send_and_receive`: (the clock, what was sent as type/group@node, the timeout)."""
    real, calls = grid.send_and_receive, []

    def send(msgs, timeout=None):
        calls.append((clock.now, [f"{m.metadata.message_type}/{m.metadata.group_id}@{m.metadata.dst_node_id}"
                                  for m in msgs], timeout))  # fmt: skip
        return real(msgs, timeout)

    grid.send_and_receive = send
    return calls


def _connecting_at(grid, clock, at):
    """Site LATE's node connects when the clock reaches `at` (None: never)."""
    real = grid.get_node_ids

    def ids():
        nodes = real()
        return nodes if at is not None and clock.now >= at else [n for n in nodes if n != grid.nodes[LATE]]

    grid.get_node_ids = ids


def _cfg(**over):
    return _site_cfg(_tree("fedavg", train={**TINY["train"], "rounds": 2}, eval={"every": 2, "finetune": []},
                           **over))  # fmt: skip


def test_start_up_waits_for_a_late_site_asking_each_node_once(tmp_path, clock):
    cfg = _cfg()
    _, grid = _sites(tmp_path, cfg)
    _connecting_at(grid, clock, 3)
    calls = _recorded(grid, clock)
    sizes, claims = discover_sites(grid, cfg)
    assert len(sizes) == 4 and claims.node == dict(enumerate(grid.nodes))
    assert clock.slept == [0.2] * 3  # polled every 0.2 s (a second on this clock) until site 1 connected
    first = [f"query/site@{n}" for i, n in enumerate(grid.nodes) if i != LATE]
    assert calls == [(0.0, first, 120), (3.0, [f"query/site@{grid.nodes[LATE]}"], 120)]  # no empty asks


@pytest.mark.parametrize("wait_s", [None, 5.0])
def test_start_up_stops_after_wait_s_naming_the_sites_connected(wait_s, tmp_path, clock):
    cfg = _cfg()
    _, grid = _sites(tmp_path, cfg)
    _connecting_at(grid, clock, None)
    calls = _recorded(grid, clock)
    args = () if wait_s is None else (wait_s,)
    seconds = 120 if wait_s is None else 5
    with pytest.raises(FlowerRoundError, match=rf"^after {seconds} s, sites \[0, 2, 3\] of \[4\] connected$"):
        discover_sites(grid, cfg, *args)
    assert len(clock.slept) == (121 if wait_s is None else 6)  # stops once past the deadline, not at it
    assert len(calls) == 1  # the connected nodes asked once; nothing sent while waiting


def test_start_up_with_no_site_at_all_says_so(tmp_path, clock):
    cfg = _cfg()
    _, grid = _sites(tmp_path, cfg)
    grid.get_node_ids = list
    with pytest.raises(FlowerRoundError, match=r"^after 3 s, sites \[\] of \? connected$"):
        discover_sites(grid, cfg, 3.0)


@pytest.mark.parametrize("reason, said", [("", "no reason"), ("Traceback (most recent call last):\n  File x\n"
                                                              "SiteError: site 1: no data\n\n", "SiteError: site 1: "
                                                              "no data"),
                                         ("<class 'pflbed.flower.sites.SiteError'>:<'site 0: client 0 of 1 has no "
                                          "training samples'>", "site 0: client 0 of 1 has no training samples"),
                                         ('<class \'KeyError\'>:<"\'x\'">', "'x'")])  # Flower's wrapping  # fmt: skip
def test_a_node_refusing_the_start_up_question_is_named_with_the_last_line_of_its_reason(reason, said, tmp_path):
    cfg = _cfg()
    _, grid = _sites(tmp_path, cfg)
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        return [Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=m)
                if m.metadata.dst_node_id == grid.nodes[LATE] else r
                for m, r in zip(msgs, real(msgs, timeout), strict=True)]  # fmt: skip

    grid.send_and_receive = send
    with pytest.raises(SiteError, match=rf"^node {grid.nodes[LATE]} refused the run or could not read its data: "
                                        rf"{re.escape(said)}$"):  # fmt: skip
        discover_sites(grid, cfg)


def _executor(tmp_path, cfg):
    _, grid = _sites(tmp_path, cfg)
    return grid, server_executor(grid, cfg)


def _down(grid, until, code=ErrorCode.NODE_UNAVAILABLE, reason="node gone"):
    """Site LATE's node answers no evaluation while `until()` holds."""
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        return [Message(Error(code, reason), reply_to=m)
                if m.metadata.message_type == "evaluate" and m.metadata.dst_node_id == grid.nodes[LATE] and until()
                else r for m, r in zip(msgs, real(msgs, timeout), strict=True)]  # fmt: skip

    grid.send_and_receive = send


def _evaluations(calls):
    return [(t, len(sent), timeout) for t, sent, timeout in calls if sent and sent[0].startswith("evaluate/")]


def test_an_evaluation_asks_again_only_the_site_that_is_down_until_it_answers(tmp_path, clock):
    """Unset `executor.round_timeout`: up to 120 s, polled every second, each ask waiting what is left."""
    grid, ex = _executor(tmp_path, _cfg())
    client.algorithm.cache_clear()
    _down(grid, lambda: clock.now < 2)
    calls = _recorded(grid, clock)
    answers = ex._ask_sites(ex.algo.init_server(), True, [])
    assert len(answers) == 4 and clock.slept == [1.0, 1.0]  # no sleep once every site has answered
    assert _evaluations(calls) == [(0.0, 4, 120.0), (1.0, 1, 119.0), (2.0, 1, 118.0)]
    assert all(sent[0].startswith("evaluate/evaluate@") for _, sent, _ in calls)


def test_an_evaluation_stops_after_the_round_timeout_naming_the_sites_it_could_not_reach(tmp_path, clock):
    """`executor.round_timeout` 3 s: each ask waits what is left of it, at least 1 s; the last ask is the first
    one made once past the deadline."""
    cfg = _cfg()
    cfg = validate_config({**cfg.model_dump(mode="json"), "executor": {**cfg.executor.model_dump(mode="json"),
                                                                       "round_timeout": 3.0}})  # fmt: skip
    grid, ex = _executor(tmp_path, cfg)
    client.algorithm.cache_clear()
    _down(grid, lambda: True)
    calls = _recorded(grid, clock)
    with pytest.raises(FlowerRoundError, match=rf"^sites \[{LATE}\] could not be reached to evaluate their clients$"):
        ex._ask_sites(ex.algo.init_server(), True, [])
    assert _evaluations(calls) == [(0.0, 4, 3.0), (1.0, 1, 2.0), (2.0, 1, 1.0), (3.0, 1, 1.0), (4.0, 1, 1.0)]
    assert clock.slept == [1.0] * 4


def test_a_site_whose_evaluation_raised_stops_the_run_with_the_last_line_of_its_reason(tmp_path, clock):
    grid, ex = _executor(tmp_path, _cfg())
    client.algorithm.cache_clear()
    _down(grid, lambda: True, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "Traceback:\n  ...\nValueError: no state\n")
    with pytest.raises(FlowerRoundError, match=rf"^site {LATE} could not evaluate: ValueError: no state$"):
        ex._ask_sites(ex.algo.init_server(), True, [])
    assert clock.slept == []


def test_a_question_mid_run_waits_30_s_and_a_node_that_failed_to_answer_is_asked_again(tmp_path, clock):
    """A node that joins mid-run and answers with an error (here: a node holding no data) is asked again at the
    next question, as a node that is not up yet; a grid without new nodes is sent nothing."""
    grid, ex = _executor(tmp_path, _cfg())
    calls = _recorded(grid, clock)
    ex._ask()
    assert calls == []
    grid.nodes.append(5000)  # a fifth node, configured with no data
    ex._ask()
    ex._ask()
    assert calls == [(0.0, ["query/site@5000"], 30)] * 2 and 5000 not in ex.asked and ex.refusals == []
