"""The server's side of a deployment with the data on the sites (`sites.local`).

`discover_sites` asks every SuperNode, before the run's algorithm exists, what it holds (`sites.report`), and
refuses a site whose samples or labels do not fit the run; the server's algorithm is then built over no client data
(`sites.server_algorithm`). `SiteExecutor` trains as `FlowerExecutor` with the states on the nodes, the clients of
site k being the global ids that follow those of sites 0…k−1, and evaluates on the sites (`site_eval`): the server
receives numbers, never a sample or a client state. Its checkpoints hold, per client, only the round of the state
its site keeps (`site.version`), which is all a resumed server needs to ask the sites for the right one.

A site is not trusted to be honest: each site is bound to the node found at start-up (`site_claims`), its
clients' counts are bounded and fixed then, each round's replies are checked against what was sent
(`reply_check`: a wrong one leaves its site out of the round, as a lost reply), and so is what a reply carries
besides them (`reply_check.clear_fault`: the round, seconds, flags of its own clients), and its evaluation figures
against its own clients (`site_eval.check_scores`: wrong ones stop the run, naming the site). A site whose node
fails a round's work stops the run with one line naming it (`client_error`), not with the site's traceback.
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
from pflbed.flower.executor import FlowerExecutor, FlowerRoundError, last_line
from pflbed.flower.project import config_json
from pflbed.flower.records import NONFINITE_STATE, from_record, to_record
from pflbed.flower.reply_check import ReplyCheck, clear_fault, refuse, seconds, shown, site_json
from pflbed.flower.site_claims import Claims, check_counts, declared_eval
from pflbed.flower.site_eval import check_scores, combine
from pflbed.flower.sites import SiteError, check_report, offsets
from pflbed.privacy import clip_reply

VERSION = "site.version"


def site_question(grid: Grid, cfg_json: str, nodes: list[int], timeout: float) -> list[Message]:
    """Ask `nodes` which site each serves and what it holds (`sites.report`)."""
    conf = ConfigRecord({"pflbed-config": cfg_json})
    asks = [Message(RecordDict({"config": conf}), dst_node_id=n, message_type=MessageType.QUERY, group_id="site")
            for n in nodes]  # fmt: skip
    return list(grid.send_and_receive(asks, timeout=timeout)) if asks else []


def site_answer(reply: Message, cfg: Config) -> tuple[int, int, dict]:
    """(site, number of sites, report) of a node's answer, its report checked against the run (`SiteError`: one
    line naming the site, or the node where it does not say which site it is)."""
    node = reply.metadata.src_node_id
    try:
        k, parts = int(reply.content["node"][PARTITION]), int(reply.content["node"][PARTITIONS])
        info = site_json(str(reply.content["site"]["report"]), 2)  # lists in a mapping
        if not isinstance(info, dict) or not {"num_train", "input_shape", "labels"} <= set(info):
            raise ValueError("a report of num_train, input_shape and labels is needed")
    except (KeyError, TypeError, ValueError) as e:
        raise SiteError(f"node {node}: its answer to the start-up question is not one ({e})") from None
    try:
        check_report(cfg, k, info)
    except (TypeError, ValueError) as e:  # shapes or labels that are not lists of integers
        raise SiteError(f"site {k}: its report's input_shape or labels are not lists of integers ({e})") from None
    why = check_counts(cfg, k, info["num_train"])
    if why is not None:
        raise SiteError(why)
    try:
        info["evals"] = declared_eval(cfg, k, info)
    except ValueError as e:
        raise SiteError(str(e)) from None
    return k, parts, info


def _claimed(reply: Message) -> int | None:
    """The site a node's answer claims to be, where it says."""
    try:
        return int(reply.content["node"][PARTITION])
    except (KeyError, TypeError, ValueError):
        return None


def discover_sites(grid: Grid, cfg: Config, wait_s: float = 120.0) -> tuple[list[list[int]], Claims]:
    """Every site's clients' training-sample counts, in partition order, and the node serving each site (bound
    to it: `site_claims.Claims`): one question to each node as it connects (which site it is, and what it holds),
    until every site has answered. A second node claiming a site is refused (one line), unless it is the site
    restarted (`Claims.claim`)."""
    claims = Claims()
    parts: set[int] = set()
    asked = claims.asked
    cfg_json = config_json(cfg)
    deadline = time.monotonic() + wait_s
    while True:
        connected = set(grid.get_node_ids())
        for reply in site_question(grid, cfg_json, sorted(connected - asked), 120):
            if reply.has_error():
                raise SiteError(f"node {reply.metadata.src_node_id} refused the run or could not read its data: "
                                f"{last_line(reply.error.reason)}")  # fmt: skip
            asked.add(reply.metadata.src_node_id)
            try:
                k, n_parts, info = site_answer(reply, cfg)
            except SiteError as e:
                if _claimed(reply) not in claims.node:
                    raise
                refuse(f"{e}; its claim is refused")  # another node's claim of a site found already
                continue
            why = claims.claim(k, reply.metadata.src_node_id, info, info["evals"], connected)
            if why is not None:
                refuse(why)
                continue
            parts.add(n_parts)
        if len(parts) > 1:
            raise FlowerRoundError(f"the sites disagree on their number: {sorted(parts)}")
        if parts and set(claims.node) == set(range(next(iter(parts)))):
            break
        if time.monotonic() > deadline:
            raise FlowerRoundError(f"after {wait_s:.0f} s, sites {sorted(claims.node)} of {sorted(parts) or '?'} "
                                   "connected")  # fmt: skip
        time.sleep(0.2)
    sizes = claims.counts_list()
    total = sum(len(s) for s in sizes)
    if total != cfg.federation.clients:
        raise SiteError(f"federation.clients is {cfg.federation.clients}, but the sites hold {total} clients "
                        f"({', '.join(str(len(s)) for s in sizes)}): set federation.clients={total}")
    return sizes, claims


class SiteExecutor(FlowerExecutor):
    def __init__(self, algo: Algorithm, grid: Grid, sizes: list[list[int]], nodes: Claims | dict[int, int]) -> None:
        self.sizes, self.first = sizes, offsets(sizes)
        self.extra_conf = {"site-sizes": json.dumps(sizes)}
        if not isinstance(nodes, Claims):  # nodes known otherwise: bound to them, without tokens
            claims = Claims()
            claims.node, claims.counts, claims.token = dict(nodes), dict(enumerate(sizes)), dict.fromkeys(nodes)
            claims.eval = dict.fromkeys(nodes)
            nodes = claims
        self.claims = nodes
        nodes.asked |= set(nodes.node.values())
        self.node_of, self.parts, self.asked = nodes.node, {len(sizes)}, nodes.asked  # shared with the claims
        cfg = algo.ctx.cfg
        self.check = ReplyCheck(algo, cfg.sites.max_update)
        self.refusals: list[str] = []  # every line refusing a site's replies or claim, in order
        # site → its test and val sample counts: as declared at start-up, else as its first evaluation counted them
        self.eval_counts: dict[int, list[int]] = {k: v for k, v in nodes.eval.items() if v is not None}
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

    def _refuse(self, line: str) -> None:
        self.refusals.append(line)
        refuse(line)

    def _ask(self) -> None:
        """Ask each node connected since the last call which site it serves (`discover_sites`'s question): a
        restarted site's new node serves it from then on, where `Claims.claim` accepts it; any other claim is
        refused with one line, and the node is not asked again."""
        connected = set(self.grid.get_node_ids())
        cfg = self.algo.ctx.cfg
        for reply in site_question(self.grid, self.config, sorted(connected - self.asked), 30):
            if reply.has_error():  # asked again next time, as a node not up yet
                continue
            node = reply.metadata.src_node_id
            self.asked.add(node)
            try:
                k, n_parts, info = site_answer(reply, cfg)
            except SiteError as e:
                self._refuse(f"{e}; its claim is refused")
                continue
            why = "a site number beyond the run's" if not 0 <= k < len(self.sizes) or n_parts != len(self.sizes) \
                else self.claims.claim(k, node, info, info["evals"], connected)  # fmt: skip
            if why is not None:
                self._refuse(why if why.startswith("site") else f"node {node}: {why}")

    def screen(self, rnd: int, payloads: dict[int, Tensors], arrived: dict[int, RecordDict]) -> dict[int, Tensors]:
        """Every reply read and checked (`reply_check.ReplyCheck`) before the round takes any: a site with a reply
        that cannot be read, or is refused, is taken out of `arrived` (its clients count as lost this round, and its
        states stay at their last accepted round), with one line naming it. Under `privacy`, the replies are clipped
        again here (`privacy.clip_reply`, which leaves an honest clipped reply as it is)."""
        device, replies, refused = self.algo.ctx.device, {}, {}
        for cid in sorted(arrived):
            content = arrived[cid]
            try:
                if "config" not in content.config_records:
                    raise KeyError("config")
                replies[cid] = from_record(content.array_records[f"reply/{cid}"], device)
            except (KeyError, TypeError, ValueError) as e:
                refused.setdefault(self.site(cid), f"client {cid}'s reply cannot be read ({type(e).__name__}: {e})")
        for site, cids in self._sites_of(arrived).items():
            why = None if site in refused else self._clear_fault(rnd, arrived[cids[0]], cids)
            if why is not None:
                refused[site] = why
        readable = {c: r for c, r in replies.items() if self.site(c) not in refused}
        for site, why in self.check.round(payloads, readable, self.site).items():
            refused.setdefault(site, why)
        for site, why in sorted(refused.items()):
            self._refuse(f"site {site}, round {rnd}: {why}; its clients are left out of the round")
            for cid in [c for c in arrived if self.site(c) == site]:
                del arrived[cid]
                replies.pop(cid, None)
        clip = self.algo.ctx.cfg.privacy.clip
        if clip is not None:
            replies = {c: clip_reply(payloads[c], r, clip) for c, r in replies.items()}
        return replies

    def _sites_of(self, arrived: dict[int, RecordDict]) -> dict[int, list[int]]:
        """The arrived clients of each site (one reply each: a site is one node)."""
        sites: dict[int, list[int]] = {}
        for cid in sorted(arrived):
            sites.setdefault(self.site(cid), []).append(cid)
        return sites

    @staticmethod
    def _clear_fault(rnd: int, content: RecordDict, cids: list[int]) -> str | None:
        """Why a site's reply is refused beyond its tensors (`reply_check.clear_fault`): records other than its
        clients' replies and its figures, or figures other than the round, its seconds and its clients' flags."""
        extra = sorted(set(content.array_records) - {f"reply/{c}" for c in cids}) + \
            sorted(set(content.config_records) - {"config"}) + sorted(content.metric_records)  # fmt: skip
        if extra:
            return f"its reply holds {shown(extra[0])}, which is not a record of its clients' replies"
        figures = {"round": lambda v: v == rnd and type(v) is int, "update_s": seconds, "records_s": seconds}
        why = clear_fault(content.config_records["config"], figures, [NONFINITE_STATE], cids)
        return None if why is None else f"its reply's figures are refused: {why}"

    def client_error(self, rnd: int, cids: list[int], reason: str) -> Exception:
        """A site whose node failed the round's work (its policy refused the run, say) stops the run with one line
        naming it: the last line of its reason, the site's own text."""
        return FlowerRoundError(f"site {self.site(cids[0])}, round {rnd}: its node failed the round's work: "
                                f"{last_line(reason)}")  # fmt: skip

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
                view = self.algo.server_view(server, cids)  # shared entries and this site's clients' only
                content = RecordDict({"config": ConfigRecord(conf), "server": to_record(view)})
                msgs.append(Message(content, dst_node_id=self.node_of[site], message_type=MessageType.EVALUATE,
                                    group_id="evaluate"))  # fmt: skip
                sites.append(site)
            replies = self.grid.send_and_receive(msgs, timeout=max(1.0, deadline - time.monotonic()))
            site_of = {m.metadata.message_id: k for m, k in zip(msgs, sites, strict=True)}  # ids set by sending
            for reply in replies:
                site = site_of[reply.metadata.reply_to_message_id]
                if not reply.has_error():
                    answers[site] = self._scores(site, by_site[site], reply, round_figures, methods)
                elif reply.error.code in (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION):
                    raise FlowerRoundError(f"site {site} could not evaluate: {last_line(reply.error.reason)}")
            if len(answers) < len(by_site):
                if time.monotonic() > deadline:
                    missing = sorted(set(by_site) - set(answers))
                    raise FlowerRoundError(f"sites {missing} could not be reached to evaluate their clients")
                time.sleep(1.0)
        return [answers[k] for k in sorted(answers)]

    def _scores(self, site: int, cids: list[int], reply: Message, round_figures: bool,
                methods: list[tuple[int, str]]) -> dict:  # fmt: skip
        """A site's evaluation numbers, checked (`site_eval.check_scores`): figures it has no right to send stop the
        run, naming the site — without its clients the figures would be of another federation."""
        bound = self.algo.ctx.cfg.sites.max_client_samples * len(cids)
        try:
            answer = site_json(str(reply.content["scores"]["json"]), 3)  # per part, per split, per client
            why = check_scores(answer, cids, round_figures, [m for _, m in methods], bound,
                               self.eval_counts.get(site))  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            why = f"its numbers cannot be read ({type(e).__name__}: {e})"
        if why is not None:
            raise FlowerRoundError(f"site {site}: its evaluation is refused: {why}")
        if round_figures and "gfl_test" in answer[""]:
            self.eval_counts[site] = [answer[""]["gfl_test"][1], answer[""]["gfl_val"][1]]
        return answer

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
