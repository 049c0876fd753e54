"""The algorithm contract (DESIGN §4).

Everything that crosses the server/client boundary is a flat `dict[str, Tensor]`: payloads, replies, server
state and client state alike. No Python object is shared between server and client, so the same algorithm runs
in-process, in worker processes or across machines, and checkpoints are just tensor dicts. A client's randomness
comes from a generator seeded by (seed, round, client id), so where and in which order clients run never changes
a result.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from pflbed.algorithms.common import Budget as Budget  # re-exported: the contract's shared types
from pflbed.algorithms.common import ClientContext as ClientContext
from pflbed.algorithms.common import ClientData as ClientData
from pflbed.algorithms.common import Predictor as Predictor
from pflbed.algorithms.common import Same as Same
from pflbed.algorithms.common import Tensors as Tensors
from pflbed.algorithms.reply_shapes import UNSENT, Spec, misfit, specs, whole
from pflbed.data.arrays import DataSource
from pflbed.data.augment import Augment
from pflbed.federation import Federation
from pflbed.models import BlockNet, build_model

if TYPE_CHECKING:
    from pflbed.algorithms.local_sgd import LocalSGDPlan
    from pflbed.config import Config  # annotations only


class NoOptions(BaseModel):
    """Algorithm-specific options: none."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class Context:
    """What an algorithm may read: config, data, federation and one reusable model object per architecture.

    `device` is where the run's tensors live (`executor.device`): the data, the federation's indices and priors, and
    the models are on it, so a tensor an algorithm creates belongs there too — take the device from the data, the
    parameters or `ctx.device`, never from torch's default device. Random generators stay on the CPU.
    """

    cfg: Config
    source: DataSource
    federation: Federation
    options: BaseModel
    model: BlockNet  # reusable template: load parameters in, train, read them out
    initial_params: Tensors = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    augment: Augment | None = None  # `dataset.augment`, applied by `ClientData.batch`

    @property
    def seed(self) -> int:
        return self.cfg.seed

    def new_model(self, name: str | None = None) -> BlockNet:
        """A fresh zoo model on `device`, initialized from torch's global (CPU) RNG, which the caller seeds."""
        name = name or self.cfg.model.name
        m = self.cfg.model
        return build_model(name, self.source.input_shape, self.source.num_classes, self.device, m.channels_last)

    def client_data(self, cid: int) -> ClientData:
        split = self.federation.clients[cid]
        return ClientData(cid, self.source.train.x, self.source.train.y, split.train, split.val, split.prior,
                          self.augment)  # fmt: skip


class Aggregator(Protocol):
    """The server's side of one round (`Algorithm.aggregator`): replies in, one at a time, then the new server."""

    def add(self, cid: int, reply: Tensors) -> None: ...

    def result(self) -> Tensors: ...


class _Collected:
    """The default aggregator: every reply kept, then `Algorithm.aggregate` over all of them."""

    def __init__(self, algo: Algorithm, rnd: int, server: Tensors, weights: dict[int, float]) -> None:
        self.algo, self.rnd, self.server, self.weights = algo, rnd, server, weights
        self.replies: dict[int, Tensors] = {}

    def add(self, cid: int, reply: Tensors) -> None:
        self.replies[cid] = reply

    def result(self) -> Tensors:
        return self.algo.aggregate(self.rnd, self.server, self.replies, self.weights)


class Algorithm:
    """Subclass once per algorithm file. See DESIGN §4 for the life cycle."""

    name: ClassVar[str]
    Config: ClassVar[type[BaseModel]] = NoOptions
    # Client-level DP (`pflbed.privacy`): None declares that every reply entry is the client's new value of the
    # payload entry of the same name (the same payload for every client), and that the server reads the replies only
    # through their weighted mean, so clipping each client's change and noising their sum protects all that leaves
    # a client; otherwise why DP does not apply (`privacy.clip` is then refused with this line).
    dp_refused: ClassVar[str | None] = "its replies are not declared to be updates of a model shared by every client"
    # Server-state entries that belong to one client: a regular expression matched at the start of a key, its first
    # group the client's id (e.g. r"local/(\d+)/"). None: every entry is shared. A site-local run sends each site
    # only the shared entries and its own clients' (`server_view`).
    client_entries: ClassVar[str | None] = None
    # Integer payload entries that are instructions to the clients, never replied and holding nothing private (L2GD's
    # run lengths): exempt from client-level DP's check that every payload entry can be clipped and noised.
    dp_instructions: ClassVar[tuple[str, ...]] = ()
    # Why the client update is not a `LocalSGDPlan`, for an algorithm that declares no `sgd_plan`: it then runs
    # client by client under `executor.batch_clients` too (docs/algorithms lists it with this reason). None: a plan.
    loop_only: ClassVar[str | None] = None

    @staticmethod
    def secagg_refusal(options: BaseModel) -> str | None:
        """Why these options cannot run under SecAgg+ (`sites.secagg`), as the one-line config error; None: they can.
        SecAgg+ sends one payload to every site and sums one update per site, so options that give some clients
        another payload (pFedMe's `train_clients: all`) are refused."""
        return None

    @staticmethod
    def unread_train(options: BaseModel) -> frozenset[str]:
        """The `train.*` keys that a run with these options never reads in its training and its own evaluation:
        none by default. An update of plain gradient steps reads no `momentum` or `weight_decay`, and one whose
        phases have lengths of their own reads no `local_epochs`.

        Why declare them: `pflbed tune` searches the `train.*` keys for every method, and a key the method never
        reads is a dimension of noise in its search (trials spent learning nothing about it) and a "chosen value"
        that means nothing. A personalization (`eval.finetune`, new clients) reads `common.Budget.TRAIN_KEYS`
        whatever this says. `tests/algorithms/test_unread_train.py` runs every algorithm with each key changed."""
        return frozenset()

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.opts = ctx.options

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        raise NotImplementedError

    def init_client(self, cid: int) -> Tensors:
        """Personal state a client starts with (heads, masks, coefficients…). Default: none."""
        return {}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        raise NotImplementedError

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """Why `payload` is not what this algorithm's server sends client `cid` (holding `state`) in round `rnd`:
        another key set, shape or dtype (`reply_shapes.misfit`); None if it is. A site checks every payload with
        this before its client trains on it (`pflbed.flower.site_message`).

        Why: a site-local deployment's server is another party, and the client update reads its payload as the
        algorithm's `configure` makes it. A payload with more keys than that can name the client's personal
        entries: an update that starts from `{**payload, **state}` and replies `payload`'s keys would send them
        back trained (GPFL's head), and one that starts from `{**state, **payload}` would train from the
        server's choice of them. One of another shape would fail inside the update, or broadcast.

        Default: the structure `configure` gives from the initial server state in the same round, which is every
        round's for an algorithm whose server state keeps its structure. An algorithm whose payloads change
        structure with the round, the client's history or its state (a warm start ending, entries a client holds
        personal, models of other clients chosen per round) overrides this with the structures its server can
        send; `tests/algorithms/test_payload_fits.py` runs every algorithm and checks each payload against it."""
        return misfit(payload, specs(self.configure(rnd, self.init_server(), [cid])[cid]), UNSENT)

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        """Default: run the algorithm's `sgd_plan` on the shared model (algorithms without one override this)."""
        from pflbed.algorithms.local_sgd import run_plan

        plan = self.round_plan(payload, state, data, cctx)
        if plan is None:
            raise NotImplementedError(f"{self.name} defines neither client_update nor sgd_plan")
        return run_plan(self.ctx.model if plan.model is None else plan.model, plan, data, self.ctx.cfg.train,
                        cctx.generator)  # fmt: skip

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan | None:
        """The client update as plain local SGD on the run's model (`local_sgd.LocalSGDPlan`), or None when it is
        anything else. Declaring one lets the engine train many clients together (`executor.batch_clients`)."""
        return None

    def round_plan(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> LocalSGDPlan | None:
        """The plan of round `cctx.rnd`: `sgd_plan`'s. An update that depends on the round (KT-pFL's epochs ramp
        over the rounds, its reply reads the round's public batch) or that first computes its start on the
        client's data (FedALA's learned aggregation weights) overrides this instead. It may draw from
        `cctx.generator` and torch's global RNG (seeded for the client's update, as `client_update` runs): the
        plan's training goes on from where it left both, in the loop and in a batched round alike. One that
        returns None draws nothing."""
        return self.sgd_plan(payload, state, data)

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> Aggregator:
        """How the server takes in the round's replies: one at a time, in client order (`weights` names the round's
        clients). Default: keep them all, then `aggregate`. A server rule that is a running sum (a weighted mean:
        `training.WeightedMean`) folds each reply in and drops it instead, so a round never holds all its replies
        — 100 replies of a 1.7M-parameter model are 660 MB."""
        return _Collected(self, rnd, server, weights)

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        """The server rule over all of a round's replies. Define it, or `aggregator` (then this folds through it)."""
        if type(self).aggregator is Algorithm.aggregator:
            raise NotImplementedError(f"{self.name} defines neither aggregate nor aggregator")
        agg = self.aggregator(rnd, server, weights)
        for c in sorted(replies):
            agg.add(c, replies[c])
        return agg.result()

    # --- evaluation ------------------------------------------------------------------------------------------
    def generic_model(self, server: Tensors) -> Predictor | None:
        """The model evaluated for G-FL; None for methods without one."""
        return None

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        raise NotImplementedError

    def server_view(self, server: Tensors, cids: Collection[int]) -> Tensors:
        """The part of the server state that a site holding clients `cids` receives to evaluate them
        (`sites.local`): the shared entries and, of the per-client ones (`client_entries`), only those of `cids`.

        Why: a site is trusted with its own clients, not with the others'. Their latest models, heads or masks in
        the server state are theirs, and a site given the whole state could rebuild another client's personal
        model. The view must evaluate `cids` exactly as the whole state does (`personal_model`, `generic_model`
        and, for the final +FT/+LP, `personalize` read only shared entries and those of the client evaluated); an
        algorithm whose per-client parts are rows of a shared tensor overrides this and blanks the other rows
        (`own_rows`). Not for new clients: their start may mix every client's entries on the server.
        """
        if self.client_entries is None:
            return server
        pattern, keep = re.compile(self.client_entries), {int(c) for c in cids}
        return {k: v for k, v in server.items() if (m := pattern.match(k)) is None or int(m.group(1)) in keep}

    def view_fits(self, view: Tensors, cids: list[int]) -> str | None:
        """Why `view` is not what this algorithm's server sends a site to evaluate its clients `cids`
        (`server_view`): another key set, shape or dtype (`reply_shapes.misfit`); None if it is. A site checks
        every view with this before it evaluates (`pflbed.flower.site_message`).

        Why: a site-local deployment's server is another party, and a site's evaluation reads the view as
        `server_view` makes it. An entry of another shape failed inside the evaluation, with a traceback; one the
        server does not send was read where an evaluation merges the view with the client's state.

        Default: the view of the initial server state and, held whole or not at all, each of `view_groups`: the
        entries the server state gains over the run. `tests/algorithms/test_view_fits.py` runs every algorithm
        and checks each view of its server states against this."""
        return misfit(view, whole(view, specs(self.server_view(self.init_server(), cids)), self.view_groups(cids)),
                      UNSENT)  # fmt: skip

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """The entries a view for clients `cids` may hold beyond its initial ones, in groups a server state gains
        whole: a client's stored model once it has replied, a warm start's pooled models, a consensus from the
        second round. Default: none (the server state keeps its structure)."""
        return []

    def finetune_methods(self, server: Tensors, methods: list[str]) -> list[str]:
        """Which of `eval.finetune`'s methods run on the participated clients at the final round (reported under
        `final.<method>`): every one where there is a generic model to personalize from, none otherwise. An
        algorithm whose `personalize` tunes nothing overrides this, so that no row repeats its P-FL figure under
        a fine-tuning label."""
        return list(methods) if self.generic_model(server) is not None else []

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """Adapt to one client, yielding its model after each of `budget.epochs` epochs.

        Each yielded predictor must own a snapshot of its parameters: the new-client protocol keeps the best
        epoch's predictor while later epochs train on.

        Default: from the generic model, fine-tune everything (`ft`) or the head only (`lp`). Yielding per epoch
        lets the new-client protocol report both the last epoch and the epoch chosen on validation.
        """
        from pflbed.algorithms.training import finetune_epochs

        generic = self.generic_model(server)
        if generic is None:
            raise NotImplementedError(f"{self.name} has no generic model to personalize from")
        yield from finetune_epochs(self.ctx.model, generic.params, data, budget, generator)

    # --- diagnostics -----------------------------------------------------------------------------------------
    def diagnostics(self, rnd: int, server: Tensors, state_of: Callable[[int], Tensors]) -> dict[str, Any]:
        """Method-specific figures logged with every evaluation under `diag` in metrics.jsonl (JSON values).

        E.g. mask sizes, basis similarity, coefficient entropy. Default: none.
        """
        return {}

    def artifacts(self, server: Tensors, state_of: Callable[[int], Tensors], out_dir: Path) -> dict[str, str]:
        """Write method-specific end-of-run files (plots, matrices) into `out_dir`; return {name: file name}."""
        return {}

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        """A new client's model with no adaptation (None where the method has none). Default: the generic model."""
        return self.generic_model(server)


def own_rows(table: torch.Tensor, rows: Collection[int]) -> torch.Tensor:
    """`table` with every row but `rows` zeroed: a per-client table (one row per client) as a site may see it,
    its own clients' rows only (`Algorithm.server_view`). The shape stays, so row indices keep their meaning."""
    keep = torch.zeros(len(table), dtype=torch.bool, device=table.device)
    keep[list(rows)] = True
    return torch.where(keep.view(-1, *[1] * (table.dim() - 1)), table, torch.zeros_like(table))
