"""A site-local deployment's server against a malicious site: counts, replies, evaluation figures and claims that a
site has no right to send are refused with one line naming the site, never a crash. In-process, on the faked
Flower runtime, site 1's messages rewritten as a site running other code would send them."""

import hashlib
import json
import math
import re

import numpy as np
import pytest
import torch

from pflbed.config import validate_config

from ..tiny import TINY, figures

flwr = pytest.importorskip("flwr")

from flwr.app import ConfigRecord, MetricRecord  # noqa: E402
from flwr.common import Code, FitRes, Parameters, Status  # noqa: E402

from pflbed.flower import client  # noqa: E402
from pflbed.flower.executor import FlowerRoundError  # noqa: E402
from pflbed.flower.records import from_record, to_record  # noqa: E402
from pflbed.flower.site_claims import (  # noqa: E402
    TOKEN,
    Claims,
    check_counts,
    declared_eval,
    site_token,
    token_hash,
)
from pflbed.flower.site_executor import SiteExecutor, discover_sites  # noqa: E402
from pflbed.flower.sites import SiteError, server_algorithm  # noqa: E402

from ..fake_flower import FakeGrid, ticking_time  # noqa: E402
from .site_setup import _server_task, _site_cfg, _sites, _tampered, _tree, run_sites, server_executor  # noqa: E402

BAD = 1  # the malicious site (one client per site: its client is client 1)


def _short(name="fedavg", **over):
    return _tree(name, train={**TINY["train"], "rounds": 3}, eval={"every": 2, "finetune": []}, **over)


def _tamper(grid, kind, change):
    """Rewrite the replies of site BAD's node to messages of `kind` ("site", "train", "evaluate") with `change`."""
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        replies = real(msgs, timeout)
        for i, m in enumerate(msgs):
            if m.metadata.dst_node_id != grid.nodes[BAD] or replies[i].has_error():
                continue
            if kind == "site" and m.metadata.group_id == "site":
                info = json.loads(str(replies[i].content["site"]["report"]))
                report = change(info)  # a report, or the text sent in its place
                replies[i].content["site"] = ConfigRecord({"report": report if isinstance(report, str) else
                                                           json.dumps(report)})  # fmt: skip
            elif kind == m.metadata.message_type == "train" or kind == m.metadata.message_type == "evaluate":
                change(m, replies[i])
        return replies

    grid.send_and_receive = send


def _refusals(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("pflbed: refused:")]


# --- 5. sample counts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[10**15], [-250], [0], [True], [2.5], "12", [], [1] * 5])
def test_a_site_reporting_counts_out_of_bounds_is_refused_at_start_up(counts, tmp_path):
    """Counts are clients' weights: a huge one made the mean its reply, a negative or zero one an extrapolation.
    Positive integers up to sites.max_client_samples, at most federation.clients of them."""
    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    _tamper(grid, "site", lambda info: {**info, "num_train": counts})
    with _server_task(), pytest.raises(SiteError, match=f"^site {BAD}: .*(num_train|clients)"):
        discover_sites(grid, cfg)


@pytest.mark.parametrize("change", [{"labels": 5}, {"labels": ["a"]}, {"input_shape": 3}])
def test_a_report_that_is_not_one_is_refused_with_one_line(change, tmp_path):
    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    _tamper(grid, "site", lambda info: {**info, **change})
    with _server_task(), pytest.raises(SiteError, match=f"^site {BAD}: its report's input_shape or labels"):
        discover_sites(grid, cfg)


@pytest.mark.parametrize("change", [list, lambda info: {k: v for k, v in info.items() if k != "labels"}])
def test_an_answer_that_is_no_report_is_refused_naming_its_node(change, tmp_path):
    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    _tamper(grid, "site", change)
    with _server_task(), pytest.raises(SiteError, match=rf"^node {grid.nodes[BAD]}: its answer to the start-up "
                                                         r"question is not one \(a report of num_train, input_shape "
                                                         r"and labels is needed\)$"):  # fmt: skip
        discover_sites(grid, cfg)


DEEP = "[" * 100_000  # JSON nested past Python's recursion limit: its parser raised RecursionError


@pytest.mark.parametrize(("change", "why"), [
    (lambda info: DEEP, "it nests deeper than 2"),
    (lambda info: {**info, "labels": [info["labels"]]}, "it nests deeper than 2"),
    (lambda info: "{", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
])  # fmt: skip
def test_a_report_that_is_no_json_of_lists_in_a_mapping_is_refused_naming_its_node(change, why, tmp_path):
    """A report nested deeper than a report's two levels is refused whole: one nested past Python's recursion limit
    crashed the server (a `RecursionError` from the parser, or from any later `repr` of it)."""
    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    _tamper(grid, "site", change)
    with _server_task(), pytest.raises(SiteError) as e:
        discover_sites(grid, cfg)
    assert str(e.value) == f"node {grid.nodes[BAD]}: its answer to the start-up question is not one ({why})"


def test_a_report_of_exactly_what_a_site_must_report_is_taken(tmp_path):
    """num_train, input_shape and labels, and nothing else (no token, no evaluation counts): a site of another make."""
    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    _tamper(grid, "site", lambda info: {k: info[k] for k in ("num_train", "input_shape", "labels")})
    with _server_task():
        _, claims = discover_sites(grid, cfg)
    assert claims.node[BAD] == grid.nodes[BAD] and claims.token[BAD] is None and claims.eval[BAD] is None


def test_sites_that_disagree_on_their_number_stop_the_start_up(tmp_path):
    from pflbed.flower.client import PARTITION, PARTITIONS

    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        replies = real(msgs, timeout)
        for r in replies:
            if r.metadata.src_node_id == grid.nodes[BAD]:
                r.content["node"] = ConfigRecord({PARTITION: BAD, PARTITIONS: 5})
        return replies

    grid.send_and_receive = send
    with _server_task(), pytest.raises(FlowerRoundError, match=r"^the sites disagree on their number: \[4, 5\]$"):
        discover_sites(grid, cfg)


def _bounded(max_client_samples):
    cfg = _site_cfg(_short())
    return validate_config({**cfg.model_dump(mode="json"), "sites": {**cfg.sites.model_dump(mode="json"),
                                                                     "max_client_samples": max_client_samples}})


def test_the_bound_on_counts_is_the_server_s_config(tmp_path):
    _, grid = _sites(tmp_path, _site_cfg(_short()))
    with _server_task(), pytest.raises(SiteError, match="max_client_samples=5"):
        discover_sites(grid, _bounded(5))


def test_the_count_rules_take_their_bounds_themselves():
    """`check_counts`: federation.clients clients (4 here), counts from 1 to sites.max_client_samples, pass; a client
    more, a count of 0 or one above the bound is refused. `declared_eval`: test and val counts from 0 to the bound."""
    cfg = _bounded(100)
    assert check_counts(cfg, 1, [1, 100, 7, 1]) is None
    for counts, why in (([1] * 5, "reports 5 clients, more than federation.clients=4"), ([0], r"num_train\[0\]=0;"),
                        ([5, 101], r"num_train\[1\]=101; a count is an integer from 1 to sites.max_client_samples=100$")
                        ):  # fmt: skip
        assert re.search(why, check_counts(cfg, 1, counts)), counts
    train = {"num_train": [3, 3]}
    assert declared_eval(cfg, 1, train) is None  # nothing declared: nothing to hold its evaluations to
    assert declared_eval(cfg, 1, {**train, "num_test": [0, 100], "num_val": [2, 3]}) == [100, 5]
    for info, key in (({"num_test": [1, 1]}, "num_val"), ({"num_val": [1, 1]}, "num_test"),  # one without the other
                      ({"num_test": [1, 101], "num_val": [1, 1]}, "num_test")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^site 1: {key}=.*; one count per client, from 0 to sites.max_client"):
            declared_eval(cfg, 1, {**train, **info})
    long = list(range(1, 100))
    with pytest.raises(ValueError, match=rf"^site 1: num_test={re.escape(str(long)[:60])}; one count"):  # cut to 60
        declared_eval(cfg, 1, {**train, "num_test": long, "num_val": [1, 1]})


def test_only_a_non_empty_string_is_a_token():
    """What a node presents as its token is the server's to hash only where it is a non-empty string; anything else
    (a number, a list, an empty string) is no token at all, never a crash and never the hash of ""."""
    assert token_hash("abc") == hashlib.sha256(b"abc").hexdigest()
    assert token_hash("") is token_hash(None) is token_hash(7) is token_hash(["abc"]) is None


def _executor(tmp_path, tree):
    cfg = _site_cfg(tree)
    _, grid = _sites(tmp_path, cfg)
    return grid, server_executor(grid, cfg)


@pytest.mark.parametrize("what", ["num_train", "num_test"])
def test_a_restarted_site_reporting_other_counts_is_refused_and_keeps_its_node(what, tmp_path, capsys):
    grid, ex = _executor(tmp_path, _short())
    old = grid.nodes[BAD]
    grid.nodes[BAD] = max(grid.nodes) + 1  # restarted, under a new node id
    client.algorithm.cache_clear()
    if what == "num_train":
        _tamper(grid, "site", lambda info: {**info, "num_train": [n * 100 for n in info["num_train"]]})
        line = (f"counts [{ex.sizes[BAD][0] * 100}], not those of start-up [{ex.sizes[BAD][0]}]")
    else:  # declared now, not at start-up
        _tamper(grid, "site", lambda info: {**info, "num_test": [5], "num_val": [5]})
        line = "[5, 5] test and val samples, not those of start-up"
    with _server_task():
        ex._ask()
    assert ex.node_of[BAD] == old
    lines = _refusals(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"pflbed: refused: site {BAD}: node {grid.nodes[BAD]} ")
    assert lines[0].endswith(line)


# --- 6. replies ---------------------------------------------------------------------------------------------------


LOST = (2, 3)  # the rounds of a rewritten reply (the fake grid's `lost` schedule would lose round 1's evaluation too)


def _rewrite(reply_change, rounds=LOST):
    """A TRAIN change: site BAD's reply of its client in `rounds` rewritten by reply_change(payload, reply)."""

    def change(msg, reply):
        rnd = int(msg.content["config"]["round"])
        for cid in msg.content["config"]["cids"]:
            if rnd in rounds:
                payload, honest = from_record(msg.content[f"payload/{cid}"]), from_record(reply.content[f"reply/{cid}"])
                reply.content[f"reply/{cid}"] = to_record(reply_change(payload, honest))

    return change


def _huge(p, r):
    return {k: v * 1e30 for k, v in r.items()}


def _wide_bias(p, r):
    return {k: v.expand(2, *v.shape).clone() if v.dim() == 1 else v for k, v in r.items()}


def _dropped(p, r):
    return dict(sorted(r.items())[1:])


def _extra(p, r):
    return {**r, "extra": torch.zeros(3)}


def _int64(p, r):
    return {k: v.long() if i == 0 else v for i, (k, v) in enumerate(sorted(r.items()))}


REPLIES = {"huge": _huge, "wide_bias": _wide_bias, "dropped_key": _dropped, "extra_key": _extra, "int64": _int64}


@pytest.fixture(scope="module")
def lost_run(tmp_path_factory):
    """The run in which site BAD's replies are lost in rounds 2 and 3: what a refused site must give."""
    tree = _short()
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path_factory.mktemp("lost"), validate_config(tree))
    grid.lost = dict.fromkeys(LOST, [BAD])
    return run_sites(_site_cfg(tree), grid)


@pytest.mark.parametrize("attack", list(REPLIES))
def test_a_wrong_reply_leaves_its_site_out_of_the_round_as_a_lost_one(attack, lost_run, tmp_path, capsys):
    """×10³⁰ (finite), a [2, 10] tensor for a [10] bias, a dropped key, an extra key, an int64 entry: each refused
    with one line naming the site, and the run is the one in which the site's replies were lost."""
    tree = _short()
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    _tamper(grid, "train", _rewrite(REPLIES[attack]))
    result = run_sites(_site_cfg(tree), grid)
    assert figures(result.summary) == figures(lost_run.summary)
    assert all(torch.equal(result.server[k], lost_run.server[k]) for k in lost_run.server)
    lines = _refusals(capsys)
    assert len(lines) == 2 and all(f"site {BAD}, round {r}: client {BAD}'s reply" in line
                                   for r, line in zip(LOST, lines, strict=True))  # fmt: skip
    assert [r.get("failed_clients") for r in result.history] == [{"2": [BAD]}, {"3": [BAD]}]


# Algorithms that check their own replies (`reply_fits`), with light options: a wide tensor refused, each alike
OWN_CHECK = {"scaffold": {}, "fedpac": {"body_epochs": 1}, "fedfomo": {"M": 2}, "fedselect": {}, "fedamp": {},
             "fedbasis": {"K": 2, "alpha_epochs": 1, "basis_epochs": 1}, "fedmtl": {},
             "pfedhn": {"local_steps": 2, "hidden": 16, "hidden_layers": 1}}  # fmt: skip


@pytest.mark.parametrize("name", list(OWN_CHECK))
def test_an_algorithm_s_own_check_leaves_a_site_with_a_wrong_reply_out_of_the_round(name, tmp_path, capsys):
    """Every 1-D entry of site BAD's replies widened to [2, n] in rounds 2 and 3: refused by the algorithm's
    `reply_fits` with one line each, the site left out of those rounds, and the server state the one of the run
    in which those replies were lost (its client state, which the site kept, may differ)."""
    tree = _short(name, algorithm={"name": name, **OWN_CHECK[name]})
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path / "lost", validate_config(tree))
    grid.lost = dict.fromkeys(LOST, [BAD])
    lost = run_sites(_site_cfg(tree), grid)
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path / "wide", validate_config(tree))
    _tamper(grid, "train", _rewrite(_wide_bias))
    result = run_sites(_site_cfg(tree), grid)
    assert result.server.keys() == lost.server.keys()
    assert all(torch.equal(result.server[k], lost.server[k]) for k in lost.server)
    lines = _refusals(capsys)
    assert len(lines) == 2 and all(f"site {BAD}, round {r}: client {BAD}'s reply has '" in line and "of shape [2, "
                                   in line for r, line in zip(LOST, lines, strict=True))  # fmt: skip
    assert [r.get("failed_clients") for r in result.history] == [{"2": [BAD]}, {"3": [BAD]}]


def test_a_reply_that_is_not_a_record_of_tensors_is_refused(tmp_path, capsys):
    tree = _short()
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))

    def change(msg, reply):
        for cid in msg.content["config"]["cids"]:
            if int(msg.content["config"]["round"]) in LOST:
                del reply.content[f"reply/{cid}"]

    _tamper(grid, "train", change)
    result = run_sites(_site_cfg(tree), grid)
    assert [r.get("failed_clients") for r in result.history] == [{"2": [BAD]}, {"3": [BAD]}]
    lines = _refusals(capsys)
    assert len(lines) == 2 and all(f"site {BAD}, round" in line and "cannot be read" in line for line in lines)


def _figures(change):
    """A TRAIN change: the content of site BAD's reply in the `LOST` rounds rewritten by change(content, round)."""

    def rewrite(msg, reply):
        rnd = int(msg.content["config"]["round"])
        if rnd in LOST:
            change(reply.content, rnd)

    return rewrite


def _set(**over):
    """A change of the reply's figures (its `config` record): `over` set, those set to None left out."""

    def change(content, rnd):
        figures = {**dict(content["config"]), **over}
        content["config"] = ConfigRecord({k: v for k, v in figures.items() if v is not None})

    return change


def _round(value):
    def change(content, rnd):
        content["config"] = ConfigRecord({**dict(content["config"]), "round": value(rnd)})

    return change


def _record(kind):
    def change(content, rnd):
        if kind == "state":  # what a node keeping no state sends: its client's new state
            content[f"state/{BAD}"] = content[f"reply/{BAD}"]
        else:
            content["extra"] = MetricRecord({"x": 1.0}) if kind == "metric" else ConfigRecord({"x": 1})

    return change


OTHER = 2  # another site's client (client 2, of site 2)
NEWLINES = "w\npflbed: refused: site 2, round 2"  # a flag that would write a line of the site's own
CARRIED = {  # site BAD's reply in rounds 2 and 3 → why it is refused (the line's middle), given the round
    "seconds_text": (_set(update_s="abc"), lambda r: "its reply's figures are refused: its 'update_s' is 'abc'"),
    "seconds_list": (_set(records_s=[1.0]), lambda r: "its reply's figures are refused: its 'records_s' is '[1.0]'"),
    "seconds_nan": (_set(update_s=float("nan")), lambda r: "its reply's figures are refused: its 'update_s' is 'nan'"),
    "seconds_negative": (_set(records_s=-1.0), lambda r: "its reply's figures are refused: its 'records_s' is '-1.0'"),
    "seconds_bool": (_set(update_s=True), lambda r: "its reply's figures are refused: its 'update_s' is 'True'"),
    "seconds_missing": (_set(records_s=None), lambda r: "its reply's figures are refused: its 'records_s' is missing"),
    "round": (_round(lambda r: r + 1), lambda r: f"its reply's figures are refused: its 'round' is '{r + 1}'"),
    "round_float": (_round(float), lambda r: f"its reply's figures are refused: its 'round' is '{r}.0'"),
    "flag_other_client": (_set(**{f"nonfinite/{OTHER}": "w"}), lambda r: "its reply's figures are refused: it sends "
                          f"'nonfinite/{OTHER}', which is not a figure of its own clients"),
    "flag_newlines": (_set(**{f"nonfinite/{BAD}": NEWLINES}), lambda r: "its reply's figures are refused: its "
                      f"'nonfinite/{BAD}' names no entry: {NEWLINES!r}"),
    "figure_extra": (_set(note="x"), lambda r: "its reply's figures are refused: it sends 'note', which is not a "
                     "figure of its own clients"),
    "state_record": (_record("state"), lambda r: f"its reply holds 'state/{BAD}', which is not a record of its "
                     "clients' replies"),
    "metric_record": (_record("metric"), lambda r: "its reply holds 'extra', which is not a record of its clients' "
                      "replies"),
    "config_record": (_record("config"), lambda r: "its reply holds 'extra', which is not a record of its clients' "
                      "replies"),
}  # fmt: skip


@pytest.mark.parametrize("attack", list(CARRIED))
def test_what_a_reply_carries_besides_its_tensors_is_held_to_what_a_site_sends(attack, lost_run, tmp_path, capsys):
    """A site's reply carries the round, its seconds and, per client of its own, the name of a non-finite state
    entry; seconds as text crashed the server, and a flag naming another site's client stopped the run blaming
    that site. Anything else, or any of these out of its rule, is refused with one line naming the site (the round
    is the one of a lost reply)."""
    change, why = CARRIED[attack]
    tree = _short()
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    _tamper(grid, "train", _figures(change))
    result = run_sites(_site_cfg(tree), grid)
    assert figures(result.summary) == figures(lost_run.summary)
    assert all(torch.equal(result.server[k], lost_run.server[k]) for k in lost_run.server)
    assert _refusals(capsys) == [f"pflbed: refused: site {BAD}, round {r}: {why(r)}; its clients are left out of the "
                                 "round" for r in LOST]  # fmt: skip
    assert [r.get("failed_clients") for r in result.history] == [{"2": [BAD]}, {"3": [BAD]}]


@pytest.mark.parametrize(("code", "reason", "said"), [
    ("CLIENT_APP_RAISED_EXCEPTION", "", "no reason"), ("CLIENT_APP_RAISED_EXCEPTION", " \n ", "no reason"),
    ("CLIENT_APP_RAISED_EXCEPTION", "Traceback (most recent call last):\n  File x\nSiteError: no\n\n", "SiteError: no"),
    ("LOAD_CLIENT_APP_EXCEPTION", "ModuleNotFoundError: pflbed", "ModuleNotFoundError: pflbed"),
])  # fmt: skip
def test_a_site_whose_node_fails_the_round_s_work_stops_the_run_in_one_line_naming_it(code, reason, said, tmp_path):
    """A site's node raising (its policy refusing the run, its ClientApp not loading) stops the run, as a client
    update raising does, with one line: the site, the round and the last line of its reason, the site's own text
    (not a traceback of the site's choosing)."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    tree = _short()
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    real, rounds = grid.send_and_receive, []

    def send(msgs, timeout=None):
        failing = [m.metadata.dst_node_id == grid.nodes[BAD] and m.metadata.message_type == "train" for m in msgs]
        rounds.extend(int(m.content["config"]["round"]) for m, f in zip(msgs, failing, strict=True) if f)
        return [Message(Error(getattr(ErrorCode, code), reason), reply_to=m) if f else r
                for m, f, r in zip(msgs, failing, real(msgs, timeout), strict=True)]  # fmt: skip

    grid.send_and_receive = send
    with pytest.raises(FlowerRoundError) as e:
        run_sites(_site_cfg(tree), grid)
    assert str(e.value) == f"site {BAD}, round {rounds[0]}: its node failed the round's work: {said}"


@pytest.mark.parametrize("what", ["reply", "state"])
def test_a_site_s_non_finite_reply_or_flagged_state_stops_the_run_as_diverged_naming_round_and_client(what, tmp_path):
    """A NaN in site BAD's reply, or a flag of its own client's state (what an honest site whose client diverged
    sends): the run stops as a diverged one, naming the round and the client, the reply's or the flag's entry."""
    from pflbed.errors import DivergedError

    named = []

    def change(content, rnd):
        reply = from_record(content[f"reply/{BAD}"])
        named.append(sorted(reply)[-1])
        if what == "reply":
            content[f"reply/{BAD}"] = to_record({**reply, named[-1]: reply[named[-1]] * float("nan")})
        else:
            content["config"] = ConfigRecord({**dict(content["config"]), f"nonfinite/{BAD}": named[-1]})

    tree = _short()
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    _tamper(grid, "train", _figures(change))
    with pytest.raises(DivergedError) as e:
        run_sites(_site_cfg(tree), grid)
    assert str(e.value) == (f"diverged in round {LOST[0]}: client {BAD}'s {what} has non-finite values in "
                            f"'{named[0]}' — lower train.lr (or the algorithm's own lrs)")


def test_a_site_s_clear_figures_rule_by_rule():
    """`clear_fault`: every field present and passing its rule; flags only `<flag>/<cid>` of the clients given, each
    an entry's name (printable, 1 to MAX_NAME characters); nothing else. `seconds`: finite, non-negative numbers."""
    from pflbed.flower.reply_check import MAX_NAME, clear_fault, seconds, shown

    fields = {"round": lambda v: v == 3, "update_s": seconds}
    ok = {"round": 3, "update_s": 0.5}
    assert clear_fault(ok, fields, ["f", "g"], [4, 5]) is None
    assert clear_fault({**ok, "f/4": "w", "g/5": "x" * MAX_NAME, "g/4": "a b"}, fields, ["f", "g"], [4, 5]) is None
    assert [seconds(v) for v in (0, 0.0, 7, 1e9)] == [True] * 4
    assert [seconds(v) for v in (-1e-9, math.inf, math.nan, True, "1", None)] == [False] * 6

    def why(record, cids=(4, 5)):
        return clear_fault(record, fields, ["f", "g"], cids)

    assert why({**ok, "update_s": -1}) == "its 'update_s' is '-1'"
    assert why({**ok, "round": 4}) == "its 'round' is '4'"
    assert why({"round": 3}) == "its 'update_s' is missing"
    assert why({}) == "its 'round' is missing"
    assert why({**ok, "f/6": "w"}) == "it sends 'f/6', which is not a figure of its own clients"
    assert why({**ok, "h/4": "w"}) == "it sends 'h/4', which is not a figure of its own clients"
    assert why({**ok, "f/4": "w"}, cids=()) == "it sends 'f/4', which is not a figure of its own clients"
    assert why({**ok, "f/4": ""}) == "its 'f/4' names no entry: ''"
    assert why({**ok, "g/5": 3}) == "its 'g/5' names no entry: '3'"
    assert why({**ok, "f/4": "x" * (MAX_NAME + 1)}) == f"its 'f/4' names no entry: {'x' * 60 + '…'!r}"
    assert why({**ok, "f/4": "a\tb"}) == "its 'f/4' names no entry: 'a\\tb'"
    assert shown("y" * 61) == repr("y" * 60 + "…") and shown("y" * 60) == repr("y" * 60) and shown(7) == "'7'"
    assert shown("z" * 9, limit=3) == repr("zzz…")


def test_a_site_s_json_nests_at_most_as_deep_as_it_is_told():
    """`site_json`: JSON whose containers nest at most `depth` deep (an empty one counts); a `RecursionError` of the
    parser is a ValueError like any text that is no JSON."""
    from pflbed.flower.reply_check import site_json

    assert [site_json(t, d) for t, d in [("1", 0), ("[1]", 1), ("[]", 1), ('{"a": [1, {}]}', 3)]] == \
        [1, [1], [], {"a": [1, {}]}]  # fmt: skip
    for text, depth in [("[]", 0), ("{}", 0), ("[[1]]", 1), ('[1, {"a": []}]', 2), ('{"a": [1, {}]}', 2), (DEEP, 999)]:
        with pytest.raises(ValueError, match=f"^it nests deeper than {depth}$"):
            site_json(text, depth)
    with pytest.raises(ValueError, match="^Expecting value"):
        site_json("", 3)


def test_a_round_s_timing_adds_up_the_seconds_of_the_replies_it_takes(tmp_path, monkeypatch):
    """`executor.timing`: the sites' seconds summed over the replies taken, once per site's reply (two sites of
    two clients each, every client sampled), a refused reply's left out. The server's own seconds add up over the
    rounds too: its clock here ticks one second a reading, so each round's messages and wait take one each, and
    each reply taken one more."""
    from pflbed.flower import executor
    from pflbed.results.experiment import experiment

    monkeypatch.setattr(executor, "time", ticking_time())

    tree = _short(federation={**TINY["federation"], "clients": 4, "sample_fraction": 1.0})
    client.algorithm.cache_clear()
    dirs, _ = _sites(tmp_path, validate_config(tree))
    nodes = {k: {"data": str(dirs[k] / "train.npz"), "clients": 2, "state-dir": str(tmp_path / f"s{k}")}
             for k in range(2)}  # fmt: skip
    grid = FakeGrid(partitions=2, node_configs=nodes)
    cfg = _site_cfg(tree)
    ex = server_executor(grid, cfg)
    real, taken = grid.send_and_receive, []

    def send(msgs, timeout=None):
        replies = real(msgs, timeout)
        for m, reply in zip(msgs, replies, strict=True):
            if m.metadata.message_type == "train" and not reply.has_error():
                refused = m.metadata.dst_node_id == grid.nodes[BAD] and int(m.content["config"]["round"]) == 2
                reply.content["config"] = ConfigRecord({**dict(reply.content["config"]), "records_s": 0.25,
                                                        "update_s": "abc" if refused else 2.0})  # fmt: skip
                taken.extend([] if refused else [len(m.content["config"]["cids"])])
        return replies

    grid.send_and_receive = send
    with _server_task():
        experiment(cfg, ex.algo, ex, None, False, False)
    assert taken == [2] * 5  # three rounds of two sites, each with its two clients, one reply refused
    assert ex.timing["client_update_s"] == 2.0 * 5 and ex.timing["client_records_s"] == 0.25 * 5
    assert ex.timing["server_records_s"] == 3 + 2 * 5 and ex.timing["wait_s"] == 3


@pytest.mark.parametrize("bound", [None, 10.0])
def test_the_bound_on_updates_is_the_server_s_config(bound, tmp_path):
    """`sites.max_update`: a reply changing the model 500× as much as it did (about 40× its norm) passes the
    default bound (100) and is refused under a bound of 10 (in the last round: accepted earlier, it diverges)."""
    tree = _short()
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    _tamper(grid, "train", _rewrite(lambda p, r: {k: p[k] + (v - p[k]) * 500 for k, v in r.items()}, (3,)))
    cfg = _site_cfg(tree)
    if bound is not None:
        cfg = validate_config({**cfg.model_dump(mode="json"), "sites": {**cfg.sites.model_dump(mode="json"),
                                                                        "max_update": bound}})  # fmt: skip
    refusals = run_sites(cfg, grid).executor.refusals
    assert refusals == [] if bound is None else len(refusals) == 1 and "sites.max_update=10" in refusals[0]


def test_an_algorithm_that_checks_its_own_replies_decides_and_a_shared_default_does_not(monkeypatch):
    """`reply_fits(payload, reply)` (None, or why not) replaces the rule for replies of payload entries; the same
    method on `Algorithm` itself, a default every algorithm shares, does not."""
    from pflbed.algorithms.base import Algorithm
    from pflbed.algorithms.fedavg import FedAvg
    from pflbed.flower.reply_check import ReplyCheck

    class Declares(FedAvg):
        def reply_fits(self, payload, reply):
            return "is not a reply of this algorithm" if "w" not in reply else None

    payload = {"w": torch.zeros(3)}
    assert ReplyCheck(object.__new__(Declares), 100.0).fault(payload, {"dc/w": torch.zeros(3)}) == \
        "is not a reply of this algorithm"  # fmt: skip
    assert ReplyCheck(object.__new__(Declares), 100.0).fault(payload, {"w": torch.ones(3), "n": torch.ones(1)}) is None
    monkeypatch.setattr(Algorithm, "reply_fits", lambda self, p, r: None, raising=False)
    check = ReplyCheck(object.__new__(FedAvg), 100.0)
    assert check.fault(payload, {"w": torch.zeros(2)}) == "has 'w' of shape [2], the server sent [3]"


def test_the_update_bound_is_inclusive_and_a_reply_with_a_key_the_others_lack_is_named_so():
    """Rules of `ReplyCheck`: a change of exactly `sites.max_update` passes (over it is refused); a reply whose key
    set is larger than the one elected for its payload's structure is refused for the keys no other reply has."""
    from pflbed.algorithms.fedavg import FedAvg
    from pflbed.flower.reply_check import ReplyCheck

    payload = {"a": torch.zeros(2), "b": torch.zeros(1)}
    check = ReplyCheck(object.__new__(FedAvg), 0.625)
    assert check.fault(payload, {"a": torch.tensor([0.375, 0.5])}) is None
    assert check.fault(payload, {"a": torch.tensor([0.375, 0.5001])}).startswith("changes the model by 0.625 ×")
    replies = {1: {"a": torch.zeros(2)}, 2: {"a": torch.zeros(2)}, 3: {"a": torch.zeros(2), "b": torch.zeros(1)}}
    refused = check.round(dict.fromkeys(replies, payload), replies, lambda cid: cid)
    assert refused == {3: "client 3's reply has keys ['b'] no other reply has"}
    five = {k: torch.zeros(1) for k in "abcde"}  # a message names at most three keys
    replies = {1: {"a": torch.zeros(1)}, 2: {"a": torch.zeros(1)}, 3: dict(five)}
    assert ReplyCheck(object.__new__(FedAvg), 1.0).round(dict.fromkeys(replies, five), replies, lambda c: c) == \
        {3: "client 3's reply has keys ['b', 'c', 'd'] no other reply has"}  # fmt: skip
    replies = {1: dict(five), 2: dict(five), 3: {"a": torch.zeros(1)}}
    assert ReplyCheck(object.__new__(FedAvg), 1.0).round(dict.fromkeys(replies, five), replies, lambda c: c) == \
        {3: "client 3's reply lacks keys ['b', 'c', 'd']"}  # fmt: skip


def test_the_elected_key_set_is_most_sites_then_the_payload_s_own_then_most_clients_then_the_lowest_site():
    from pflbed.flower.reply_check import ReplyCheck, structure

    sig = structure({k: torch.zeros(1) for k in "abc"})
    own, a, b = frozenset("abc"), frozenset("a"), frozenset("b")

    def site(cid):
        return cid // 10  # clients 10, 11 at site 1; 30 at site 3; 50 at site 5

    assert ReplyCheck.elect(sig, {a: [10, 30], b: [50]}, site) == a  # two sites against one
    assert ReplyCheck.elect(sig, {a: [10, 11], own: [50]}, site) == own  # one site each: the payload's own
    assert ReplyCheck.elect(sig, {b: [50], a: [10, 11]}, site) == a  # one site each, neither own: most clients
    assert ReplyCheck.elect(sig, {a: [50], b: [30]}, site) == b  # then the lowest site


def test_honest_runs_stay_far_below_the_update_bound(tmp_path):
    """The default `sites.max_update` (100) against the honest replies of the site tests' algorithms."""
    from pflbed.flower.reply_check import update_ratio

    worst = []
    for name in ("fedavg", "fedper", "fedselect", "fedrod"):
        tree = _short(name)
        client.algorithm.cache_clear()
        _, grid = _sites(tmp_path / name, validate_config(tree))
        _tamper(grid, "train", _rewrite(lambda p, r: worst.append(update_ratio(p, r)) or r))
        assert run_sites(_site_cfg(tree), grid).executor.refusals == []
    assert worst and max(worst) < 2


def test_the_update_ratio_is_the_change_of_the_entries_sent_over_the_payload_s_norm_at_least_one():
    """Rule (`update_ratio`): ‖reply − payload‖ ÷ max(1, ‖payload‖) over the reply's entries of a payload key and
    shape; the others (a key not sent, another shape: the entry check's to refuse) count for neither norm."""
    from pflbed.flower.reply_check import update_ratio

    small = {"a": torch.zeros(2)}
    assert update_ratio(small, {"a": torch.tensor([0.375, 0.5])}) == 0.625  # over max(1, 0) = 1
    big = {"a": torch.tensor([6.0, 8.0]), "b": torch.ones(3)}
    reply = {"c": torch.ones(1) * 100, "b": torch.ones(2) * 100, "a": torch.tensor([9.0, 12.0])}  # skipped ones first
    assert update_ratio(big, reply) == pytest.approx(5 / 10, rel=1e-12)  # b: another shape, c: not sent
    assert update_ratio(big, {"b": torch.ones(3)}) == 0.0
    # the norms in float64 whatever the entries' dtype: 1,001 in bfloat16 is 1,000 or 1,002
    half = {"h": torch.ones(1001, dtype=torch.bfloat16)}
    moved = {"h": half["h"].clone().index_fill_(0, torch.tensor([0]), 1.5)}
    assert update_ratio(half, moved) == pytest.approx(0.5 / 1001**0.5, rel=1e-12)


def test_under_privacy_the_server_clips_a_reply_again(tmp_path, monkeypatch):
    """A reply whose update is 50× what the site's clip let out (within `sites.max_update`) is clipped again on
    the server: every reply the server rule takes (the round's stream hands on the checked reply, not the one read
    from the message) has an update of norm at most `privacy.clip`."""
    from pflbed.privacy import update_norm

    tree = _short(privacy={"clip": 0.01, "noise_multiplier": 0.5, "randomness": "seeded"})  # a sample with site 1
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    tampered = []

    def fifty(p, r):
        tampered.append(1)
        return {k: p[k] + (v - p[k]) * 50 for k, v in r.items()}

    _tamper(grid, "train", _rewrite(fifty, (1, 2, 3)))
    norms, sent, screen, keep = {}, {}, SiteExecutor.screen, SiteExecutor.keep_on_node

    def seen(self, rnd, payloads, arrived):
        sent.update({(rnd, c): payloads[c] for c in arrived})
        return screen(self, rnd, payloads, arrived)

    def taken(self, rnd, cid, reply, conf):
        norms[rnd, cid] = update_norm(sent[rnd, cid], reply)
        return keep(self, rnd, cid, reply, conf)

    monkeypatch.setattr(SiteExecutor, "screen", seen)
    monkeypatch.setattr(SiteExecutor, "keep_on_node", taken)
    bad = run_sites(_site_cfg(tree), grid)
    assert bad.executor.refusals == [] and tampered and {c for _, c in norms} >= {BAD}
    assert max(norms.values()) <= 0.01 * (1 + 1e-6)


# --- 7. evaluation figures ----------------------------------------------------------------------------------------


def _scores(change):
    def rewrite(msg, reply):
        scores = json.loads(str(reply.content["scores"]["json"]))
        change(scores)
        reply.content["scores"] = ConfigRecord({"json": json.dumps(scores)})

    return rewrite


def _overwrite(s):
    s[""]["test"]["0"] = 0.99  # another site's client


def _above(s):
    s[""]["test"][str(BAD)] = 7.5


def _below(s):
    s[""]["val"][str(BAD)] = -3.0


def _infinite(s):
    s[""]["test"][str(BAD)] = float("inf")


def _gfl_counts(s):
    s[""]["gfl_test"] = [10**9, 10**9]


def _gfl_correct(s):
    s[""]["gfl_val"] = [s[""]["gfl_val"][1] + 1, s[""]["gfl_val"][1]]


def _missing(s):
    del s[""]["test"][str(BAD)]


def _bool(s):
    s[""]["gfl_test"] = [True, True]


FIGURES = {"other_site_client": (_overwrite, "score clients"), "above_one": (_above, "outside"),
           "below_zero": (_below, "outside"), "infinite": (_infinite, "outside"),
           "gfl_counts": (_gfl_counts, "gfl_test"), "gfl_correct": (_gfl_correct, "gfl_val"),
           "missing_client": (_missing, "score clients"), "bool_counts": (_bool, "gfl_test")}  # fmt: skip


def test_the_server_s_check_of_a_site_s_numbers_rule_by_rule():
    """`site_eval.check_scores` on its own: exactly the site's clients, accuracies in [0, 1] (both ends) or NaN, G-FL
    counts [correct, samples] with 0 ≤ correct ≤ samples ≤ the bound (both ends), the samples those declared; each
    part asked for checked, the G-FL counts only in the round's figures."""
    from pflbed.flower.site_eval import check_scores

    def part(test=1.0, val=0.0, **gfl):
        return {"test": {"1": test, "2": 0.5}, "val": {"1": val, "2": 0.5}, **gfl}

    def why(answer, round_figures=True, methods=(), counts=None):
        return check_scores(answer, [1, 2], round_figures, list(methods), 5, counts)

    counted = {"gfl_test": [0, 4], "gfl_val": [5, 5]}
    assert why({"": part(**counted)}, counts=[4, 5]) is None
    assert why({"": part(test=float("nan"))}) is None  # a client without test samples; no G-FL counts sent
    assert why({"ft": part()}, round_figures=False, methods=["ft"]) is None
    assert why({"": part(), "ft": part(gfl_test=[9, 1])}, methods=["ft"]) is None  # counts only in the round's
    refused = [
        ([1, 2], {}, "^its numbers are not a mapping$"),
        ({}, {}, "the round's figures are missing"),
        ({"": part()}, {"methods": ["lp"]}, "'lp' are missing"),
        ({"": {**part(), "test": {"1": 1.0}}}, {}, r"the round's figures score clients \['1'\] on test, its clients "
                                                   r"are \[1, 2\]"),
        ({"": {**part(), "val": [0.5, 0.5]}}, {}, r"score clients \[0.5, 0.5\] on val"),
        ({"": {**part(), "val": 5}}, {}, r"score clients 5 on val"),
        ({"": {**part(), "val": {str(c): 0.5 for c in range(100)}}}, {},  # the clients shown cut to 60 characters
         rf"score clients {re.escape(str(sorted(str(c) for c in range(100)))[:60])} on val"),
        ({"": part(test=1.0000001)}, {}, "give client 1 a test accuracy of 1.0000001, outside"),
        ({"": part(val=-1e-9)}, {}, "give client 1 a val accuracy of -1e-09, outside"),
        ({"": part(test=True)}, {}, "accuracy of True"),
        ({"": part(test="0.5")}, {}, "accuracy of '0.5'"),
        ({"": part(gfl_test=[0, 4])}, {}, r"^gfl_val None is not \[correct, samples\] with 0 ≤ correct ≤ samples ≤ 5$"),
        ({"": part(gfl_val=[0, 4])}, {}, r"^gfl_test None is not"),  # either one sent: both checked
        ({"": part(**{**counted, "gfl_val": list(range(30))})}, {},
         rf"^gfl_val {re.escape(str(list(range(30)))[:60])} is"),  # shown cut to 60 characters
        ({"": part(**{**counted, "gfl_test": [6, 6]})}, {}, r"^gfl_test \[6, 6\] is not"),
        ({"": part(**{**counted, "gfl_test": [3, 2]})}, {}, r"^gfl_test \[3, 2\] is not"),
        ({"": part(**{**counted, "gfl_val": [-1, 2]})}, {}, r"^gfl_val \[-1, 2\] is not"),
        ({"": part(**{**counted, "gfl_val": [1, 2, 3]})}, {}, r"^gfl_val \[1, 2, 3\] is not"),
        ({"": part(**{**counted, "gfl_val": [1.0, 2]})}, {}, r"^gfl_val \[1.0, 2\] is not"),
        ({"": part(**{**counted, "gfl_val": [True, 2]})}, {}, r"^gfl_val \[True, 2\] is not"),
        ({"": part(**counted)}, {"counts": [3, 5]}, r"^gfl_test counts 4 samples, not the 3 it declared or counted "
                                                    r"first$"),
        ({"": part(**counted)}, {"counts": [4, 4]}, r"^gfl_val counts 5 samples, not the 4 it"),
    ]  # fmt: skip
    for answer, options, message in refused:
        got = why(answer, **options)
        assert got is not None and re.search(message, got), (message, got)


@pytest.mark.parametrize("attack", list(FIGURES))
def test_figures_a_site_has_no_right_to_send_stop_the_run_naming_it(attack, tmp_path):
    change, what = FIGURES[attack]
    tree = _short()
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    _tamper(grid, "evaluate", _scores(change))
    with pytest.raises(FlowerRoundError, match=f"^site {BAD}: its evaluation is refused: .*{what}"):
        run_sites(_site_cfg(tree), grid)


def test_a_site_s_g_fl_counts_may_not_change_between_evaluations(tmp_path):
    tree = _tree("fedavg", eval={"every": 1, "finetune": []}, train={**TINY["train"], "rounds": 2})
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    seen = []

    def later(s):
        seen.append(1)
        if len(seen) == 2:
            s[""]["gfl_test"] = [s[""]["gfl_test"][0], s[""]["gfl_test"][1] + 1]

    _tamper(grid, "evaluate", _scores(later))
    with pytest.raises(FlowerRoundError, match=f"^site {BAD}: .*gfl_test counts .* it declared or counted first"):
        run_sites(_site_cfg(tree), grid)


def _declaring(monkeypatch, change=lambda info: info):
    """Sites declaring their clients' test and val sample counts at start-up (`num_test`, `num_val`), `change`d."""
    from pflbed.flower import site_node, sites

    def report(files, clients, cfg, site):
        _, splits = sites.site_splits(files, clients, cfg, site)
        info = {**sites.report(files, clients, cfg, site), "num_val": [len(va) for _, va, _ in splits],
                "num_test": [len(te) for _, _, te in splits]}  # fmt: skip
        return change(info) if site == BAD else info

    monkeypatch.setattr(site_node, "report", report)


def test_g_fl_counts_must_be_those_a_site_declared(tmp_path, monkeypatch):
    """Declared honestly, the run goes through; a site whose figures count other samples than it declared (here:
    it declared none) stops the run at its first evaluation."""
    tree = _short()
    _declaring(monkeypatch)
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path / "honest", validate_config(tree))
    result = run_sites(_site_cfg(tree), grid)
    ex = result.executor
    assert ex.refusals == [] and ex.claims.eval[BAD] == ex.eval_counts[BAD] and ex.eval_counts[BAD][0] > 0
    _declaring(monkeypatch, lambda info: {**info, "num_test": [0] * len(info["num_test"])})
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path / "lying", validate_config(tree))
    with pytest.raises(FlowerRoundError, match=f"^site {BAD}: .*gfl_test counts [1-9][0-9]* samples, not the 0 it "):
        run_sites(_site_cfg(tree), grid)


@pytest.mark.parametrize("num_test", [[-1], [10**15], [True], "3", [1, 2]])
def test_a_declaration_of_test_samples_out_of_bounds_is_refused_at_start_up(num_test, tmp_path, monkeypatch):
    cfg = _site_cfg(_short())
    _declaring(monkeypatch, lambda info: {**info, "num_test": num_test})
    _, grid = _sites(tmp_path, cfg)
    with _server_task(), pytest.raises(SiteError, match=f"^site {BAD}: num_test="):
        discover_sites(grid, cfg)


def test_the_screen_returns_no_reply_of_a_refused_site_and_says_why_each_is_refused(tmp_path, capsys):
    """`SiteExecutor.screen` on its own: a site whose reply has no config record, and one whose reply is of the
    wrong shape, are refused with one line each and taken out of `arrived`; only the other sites' replies are
    returned (the round must not take a refused one, whatever its caller does)."""
    from flwr.app import RecordDict

    grid, ex = _executor(tmp_path, _short())
    server = ex.algo.init_server()
    payloads = ex.algo.configure(2, server, [0, 1, 2, 3])

    def arrived(cid, reply, config=True):
        figures = ConfigRecord({"round": 2, "update_s": 0.5, "records_s": 0.25})
        return RecordDict({**({"config": figures} if config else {}), f"reply/{cid}": to_record(reply)})

    honest = {c: {k: v + 0.001 for k, v in p.items()} for c, p in payloads.items()}
    came = {c: arrived(c, r) for c, r in honest.items()}
    came[1] = arrived(1, honest[1], config=False)
    came[2] = arrived(2, {k: v[..., :1] if v.dim() else v for k, v in honest[2].items()})
    replies = ex.screen(2, payloads, came)
    assert sorted(replies) == sorted(came) == [0, 3]
    assert all(torch.equal(replies[c][k], honest[c][k]) for c in (0, 3) for k in honest[c])
    assert ex.refusals[0] == "site 1, round 2: client 1's reply cannot be read (KeyError: 'config'); its clients are " \
                             "left out of the round"  # fmt: skip
    assert ex.refusals[1].startswith("site 2, round 2: client 2's reply has '") and len(ex.refusals) == 2


def test_a_client_s_state_asked_for_on_the_server_is_refused_naming_the_algorithm(tmp_path):
    _, ex = _executor(tmp_path, _short("fedper"))
    with pytest.raises(SiteError, match=r"^client 2's state is on its site; fedper asked for it on the server$"):
        ex.state(2)


def test_a_site_s_numbers_are_bounded_by_its_clients_and_its_g_fl_counts_kept_from_the_round_s_figures(tmp_path):
    """`SiteExecutor._scores` on its own: the G-FL counts of a site of two clients may reach twice
    sites.max_client_samples; unreadable numbers stop the run naming the site; the counts a site's first round
    figures give are those it is held to from then on, and figures of a personalization alone change nothing."""
    from types import SimpleNamespace

    _, ex = _executor(tmp_path, _short())
    ex.algo.ctx.cfg.sites.max_client_samples = 10  # a site of two clients: up to 20 samples

    def reply(answer):
        return SimpleNamespace(content={"scores": {"json": answer if isinstance(answer, str) else json.dumps(answer)}})

    part = {"test": {"0": 0.5, "1": 1.0}, "val": {"0": 0.5, "1": 0.5}}
    ex.eval_counts.pop(0, None)
    assert ex._scores(0, [0, 1], reply({"ft": part}), False, [(0, "ft")]) == {"ft": part}
    assert 0 not in ex.eval_counts
    counted = {**part, "gfl_test": [12, 20], "gfl_val": [3, 15]}
    assert ex._scores(0, [0, 1], reply({"": counted}), True, []) == {"": counted}
    assert ex.eval_counts[0] == [20, 15]
    with pytest.raises(FlowerRoundError, match=r"^site 0: its evaluation is refused: gfl_test \[12, 21\] is not"):
        ex._scores(0, [0, 1], reply({"": {**counted, "gfl_test": [12, 21]}}), True, [])
    with pytest.raises(FlowerRoundError, match=r"^site 0: its evaluation is refused: its numbers cannot be read "
                                               r"\(JSONDecodeError: "):  # fmt: skip
        ex._scores(0, [0, 1], reply("{"), True, [])
    for deep in (DEEP, {"": {**counted, "test": {"0": [0.5], "1": 1.0}}}):  # past the recursion limit, or 4 deep
        with pytest.raises(FlowerRoundError) as e:
            ex._scores(0, [0, 1], reply(deep), True, [])
        assert str(e.value) == "site 0: its evaluation is refused: its numbers cannot be read (ValueError: it " \
                               "nests deeper than 3)"  # fmt: skip


def test_a_server_test_set_of_one_sample_is_the_g_fl_source(tmp_path):
    from pflbed.data import load_source

    source = load_source(validate_config(_short()).dataset)
    path = tmp_path / "one.npz"
    np.savez(path, x=source.test.x[:1].numpy(), y=source.test.y[:1].numpy())
    cfg = _site_cfg(_short(), test=path)
    _, grid = _sites(tmp_path, cfg)
    ex = server_executor(grid, cfg)
    assert ex.algo.ctx.federation.global_test.numel() == 1
    assert ex.summary_extra == {"gfl_source": "sites.test (on the server)"}


def test_a_final_personalization_is_asked_with_the_final_evaluation_and_of_another_state_on_its_own(tmp_path):
    """The final evaluation (`quick` None) asks every site for its final personalizations too: P-FL of +FT then
    sends nothing. Before any final evaluation, or of another server state (a different object), the sites are
    asked for it alone, without the round's figures; the same numbers for the same weights, without any G-FL
    figure."""
    grid, ex = _executor(tmp_path, _tree("fedavg", train={**TINY["train"], "rounds": 2},
                                         eval={"every": 2, "finetune": ["ft"]}))  # fmt: skip
    asked, answered = [], []
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        asked.extend(json.loads(str(m.content["config"]["methods"])) + [m.content["config"]["round"]] for m in msgs
                     if m.metadata.message_type == "evaluate")  # fmt: skip
        replies = real(msgs, timeout)
        answered.extend(sorted(json.loads(str(r.content["scores"]["json"]))) for r in replies
                        if "scores" in r.content)  # fmt: skip
        return replies

    grid.send_and_receive = send
    server = ex.algo.init_server()
    with _server_task():
        first = ex.personalize_on_sites(server, "ft", 0)
        ex.evaluate_on_sites(server, None)
        cached = ex.personalize_on_sites(server, "ft", 0)
        again = ex.personalize_on_sites(dict(server), "ft", 0)
    assert asked == [[[0, "ft"], False]] * 4 + [[[0, "ft"], True]] * 4 + [[[0, "ft"], False]] * 4
    assert answered == [["ft"]] * 4 + [["", "ft"]] * 4 + [["ft"]] * 4  # the round's figures only when asked
    assert first == cached == again and "pfl_acc" in cached and not any(k.startswith("gfl_") for k in cached)


# --- 8. claims ------------------------------------------------------------------------------------------------------


def _without_tokens(monkeypatch):
    """Sites presenting no token at start-up (a site that lost its state directory, or a node of another make)."""
    real = client.site_report

    def report(context, config):
        return {k: v for k, v in real(context, config).items() if k != TOKEN}

    monkeypatch.setattr(client, "site_report", report)


def _hijacker(grid, site, node, token=None, after=0):
    """Node `node` joins the grid once round `after` is sent, claiming `site` (with a copy of its data and report,
    a token of its own); every message sent to it is recorded."""
    real_ids, real_send = grid.get_node_ids, grid.send_and_receive
    received = []

    def ids():
        return [*real_ids(), node] if grid.trained >= after else real_ids()

    def send(msgs, timeout=None):
        out = []
        for m in msgs:
            if m.metadata.dst_node_id != node:
                out.extend(real_send([m], timeout))
                continue
            received.append(m.metadata.message_type + "/" + m.metadata.group_id)
            m.metadata.__dict__["_dst_node_id"] = grid.nodes[site]  # answered as the site would
            reply = real_send([m], timeout)[0]
            reply.metadata.__dict__["_src_node_id"] = node
            if m.metadata.group_id == "site" and not reply.has_error():
                info = json.loads(str(reply.content["site"]["report"]))
                info[TOKEN] = token
                reply.content["site"] = ConfigRecord({"report": json.dumps(info)})
            out.append(reply)
        return out

    grid.get_node_ids, grid.send_and_receive = ids, send
    return received


@pytest.mark.parametrize("tokens", [True, False])
def test_another_node_claiming_a_site_mid_run_gets_none_of_its_messages(tokens, tmp_path, monkeypatch, capsys):
    """Sites present their tokens: a claim without the site's token is refused; without tokens, a claim while the
    site's node serves it.
    The run is the one without the claim."""
    tree = _short()
    client.algorithm.cache_clear()
    if not tokens:
        _without_tokens(monkeypatch)
    _, grid = _sites(tmp_path / "straight", validate_config(tree))
    straight = run_sites(_site_cfg(tree), grid)
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path / "claimed", validate_config(tree))
    received = _hijacker(grid, 0, 5000, "not-the-token" if tokens else None, after=1)
    claimed = run_sites(_site_cfg(tree), grid)
    assert received == ["query/site"]  # asked once which site it serves (after round 1), then never sent anything
    assert figures(claimed.summary) == figures(straight.summary)
    assert _refusals(capsys) == [
        "pflbed: refused: site 0: node 5000 claims it " + ("without the token it presented at start-up" if tokens
                                                           else "while node 1000 serves it")]  # fmt: skip


def test_a_site_restarted_with_its_token_continues(tmp_path, monkeypatch):
    """The restart of `test_sites_restarted_mid_run_continue_from_their_own_state_directories`, with tokens: the
    restarted sites present theirs again (from their state directories) and continue."""
    tree = _short("fedper")
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    straight = run_sites(_site_cfg(tree), grid)
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path / "again", validate_config(tree))
    grid.restart = {2: [0, 2]}
    restarted = run_sites(_site_cfg(tree), grid)
    assert grid.nodes[0] != 1000 and grid.nodes[2] != 1002
    assert restarted.executor.refusals == []
    assert figures(restarted.summary) == figures(straight.summary)


def test_a_claim_moves_a_site_only_with_its_token_and_its_start_up_report():
    """`Claims.claim` on its own. The first claim binds; its own node again checks nothing. Another node takes a site
    that presented a token with that token alone, even while the first node is still on the grid (a restarted
    site's old node may not have been dropped yet); a site without a token moves only once its node has left. The
    counts (shown to five) and the declared evaluation samples must be those of start-up."""
    c, counts = Claims(), [1, 2, 3, 4, 5, 6, 7]
    assert c.claim(0, 10, {"num_train": counts, TOKEN: "t"}, None, {10}) is None and c.node[0] == 10
    assert c.claim(0, 10, {"num_train": [9]}, None, {10}) is None
    assert c.claim(0, 11, {"num_train": counts, TOKEN: "u"}, None, {10, 11}).endswith("without the token it presented "
                                                                                       "at start-up")  # fmt: skip
    assert c.claim(0, 11, {"num_train": counts, TOKEN: "t"}, None, {10, 11}) is None and c.node[0] == 11
    assert c.claim(0, 12, {"num_train": [9, *counts[1:]], TOKEN: "t"}, None, {12}) == (
        "site 0: node 12 reports training-sample counts [9, 2, 3, 4, 5], not those of start-up [1, 2, 3, 4, 5]")
    assert c.claim(1, 20, {"num_train": [3]}, [4, 4], {20}) is None
    assert c.claim(1, 21, {"num_train": [3]}, [4, 4], {20, 21}) == "site 1: node 21 claims it while node 20 serves it"
    assert c.claim(1, 21, {"num_train": [3]}, [5, 4], {21}).endswith("declares [5, 4] test and val samples, not "
                                                                      "those of start-up")  # fmt: skip
    assert c.claim(1, 21, {"num_train": [3]}, [4, 4], {21}) is None and c.node[1] == 21
    assert c.counts_list() == [counts, [3]]


def test_a_site_s_report_carries_the_token_kept_in_its_own_state_directory(tmp_path):
    """The token a site presents is the one in the state directory its node config names (where a restart finds it
    again); a node asked for data it does not hold answers as site 0 where its node config names no partition."""
    from flwr.app import Context, RecordDict

    from pflbed.flower import site_node

    def _context(node):
        return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})

    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    node = {**grid.node_configs[1], "partition-id": 1}
    report = site_node.site_report(_context(node), _tampered(cfg))
    assert report[TOKEN] == (tmp_path / "states-1" / "site-token").read_text().strip() != ""
    plain = validate_config({**_short(), "executor": {"name": "flower"}})
    with pytest.raises(SiteError, match=r"^site 0: the server asked for this node's data, but its config names no "
                                        r"data=$"):  # fmt: skip
        site_node.site_report(_context({}), _tampered(plain))
    with pytest.raises(SiteError, match=r"^site 1: client \d+ of 5000 has no training samples"):  # named once
        site_node.site_report(_context({**node, "clients": 5000}), _tampered(cfg))


def test_a_site_token_is_made_once_readable_by_its_owner_only(tmp_path):
    token = site_token(tmp_path / "states")
    assert len(token) == 64 and site_token(tmp_path / "states") == token
    assert (tmp_path / "states" / "site-token").stat().st_mode & 0o777 == 0o600


def test_a_second_claim_at_start_up_is_refused_and_the_first_node_keeps_the_site(tmp_path, monkeypatch, capsys):
    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    received = _hijacker(grid, 0, 5000, "mine")
    with _server_task():
        _, claims = discover_sites(grid, cfg)
        ex = SiteExecutor(server_algorithm(cfg, claims.counts_list()), grid, claims.counts_list(), claims)
        ex._ask()  # the executor knows the refused node: it does not ask it again
    assert claims.node[0] == 1000 and ex.node_of[0] == 1000 and received == ["query/site"]
    assert _refusals(capsys) == ["pflbed: refused: site 0: node 5000 claims it without the token it presented at "
                                 "start-up"]  # fmt: skip


def test_a_second_claim_at_start_up_with_a_report_out_of_bounds_is_refused_not_fatal(tmp_path, capsys):
    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    _hijacker(grid, 0, 5000)
    _report_of(grid, 5000, _out_of_bounds)
    with _server_task():
        _, claims = discover_sites(grid, cfg)
    assert claims.node[0] == 1000
    assert [line.split(": num_train")[0] for line in _refusals(capsys)] == ["pflbed: refused: site 0"]


def _report_of(grid, node, change):
    """Node `node`'s start-up answers `change`d: change(reply) rewrites its content."""
    real = grid.send_and_receive

    def send(msgs, timeout=None):
        replies = real(msgs, timeout)
        for r in replies:
            if r.metadata.src_node_id == node and not r.has_error():
                change(r)
        return replies

    grid.send_and_receive = send


def _out_of_bounds(reply):
    info = json.loads(str(reply.content["site"]["report"]))
    reply.content["site"] = ConfigRecord({"report": json.dumps({**info, "num_train": [10**15]})})


def _asked(grid):
    """The nodes each question is sent to, in order (as addressed: before a hijacker's node answers as its site)."""
    real, asked = grid.send_and_receive, []

    def send(msgs, timeout=None):
        asked.extend(m.metadata.dst_node_id for m in msgs if m.metadata.message_type == "query")
        return real(msgs, timeout)

    grid.send_and_receive = send
    return asked


@pytest.mark.parametrize("claim", ["other_token", "no_tokens", "out_of_bounds"])
def test_a_refused_claim_at_start_up_leaves_the_nodes_after_it_asked_once(claim, tmp_path, monkeypatch, capsys):
    """Node 1001 claims site 0 after site 0's node, before the nodes of sites 1-3: refused, and the question's
    other answers are taken as they are — no node is asked twice."""
    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    grid.nodes[1] = 1010  # node ids 1000, 1001 (the claim), 1002, 1003, 1010
    if claim == "no_tokens":
        _without_tokens(monkeypatch)
    _hijacker(grid, 0, 1001, "mine" if claim == "other_token" else None)
    if claim == "out_of_bounds":
        _report_of(grid, 1001, _out_of_bounds)
    asked = _asked(grid)
    with _server_task():
        _, claims = discover_sites(grid, cfg)
    assert asked == [1000, 1001, 1002, 1003, 1010] and claims.node == {0: 1000, 1: 1010, 2: 1002, 3: 1003}
    line = {"other_token": "site 0: node 1001 claims it without the token it presented at start-up",
            "no_tokens": "site 0: node 1001 claims it while node 1000 serves it",
            "out_of_bounds": "site 0: num_train[0]=1000000000000000; a count is an integer from 1 to "
                             f"sites.max_client_samples={cfg.sites.max_client_samples}; its claim is refused"}[claim]
    assert _refusals(capsys) == [f"pflbed: refused: {line}"]


def test_claims_mid_run_are_refused_one_line_each_and_a_node_that_failed_to_answer_is_asked_again(tmp_path, capsys):
    """Nodes joining mid-run, in id order: 4999 holds no data (its answer is an error: asked again next time), 5000
    reports counts out of bounds, 5001 presents another token, 5002 claims a fifth site of four, 5003 site 0 of
    five sites. Each refused with its own line, in that order."""
    from pflbed.flower.client import PARTITION, PARTITIONS

    grid, ex = _executor(tmp_path, _short())
    grid.nodes.append(4999)  # a fifth partition, whose node config names no data
    for node in (5000, 5001, 5002, 5003):
        _hijacker(grid, 0, node, "mine")
    _report_of(grid, 5000, _out_of_bounds)
    for node, (k, parts) in {5002: (4, 4), 5003: (0, 5)}.items():
        _report_of(grid, node, lambda r, k=k, parts=parts: r.content.__setitem__(
            "node", ConfigRecord({PARTITION: k, PARTITIONS: parts})))
    asked = _asked(grid)
    with _server_task():
        ex._ask()
        ex._ask()
    assert asked == [4999, 5000, 5001, 5002, 5003, 4999] and 4999 not in ex.asked
    assert ex.refusals == [
        f"site 0: num_train[0]=1000000000000000; a count is an integer from 1 to sites.max_client_samples="
        f"{ex.algo.ctx.cfg.sites.max_client_samples}; its claim is refused",
        "site 0: node 5001 claims it without the token it presented at start-up",
        "node 5002: a site number beyond the run's", "node 5003: a site number beyond the run's"]
    assert ex.node_of == {k: grid.nodes[k] for k in range(4)}
    assert [line.removeprefix("pflbed: refused: ") for line in _refusals(capsys)] == ex.refusals


# --- SecAgg+: what the server sees in clear -------------------------------------------------------------------------


def _secagg_executor(tmp_path):
    from pflbed.flower.secagg import SecAggExecutor

    tree = _short("fedavg", privacy={"clip": 0.5, "noise_multiplier": 0.5})
    cfg = _site_cfg(tree)
    cfg = validate_config({**cfg.model_dump(mode="json"), "sites": {**cfg.sites.model_dump(mode="json"),
                                                                    "secagg": True}})  # fmt: skip
    _, grid = _sites(tmp_path, cfg)
    ex = server_executor(grid, cfg, SecAggExecutor)
    return ex, ex.algo


def _own(ex, sites=range(4)):
    """Each of `sites`' clients this round, by node (one client per site: the site's number)."""
    return {ex.node_of[s]: [s] for s in sites}


def _fitres(weight, keys, beyond=0):
    return FitRes(Status(Code.OK, ""), Parameters([], ""), weight,
                  {"keys": json.dumps(keys), "beyond_range": beyond})  # fmt: skip


@pytest.mark.parametrize("attack", ["weight", "keys", "foreign_key", "no_metrics", "foreign_key_alone"])
def test_under_secagg_a_site_s_clear_weight_and_keys_are_checked(attack, tmp_path):
    """Its clear weight, the one its clients' counts give; its keys, payload entries named by every site alike
    (alone: the only site with clients in its first round names one the server did not send)."""
    ex, algo = _secagg_executor(tmp_path)
    payload = algo.init_server()
    keys = sorted(payload)
    replied = {ex.node_of[s]: _fitres(1, keys) for s in range(4)}
    weight = {ex.node_of[s]: 1 for s in range(4)}
    bad = ex.node_of[BAD]
    if attack == "foreign_key_alone":
        replied = {n: _fitres(0, []) for n in replied}
        weight = dict.fromkeys(weight, 0)
        replied[bad], weight[bad] = _fitres(1, [*keys, "x"]), 1
        with pytest.raises(FlowerRoundError, match=f"^site {BAD}, round 1: .*not entries sent"):
            ex._check(1, payload, replied, weight, _own(ex, [BAD]))
        return
    ex._check(1, payload, replied, weight, _own(ex))  # the honest round passes
    replied[bad] = {"weight": _fitres(10**6, keys), "keys": _fitres(1, keys[1:]),
                    "foreign_key": _fitres(1, [*keys, "x"]),
                    "no_metrics": FitRes(Status(Code.OK, ""), Parameters([], ""), 1, {})}[attack]  # fmt: skip
    with pytest.raises(FlowerRoundError, match=f"^site {BAD}, round 2: "):
        ex._check(2, payload, replied, weight, _own(ex))


NOT_OWN = "which is not a figure of its own clients"


@pytest.mark.parametrize(("metrics", "sampled", "why"), [
    ({"nonfinite-reply/abc": "w"}, range(4), f"it sends 'nonfinite-reply/abc', {NOT_OWN}"),
    ({f"nonfinite/{OTHER}": "w"}, range(4), f"it sends 'nonfinite/{OTHER}', {NOT_OWN}"),
    ({f"nonfinite/{BAD}": "w"}, [0, 2], f"it sends 'nonfinite/{BAD}', {NOT_OWN}"),
    ({f"nonfinite-reply/{BAD}": NEWLINES}, range(4), f"its 'nonfinite-reply/{BAD}' names no entry: {NEWLINES!r}"),
    ({"beyond_range": -3}, range(4), "its 'beyond_range' is '-3'"),
    ({"beyond_range": True}, range(4), "its 'beyond_range' is 'True'"),
    ({"beyond_range": "5"}, range(4), "its 'beyond_range' is '5'"),
    ({"beyond_range": 2.0}, range(4), "its 'beyond_range' is '2.0'"),
    (lambda n: {"beyond_range": n + 1}, range(4), lambda n: f"its 'beyond_range' is '{n + 1}'"),
    ({"keys": ["w"]}, range(4), "its 'keys' is \"['w']\""),
    ({"note": "x"}, [0, 2], f"it sends 'note', {NOT_OWN}"),
    ({"keys": json.dumps(NEWLINES)}, range(4), f"keys {NEWLINES!r} are not entries sent"),
    ({"keys": json.dumps(["y" * 70])}, range(4), f"keys ['{'y' * 58} are not entries sent"),  # cut at 60
    ({"keys": json.dumps([["w"]])}, range(4), "it nests deeper than 1"),  # names that are no names
    ({"keys": DEEP}, range(4), "it nests deeper than 1"),  # past the recursion limit: crashed the server
    ({"keys": json.dumps({"w": 1})}, range(4), "keys {'w': 1} are not entries sent"),
])  # fmt: skip
def test_under_secagg_a_site_s_clear_metrics_carry_only_its_own_figures(metrics, sampled, why, tmp_path):
    """A site's metrics are its `keys`, its count of entries beyond SecAgg+'s range (0 to the payload's entries)
    and flags of its own clients this round. A flag is a run's stop, so one of another site's client would blame
    that site (one with a name that is no number crashed the server); a negative count would hide another site's.
    Each refused with one line naming the site, sampled or not (`sampled`: the sites with a client this round)."""
    ex, algo = _secagg_executor(tmp_path)
    payload = algo.init_server()
    keys, entries = sorted(payload), sum(v.numel() for v in payload.values())
    replied = {ex.node_of[s]: _fitres(1, keys) for s in range(4)}
    weight = {ex.node_of[s]: 1 for s in range(4)}
    honest = {f"nonfinite/{BAD}": "w", f"nonfinite-reply/{BAD}": "x" * 200, "beyond_range": entries}
    replied[ex.node_of[BAD]].metrics.update(honest)
    ex._check(1, payload, replied, weight, _own(ex))  # its own clients' flags, a count of every entry: taken
    replied[ex.node_of[BAD]] = _fitres(1, keys)
    replied[ex.node_of[BAD]].metrics.update(metrics(entries) if callable(metrics) else metrics)
    with pytest.raises(FlowerRoundError) as e:
        ex._check(2, payload, replied, weight, _own(ex, sampled))
    why = why(entries) if callable(why) else why
    assert str(e.value) == f"site {BAD}, round 2: its clear metrics are refused ({why})"


def test_a_site_executor_given_plain_nodes_binds_them(tmp_path):
    """`SiteExecutor` built from a dict of nodes (no tokens): bound all the same."""
    cfg = _site_cfg(_short())
    _, grid = _sites(tmp_path, cfg)
    with _server_task():
        sizes, claims = discover_sites(grid, cfg)
        ex = SiteExecutor(server_algorithm(cfg, sizes), grid, sizes, dict(claims.node))
    assert ex.claims.node == claims.node and ex.claims.counts == dict(enumerate(sizes))



def test_under_secagg_a_diverged_client_stops_the_run_as_diverged_not_as_an_attack(tmp_path):
    """A NaN in a site's update would unmask as a huge finite entry (SecAgg+ quantizes it to garbage), which the
    bound would take for an attack: the site flags the client in clear, and the round stops as a diverged one."""
    import numpy as np
    from flwr.common import ndarrays_to_parameters

    from pflbed.errors import DivergedError
    from pflbed.flower.secagg_node import NONFINITE_REPLY

    ex, algo = _secagg_executor(tmp_path)
    payload = algo.init_server()
    keys = sorted(payload)
    replied = {ex.node_of[s]: _fitres(1, keys) for s in range(4)}
    ex._check(1, payload, replied, {ex.node_of[s]: 1 for s in range(4)}, _own(ex))
    garbage = ndarrays_to_parameters([np.full(tuple(payload[k].shape), 1e6, np.float32) for k in keys])
    metrics = {"keys": json.dumps(keys), "beyond_range": 0}
    replied = {n: FitRes(Status(Code.OK, ""), garbage, 1, dict(metrics)) for n in replied}
    replied[ex.node_of[BAD]].metrics[f"{NONFINITE_REPLY}/{BAD}"] = keys[0]
    with pytest.raises(DivergedError, match=f"client {BAD}'s reply has non-finite values in '{keys[0]}'"):
        list(ex._replies(1, dict.fromkeys(range(4), payload), replied, [0, 1, 2, 3]))


def _mean_of(payload, replied, value, **metrics):
    """Every site's reply carrying the unmasked mean `value` on each entry, as the protocol hands them back: in
    float64 (Flower's dequantization)."""
    from flwr.common import ndarrays_to_parameters

    keys = sorted(payload)
    mean = ndarrays_to_parameters([np.full(tuple(payload[k].shape), value, np.float64) for k in keys])
    return {n: FitRes(Status(Code.OK, ""), mean, 1, {"keys": json.dumps(keys), "beyond_range": 0, **metrics})
            for n in replied}  # fmt: skip


def test_under_secagg_each_arrived_client_gets_the_payload_plus_the_mean_in_its_dtype_and_its_new_version(tmp_path):
    """`_replies`: one reply per arrived client (one client alone too), payload + the unmasked mean, in the payload's
    dtype, the client's state now of this round; entries beyond SecAgg+'s range, a client flagged non-finite (its
    reply, or its state), and a mean past the bound each stop the round in one line naming the round."""
    from pflbed.errors import DivergedError

    ex, algo = _secagg_executor(tmp_path)
    payload = algo.init_server()
    keys = sorted(payload)
    replied = {ex.node_of[s]: _fitres(1, keys) for s in range(4)}
    ex._check(1, payload, replied, {ex.node_of[s]: 1 for s in range(4)}, _own(ex))
    payloads = dict.fromkeys(range(4), payload)
    got = dict(ex._replies(3, payloads, _mean_of(payload, replied, 0.01), [0, 2, 3]))
    assert sorted(got) == [0, 2, 3] and {c: ex.version.get(c) for c in range(4)} == {0: 3, 1: None, 2: 3, 3: 3}
    for reply in got.values():
        assert all(reply[k].dtype == payload[k].dtype and torch.allclose(reply[k], payload[k] + 0.01) for k in keys)
    assert list(dict(ex._replies(4, payloads, _mean_of(payload, replied, 0.01), [2]))) == [2]
    beyond = _mean_of(payload, replied, 0.01)
    beyond[ex.node_of[2]].metrics["beyond_range"] = 3
    with pytest.raises(FlowerRoundError) as e:
        list(ex._replies(5, payloads, beyond, [0, 1]))
    assert str(e.value) == ("round 5: 3 entries of the sites' updates exceed SecAgg+'s range ±8, where it clips; "
                            "lower train.lr or use privacy.clip")
    with pytest.raises(DivergedError, match=r"^diverged in round 5: client 1's state has non-finite values in 'head'"):
        list(ex._replies(5, payloads, _mean_of(payload, replied, 0.01, **{"nonfinite/1": "head"}), [0, 1]))
    with pytest.raises(DivergedError, match=r"^diverged in round 6: client 1's reply has non-finite values in 'w'"):
        list(ex._replies(6, payloads, _mean_of(payload, replied, 0.01, **{"nonfinite-reply/1": "w"}), [0, 1]))
    with pytest.raises(FlowerRoundError, match=r"^round 7: the sites' mean update is .* over sites.max_update=\S+: a "
                                               r"site sent more than its update$"):  # fmt: skip
        list(ex._replies(7, payloads, _mean_of(payload, replied, 1e6), [0, 1]))
    from pflbed.flower.reply_check import update_ratio

    at = update_ratio(payload, got[0])  # a mean exactly at the bound is taken: the bound is inclusive
    cfg = algo.ctx.cfg
    algo.ctx.cfg = cfg.model_copy(update={"sites": cfg.sites.model_copy(update={"max_update": at})})
    assert len(list(ex._replies(8, payloads, _mean_of(payload, replied, 0.01), [0]))) == 1


def test_under_secagg_the_clear_metrics_are_held_to_the_run_s_key_set_and_the_expected_weight(tmp_path):
    """`_check`: a site naming no entry is refused; the key set elected in the first round is kept for the run (a
    later majority of other keys is refused, not elected); a site with no client this round (`active`) is not
    asked for keys even where it weighs 1 (distributed noise: every site does); each refusal is one full line."""
    ex, algo = _secagg_executor(tmp_path)
    payload = algo.init_server()
    keys = sorted(payload)
    weight = {ex.node_of[s]: 1 for s in range(4)}
    replied = {ex.node_of[s]: _fitres(1, keys) for s in range(4)}
    with pytest.raises(FlowerRoundError) as e:
        ex._check(1, payload, {**replied, ex.node_of[2]: _fitres(1, [])}, weight, _own(ex))
    assert str(e.value) == "site 2, round 1: its clear metrics are refused (keys [] are not entries sent)"
    with pytest.raises(FlowerRoundError) as e:
        ex._check(1, payload, {**replied, ex.node_of[1]: _fitres(5, keys)}, weight, _own(ex))
    assert str(e.value) == "site 1, round 1: it weighs its update 5, the server expects 1 from its clients' counts"
    ex._check(1, payload, replied, weight, _own(ex))  # elects `keys`
    fewer = {**{ex.node_of[s]: _fitres(1, keys[:1]) for s in range(3)}, ex.node_of[3]: _fitres(1, keys)}
    with pytest.raises(FlowerRoundError) as e:
        ex._check(2, payload, fewer, weight, _own(ex))
    assert str(e.value) == f"site 0, round 2: it names updated entries other than the other sites' {keys[:3]}…"
    idle = {**replied, ex.node_of[2]: _fitres(1, []), ex.node_of[3]: _fitres(1, [])}
    ex._check(3, payload, idle, weight, _own(ex, [0, 1]))
