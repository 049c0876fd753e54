"""The Flower executor (`executor.name: flower`): a round's client work as Flower messages to SuperNodes.

Runs inside a ServerApp, on its `Grid`, under the same `engine.driver.Driver` as every other executor. Per round
one TRAIN message goes to each node serving a sampled client's partition (`client.py`), carrying those clients'
payloads and states; the reply carries their replies and new states, which this executor keeps like `LoopExecutor`
(states live with the server, where evaluation and checkpoints need them, so a node can restart between rounds
and lose nothing). With `executor.state_dir`, the nodes keep the states instead (`node_states.py`): messages carry
the round of the state each client's node should hold, and the server reads states from the nodes only to
evaluate or checkpoint, once per client since it last trained. A node that restarts connects with a new node id;
the server asks every new node which partition it serves before each round, and sends that partition's clients
to the newest node.

Failures: a client whose node's reply does not arrive within `executor.round_timeout` seconds, or arrives as an
error from the runtime (the node became unavailable, its ClientApp process crashed), is left out of the round: the round
completes with the replies that arrived, the server aggregates with the weights of those clients only, and the
round's record lists the rest in `failed_clients`; their states stay as they were. So are the clients of a reply
the executor refuses (`screen`: where the nodes are the sites', `SiteExecutor` checks each reply against what was
sent). A round in which no client replied stops the run. An exception raised by the client update itself is a
bug, not a lost node: it stops the run with the node's traceback (`client_error`; a site's node, whose text is the
site's own, stops it with one line naming the site).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from pflbed.algorithms.base import Algorithm, Tensors
from pflbed.engine.executor import LoopExecutor
from pflbed.engine.guard import check_client, client_diverged
from pflbed.errors import PflbedError
from pflbed.flower.client import PARTITION, PARTITIONS
from pflbed.flower.project import config_json
from pflbed.flower.records import NONFINITE_STATE, from_record, to_record


class FlowerRoundError(PflbedError):
    """No client of a round replied (every node failed or timed out)."""

    exit_code = 3


class FlowerClientError(RuntimeError):
    """A client update raised an exception on its node (the node's traceback is in the message)."""


def last_line(reason: str) -> str:
    """A node's error as a line may show it: the last line of its reason (the error, without its traceback), and of
    Flower's wrapping of an exception, `<class 'pflbed.flower.sites.SiteError'>:<'site 0: …'>`, the message."""
    reason = reason.strip()
    line = reason.splitlines()[-1] if reason else "no reason"
    wrapped = re.fullmatch(r"<class '[\w.]+'>:<(['\"])(.*)\1>", line)
    return wrapped.group(2) if wrapped else line


class Replies:
    """A round's replies as the driver takes them: `failed` (the sampled clients that did not reply), known before
    the first reply is taken, then (cid, reply) in client order."""

    def __init__(self, failed: list[int], it: Iterator[tuple[int, Tensors]]) -> None:
        self.failed, self._it = failed, it

    def __iter__(self) -> Iterator[tuple[int, Tensors]]:
        return self._it


class FlowerExecutor(LoopExecutor):
    extra_conf: dict = {}  # more of the run that every TRAIN message tells its node (`SiteExecutor`: the sites)
    # Set, empty, by the `states` setter, which the base class's __init__ calls:
    _states: dict[int, Tensors]  # held here: every state, or (on nodes) initial and resumed ones
    version: dict[int, int]  # on nodes: the round of the state each trained client's node holds
    fetched: dict[int, Tensors]  # on nodes: copies read since those clients last trained

    def __init__(self, algo: Algorithm, grid: Grid) -> None:
        self.on_nodes = algo.ctx.cfg.executor.state_dir is not None
        super().__init__(algo)
        self.grid, self.timeout = grid, algo.ctx.cfg.executor.round_timeout
        self.config = config_json(algo.ctx.cfg)
        # Where a round's time goes (`benchmarks/flower_speed.py`): building and reading records here, waiting for
        # the replies, and on the nodes the client updates and their records.
        self.timing = {"server_records_s": 0.0, "wait_s": 0.0, "client_update_s": 0.0, "client_records_s": 0.0}
        if not hasattr(self, "node_of"):  # a subclass may know the nodes already (`SiteExecutor`)
            self.node_of: dict[int, int] = {}  # partition id → node id
            self.parts: set[int] = set()  # the numbers of partitions the nodes declared (one, when they agree)
            self.asked: set[int] = set()
        self._partitions()

    @property
    def states(self) -> dict[int, Tensors]:  # type: ignore[override]
        """Every client state there is (read from the nodes where they are kept there: checkpoints need them)."""
        if not self.on_nodes:
            return self._states
        self._fetch([c for c in self.version if c not in self.fetched])
        return {**self._states, **self.fetched}

    @states.setter
    def states(self, states: dict[int, Tensors]) -> None:
        """States given to the executor (a resumed checkpoint's): on nodes, sent along when each client next
        trains, since its node may hold a later version of it."""
        self._states, self.version, self.fetched = dict(states), {}, {}

    def state(self, cid: int) -> Tensors:
        if cid in self.version:  # on nodes, trained since this executor started
            if cid not in self.fetched:  # one read per node for every client not read yet (evaluations read all)
                self._fetch([c for c in self.version if c not in self.fetched])
            return self.fetched[cid]
        if cid not in self._states:
            self._states[cid] = self.prepare(self.algo.init_client(cid))
        return self._states[cid]

    def _ask(self) -> None:
        """Ask the nodes connected since the last call which partition they serve."""
        new = sorted(set(self.grid.get_node_ids()) - self.asked)
        asks = [Message(RecordDict({}), dst_node_id=n, message_type=MessageType.QUERY, group_id="partitions")
                for n in new]  # fmt: skip
        for reply in self.grid.send_and_receive(asks, timeout=30) if asks else []:
            if not reply.has_error():
                info = reply.content["node"]
                self.node_of[int(info[PARTITION])] = reply.metadata.src_node_id
                self.parts.add(int(info[PARTITIONS]))
                self.asked.add(reply.metadata.src_node_id)
        if len(self.parts) > 1:
            raise FlowerRoundError(f"the SuperNodes disagree on the number of partitions: {sorted(self.parts)}")

    def _partitions(self, wait_s: float = 120.0) -> None:
        """Wait (up to `wait_s`) until the connected nodes serve every partition (nodes connect while the ServerApp
        starts)."""
        deadline = time.monotonic() + wait_s
        while True:
            self._ask()
            if self.parts and set(self.node_of) == set(range(next(iter(self.parts)))):
                return
            if time.monotonic() > deadline:
                of = sorted(self.parts) or "an unknown number"
                raise FlowerRoundError(f"after {wait_s:.0f} s, SuperNodes serve partitions {sorted(self.node_of)} "
                                       f"of {of}: some nodes are missing")  # fmt: skip
            time.sleep(0.2)

    def _by_node(self, cids: list[int]) -> dict[int, list[int]]:
        by_node: dict[int, list[int]] = {}
        for cid in sorted(cids):
            by_node.setdefault(self.node_of[cid % len(self.node_of)], []).append(cid)
        return by_node

    def _fetch(self, cids: list[int]) -> None:
        """Read the states of `cids` from their nodes (one QUERY per node) into `fetched`."""
        if not cids:
            return
        self._ask()
        by_node = self._by_node(cids)
        msgs = [Message(RecordDict({"config": ConfigRecord({"pflbed-config": self.config, "cids": cs,
                                                            "versions": [self.version[c] for c in cs]})}),
                        dst_node_id=node, message_type=MessageType.QUERY, group_id="states")
                for node, cs in by_node.items()]  # fmt: skip
        device = self.algo.ctx.device
        for reply in self.grid.send_and_receive(msgs, timeout=self.timeout):
            if reply.has_error():
                raise FlowerRoundError(f"could not read client states from node {reply.metadata.src_node_id}: "
                                       f"{last_line(reply.error.reason)}")  # fmt: skip
            for key, record in reply.content.array_records.items():
                self.fetched[int(key.split("/")[1])] = from_record(record, device)
        missing = sorted(set(cids) - set(self.fetched))
        if missing:
            raise FlowerRoundError(f"the nodes holding the states of clients {missing} did not answer")

    def stream(self, rnd: int, payloads: dict[int, Tensors]) -> Replies:
        """Send every client's work, wait for the replies (or the round timeout), then hand them on in client
        order; `Replies.failed` says which clients did not reply before any reply is taken."""
        self._ask()  # a node that restarted serves its partition again, under a new node id
        t0 = time.perf_counter()
        by_node = self._by_node(list(payloads))
        msgs = []
        for node, cids in by_node.items():
            conf = {"pflbed-config": self.config, "round": rnd, "cids": cids, **self.extra_conf}
            if self.on_nodes:
                conf["versions"] = [self.version.get(c, 0) for c in cids]
            content = RecordDict({"config": ConfigRecord(conf)})
            for cid in cids:
                content[f"payload/{cid}"] = to_record(payloads[cid])
                if not self.on_nodes or cid in self._states:  # on nodes: only what the node may not have
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
            elif reply.error.code in (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION):
                raise self.client_error(rnd, cids, reply.error.reason)  # a bug, not a lost node
        checked = self.screen(rnd, payloads, arrived)
        for content in {id(c): c for c in arrived.values()}.values():  # each accepted node's reply, once
            # our client always sends both figures; a site's reply without them was refused by `screen`
            conf = content.config_records["config"]
            self.timing["client_update_s"] += float(conf["update_s"])  # type: ignore[arg-type]
            self.timing["client_records_s"] += float(conf["records_s"])  # type: ignore[arg-type]
        clients = sorted(c for c in payloads if c in arrived)
        failed = sorted(c for c in payloads if c not in arrived)
        if not clients:
            raise FlowerRoundError(f"round {rnd}: no client replied (failed: {failed})")
        device = self.algo.ctx.device

        def replies() -> Iterator[tuple[int, Tensors]]:
            for cid in clients:
                t = time.perf_counter()
                content = arrived.pop(cid)
                reply = checked.pop(cid) if cid in checked else from_record(content[f"reply/{cid}"], device)
                if self.on_nodes:
                    self.timing["server_records_s"] += time.perf_counter() - t
                    yield cid, self.keep_on_node(rnd, cid, reply, content["config"])
                    continue
                state = from_record(content[f"state/{cid}"], device)
                self.timing["server_records_s"] += time.perf_counter() - t
                yield cid, self.keep(rnd, cid, reply, state)

        return Replies(failed, replies())

    def client_error(self, rnd: int, cids: list[int], reason: str) -> Exception:
        """The error that stops the run when a node's client update raised: here, with the node's traceback (the
        nodes run the server's own clients: it is a bug)."""
        return FlowerClientError(f"clients {cids} (round {rnd}): {reason}")

    def screen(self, rnd: int, payloads: dict[int, Tensors], arrived: dict[int, RecordDict]) -> dict[int, Tensors]:
        """Replies read and accepted before the round hands any on (none here: the nodes run the server's own
        clients); a subclass whose nodes need not be trusted (`SiteExecutor`) takes the clients of a refused reply
        out of `arrived`, so that they count as lost."""
        return {}

    def keep_on_node(self, rnd: int, cid: int, reply: Tensors, conf: ConfigRecord) -> Tensors:
        """Check a reply whose client's new state stayed on its node, which now holds the state of round `rnd`."""
        check_client(rnd, cid, reply, {})
        if f"{NONFINITE_STATE}/{cid}" in conf:
            raise client_diverged(rnd, cid, "state", str(conf[f"{NONFINITE_STATE}/{cid}"]))
        self.version[cid] = rnd
        self._states.pop(cid, None)
        self.fetched.pop(cid, None)
        return reply
