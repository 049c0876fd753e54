"""Secure aggregation on a site-local deployment (`sites.secagg`, `pflbed flower local --site-data … --secagg`).

With the data on the sites, a site's reply is its client's update of the shared model. With SecAgg+ (Bell et al.,
CCS 2020, as Flower implements it: `SecAggPlusWorkflow` on the server, `secaggplus_mod` on the nodes) the server
learns only the round's weighted mean of those updates: each site masks its update with pairwise masks that cancel
in the sum and with a private mask whose seed is secret-shared among the others, so one missing site can be
unmasked without revealing any other.

What crosses, per round, every site taking part (a site with no client sampled sends a zero update of weight zero):
- four messages: the protocol's setup, key sharing, masked update (the payloads go with this one) and unmasking;
- the update: Δ̄_s = Σ_c w_c (reply_c − payload) / Σ_c w_c over the site's sampled clients, w_c = its training
  samples (uniform under `privacy`, whose clip is applied to each reply first, where the client runs), quantized
  with Flower's defaults (each entry clipped to ±8, 2²² levels, stochastic rounding) and masked;
- in clear: the weight Σ_c w_c, the names of the updated entries and each client's finiteness flag.

The server gets Σ_s W_s Δ̄_s / Σ_s W_s = the round's weighted mean update, hands each arrived client that mean as
its reply (so the algorithm's server rule, which reads only the replies' mean, `Algorithm.dp_refused`, sees the
mean of the plain deployment up to the quantization), and with `privacy` the driver adds the noise as always.
Algorithms whose server needs each reply (`dp_refused` set) are refused. The quantization error of one entry is at
most (2·8/2²²)·max W / mean W per site (3.8·10⁻⁶ for equal sites); Flower draws its rounding noise unseeded, so a
SecAgg+ run is not bit-reproducible.

What the server checks of the sites, seeing only the sum: each site's masked vector has the arrays every site must
send, in number, shape and integer type, before the protocol sums it (`_MaskedShapes`); each site's clear weight is
the one the server expects from the counts fixed at start-up, each site's `keys` are payload entries and the same
for every site (and round) (`_check`); and the unmasked mean update stays within `sites.max_update`
(`reply_check`). A site failing one cannot be taken out of a sum already formed: the round stops the run, naming
the site where the server can tell. Whatever else fails inside the protocol (a site's malformed message in one of
its stages) stops the round in one line too.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.serverapp import Grid

from pflbed.algorithms.base import Tensors
from pflbed.engine.guard import client_diverged
from pflbed.flower.executor import FlowerRoundError, Replies
from pflbed.flower.records import NONFINITE_STATE, to_record
from pflbed.flower.reply_check import clear_fault, site_json, structure, update_ratio
from pflbed.flower.secagg_node import (
    CLIP_RANGE,
    MOD_RANGE,
    NONFINITE_REPLY,
    NUM_SHARES,
    RECONSTRUCTION,
    SHARED,
    TARGET_RANGE,
    client_weight,
)
from pflbed.flower.site_executor import SiteExecutor


class _Capture(Strategy):
    """The protocol's strategy: every site takes part; the unmasked mean and each site's clear metrics are kept."""

    def __init__(self, grid: Grid, nodes: list[int]) -> None:
        self.grid, self.nodes = grid, nodes
        self.results: list | None = None

    def initialize_parameters(self, client_manager):  # noqa: ANN001, ANN201
        return None

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201
        return [(GridClientProxy(n, self.grid, 0), FitIns(Parameters([], ""), {})) for n in self.nodes]

    def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001, ANN201
        self.results = results
        return None, {}

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201
        return []

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: ANN001, ANN201
        return None, {}

    def evaluate(self, server_round, parameters):  # noqa: ANN001, ANN201
        return None


class _Workflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ whose masked-vector stage carries pflbed's TRAIN content for each site, and takes each
    site's masked vector only in the shapes every site must send (`_MaskedShapes`)."""

    def __init__(self, contents: dict[int, RecordDict], shapes: _MaskedShapes, **kwargs) -> None:
        super().__init__(**kwargs)
        self.contents, self.shapes = contents, shapes

    def collect_masked_vectors_stage(self, grid, context, state) -> bool:  # noqa: ANN001
        state.nid_to_fitins = {nid: self.contents[nid] for nid in state.nid_to_fitins}
        return super().collect_masked_vectors_stage(_CheckedGrid(grid, self.shapes), context, state)


class _MaskedShapes:
    """What the server can check of a masked vector before SecAgg+ sums it: its arrays' number, shapes and integer
    type — the weight factor (one entry) then one array per payload entry in key order (`secagg_node.site_update`).
    Flower's sum adds the vectors array by array: a vector with an array fewer or more, or one that broadcasts,
    would crash the sum, be cut silently, or garble it unnamed; here the round stops naming the site. Only each
    array's header is read (the sum reads the arrays themselves)."""

    def __init__(self, rnd: int, payload: Tensors, site_of: dict[int, int]) -> None:
        self.rnd, self.site_of = rnd, site_of
        self.want = [(1,), *(tuple(payload[k].shape) for k in sorted(payload))]
        self.names = ["the weight factor", *(f"entry {k!r}" for k in sorted(payload))]

    def check(self, msg: Message) -> None:
        where = f"site {self.site_of[msg.metadata.src_node_id]}, round {self.rnd}: its masked update"
        try:
            got = [_header(b) for b in msg.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
        except (KeyError, TypeError, ValueError):
            raise FlowerRoundError(f"{where} is not a list of .npy arrays") from None
        if len(got) != len(self.want):
            raise FlowerRoundError(f"{where} has {len(got)} arrays, not {len(self.want)} (the weight factor and one "
                                   "per payload entry)")  # fmt: skip
        for (shape, kind), want, name in zip(got, self.want, self.names, strict=True):
            if shape != want or kind != "i":  # Flower's masked vectors are int64
                raise FlowerRoundError(f"{where}'s array for {name} is of shape {shape} and dtype kind {kind!r}, not "
                                       f"integers of shape {want}")  # fmt: skip


class _CheckedGrid:
    """The grid as the masked-vector stage uses it (`send_and_receive` only): each reply that is not an error passes
    `_MaskedShapes.check`."""

    def __init__(self, grid: Grid, shapes: _MaskedShapes) -> None:
        self.grid, self.shapes = grid, shapes

    def send_and_receive(self, messages, timeout=None):  # noqa: ANN001, ANN201
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            if not reply.has_error():
                self.shapes.check(reply)
        return replies


def _header(raw: object) -> tuple[tuple[int, ...], str]:
    """An `.npy` array's shape and dtype kind from its header alone (`np.load` would read the data): version 1.0,
    what `np.save` writes for any array of a model's."""
    if not isinstance(raw, bytes):
        raise TypeError
    f = io.BytesIO(raw)
    if np.lib.format.read_magic(f) != (1, 0):
        raise ValueError
    shape, _, dtype = np.lib.format.read_array_header_1_0(f)
    return tuple(shape), dtype.kind


class SecAggExecutor(SiteExecutor):
    """`SiteExecutor` whose rounds run through SecAgg+: the server sees the round's mean update, not the replies."""

    def stream(self, rnd: int, payloads: dict[int, Tensors]) -> Replies:
        self._ask()
        t0 = time.perf_counter()
        by_node = self._by_node(list(payloads))
        nodes = sorted(set(self.node_of.values()))
        if len(nodes) < 2:
            raise FlowerRoundError("secure aggregation needs at least two sites")
        fed = self.algo.ctx.federation
        first = payloads[min(payloads)]  # every client's payload is the same (`Algorithm.dp_refused` is None)
        shared = to_record(first)
        contents, weight = {}, {}
        for node in nodes:
            cids = by_node.get(node, [])
            conf = {"pflbed-config": self.config, "round": rnd, "cids": cids, **self.extra_conf,
                    "versions": [self.version.get(c, 0) for c in cids]}  # fmt: skip
            contents[node] = RecordDict({"config": ConfigRecord(conf), SHARED: shared})
            # distributed noise: every site's update (its share of the noise, and its clients' summed changes,
            # over qN) counts once, sampled clients or not (`secagg_node`'s docstring)
            weight[node] = 1 if self.site_noise else sum(client_weight(self.algo, fed.num_train(c)) for c in cids)
        capture = _Capture(self.grid, nodes)
        context = LegacyContext(Context(0, 0, {}, RecordDict(), {}), strategy=capture)
        context.state.config_records["config"] = ConfigRecord({"current_round": rnd})
        context.state.array_records["parameters"] = compat.parameters_to_arrayrecord(Parameters([], ""), True)
        workflow = _Workflow(contents, _MaskedShapes(rnd, first, self.site_of), num_shares=NUM_SHARES,
                             reconstruction_threshold=RECONSTRUCTION, max_weight=float(max(max(weight.values()), 1)),
                             clipping_range=CLIP_RANGE, quantization_range=TARGET_RANGE, modulus_range=MOD_RANGE,
                             timeout=self.timeout)  # fmt: skip
        t1 = time.perf_counter()
        try:
            workflow(self.grid, context)
        except FlowerRoundError:
            raise
        except Exception as e:  # the protocol reads what the sites send: whatever fails stops the round in one line
            raise FlowerRoundError(f"round {rnd}: secure aggregation failed ({type(e).__name__}: {e})") from None
        self.timing["server_records_s"] += t1 - t0
        self.timing["wait_s"] += time.perf_counter() - t1
        if not capture.results:
            raise FlowerRoundError(f"round {rnd}: secure aggregation did not complete (too few sites replied)")
        replied = {proxy.node_id: fitres for proxy, fitres in capture.results}
        self._check(rnd, first, replied, weight, by_node)
        arrived = sorted(c for node, fitres in replied.items() for c in by_node.get(node, []))
        failed = sorted(c for c in payloads if c not in set(arrived))
        if not arrived:
            raise FlowerRoundError(f"round {rnd}: no client replied (failed: {failed})")
        return Replies(failed, self._replies(rnd, payloads, replied, arrived))

    @property
    def site_of(self) -> dict[int, int]:
        """Each bound node's site."""
        return {node: site for site, node in self.node_of.items()}

    @property
    def site_noise(self) -> bool:
        """Whether the sites add the noise (`privacy.noise: distributed`)."""
        return self.algo.ctx.cfg.privacy.enabled and self.algo.ctx.cfg.privacy.noise == "distributed"

    def _check(self, rnd: int, payload: Tensors, replied: dict, weight: dict[int, int],
               clients: dict[int, list[int]]) -> None:  # fmt: skip
        """What the server can check of each site in a secure round (its clear weight and metrics); a site failing
        stops the run (its masked update is in the sum already). Its metrics are `keys`, a count of entries beyond
        SecAgg+'s range (at most the payload's) and flags for its own clients this round (`clients`: each node's),
        nothing else (`reply_check.clear_fault`). The key set is fixed as for plain replies (`ReplyCheck`): the one
        most sites name, kept for the run; a site without a client this round names none (under distributed noise
        it weighs 1 all the same)."""
        site_of = self.site_of
        entries = sum(v.numel() for v in payload.values())
        figures = {"keys": lambda v: isinstance(v, str),
                   "beyond_range": lambda v: type(v) is int and 0 <= v <= entries}  # fmt: skip
        votes: dict[frozenset[str], list[int]] = {}
        for node, fitres in sorted(replied.items()):
            site = site_of[node]  # a reply comes from a node asked, a bound one
            if fitres.num_examples != weight[node]:
                raise FlowerRoundError(f"site {site}, round {rnd}: it weighs its update {fitres.num_examples}, the "
                                       f"server expects {weight[node]} from its clients' counts")  # fmt: skip
            why = clear_fault(fitres.metrics, figures, [NONFINITE_STATE, NONFINITE_REPLY], clients.get(node, []))
            if why is not None:
                raise FlowerRoundError(f"site {site}, round {rnd}: its clear metrics are refused ({why})")
            if not clients.get(node):  # no client sampled here: nothing updated (under distributed noise, its share)
                continue
            try:
                keys = site_json(fitres.metrics["keys"], 1)  # a string (`clear_fault`): a list of names
                if not isinstance(keys, list) or not keys or not set(keys) <= set(payload):
                    raise ValueError(f"keys {keys!r:.60} are not entries sent")
            except ValueError as e:
                raise FlowerRoundError(f"site {site}, round {rnd}: its clear metrics are refused ({e})") from None
            votes.setdefault(frozenset(keys), []).append(site)
        sig = structure(payload)
        if sig not in self.check.keys and votes:
            self.check.keys[sig] = self.check.elect(sig, votes, lambda s: s)
        want = self.check.keys.get(sig)
        wrong = sorted(s for keys, sites in votes.items() if keys != want for s in sites)
        if wrong:
            raise FlowerRoundError(f"site {wrong[0]}, round {rnd}: it names updated entries other than the other "
                                   f"sites' {sorted(want or [])[:3]}…")  # fmt: skip

    def _replies(self, rnd: int, payloads: dict[int, Tensors], replied: dict, arrived: list[int]
                 ) -> Iterator[tuple[int, Tensors]]:  # fmt: skip
        """Each arrived client's reply: the payload plus the round's unmasked mean update (one for all). Under
        distributed noise the unmasked mean is Σ_s v_s / (sites that replied), v_s = (Σ_c Δ̃_c + z_s)/qN: the reply
        is w + Σ_s v_s · qN / m for the m arrived clients, whose uniform mean the mechanism scales by m/qN into the
        release w + (Σ Δ̃ + Σ_s z_s)/qN, adding no noise of its own."""
        metrics = [f.metrics for f in replied.values() if f.num_examples > 0]
        for m in metrics:  # a diverged client: its masked NaNs unmask as huge finite entries, so the site says so
            for flag, key in sorted(m.items()):
                if flag.startswith(f"{NONFINITE_REPLY}/"):
                    raise client_diverged(rnd, int(flag.split("/")[1]), "reply", str(key))
        keys = self.check.keys[structure(payloads[arrived[0]])]
        beyond = sum(int(m["beyond_range"]) for m in metrics)
        if beyond:
            raise FlowerRoundError(f"round {rnd}: {beyond} entries of the sites' updates exceed SecAgg+'s range "
                                   f"±{CLIP_RANGE:g}, where it clips; lower train.lr or use privacy.clip")  # fmt: skip
        base = payloads[arrived[0]]
        update = dict(zip(sorted(base), parameters_to_ndarrays(next(iter(replied.values())).parameters), strict=True))
        scale = 1.0
        if self.site_noise:  # Σ_s v_s · qN / m (docstring)
            q, n = self.algo.ctx.cfg.federation.sample_fraction, len(self.algo.ctx.federation.participated)
            scale = len(replied) * q * n / len(arrived)
        mean = {k: base[k] + torch.from_numpy(np.asarray(update[k] * scale, dtype=np.float32)).to(base[k].device)
                for k in sorted(keys)}  # fmt: skip
        ratio = update_ratio(base, mean)
        if ratio > self.algo.ctx.cfg.sites.max_update:
            raise FlowerRoundError(f"round {rnd}: the sites' mean update is {ratio:.3g} × max(1, the model's norm), "
                                   f"over sites.max_update={self.algo.ctx.cfg.sites.max_update:g}: a site sent "
                                   "more than its update")  # fmt: skip
        flags = {k: v for m in metrics for k, v in m.items() if k.startswith(f"{NONFINITE_STATE}/")}
        for cid in arrived:  # each client's new state stayed on its site, as with the plain site executor
            yield cid, self.keep_on_node(rnd, cid, mean, flags)
