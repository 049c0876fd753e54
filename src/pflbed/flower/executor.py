"""The Flower executor (`executor.name: flower`): a round's client work as Flower messages to SuperNodes.

Runs inside a ServerApp, on its `Grid`, under the same `engine.driver.Driver` as every other executor. Per round
one TRAIN message goes to each node serving a sampled client's partition (`client.py`), carrying those clients'
payloads and states; the reply carries their replies and new states, which this executor keeps like `LoopExecutor`
(states live with the server, where evaluation and checkpoints need them, so a node can restart between rounds
and lose nothing).

Failures: a client whose node's reply does not arrive within `executor.round_timeout` seconds, or arrives as an
error from the runtime (the node became unavailable, its ClientApp process crashed), is left out of the round: the round
completes with the replies that arrived, the server aggregates with the weights of those clients only, and the
round's record lists the rest in `failed_clients`; their states stay as they were. A round in which no client
replied stops the run. An exception raised by the client update itself is a bug, not a lost node: it stops the
run with the node's traceback.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from pflbed.algorithms.base import Algorithm, Tensors
from pflbed.engine.executor import LoopExecutor
from pflbed.errors import PflbedError
from pflbed.flower.client import PARTITION, PARTITIONS
from pflbed.flower.project import config_json
from pflbed.flower.records import from_record, to_record


class FlowerRoundError(PflbedError):
    """No client of a round replied (every node failed or timed out)."""

    exit_code = 3


class FlowerClientError(RuntimeError):
    """A client update raised an exception on its node (the node's traceback is in the message)."""


class Replies:
    """A round's replies as the driver takes them: `failed` (the sampled clients that did not reply), known before
    the first reply is taken, then (cid, reply) in client order."""

    def __init__(self, failed: list[int], it: Iterator[tuple[int, Tensors]]) -> None:
        self.failed, self._it = failed, it

    def __iter__(self) -> Iterator[tuple[int, Tensors]]:
        return self._it


class FlowerExecutor(LoopExecutor):
    def __init__(self, algo: Algorithm, grid: Grid) -> None:
        super().__init__(algo)
        self.grid, self.timeout = grid, algo.ctx.cfg.executor.round_timeout
        self.config = config_json(algo.ctx.cfg)
        # Where a round's time goes (`benchmarks/flower_speed.py`): building and reading records here, waiting for
        # the replies, and on the nodes the client updates and their records.
        self.timing = {"server_records_s": 0.0, "wait_s": 0.0, "client_update_s": 0.0, "client_records_s": 0.0}
        self.node_of = self._partitions()

    def _partitions(self, wait_s: float = 120.0) -> dict[int, int]:
        """partition id → node id, asked of every connected node; waits (up to `wait_s`) until the connected
        nodes serve every partition (nodes connect while the ServerApp starts)."""
        found: dict[int, int] = {}
        parts: set[int] = set()
        asked: set[int] = set()
        deadline = time.monotonic() + wait_s
        while True:
            new = sorted(set(self.grid.get_node_ids()) - asked)
            asks = [Message(RecordDict({}), dst_node_id=n, message_type=MessageType.QUERY, group_id="partitions")
                    for n in new]  # fmt: skip
            for reply in self.grid.send_and_receive(asks, timeout=30) if asks else []:
                if not reply.has_error():
                    info = reply.content["node"]
                    found[int(info[PARTITION])] = reply.metadata.src_node_id
                    parts.add(int(info[PARTITIONS]))
                    asked.add(reply.metadata.src_node_id)
            if len(parts) > 1:
                raise FlowerRoundError(f"the SuperNodes disagree on the number of partitions: {sorted(parts)}")
            if parts and set(found) == set(range(next(iter(parts)))):
                return found
            if time.monotonic() > deadline:
                raise FlowerRoundError(f"after {wait_s:.0f} s, SuperNodes serve partitions {sorted(found)} of "
                                       f"{sorted(parts) or 'an unknown number'}: some nodes are missing")  # fmt: skip
            time.sleep(0.2)

    def stream(self, rnd: int, payloads: dict[int, Tensors]) -> Replies:
        """Send every client's work, wait for the replies (or the round timeout), then hand them on in client
        order; `Replies.failed` says which clients did not reply before any reply is taken."""
        parts = len(self.node_of)
        t0 = time.perf_counter()
        by_node: dict[int, list[int]] = {}
        for cid in sorted(payloads):
            by_node.setdefault(self.node_of[cid % parts], []).append(cid)
        msgs = []
        for node, cids in by_node.items():
            content = RecordDict({"config": ConfigRecord({"pflbed-config": self.config, "round": rnd, "cids": cids})})
            for cid in cids:
                content[f"payload/{cid}"] = to_record(payloads[cid])
                content[f"state/{cid}"] = to_record(self.state(cid))
            msgs.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(rnd)))
        arrived: dict[int, RecordDict] = {}
        t1 = time.perf_counter()
        replies = list(self.grid.send_and_receive(msgs, timeout=self.timeout))
        self.timing["server_records_s"] += t1 - t0
        self.timing["wait_s"] += time.perf_counter() - t1
        cids_of = {m.metadata.message_id: cids for m, cids in zip(msgs, by_node.values(), strict=True)}
        for reply in replies:
            cids = cids_of[reply.metadata.reply_to_message_id]
            if not reply.has_error():
                arrived.update((c, reply.content) for c in cids)
                self.timing["client_update_s"] += float(reply.content["config"]["update_s"])
                self.timing["client_records_s"] += float(reply.content["config"]["records_s"])
            elif reply.error.code in (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION):
                raise FlowerClientError(f"clients {cids} (round {rnd}): {reply.error.reason}")  # a bug, not a lost node
        clients = sorted(c for c in payloads if c in arrived)
        failed = sorted(c for c in payloads if c not in arrived)
        if not clients:
            raise FlowerRoundError(f"round {rnd}: no client replied (failed: {failed})")
        device = self.algo.ctx.device

        def replies() -> Iterator[tuple[int, Tensors]]:
            for cid in clients:
                t = time.perf_counter()
                content = arrived.pop(cid)
                reply = from_record(content[f"reply/{cid}"], device)
                state = from_record(content[f"state/{cid}"], device)
                self.timing["server_records_s"] += time.perf_counter() - t
                yield cid, self.keep(rnd, cid, reply, state)

        return Replies(failed, replies())
