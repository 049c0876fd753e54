"""The ClientApp: a SuperNode's side of pflbed (DESIGN §5, `executor.name: flower`).

A node receives, per round, one TRAIN message with the run's config (JSON), the round, and for each sampled client
it serves the payload and the client's state; it runs `engine.executor.update_client` for each — the very function
the loop and procs executors run, seeded from (seed, round, client id) alone — and replies with the replies and
the new states. The node needs no config file of its own: it builds the run's algorithm (data, federation, model)
from the config the first time it sees it, once per process, and reuses it. One message per node rather than per
client: in a deployment each message starts a ClientApp process (seconds, before any work), so a round costs one
start per node, not one per client.

With `executor.state_dir`, the states stay on the node (`node_states.py`): the message carries, instead of each
client's state, the round of the state the server expects (`versions`), and the reply carries no state — only,
for a client whose new state is non-finite, its first bad key (`nonfinite/<cid>`), for the server's divergence
guard. A state the server holds and the node may not (after the server resumed from a checkpoint) still comes in
the message, and is used instead of the node's.

QUERY messages ask which partition of the federation the node serves (`partition-id` of its node config: the
server sends client `cid` to the node serving partition `cid mod num-partitions`), or, with a `config`, for the
node's stored states of some clients (`cids`, `versions`).

A site (a node whose node config names data of its own: `site_node`) trusts the server with less: it answers only
the partition question and the site-local run's start-up question (group `site`), and trains and evaluates only
within what `site_policy.check` accepts — checked first, for every message, before anything is built, read or
written — and what `site_message` takes of the message's other fields. It never builds an algorithm from the
server's config alone (`algorithm`), so a server cannot make it load a file as initial weights, download into a
directory, or read back the states it keeps.
"""

from __future__ import annotations

import json
import time
from functools import cache, lru_cache

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.compat.common.recorddict_compat import fitres_to_recorddict

from pflbed.algorithms.base import Algorithm
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import update_client
from pflbed.engine.guard import first_nonfinite
from pflbed.flower import secagg_node as secagg
from pflbed.flower import site_policy
from pflbed.flower.node_states import NODE_CONFIG_KEY, NodeStates
from pflbed.flower.records import NONFINITE_STATE, from_record, to_record
from pflbed.flower.site_eval import evaluate_site
from pflbed.flower.site_message import check_payload, check_query, config_record, evaluate_fields, train_fields
from pflbed.flower.site_node import site_algorithm_of, site_config, site_report
from pflbed.flower.sites import SiteError

PARTITION, PARTITIONS = "partition-id", "num-partitions"
SITE_QUERIES = {"partitions": False, "site": True}  # what a site answers: group → whether it carries a config

app = ClientApp()


@lru_cache(maxsize=4)
def algorithm(config_json: str) -> Algorithm:
    """The run's algorithm in this process, built once per config; one torch thread unless the config sets
    `executor.threads` (several node processes share the machine's cores)."""
    return prepare(validate_config(json.loads(config_json)), threads=1)


def node_states(context: Context, config_json: str, algo: Algorithm) -> NodeStates | None:
    """Where this node keeps its clients' states (its `state-dir` node config, else `executor.state_dir`); None
    when they travel with the messages (`executor.state_dir` unset)."""
    if algo.ctx.cfg.executor.state_dir is None:
        return None
    return NodeStates(str(context.node_config.get(NODE_CONFIG_KEY) or algo.ctx.cfg.executor.state_dir),
                      config_json, algo)  # fmt: skip


@app.train(mods=[secagg.secagg_if_asked])
def train(msg: Message, context: Context) -> Message:
    """The updates of the round's clients this node serves, one after another (records `payload/<cid>` and
    `state/<cid>` in, `reply/<cid>` and `state/<cid>` out; states on the node: see the module's docstring)."""
    site = site_policy.holds_data(context.node_config)
    if site:  # a site: the message's fields and its policy, checked first
        conf = config_record(msg.content, "TRAIN")
        config = str(conf["pflbed-config"])
        algo, stored = site_algorithm_of(context, config, str(conf["site-sizes"]))  # its own data and states
        rnd, cids, versions = train_fields(msg.content, algo, secagg.asked(msg))
    else:
        conf = msg.content["config"]
        config = str(conf["pflbed-config"])
        site_config(dict(context.node_config), config)  # refuses a site-local run
        algo = algorithm(config)
        stored = node_states(context, config, algo)
        rnd, cids = int(conf["round"]), [int(c) for c in conf["cids"]]
        versions = dict(zip(cids, (int(v) for v in conf["versions"]), strict=True)) if stored else {}
    if secagg.asked(msg):  # SecAgg+'s masked-vector step: one update for the site, its states kept here
        return secure_train(msg, algo, stored, rnd, cids, versions)
    out = RecordDict()
    flags: dict[str, str] = {}
    update_s = records_s = 0.0
    for cid in cids:
        t0 = time.perf_counter()
        payload = from_record(msg.content[f"payload/{cid}"])
        sent = msg.content.get(f"state/{cid}")
        state = from_record(sent) if sent is not None or stored is None else stored.load(cid, versions[cid])
        if site:  # as the algorithm's server sends it (a node without data of its own trusts its server)
            check_payload(algo, rnd, cid, payload, state)
        t1 = time.perf_counter()
        reply, new_state = update_client(algo, rnd, cid, payload, state)
        t2 = time.perf_counter()
        out[f"reply/{cid}"] = to_record(reply)
        if stored is None:
            out[f"state/{cid}"] = to_record(new_state)
        else:
            stored.save(cid, rnd, new_state, keep=versions[cid])
            bad = first_nonfinite(new_state)
            if bad is not None:
                flags[f"{NONFINITE_STATE}/{cid}"] = bad
        update_s, records_s = update_s + t2 - t1, records_s + time.perf_counter() - t2 + t1 - t0
    out["config"] = ConfigRecord({"round": rnd, "update_s": update_s, "records_s": records_s, **flags})
    return Message(out, reply_to=msg)


def secure_train(msg: Message, algo: Algorithm, stored: NodeStates | None, rnd: int, cids: list[int],
                 versions: dict[int, int]) -> Message:  # fmt: skip
    """The site's clients' updates from the round's shared payload, as one weighted update for SecAgg+ to mask
    (`secagg.site_update`, with the site's share of the noise under distributed DP); their new states stay on
    the site, each non-finite one flagged."""
    if stored is None:
        raise ValueError("secure aggregation keeps the clients' states on the sites (sites.local)")
    payload = from_record(msg.content[secagg.SHARED], algo.ctx.device)
    replies, flags = [], {}
    for cid in cids:
        state = stored.load(cid, versions[cid])
        check_payload(algo, rnd, cid, payload, state)
        reply, new_state = update_client(algo, rnd, cid, payload, state)
        stored.save(cid, rnd, new_state, keep=versions[cid])
        bad = first_nonfinite(new_state)
        if bad is not None:
            flags[f"{NONFINITE_STATE}/{cid}"] = bad
        bad = first_nonfinite(reply)  # masked, a NaN would unmask as a finite, huge entry: said in clear instead
        if bad is not None:
            flags[f"{secagg.NONFINITE_REPLY}/{cid}"] = bad
        replies.append((reply, secagg.client_weight(algo, algo.ctx.client_data(cid).num_train)))
    sites = len(json.loads(str(msg.content["config"]["site-sizes"])))  # checked by the site's policy already
    update = secagg.site_update(payload, replies, flags, secagg.noise_share(algo.ctx.cfg, sites))
    return Message(fitres_to_recorddict(update, False), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The node's partition, or (with a `config`) the stored states of the clients asked for; a site answers only
    its partition and, at a site-local run's start-up, what it holds (`SITE_QUERIES`)."""
    group, has_config = msg.metadata.group_id, "config" in msg.content
    if site_policy.holds_data(context.node_config):
        if SITE_QUERIES.get(group) is not has_config:
            raise SiteError(f"this site answers only the server's {' and '.join(map(repr, SITE_QUERIES))} queries, "
                            f"not a {group!r} query{' with a config' if has_config else ''}")  # fmt: skip
        check_query(msg.content, has_config)
    if not has_config:
        return partition(msg, context)
    conf = msg.content["config"]
    config = str(conf["pflbed-config"])
    if group == "site":  # a site-local run's start-up: what this site holds (`site_node.site_report` checks it)
        info = json.dumps(site_report(context, config))
        node = partition(msg, context).content["node"]
        return Message(RecordDict({"node": node, "site": ConfigRecord({"report": info})}), reply_to=msg)
    stored = node_states(context, config, algorithm(config))
    if stored is None:
        raise ValueError("client states were asked of a node, but executor.state_dir is unset")
    out = RecordDict({f"state/{int(c)}": to_record(stored.load(int(c), int(v)))
                      for c, v in zip(conf["cids"], conf["versions"], strict=True)})  # fmt: skip
    return Message(out, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """A site-local run's evaluation of this site's clients (`site_eval.evaluate_site`): numbers, no samples."""
    if not site_policy.holds_data(context.node_config):
        raise SiteError("an evaluation was asked of a node that holds no data of its own")
    conf = config_record(msg.content, "EVALUATE")
    config = str(conf["pflbed-config"])
    algo, stored = site_algorithm_of(context, config, str(conf["site-sizes"]))
    server = cache(lambda: from_record(msg.content["server"], algo.ctx.device))  # read once: after the clients' check
    cids, versions, figures, methods = evaluate_fields(msg.content, algo, server)
    view = server()
    state = lambda c: stored.load(c, versions[c])  # noqa: E731
    scores = {}
    if figures:  # the round's figures
        scores[""] = evaluate_site(algo, view, state, cids)
    for i, method in methods:  # final personalizations (+FT, +LP), by their index
        scores[method] = evaluate_site(algo, view, state, cids, method, i)
    return Message(RecordDict({"scores": ConfigRecord({"json": json.dumps(scores)})}), reply_to=msg)


def partition(msg: Message, context: Context) -> Message:
    part = context.node_config.get(PARTITION, 0)
    parts = context.node_config.get(PARTITIONS, 1)
    return Message(RecordDict({"node": ConfigRecord({PARTITION: int(part), PARTITIONS: int(parts)})}), reply_to=msg)
