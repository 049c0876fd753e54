"""Batched clients (`executor.batch_clients`): a round's local-SGD clients trained together, for GPUs.

A GPU spends most of a small model's step launching kernels, not computing; training the round's clients one after
another leaves it idle. Here the clients whose update is a `LocalSGDPlan` (`Algorithm.sgd_plan`; which ones:
docs/guide/speed.md, generated from the registry) are stacked: one tensor per parameter — and per extra per-client
tensor (FedRoD's personal head), per constant (a correction, class counts, FedSelect's entry masks) — with a leading
client dimension, and every step runs all clients' forward, backward and SGD update as single `torch.func.vmap` calls
over `functional_call`. A tensor the round sends every client alike (one object in all their plans) that no phase
moves — FedBasis's bases, a proximal anchor, FedBABU's frozen head — is held once and taken by every client's step
unbatched (`_one_or_stacked`): on a GPU, FedBasis's K + 1 models a client fewer.

Same rule as the loop, step for step: each client draws its mini-batch order — and, with `dataset.augment`, each
batch's crop offsets and flips right after its indices, then any per-sample random inputs its objective takes
(FedCP's Gumbel noise) — from its own generator exactly as `run_plan` does, going
on from where building its plan left the generator and torch's global RNG (`BatchedExecutor.plan`); the
augmentation is applied to every client's batch in one call, so each client sees the loop's augmented batches
exactly; and the SGD update is torch.optim.SGD's (weight decay added to the gradient, momentum buffer started from
the first gradient of each phase, then p ← p − lr·buf). Clients with fewer batches simply stop (no update, no
weight decay) once theirs run out; a smaller last batch is padded and its padding weighted zero, so a client's loss
is still the mean over its real samples. Results equal the loop's up to float rounding of the batched kernels
(tolerance: docs/guide/speed.md).

BatchNorm and dropout models are batched too: each client's running statistics travel through the vmapped step
as stacked per-client tensors, returned by it, and each client's dropout masks are drawn from its own stream
before the step (`engine.per_client_layers`) — an objective's further sets of statistics too (FedCP's frozen
extractor's, `Objective.models`), its dropout calls traced through one call of it. Eligible: models whose only
buffers are BatchNorm statistics and whose only random layers are plain dropout, and clients of the round whose
plans train one architecture (`LocalSGDPlan.model`) in the same phases, on the same samples where a phase has its
own (`Phase.data`). Anything else runs through the loop, client by client — the executor decides per round.

`executor.compile` runs the vmapped step under `torch.compile` (`compiled`). A compiled step keeps one shape for
the whole phase — a step with fewer clients would compile again — so every client of the batch is computed to the
phase's last step and the results of those whose batches ran out are dropped (`_kept`): the same updates.

Under `executor.autotune` on a GPU a step computes each convolution's weight gradient as one matrix
product over the clients where a timing finds it faster than cuDNN's grouped kernels (`conv_weight_grad`).

Measured on CPU it loses to the loop for convolutional models (docs/guide/speed.md), so `batch_clients` is on by
default only when the run's device is a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from pflbed import rng
from pflbed.algorithms.base import Tensors
from pflbed.algorithms.common import Same
from pflbed.algorithms.local_sgd import (
    LocalSGDPlan,
    Objective,
    Phase,
    objective_of,
    objective_statistics,
    phase_keys,
    run_plan,
    statistics,
)
from pflbed.config import TrainConfig
from pflbed.engine import conv_weight_grad, per_client_layers
from pflbed.engine.executor import LoopExecutor, precision, private, seeded, update_client
from pflbed.engine.guard import check_clients_later, screen_finite
from pflbed.engine.per_client_layers import PerClientLayers
from pflbed.errors import ConfigError
from pflbed.models import BlockNet


def batchable_model(model: nn.Module) -> bool:
    """A step is a function of the parameters, the BatchNorm statistics and the dropout masks
    (`per_client_layers.supported`)."""
    return per_client_layers.supported(model)


class BatchedExecutor(LoopExecutor):
    """`LoopExecutor` whose rounds train plain-SGD clients of one plan shape together; the rest one by one.

    `most`: the most clients trained in one batched computation (`executor.batch_max_clients`; unset: all of a
    round's, until a GPU runs out of memory on them — then half as many, retried at once and kept — or holds them
    only by flushing its allocator's cache (`cache_flushes`) — then half as many from the next computation on).
    Each client's result does not depend on which others it was batched with (its own generators, its own
    tensors)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.most: int | None = self.algo.ctx.cfg.executor.batch_max_clients

    def train(
        self, plans: list[LocalSGDPlan], cids: list[int], streams: list[tuple[torch.Generator, torch.Generator]]
    ) -> list[Tensors]:
        """`train_together` on these clients' plans, each from its batch generator and dropout stream as its plan
        left them (`plan`), through copies — a retry draws the same — whose end the streams then take: a plan's
        `finish` draws on from where training left the client's generator (FedSelect's random GradSelect)."""
        algo, ctx = self.algo, self.algo.ctx
        gens, noise = [rng.copy(g) for g, _ in streams], [rng.copy(n) for _, n in streams]
        model = ctx.model if plans[0].model is None else plans[0].model
        with precision(algo):
            trained = train_together(model, plans, [ctx.client_data(c) for c in cids], ctx.cfg.train, gens, noise,
                                     ctx.cfg.executor.compile, ctx.model,
                                     ctx.cfg.executor.autotune and ctx.device.type == "cuda")  # fmt: skip
        for (g, n), used_g, used_n in zip(streams, gens, noise, strict=True):
            g.set_state(used_g.get_state())
            n.set_state(used_n.get_state())
        return trained

    def plans(self, rnd: int, received: dict[int, Tensors]) -> dict[int, tuple[LocalSGDPlan | None, torch.Generator,
                                                                                torch.Generator]]:  # fmt: skip
        """Each client's plan as its update builds it (`update_client`, `Algorithm.client_update`): from its
        generator, torch's global RNG seeded for it (FedALA's plan draws its sample and dropout masks first), under
        the run's precision; with the generator and the global RNG's stream as the plan left them, its training's
        to go on from. The global RNG is put back once, after them all: each plan seeds it afresh, so one fork for
        the round's plans, not one each (a round's plans are host time a GPU waits through before the first step)."""
        algo, ctx = self.algo, self.algo.ctx
        built = {}
        with rng.fork(ctx.device), precision(algo):
            for cid, payload in received.items():
                cctx = seeded(algo, rnd, cid)
                plan = algo.round_plan(payload, self.state(cid), ctx.client_data(cid), cctx)
                built[cid] = plan, cctx.generator, rng.global_now(ctx.device)
        return built

    @contextlib.contextmanager
    def as_its_update(self, noise: torch.Generator) -> Iterator[None]:
        """Where a client's plan runs as in its own update (`update_client`): torch's global RNG at `noise` (the
        client's dropout stream, where its plan or its training left it), under the run's precision; the global RNG
        put back after."""
        with rng.fork(self.algo.ctx.device):
            rng.set_global(noise, self.algo.ctx.device)
            with precision(self.algo):
                yield

    def finish(self, plan: LocalSGDPlan, trained: Tensors, noise: torch.Generator) -> tuple[Tensors, Tensors]:
        """A batched client's `finish` as `run_plan` runs it after the client's own steps (`as_its_update`): from
        where its training left its dropout stream (SCAFFOLD's option I takes a gradient pass in training mode,
        drawing masks) and under the run's precision (FedAS's Fisher trace, KT-pFL's soft predictions, that
        gradient: their forwards in bfloat16 under `executor.precision: bf16`, as in the loop). A tensor of the
        start that no phase moved comes back uncopied, shared with the other clients (`train_together`): `finish`
        may read it, never write into it (checked), and what it returns of it is copied, fresh like the loop's."""
        given = {id(v): v for k, v in trained.items() if v is plan.start.get(k)}  # shared, not copied
        versions = {i: v._version for i, v in given.items()}
        with self.as_its_update(noise):
            reply, new_state = plan.finish(trained)
        if any(v._version != versions[i] for i, v in given.items()):
            raise RuntimeError("a plan's finish wrote into a tensor its start shares with other clients")
        return tuple({k: v.clone() if id(v) in given else v for k, v in out.items()}  # type: ignore[return-value]
                     for out in (reply, new_state))  # fmt: skip

    def alone(self, plan: LocalSGDPlan, cid: int, payload: Tensors, gen: torch.Generator,
              noise: torch.Generator) -> tuple[Tensors, Tensors]:  # fmt: skip
        """A client whose plan is trained by none other's: the plan run as its update runs it (`run_plan`), the
        global RNG where the plan left it — not built again, which would redo (and count again) its work."""
        algo, ctx = self.algo, self.algo.ctx
        with self.as_its_update(noise):
            reply, new_state = run_plan(ctx.model if plan.model is None else plan.model, plan,
                                        ctx.client_data(cid), ctx.cfg.train, gen)  # fmt: skip
        return private(algo, payload, reply), new_state

    def stream(self, rnd: int, payloads: dict[int, Tensors]) -> Iterator[tuple[int, Tensors]]:
        algo, ctx = self.algo, self.algo.ctx
        received = {c: self.prepare(payloads[c]) for c in sorted(payloads)}
        built = self.plans(rnd, received)
        plans = {c: plan for c, (plan, _, _) in built.items() if plan is not None}
        groups: dict[tuple, list[int]] = {}
        batchable: dict[int, bool] = {}  # per model, not per client: a walk over its modules (100: 11 ms a round)
        for c, plan in plans.items():
            model = ctx.model if plan.model is None else plan.model
            if id(model) not in batchable:
                batchable[id(model)] = batchable_model(model)
            if batchable[id(model)]:
                shape = (Same(model), plan.phases, tuple(ph.data_key() for ph in plan.phases), plan.objective,
                         tuple(plan.start), tuple(plan.consts))  # one vmapped step  # fmt: skip
                groups.setdefault(shape, []).append(c)
        done: dict[int, tuple[Tensors, Tensors]] = {}
        for cids in (cids for cids in groups.values() if len(cids) > 1):
            start = 0
            while start < len(cids):
                part = cids[start : start + (self.most or len(cids))]
                sized = len(part) == 1 or ctx.cfg.executor.batch_max_clients is not None  # not ours to halve
                half, flushed = (len(part) + 1) // 2, cache_flushes(ctx.device)
                try:
                    trained = self.train([plans[c] for c in part], part, [built[c][1:] for c in part])
                except torch.OutOfMemoryError:  # on a GPU: half as many at a time, from now on
                    if sized:
                        raise
                    self.most, trained = half, None
                if trained is None:  # out of the handler, the failed try's tensors die with its traceback (and
                    gc.collect()  # any cycles among them): their memory goes back to the device, not to blocks
                    torch.cuda.empty_cache()  # cached at the sizes of a try twice as large
                    continue
                if not sized and cache_flushes(ctx.device) > flushed:  # fitted, at the memory's ceiling: the
                    self.most = half  # results stand, the next computations take half as many
                for c, p in zip(part, trained, strict=True):
                    reply, new_state = self.finish(plans[c], p, built[c][2])
                    done[c] = private(algo, received[c], reply), new_state
                del trained  # each reply must die once the server has folded it in (`LoopExecutor.stream`)
                start += len(part)
        # every batched client's reply and state screened at once: one wait for the device, not one per client.
        # A round of batched clients only: read once its replies were handed on (`check_clients_later`); one with
        # clients trained alone: before, then client by client in client order where the screen finds a value to
        # look at, as the loop checks them
        every = len(done) == len(received)
        later = check_clients_later(rnd, [(c, *done[c]) for c in received]) if every else None
        screened = every or (bool(done) and screen_finite(v for out in done.values() for part in out
                                                          for v in part.values()))  # fmt: skip
        for c in received:  # in client order; the rest exactly as the loop runs them, one at a time
            plan, (_, gen, noise) = plans.pop(c, None), built.pop(c)
            if c in done:
                yield c, self.keep(rnd, c, *done.pop(c), screened=screened)
                continue
            if plan is not None:
                out = self.alone(plan, c, received[c], gen, noise)
            else:
                out = update_client(algo, rnd, c, received[c], self.state(c))
            yield c, self.keep(rnd, c, *out)
        if later is not None:  # before the stream ends: before the server's state of the round exists (every
            later()  # consumer reads the stream to its end: the driver, `LoopExecutor.run`, DP's `replies`)


def cache_flushes(device: torch.device) -> int:
    """How many times the GPU's caching allocator has freed every cached block to retry an allocation it could
    not make (`num_alloc_retries`); 0 off a GPU.

    Why the executor watches it: a computation that needs nearly all of the device's memory may still fit, but only
    by such flushes, and then one at almost every step — each a wait for the device and its memory allocated again.
    Half as many clients at a time lose little: a computation that large keeps the device busy either way."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


def train_together(
    model: BlockNet,
    plans: list[LocalSGDPlan],
    datas: list,
    train: TrainConfig,
    gens: list[torch.Generator],
    noise: list[torch.Generator] | None = None,
    compile: str = "off",
    run: nn.Module | None = None,
    autotune: bool = False,
) -> list[Tensors]:
    """Run the same-shaped `plans` of several clients at once; returns each client's trained full state (a start
    tensor every client shares and no phase moved as it is, the same object for all: `_one_or_stacked`). `gens`:
    each client's batch generator; `noise`: each client's dropout stream (`rng.global_stream` of the seed the loop
    gives torch's global RNG), needed where the model has dropout; `compile`: `executor.compile`; `run`: the run's
    model, whose compiled steps share one cache (`compiled`; None: `model`'s own); `autotune`: time each eligible
    convolution's weight gradient as a product against cuDNN's grouped one and keep the faster
    (`conv_weight_grad`; `executor.autotune` on a GPU)."""
    keys = list(plans[0].start)
    buffers = tuple(k for k, _ in model.named_buffers())
    shared, params = _one_or_stacked([p.start for p in plans], lambda k: not _statistic(k, buffers))  # stacked: new
    # tensors, the starts stay untouched
    entries = {ph.entries for ph in plans[0].phases if ph.entries is not None}  # masks indexed per client
    shared_consts, consts = _one_or_stacked([p.consts for p in plans], lambda k: not k.startswith(tuple(entries)))
    products = conv_weight_grad.chosen(model, datas[0].x[:1], len(plans), train.batch_size) if autotune else frozenset()
    layers = PerClientLayers(model, products)
    if layers.drops:
        if noise is None:
            raise ValueError("a model with dropout needs each client's dropout stream (`noise`)")
        layers.trace(model, lambda: model(datas[0].x[:1]))
    momenta: dict[str | None, Tensors] = {}  # per optimizer of the plan, its momentum buffers
    model_keys = list(model.state_dict())
    for ph in plans[0].phases:
        if ph.epochs:
            buf = momenta.setdefault(ph.optimizer, {}) if ph.optimizer is not None else {}
            own, g, n = _sources(ph, datas, gens, noise)
            if ph.rule is not None or ph.model:  # a rule moves what it likes; a second model's phase, its model
                _own_copies(params, shared, [k for k in shared if ph.rule is not None or k[len(ph.model):] in
                                             model_keys and k.startswith(ph.model)], len(plans))  # fmt: skip
            if ph.rule is not None:
                _rule_phase(model, layers, params, ph, own, train, g, n, compile, run or model)
                continue
            view = {k: params[ph.model + k] for k in model_keys} if ph.model else params  # the phase's model
            _phase(model, layers, view, {} if ph.model else shared, consts, shared_consts, objective_of(plans[0], ph),
                   ph, own, train, g, n, buf, compile, run or model)  # fmt: skip
            params.update({ph.model + k: view[k] for k in model_keys} if ph.model else {})
    return [{k: params[k][i].clone() if k in params else shared[k] for k in keys} for i in range(len(plans))]


def _one_or_stacked(
    tensors: list[Tensors], may_share: Callable[[str], bool] = lambda k: True
) -> tuple[Tensors, Tensors]:
    """(shared, stacked): each key's tensor once where every client's is the same object (a payload the round sent
    them all, FedBasis's bases) and `may_share` allows, else the clients' stacked along a new leading dimension.

    Why: a tensor no phase moves needs no copy per client — vmapped steps take it unbatched, once for all clients
    (FedBasis: the bases, K + 1 models a client otherwise). A phase that moves a shared tensor (trains it, or its
    forward moves it as statistics) first gives each client its own copy (`_own_copies`)."""
    first = tensors[0]
    same = [k for k in first if len(tensors) > 1 and may_share(k) and all(t[k] is first[k] for t in tensors[1:])]
    return ({k: first[k] for k in same},
            {k: torch.stack([t[k] for t in tensors]) for k in sorted(first) if k not in same})  # fmt: skip


def _statistic(key: str, buffers: tuple[str, ...]) -> bool:
    """Whether a plan's tensor `key` is running statistics (named after one of the model's `buffers`: its own, or
    an objective's set, FedBasis's bases' `vs.`): not shared (`_one_or_stacked`) — a forward moves them, and one
    that became each client's own within a phase (`_phase`) would change the compiled step's inputs."""
    return key.endswith(buffers)


def _own_copies(params: Tensors, shared: Tensors, keys: list[str], n: int) -> None:
    """Shared tensors `keys` moved into `params`, one copy per client of the `n`: each client's to move. `params`
    stays in the order of its keys, whatever was shared: a compiled step's graph is keyed on its inputs' order."""
    for k in keys:
        params[k] = torch.stack([shared.pop(k)] * n)
    for k in sorted(params) if keys else ():
        params[k] = params.pop(k)


def _sources(
    ph: Phase, datas: list, gens: list[torch.Generator], noise: list[torch.Generator] | None
) -> tuple[list, list[torch.Generator], list[torch.Generator] | None]:
    """Each client's samples, batch generator and dropout stream in phase `ph`: its own, or the phase's `data`
    (one object for every client of the batch) and the generators of the phase's own `stream` (`Phase`)."""
    own = datas if ph.data is None else [ph.data] * len(datas)
    if ph.stream is None:
        return own, gens, noise
    device = datas[0].x.device
    return (own, [rng.generator(*ph.stream, d.cid) for d in datas],
            [rng.global_stream(ph.stream_seed(d.cid), device) for d in datas])  # fmt: skip


def _phase(
    model: BlockNet,
    layers: PerClientLayers,
    params: Tensors,
    shared: Tensors,
    consts: Tensors,
    shared_consts: Tensors,
    objective: Objective | None,
    ph: Phase,
    datas: list,
    train: TrainConfig,
    gens: list[torch.Generator],
    noise: list[torch.Generator] | None,
    buf: Tensors,
    compile: str,
    run: nn.Module,
) -> None:
    """One phase of every client's plan; `shared`, `shared_consts`: tensors the same for every client, taken by
    the steps unbatched (`_one_or_stacked`; one the phase moves becomes each client's own in `params`, updated
    in place); `buf`: the momentum buffers of the phase's optimizer (empty: a fresh one), updated in place."""
    n = len(datas)
    every = dict(sorted({**params, **shared}.items()))  # (one order, whatever is shared: `_own_copies`)
    sets = objective_statistics(objective, layers.buffer_keys, every)  # an objective's further statistics
    stats = [k for k in layers.buffer_keys if k in every] + sets  # moved by forwards, trained by none
    lr_of = {k: ph.lr for k in phase_keys(model, ph)}
    lr_of |= {k: lr for prefix, lr in ph.extra for k in every if k.startswith(prefix) and k not in sets}
    _own_copies(params, shared, [k for k in shared if k in lr_of or k in stats], n)
    trains = {k: consts[ph.entries + k] for k in lr_of if ph.entries is not None and ph.entries + k in consts}
    trainable = list(lr_of)
    fixed = [k for k in params if k not in lr_of and k not in stats]
    model_keys = set(model.state_dict())
    draw = getattr(objective, "draw", None)  # per-sample random inputs (`local_sgd.Objective`)
    rows, weights, active, draws, lengths, inputs = _schedule(datas, train, ph, gens, draw)
    momentum, weight_decay = ph.sgd(train)
    pool_x = datas[0].x
    traced = bool(getattr(objective, "models", ())) and bool(layers.drops)  # forwards beyond the model's one
    if traced:
        calls = layers.calls
        one = {k: v[0] for k, v in params.items()} | shared, {k: v[0] for k, v in consts.items()} | shared_consts
        noise_one = {"noise": draw(1, torch.Generator().manual_seed(0)).to(pool_x.device)} if draw else {}
        layers.trace(model, lambda: objective(model, *one, pool_x[:1], datas[0].y[:1], None, **noise_one))
    model.train()

    hooks = hasattr(objective, "running")  # statistics derived from the plan's tensors (`local_sgd.Objective`)

    def loss(
        p: Tensors, q: Tensors, b: Tensors, cst: Tensors, z: Tensors, zc: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor, m: list[torch.Tensor], r: list[torch.Tensor],
    ) -> tuple[torch.Tensor, Tensors]:  # fmt: skip
        tensors = {**p, **q, **z, **b}  # with the statistics: a forward may name its set (`enter`)
        cst = {**cst, **zc}
        if hooks:
            b = objective.running(tensors, cst)  # type: ignore[union-attr]
        layers.enter(b, w > 0, m, bool(sets))
        if objective is None:
            out = functional_call(model, {k: v for k, v in tensors.items() if k in model_keys}, (x,))
            value = (F.cross_entropy(out, y, reduction="none") * w).sum()
        elif r:  # the step's random inputs (none: an empty list, which vmap maps over as nothing)
            value = objective(model, tensors, cst, x, y, w, noise=r[0])  # type: ignore[call-arg]
        else:
            value = objective(model, tensors, cst, x, y, w)
        moved = layers.leave()
        return value, objective.hand_back(tensors, cst, b, moved) if hooks else moved  # type: ignore[union-attr]

    grads_of = compiled(vmap(grad(loss, has_aux=True), in_dims=(0, 0, 0, 0, None, None, 0, 0, 0, 0, 0)), compile,
                        run, lambda out: (out[0], copies(out[1])))  # the gradients: used up within the step
    static = compile != "off"  # one shape for every step: a new one would compile again
    for s, live in enumerate(active):
        keep, live = _selection(live, len(datas), static, pool_x.device)
        whole = live is None
        sel = None if whole else torch.tensor(live, device=pool_x.device)
        x, y, w = _gather(datas[0], rows[s], weights[s], None if draws is None else draws[s], sel)
        p = {k: params[k] if whole else params[k][sel] for k in trainable}
        q = {k: params[k] if whole else params[k][sel] for k in fixed}
        b = {k: params[k] if whole else params[k][sel] for k in stats}
        cst = {k: v if whole else v[sel] for k, v in consts.items()}
        ids = range(len(datas)) if whole else live
        masks = layers.draw([int(lengths[s, i]) for i in ids], w.shape[1], [noise[i] for i in ids],
                            pool_x.device) if layers.calls and noise is not None else []  # fmt: skip
        r = [] if inputs is None else [inputs[s] if whole else inputs[s][sel]]
        with layers.patched():
            g, moved = grads_of(p, q, b, cst, dict(shared), shared_consts, x, y, w, masks, r)
        if any(k in shared for k in moved):  # a hook moved a shared tensor (`hand_back`): each client's own now
            _own_copies(params, shared, [k for k in moved if k in shared], n)
            stats += [k for k in moved if k in params and k not in stats]
        for k in (k for k in moved if k in params):  # the statistics each client's forward moved (a finished
            if whole:  # client's forward has no real row: its statistics come back as they were, `per_client_layers`)
                params[k] = moved[k]
            else:
                params[k][sel] = moved[k]
        for k in trainable:  # torch.optim.SGD's update, per client
            d = g[k].add(p[k], alpha=weight_decay) if weight_decay else g[k]
            if momentum:
                if k not in buf:  # k's first step, its phase's first (a phase trains the same keys throughout):
                    assert whole and keep is None  # every client has a batch in it (each has a training sample)
                    buf[k] = d.clone()
                elif keep is not None:
                    d = buf[k].mul(momentum).add_(d)
                    buf[k] = _kept(keep, d, buf[k])
                else:
                    d = (buf[k] if whole else buf[k][sel]).mul_(momentum).add_(d)
                    if not whole:
                        buf[k][sel] = d
            new = p[k].add(d, alpha=-lr_of[k])
            if k in trains:  # only the entries the phase trains move
                new = torch.where(trains[k] if whole else trains[k][sel], new, p[k])
            if whole:
                params[k] = _kept(keep, new, p[k])
            else:
                params[k][sel] = new
    if traced:
        layers.calls = calls  # the model's, for the next phase


def _rule_phase(
    model: BlockNet, layers: PerClientLayers, params: Tensors, ph: Phase, datas: list, train: TrainConfig,
    gens: list[torch.Generator], noise: list[torch.Generator] | None, compile: str, run: nn.Module,
) -> None:  # fmt: skip
    """A phase of `ph.rule`'s steps (`local_sgd.StepRule`) for every client at once: step s reads batches
    r·s … r·s + r − 1 of each client's schedule (r = `rule.batches`; a client's batches are a whole number of
    steps), its forwards' dropout masks drawn before it in the rule's call order; the rule runs vmapped, its
    gradients through `_ClientGradients`, and its new values replace the tensors it changed."""
    rule = ph.rule
    assert rule is not None
    stats = statistics(rule, layers.buffer_keys, params)
    moving = [k for k in params if k not in stats]
    own = [k for k, _ in model.named_parameters()]
    rows, weights, active, draws, lengths, _ = _schedule(datas, train, ph, gens)
    if bool((lengths.count_nonzero(0) % rule.batches).any()):
        raise ValueError("a rule's phase ended inside a step: its batches are not a whole number of steps")
    model.train()

    def step(
        p: Tensors, b: Tensors, batch: list[tuple[torch.Tensor, ...]], masks: list[list[torch.Tensor]]
    ) -> tuple[Tensors, Tensors]:
        grads = _ClientGradients(model, layers, {k: p[k] for k in own}, b, batch, masks)
        return rule(grads, p), grads.stats

    steps = compiled(vmap(step), compile, run)
    r, device = rule.batches, datas[0].x.device
    for s in range(0, len(active), r):
        keep, live = _selection(active[s], len(datas), compile != "off", device)
        whole = live is None
        sel = None if whole else torch.tensor(live, device=device)
        batch = [_gather(datas[0], rows[s + j], weights[s + j], None if draws is None else draws[s + j], sel)
                 for j in range(r)]  # fmt: skip
        ids = range(len(datas)) if whole else live
        masks = [layers.draw([int(lengths[s + j, i]) for i in ids], batch[j][2].shape[1], [noise[i] for i in ids],
                             device) if layers.calls and noise is not None else [] for j in rule.forwards]  # fmt: skip
        p = {k: params[k] if whole else params[k][sel] for k in moving}
        b = {k: params[k] if whole else params[k][sel] for k in stats}
        with layers.patched():
            new, moved = steps(p, b, batch, masks)
        moved = {k: v for k, v in moved.items() if k in params}  # (a finished client's come back as they were)
        for k, v in {**new, **moved}.items():
            if whole:
                params[k] = _kept(keep, v, params[k])
            else:
                params[k][sel] = v


class _ClientGradients:
    """`local_sgd.Gradients` of one client inside a vmapped step: each call one forward through the model with
    the client's parameters (`base`, overridden by the call's), its BatchNorm statistics (`stats`: the plan's
    keys, of every model the rule names) carried from call to call, its next forward's dropout masks, its loss
    the real samples' weighted mean (`per_client_layers`)."""

    def __init__(
        self, model: BlockNet, layers: PerClientLayers, base: Tensors, stats: Tensors,
        batch: list[tuple[torch.Tensor, ...]], masks: list[list[torch.Tensor]],
    ) -> None:  # fmt: skip
        self.model, self.layers, self.base, self.stats, self.batch = model, layers, base, stats, batch
        self.masks = list(masks)

    def _loss(self, params: Tensors, j: int, model: str = "") -> tuple[torch.Tensor, Tensors]:
        x, y, w = self.batch[j]
        own = {k: self.stats[model + k] for k in self.layers.buffer_keys}
        self.layers.enter(own, w > 0, self.masks.pop(0))  # one list of masks per forward
        out = functional_call(self.model, {**self.base, **params}, (x,))
        moved = {model + k: v for k, v in self.layers.leave().items()}
        return (F.cross_entropy(out, y, reduction="none") * w).sum(), moved

    def grad(self, params: Tensors, j: int, model: str = "") -> Tensors:
        g, moved = grad(lambda p: self._loss(p, j, model), has_aux=True)(params)
        self.stats = {**self.stats, **moved}
        return g

    def hvp(self, params: Tensors, j: int, v: Tensors) -> Tensors:
        def dot(p: Tensors) -> tuple[torch.Tensor, Tensors]:
            g, moved = grad(lambda q: self._loss(q, j), has_aux=True)(p)
            return sum((g[k] * v[k]).sum() for k in g), moved

        hv, moved = grad(dot, has_aux=True)(params)
        self.stats = {**self.stats, **moved}
        return hv


def _selection(
    live: list[int] | None, n: int, static: bool, device: torch.device
) -> tuple[torch.Tensor | None, list[int] | None]:
    """(keep, live) for a step where only the clients `live` (None: all `n`) still have a batch: compiled
    (`static`), every client is computed and `keep` masks the results to keep; otherwise only `live` is."""
    if not static or live is None:
        return None, live
    keep = torch.zeros(n, dtype=torch.bool)
    keep[live] = True
    return keep.to(device), None


def _gather(
    data: Any, rows: torch.Tensor, weights: torch.Tensor, draws: torch.Tensor | None, sel: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch of every selected client (`sel`; None: all) from the shared pool, in one gather: the inputs
    augmented at once with the choices each client's generator drew, the labels, the per-sample weights."""
    r, w = (rows, weights) if sel is None else (rows[sel], weights[sel])
    x, y = data.x[r], data.y[r]
    if data.augment is not None:
        d = draws if sel is None else draws[sel]
        x = data.augment.apply(x.flatten(0, 1), d.flatten(0, 1)).view(x.shape)
    return x, y, w


def _kept(keep: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """`new` for the clients in `keep` (a mask over the leading client dimension), `old` for the others; `new`
    where there is no mask."""
    return new if keep is None else torch.where(keep.view(-1, *[1] * (new.dim() - 1)), new, old)


_compiled_for: list[weakref.ref] = []  # the model whose steps dynamo's cache holds (`compiled`)


def copies(out: Any) -> Any:
    """Every tensor of a step's output copied (`compiled`'s default `kept`)."""
    return torch.utils._pytree.tree_map(torch.clone, out)


def compiled(step: Callable, mode: str, model: nn.Module, kept: Callable[[Any], Any] = copies) -> Callable:
    """`step` (of a run whose model is `model`) under `torch.compile` in `mode` (`executor.compile`), or itself
    when "off". A run's steps of other architectures (KT-pFL's zoo) share its cache, a graph per architecture.

    Why it compiles once per run: dynamo keys its cache on the step's code, shared by every phase's new closure,
    and guards on what the step reads (the model, the per-client layers' settings, the tensors' shapes), so a later
    round reuses the graph; a new shape (another number of clients batched, a phase training other keys) adds one
    (a phase's steps keep theirs: `_phase` computes its finished clients too). Under
    CUDA graphs (`reduce-overhead`) each call is a new step — its outputs live in memory the next replay reuses —
    so what the caller keeps past the next call is copied out first: `kept(out)` (default: all of it; `_phase`
    uses its gradients before the next step, which the device runs after, in stream order, and copies only the
    statistics it keeps — one copy of every client's gradients a step fewer). A step of another run's model (the
    next run in this process) starts from an empty cache: the last run's graphs could never serve it, and they count
    against dynamo's limit of graphs per code (8), past which it would run every later run's steps eagerly, saying
    so only in a warning."""
    if mode == "off":
        return step
    if not _compiled_for or _compiled_for[0]() is not model:
        torch._dynamo.reset()
        _compiled_for[:] = [weakref.ref(model)]
    conv_weight_grad.keep_in_graph()  # (a step may compute weight gradients as products)
    fast = torch.compile(step, mode=mode)

    def run(*args: Any) -> Any:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        try:
            out = fast(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # no compiler here, say: the setting is at fault
            raise ConfigError(f"executor.compile={mode}: torch.compile failed here ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}); set executor.compile=off") from e  # fmt: skip
        return kept(out) if mode == "reduce-overhead" else out

    return run


def _schedule(
    datas: list, train: TrainConfig, ph: Phase, gens: list[torch.Generator],
    draw: Callable[[int, torch.Generator], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int] | None], torch.Tensor | None, torch.Tensor,
           torch.Tensor | None]:  # fmt: skip
    """Every step's batch of every client, built once on the CPU and moved to the device in one copy.

    Returns `rows` [steps, clients, width] (indices into the shared pool; a batch shorter than `width` is padded
    with its first sample), `weights` of the same shape (1/len(batch) on real rows, 0 on padding and on steps after
    a client's last: each client's loss is the mean over its real samples), per step the clients that still
    have a batch (None: all), and with augmentation each row's random choices `draws` [steps, clients, width, 3]
    (`Augment.draw`'s, drawn right after the batch's indices, as `ClientData.batch` draws them; None without),
    each client's real batch size per step `lengths` [steps, clients] (on the CPU: dropout masks are drawn
    for those rows), and with `draw` (an objective's per-sample random inputs) each row's `inputs`
    [steps, clients, width, …], drawn after the batch and its choices as the loop draws them (None without; 0 on
    padding).
    Why up front: building the batches step by step costs a few small device operations per client and step,
    which on a GPU took longer than the step itself. The batches are the phase's (`Phase.batches`) on the same
    generators — the loop's, sample for sample.
    """
    augment = datas[0].augment
    if any(d.x is not datas[0].x or d.y is not datas[0].y or d.augment is not augment for d in datas):
        raise ValueError("batched clients index one shared training pool (`Context.client_data`)")
    orders: list[torch.Tensor] = []  # every client's batches' indices, client after client
    sizes: list[int] = []  # the batches' sizes, in that order
    drawn: list[torch.Tensor] = []
    given: list[torch.Tensor] = []
    counts: list[int] = []  # each client's number of batches
    # every client's indices brought to the host in one copy: one wait for the device, not one per client
    host = torch.cat([d.train for d in datas]).cpu().split([d.num_train for d in datas])
    for indices, g in zip(host, gens, strict=True):
        if augment is None and draw is None:  # nothing drawn between batches: all of them at once
            order, its = ph.batches_at_once(indices, train, g)
            orders.append(order)
            sizes += its
            counts.append(len(its))
            continue
        before = len(sizes)
        for b in ph.batches(indices, train, g):  # lazily: a batch, then its choices, then its inputs
            orders.append(b)
            sizes.append(len(b))
            if augment is not None:
                drawn.append(augment.draw(len(b), g))
            if draw is not None:
                given.append(draw(len(b), g).cpu())
        counts.append(len(sizes) - before)
    rows, weights, lengths, pos, real = _laid_out(torch.cat(orders), sizes, counts)
    draws = _padded(torch.cat(drawn), pos, real) if augment is not None else None
    inputs = _padded(torch.cat(given), pos, real) if draw is not None else None
    active = [None if all(s < n for n in counts) else [c for c, n in enumerate(counts) if s < n]
              for s in range(len(rows))]  # fmt: skip
    device = datas[0].x.device
    return (rows.to(device), weights.to(device), active, draws.to(device) if draws is not None else None, lengths,
            inputs.to(device) if inputs is not None else None)  # fmt: skip


def _laid_out(
    order: torch.Tensor, batch_sizes: list[int], counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clients' batches (their indices concatenated in `order`, client after client, of `batch_sizes`;
    `counts[c]` of them client c's) laid out by step and client, in a few whole-tensor operations rather than a
    few small ones per batch: per batch, they cost more host time than a GPU takes for a CNN's step (tens of ms a
    round). Returns `rows` [steps, clients, width] (a batch's indices, padded with its first; 0 where a client has
    no batch), `weights` (1/len(batch) on real rows, else 0), `lengths` [steps, clients], and for laying out what
    goes with each sample (`_padded`): each row's position in `order`, and whether it is real."""
    sizes = torch.tensor(batch_sizes)
    per_client = torch.tensor(counts)
    client = torch.repeat_interleave(per_client)  # each batch's client
    step = torch.arange(len(batch_sizes)) - (per_client.cumsum(0) - per_client)[client]  # its step in its client
    shape = (int(per_client.max()), len(counts))
    lengths = torch.zeros(shape, dtype=torch.long).index_put_((step, client), sizes)
    first = torch.zeros(shape, dtype=torch.long).index_put_((step, client), sizes.cumsum(0) - sizes)
    j = torch.arange(int(sizes.max()))
    real = j < lengths[..., None]
    pos = first[..., None] + torch.where(real, j, 0)  # a padding row: its batch's first sample
    rows = torch.where(lengths[..., None] > 0, order.long()[pos], 0)
    weights = torch.where(real, 1.0 / lengths.clamp(min=1)[..., None], 0.0)  # in the default dtype
    return rows, weights, lengths, pos, real


def _padded(values: torch.Tensor, pos: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per-sample `values` (the batches' in order, concatenated) laid out as `_laid_out`'s rows: [steps, clients,
    width, …], 0 on padding rows and where a client has no batch."""
    keep = real.view(*real.shape, *[1] * (values.dim() - 1))
    return torch.where(keep, values[pos], torch.zeros((), dtype=values.dtype))
