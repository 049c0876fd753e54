"""Flower's runtime, faked in this process: the ServerApp's grid and the SuperNodes' ClientApps, with lost nodes,
late replies and restarted nodes on a schedule. Import only after `pytest.importorskip("flwr")`."""

import copy
import itertools
import time
import traceback
import uuid
from types import SimpleNamespace

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from pflbed.flower import client, site_node


def ticking_time() -> SimpleNamespace:
    """A stand-in for a module's `time` whose `perf_counter` ticks one second a reading, so that a test can count
    the seconds a round adds up (the real clock's would differ run to run); waits keep the real clock."""
    return SimpleNamespace(perf_counter=itertools.count().__next__, monotonic=time.monotonic, sleep=time.sleep)


class FakeGrid:
    """A Grid whose nodes run the ClientApp in this process, as Flower's runtime would (an exception in the app
    becomes an error reply). One node per client by default, so that a lost client loses only itself. Schedules,
    by round r:
    - `lost[r]`: the nodes serving these clients are lost (no work done, no reply);
    - `late[r]`: these nodes do the work but their reply comes too late (the server gets an error, as at its
      round timeout; states a node keeps on disk are written);
    - `restart[r]`: the nodes of these partitions restart after round r-1: a new node id, and a ClientApp process
      that has built nothing yet (nothing kept in memory survives).
    As over a real connection, each node keeps its Flower context state from one message to the next, and each
    message's content reaches the node as a copy: what SecAgg+'s four stages need (its mod keeps the protocol's
    state in the context and consumes its config records), and no node can change what the server keeps.
    """

    def __init__(self, partitions=6, lost=None, late=None, restart=None, node_configs=None):
        self.parts, self.lost, self.late, self.restart = partitions, lost or {}, late or {}, restart or {}
        self.node_configs = node_configs or {}  # partition → more node config (a site's data=, state-dir=)
        self.states = {}  # node id → its context state
        self.nodes = [1000 + p for p in range(partitions)]
        self.trained = 0  # the last round of which a node received work

    def get_node_ids(self):
        for part in self.restart.pop(self.trained + 1, ()):
            self.nodes[part] = max(self.nodes) + 1
            client.algorithm.cache_clear()
            site_node._algorithm.cache_clear()
        return list(self.nodes)

    def send_and_receive(self, msgs, timeout=None):
        out = []
        for msg in msgs:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            if msg.metadata.dst_node_id not in self.nodes:  # a node that restarted under a new id
                out.append(Message(Error(ErrorCode.NODE_UNAVAILABLE, "node gone"), reply_to=msg))
                continue
            part = self.nodes.index(msg.metadata.dst_node_id)
            state = self.states.setdefault(msg.metadata.dst_node_id, RecordDict())
            msg.content = copy.deepcopy(msg.content)
            ctx = Context(run_id=1, node_id=msg.metadata.dst_node_id, state=state, run_config={},
                          node_config={client.PARTITION: part, client.PARTITIONS: self.parts,
                                       **self.node_configs.get(part, {})})  # fmt: skip
            conf = msg.content.get("config", {})
            rnd = int(conf.get("round", 0))
            self.trained = max(self.trained, rnd)
            if "cids" in conf and set(conf["cids"]) & set(self.lost.get(rnd, ())):
                out.append(Message(Error(ErrorCode.NODE_UNAVAILABLE, "node gone"), reply_to=msg))
                continue
            try:
                reply = client.app(msg, ctx)
            except Exception:
                reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, traceback.format_exc()), reply_to=msg)
            if "round" in conf and set(conf["cids"]) & set(self.late.get(rnd, ())):
                reply = Message(Error(ErrorCode.MESSAGE_UNAVAILABLE, "reply after the round timeout"), reply_to=msg)
            out.append(reply)
        return out


class FakeSimulation:
    """Runs an experiment on a FakeGrid in this thread. Messages are stamped with the run and task of the process,
    which Flower's runtime sets: set here for the experiment, and put back afterwards (a real simulation may be
    running in this process, idle between its experiments, with its own)."""

    def __init__(self, grid):
        self.grid = grid

    def run(self, algo, experiment):
        from flwr.supercore.task_identity import TaskIdentity

        from pflbed.flower.executor import FlowerExecutor

        keys = ("_run_id", "_task_id", "_node_id")
        saved = {k: getattr(TaskIdentity, k) for k in keys}
        for k in keys:
            setattr(TaskIdentity, k, 1)
        try:
            return experiment(FlowerExecutor(algo, self.grid))
        finally:
            for k, v in saved.items():
                setattr(TaskIdentity, k, v)


