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

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
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


def discover_sites(grid: Grid, cfg: Config, wait_s: float = 120.0) -> tuple[list[list[int]], dict[int, int]]:
    """Every site's clients' training-sample counts, in partition order, and the node serving each site: one
    question to each node as it connects (which site it is, and what it holds), until every site has answered."""
    nodes: dict[int, int] = {}
    parts: set[int] = set()
    sizes: dict[int, list[int]] = {}
    asked: set[int] = set()
    conf = ConfigRecord({"pflbed-config": config_json(cfg)})
    deadline = time.monotonic() + wait_s
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        asks = [Message(RecordDict({"config": conf}), dst_node_id=n, message_type=MessageType.QUERY, group_id="site")
                for n in new]  # fmt: skip
        for reply in grid.send_and_receive(asks, timeout=120) if asks else []:
            if reply.has_error():
                raise SiteError(f"node {reply.metadata.src_node_id} refused the run or could not read its data: "
                                f"{_error(reply)}")  # fmt: skip
            k = int(reply.content["node"][PARTITION])
            parts.add(int(reply.content["node"][PARTITIONS]))
            info = json.loads(str(reply.content["site"]["report"]))
            check_report(cfg, k, info)
            nodes[k], sizes[k] = reply.metadata.src_node_id, [int(n) for n in info["num_train"]]
            asked.add(reply.metadata.src_node_id)
        if len(parts) > 1:
            raise FlowerRoundError(f"the sites disagree on their number: {sorted(parts)}")
        if parts and set(nodes) == set(range(next(iter(parts)))):
            break
        if time.monotonic() > deadline:
            raise FlowerRoundError(f"after {wait_s:.0f} s, sites {sorted(nodes)} of {sorted(parts) or '?'} connected")
        time.sleep(0.2)
    total = sum(len(s) for s in sizes.values())
    if total != cfg.federation.clients:
        raise SiteError(f"federation.clients is {cfg.federation.clients}, but the sites hold {total} clients "
                        f"({', '.join(str(len(sizes[k])) for k in sorted(sizes))}): set federation.clients={total}")
    return [sizes[k] for k in sorted(sizes)], nodes


class SiteExecutor(FlowerExecutor):
    def __init__(self, algo: Algorithm, grid: Grid, sizes: list[list[int]], nodes: dict[int, int]) -> None:
        self.sizes, self.first = sizes, offsets(sizes)
        self.extra_conf = {"site-sizes": json.dumps(sizes)}
        self.node_of, self.parts, self.asked = dict(nodes), {len(sizes)}, set(nodes.values())  # `discover_sites`'s
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

    def site(self, cid: int) -> int:
        """The site holding client `cid` (sites hold consecutive ids, in site order)."""
        return bisect.bisect_right(self.first, cid) - 1

    def _by_node(self, cids: list[int]) -> dict[int, list[int]]:
        by_node: dict[int, list[int]] = {}
        for cid in sorted(cids):
            by_node.setdefault(self.node_of[self.site(cid)], []).append(cid)
        return by_node

    def _ask_sites(self, server: Tensors, round_figures: bool, methods: list[tuple[int, str]]) -> list[dict]:
        """Every site's `evaluate_site` numbers for all its clients: {"": the round's, method: a personalization's}.
        A site that cannot be reached (its node is down, or restarting under a new node id) is asked again until
        it answers or `executor.round_timeout` (default 120 s) has passed: scores need every site."""
        record = to_record(server)
        by_site: dict[int, list[int]] = {}
        for cid in self.algo.ctx.federation.participated:
            by_site.setdefault(self.site(cid), []).append(cid)
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + (self.timeout or 120.0)
        while len(answers) < len(by_site):
            self._ask()  # a restarted site serves its partition again, under a new node id
            msgs, sites = [], []
            for site, cids in by_site.items():
                if site in answers:
                    continue
                conf = {"pflbed-config": self.config, "cids": cids, "versions": [self.version.get(c, 0) for c in cids],
                        "round": round_figures, "methods": json.dumps(methods), **self.extra_conf}  # fmt: skip
                content = RecordDict({"config": ConfigRecord(conf), "server": record})
                msgs.append(Message(content, dst_node_id=self.node_of[site], message_type=MessageType.EVALUATE,
                                    group_id="evaluate"))  # fmt: skip
                sites.append(site)
            replies = self.grid.send_and_receive(msgs, timeout=max(1.0, deadline - time.monotonic()))
            site_of = {m.metadata.message_id: k for m, k in zip(msgs, sites, strict=True)}  # ids set by sending
            for reply in replies:
                site = site_of[reply.metadata.reply_to_message_id]
                if not reply.has_error():
                    answers[site] = json.loads(str(reply.content["scores"]["json"]))
                elif reply.error.code in (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION):
                    raise FlowerRoundError(f"site {site} could not evaluate: {_error(reply)}")
            if len(answers) < len(by_site):
                if time.monotonic() > deadline:
                    missing = sorted(set(by_site) - set(answers))
                    raise FlowerRoundError(f"sites {missing} could not be reached to evaluate their clients")
                time.sleep(1.0)
        return [answers[k] for k in sorted(answers)]

    def evaluate_on_sites(self, server: Tensors, quick: Context | None) -> tuple[dict, dict[int, float]]:
        """A round's figures, scored on the sites; G-FL on the server's test set where it has one (`quick`: its
        subsampled view, for an intermediate evaluation). The final evaluation (`quick` None) asks the sites for the
        run's final personalizations in the same message, one start of each site's ClientApp fewer."""
        ctx = quick or self.algo.ctx
        generic = self.algo.generic_model(server)
        gfl = None
        if generic is not None and ctx.federation.global_test.numel():
            idx = ctx.federation.global_test
            labels = Predictions(ctx.source, ctx.cfg.eval.batch_size)(generic, "test", idx)
            gfl = accuracy(labels, ctx.source.test.y[idx])
        methods = []
        if quick is None:
            methods = list(enumerate(self.algo.finetune_methods(server, list(self.algo.ctx.cfg.eval.finetune))))
        sites = self._ask_sites(server, True, methods)
        self.personalized = (server, {m: [s[m] for s in sites] for _, m in methods})
        return combine([s[""] for s in sites], gfl, generic is not None)

    def personalize_on_sites(self, server: Tensors, method: str, index: int) -> dict:
        """P-FL of a final personalization (+FT, +LP), each site personalizing and scoring its own clients (asked
        with the final evaluation, where that was of this server state)."""
        asked_with, done = getattr(self, "personalized", (None, {}))
        sites = done[method] if asked_with is server and method in done else \
            [s[method] for s in self._ask_sites(server, False, [(index, method)])]  # fmt: skip
        figures = combine(sites, None, False)[0]
        return {k: v for k, v in figures.items() if not k.startswith("gfl_")}  # as `evaluate_personalized`
