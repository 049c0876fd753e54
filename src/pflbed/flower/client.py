"""The ClientApp: a SuperNode's side of pflbed (DESIGN §5, `executor.name: flower`).

A node receives, per round, one TRAIN message with the run's config (JSON), the round, and for each sampled client
it serves the payload and the client's state; it runs `engine.executor.update_client` for each — the very function
the loop and procs executors run, seeded from (seed, round, client id) alone — and replies with the replies and
the new states. The node needs no config file of its own: it builds the run's algorithm (data, federation, model)
from the config the first time it sees it, once per process, and reuses it. One message per node rather than per
client: in a deployment each message starts a ClientApp process (seconds, before any work), so a round costs one
start per node, not one per client.

A QUERY message asks which partition of the federation the node serves (`partition-id` of its node config):
the server sends client `cid` to the node serving partition `cid mod num-partitions`.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from pflbed.algorithms.base import Algorithm
from pflbed.config import validate_config
from pflbed.engine.executor import update_client
from pflbed.engine.loop import prepare
from pflbed.flower.records import from_record, to_record

PARTITION, PARTITIONS = "partition-id", "num-partitions"

app = ClientApp()


@lru_cache(maxsize=4)
def algorithm(config_json: str) -> Algorithm:
    """The run's algorithm in this process, built once per config; one torch thread unless the config sets
    `executor.threads` (several node processes share the machine's cores)."""
    return prepare(validate_config(json.loads(config_json)), threads=1)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """The updates of the round's clients this node serves, one after another (records `payload/<cid>` and
    `state/<cid>` in, `reply/<cid>` and `state/<cid>` out)."""
    conf = msg.content["config"]
    algo = algorithm(str(conf["pflbed-config"]))
    rnd = int(conf["round"])
    out = RecordDict()
    update_s = records_s = 0.0
    for cid in (int(c) for c in conf["cids"]):
        t0 = time.perf_counter()
        payload, state = from_record(msg.content[f"payload/{cid}"]), from_record(msg.content[f"state/{cid}"])
        t1 = time.perf_counter()
        reply, new_state = update_client(algo, rnd, cid, payload, state)
        t2 = time.perf_counter()
        out[f"reply/{cid}"], out[f"state/{cid}"] = to_record(reply), to_record(new_state)
        update_s, records_s = update_s + t2 - t1, records_s + time.perf_counter() - t2 + t1 - t0
    out["config"] = ConfigRecord({"round": rnd, "update_s": update_s, "records_s": records_s})  # where time goes
    return Message(out, reply_to=msg)


@app.query()
def partition(msg: Message, context: Context) -> Message:
    part = context.node_config.get(PARTITION, 0)
    parts = context.node_config.get(PARTITIONS, 1)
    return Message(RecordDict({"node": ConfigRecord({PARTITION: int(part), PARTITIONS: int(parts)})}), reply_to=msg)
