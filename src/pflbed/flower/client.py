"""The ClientApp: a SuperNode's side of pflbed (DESIGN §5, `executor.name: flower`).

A node receives, per sampled client, one TRAIN message with the run's config (JSON), the round, the client id,
the payload and the client's state; it runs `engine.executor.update_client` — the very function the loop and
procs executors run, seeded from (seed, round, client id) alone — and replies with the reply and the new state.
So the node needs no config file of its own: it builds the run's algorithm (data, federation, model) from the
config the first time it sees it, once per process, and reuses it.

A QUERY message asks which partition of the federation the node serves (`partition-id` of its node config):
the server sends client `cid` to the node serving partition `cid mod num-partitions`.
"""

from __future__ import annotations

import json
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
    conf = msg.content["config"]
    algo = algorithm(str(conf["pflbed-config"]))
    rnd, cid = int(conf["round"]), int(conf["cid"])
    payload, state = from_record(msg.content["payload"]), from_record(msg.content["state"])
    reply, new_state = update_client(algo, rnd, cid, payload, state)
    content = RecordDict({"reply": to_record(reply), "state": to_record(new_state),
                          "config": ConfigRecord({"cid": cid, "round": rnd})})  # fmt: skip
    return Message(content, reply_to=msg)


@app.query()
def partition(msg: Message, context: Context) -> Message:
    part = context.node_config.get(PARTITION, 0)
    parts = context.node_config.get(PARTITIONS, 1)
    return Message(RecordDict({"node": ConfigRecord({PARTITION: int(part), PARTITIONS: int(parts)})}), reply_to=msg)
