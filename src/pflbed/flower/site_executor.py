"""The server's side of a deployment with the data on the sites (`sites.local`).

`discover_sites` asks every SuperNode, before the run's algorithm exists, what it holds (`sites.report`), and
refuses a site whose samples or labels do not fit the run; the server's algorithm is then built over no client data
(`sites.server_algorithm`). `SiteExecutor` trains as `FlowerExecutor` with the states on the nodes, the clients of
site k being the global ids that follow those of sites 0…k−1, and evaluates on the sites (`site_eval`): the server
receives numbers, never a sample or a client state. Its checkpoints hold, per client, only the round of the state
its site keeps (`site.version`), which is all a resumed server needs to ask the sites for the right one.
"""

from __future__ import annotations

import bisect
import json
import time
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from pflbed.algorithms.base import Algorithm, Context, Tensors
from pflbed.config import Config
from pflbed.evaluation.evaluate import Predictions
from pflbed.evaluation.metrics import accuracy
from pflbed.flower.client import PARTITION, PARTITIONS
from pflbed.flower.executor import FlowerExecutor, FlowerRoundError
from pflbed.flower.project import config_json
from pflbed.flower.records import to_record
from pflbed.flower.site_eval import combine
from pflbed.flower.sites import SiteError, check_report, offsets

VERSION = "site.version"


def _error(reply: Message) -> str:
    reason = reply.error.reason.strip()
    return reason.splitlines()[-1] if reason else "no reason"


def discover_sites(grid: Grid, cfg: Config, wait_s: float = 120.0) -> list[list[int]]:
    """Every site's clients' training-sample counts, in partition order, once a node serves each partition."""
    nodes: dict[int, int] = {}
    parts: set[int] = set()
    deadline = time.monotonic() + wait_s
    while True:
        asks = [Message(RecordDict({}), dst_node_id=n, message_type=MessageType.QUERY, group_id="partitions")
                for n in grid.get_node_ids() if n not in nodes.values()]  # fmt: skip
        for reply in grid.send_and_receive(asks, timeout=30) if asks else []:
            if not reply.has_error():
                nodes[int(reply.content["node"][PARTITION])] = reply.metadata.src_node_id
                parts.add(int(reply.content["node"][PARTITIONS]))
        if len(parts) > 1:
            raise FlowerRoundError(f"the sites disagree on their number: {sorted(parts)}")
        if parts and set(nodes) == set(range(next(iter(parts)))):
            break
        if time.monotonic() > deadline:
            raise FlowerRoundError(f"after {wait_s:.0f} s, sites {sorted(nodes)} of {sorted(parts) or '?'} connected")
        time.sleep(0.2)
    conf = ConfigRecord({"pflbed-config": config_json(cfg)})
    asks = [Message(RecordDict({"config": conf}), dst_node_id=nodes[k], message_type=MessageType.QUERY,
                    group_id="site") for k in sorted(nodes)]  # fmt: skip
    sizes: dict[int, list[int]] = {}
    site_of = {nodes[k]: k for k in nodes}
    for reply in grid.send_and_receive(asks, timeout=120):
        k = site_of[reply.metadata.src_node_id]
        if reply.has_error():
            raise SiteError(f"site {k} refused the run or could not read its data: {_error(reply)}")
        info = json.loads(str(reply.content["site"]["report"]))
        check_report(cfg, k, info)
        sizes[k] = [int(n) for n in info["num_train"]]
    if set(sizes) != set(nodes):
        raise FlowerRoundError(f"sites {sorted(set(nodes) - set(sizes))} did not say what they hold")
    total = sum(len(s) for s in sizes.values())
    if total != cfg.federation.clients:
        raise SiteError(f"federation.clients is {cfg.federation.clients}, but the sites hold {total} clients "
                        f"({', '.join(str(len(sizes[k])) for k in sorted(sizes))}): set federation.clients={total}")
    return [sizes[k] for k in sorted(sizes)]


class SiteExecutor(FlowerExecutor):
    def __init__(self, algo: Algorithm, grid: Grid, sizes: list[list[int]]) -> None:
        self.sizes, self.first = sizes, offsets(sizes)
        self.extra_conf = {"site-sizes": json.dumps(sizes)}
        super().__init__(algo, grid)
        self.on_nodes = True
        has_test = algo.ctx.federation.global_test.numel() > 0
        self.summary_extra = {"gfl_source": "sites.test (on the server)" if has_test else
                              "the sites' test data, sample-weighted"}  # fmt: skip

    @property
    def states(self) -> dict[int, Tensors]:  # type: ignore[override]
        """Per client, the round of the state its site keeps (what checkpoints hold: the states stay on the sites)."""
        return {c: {VERSION: torch.tensor([v])} for c, v in self.version.items()}

    @states.setter
    def states(self, states: dict[int, Tensors]) -> None:
        self._states, self.fetched = {}, {}
        self.version = {int(c): int(s[VERSION][0]) for c, s in states.items()}

    def state(self, cid: int) -> Tensors:
        raise SiteError(f"client {cid}'s state is on its site; {self.algo.ctx.cfg.algorithm.name} asked for it on "
                        "the server")  # fmt: skip

    def _by_node(self, cids: list[int]) -> dict[int, list[int]]:
        by_node: dict[int, list[int]] = {}
        for cid in sorted(cids):
            by_node.setdefault(self.node_of[bisect.bisect_right(self.first, cid) - 1], []).append(cid)
        return by_node

    def _ask_sites(self, server: Tensors, method: str, index: int) -> list[dict[str, Any]]:
        """Every site's `evaluate_site` numbers for all its clients."""
        self._ask()
        record = to_record(server)
        msgs = []
        by_node = self._by_node(list(self.algo.ctx.federation.participated))
        for node, cids in by_node.items():
            conf = {"pflbed-config": self.config, "cids": cids, "versions": [self.version.get(c, 0) for c in cids],
                    "method": method, "method-index": index, **self.extra_conf}  # fmt: skip
            content = RecordDict({"config": ConfigRecord(conf), "server": record})
            msgs.append(Message(content, dst_node_id=node, message_type=MessageType.EVALUATE, group_id="evaluate"))
        out = []
        for reply in self.grid.send_and_receive(msgs, timeout=self.timeout):
            if reply.has_error():
                raise FlowerRoundError(f"node {reply.metadata.src_node_id} could not evaluate: {_error(reply)}")
            out.append(json.loads(str(reply.content["scores"]["json"])))
        if len(out) != len(msgs):
            raise FlowerRoundError(f"{len(msgs) - len(out)} sites did not return their evaluation")
        return out

    def evaluate_on_sites(self, server: Tensors, quick: Context | None) -> tuple[dict, dict[int, float]]:
        """A round's figures, scored on the sites; G-FL on the server's test set where it has one (`quick`: its
        subsampled view, for an intermediate evaluation)."""
        ctx = quick or self.algo.ctx
        generic = self.algo.generic_model(server)
        gfl = None
        if generic is not None and ctx.federation.global_test.numel():
            idx = ctx.federation.global_test
            labels = Predictions(ctx.source, ctx.cfg.eval.batch_size)(generic, "test", idx)
            gfl = accuracy(labels, ctx.source.test.y[idx])
        return combine(self._ask_sites(server, "", 0), gfl, generic is not None)

    def personalize_on_sites(self, server: Tensors, method: str, index: int) -> dict:
        """P-FL of a final personalization (+FT, +LP), each site personalizing and scoring its own clients."""
        figures = combine(self._ask_sites(server, method, index), None, False)[0]
        return {k: v for k, v in figures.items() if not k.startswith("gfl_")}  # as `evaluate_personalized`
