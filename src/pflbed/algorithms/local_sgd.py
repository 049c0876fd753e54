"""Client updates that are local SGD on a differentiable loss, declared as data.

FedAvg, FedPer, FedRep, LG-FedAvg and FedBABU all update a client the same way: load a starting state, run one or
more phases of mini-batch SGD, each training some blocks with the others frozen, then split the trained state into
the reply and the client's new state. Others train tensors beyond the model (FedRoD's personal head, at a learning
rate of its own) on a loss of their own (FedRoD's balanced softmax plus the personal head's loss), which may read
per-client constants (the client's class counts). Declaring the update as a `LocalSGDPlan` (`Algorithm.sgd_plan`)
lets the engine run it either one client at a time (`run_plan`, the rule itself) or many clients of one
architecture together (`engine.batched`), with one definition of the update.

An `Objective` is written once for both: a function of the current tensors (`params`: the model's parameters by
state-dict key, and the plan's extra tensors), the client's constants, a batch and its per-sample weights `w`.
`w` is None in the loop (the batch's plain mean, the ops the algorithm always ran) and, in a batched step, 1/n on a
client's n real samples and 0 on its padding (`weighted_mean`). The model is called through `model_forward` /
`run_blocks`, which take its parameters from `params` (`torch.func.functional_call`), so the same objective runs on
one client's tensors or, under `vmap`, on every client's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Protocol

import torch
from torch.func import functional_call

from pflbed import compute, rng
from pflbed.algorithms.common import ClientData, Same, Tensors
from pflbed.algorithms.partial import train_blocks
from pflbed.algorithms.sgd import SGD
from pflbed.algorithms.training import get_params, index_batches, load_params
from pflbed.models import BlockNet

if TYPE_CHECKING:
    from pflbed.config import TrainConfig  # annotations only


@dataclass(frozen=True)
class Phase:
    """`epochs` epochs of SGD at `lr` on `blocks`, every other block frozen; a fresh optimizer (no momentum carried
    over from an earlier phase) unless `optimizer` names one. Batch size, momentum and weight decay are `train.*`.

    `keys`: only these parameters of `blocks` train (None: all of them). `entries`: a constant prefix; a parameter
    with a constant `entries + key` (bool, of its shape) trains only where that is True, every other entry held
    exactly (put back after each step: weight decay and momentum would move it otherwise); one without trains
    whole. `optimizer`: phases of one plan naming the same optimizer step one SGD, its momentum buffers kept from
    one phase to the next (FedSelect's two sides, each its own optimizer for the round). `model`: a key prefix; the
    phase trains the second model whose tensors (parameters and buffers) are the plan's `model + key` (Ditto's
    personal model), the plan's own model tensors untouched. `objective`: this phase's loss (None: the plan's).
    `steps`: stop after this many batches, the last of the `epochs` cut short (pFedHN's K steps; None: every
    batch of the epochs). `momentum`, `weight_decay`: this phase's (None: `train.*`; L2GD's plain gradient steps
    set both 0). `rule`: a step that is more than one SGD step on one gradient (`StepRule`: Per-FedAvg's, pFedMe's);
    it then updates the plan's tensors itself at its own step sizes, and the phase sets nothing but `epochs` and
    `steps` (`blocks` and `lr` are not read)."""

    blocks: tuple[str, ...]
    epochs: int
    lr: float
    extra: tuple[tuple[str, float], ...] = ()  # (key prefix, lr): the plan's extra tensors this phase trains
    keys: tuple[str, ...] | None = None
    entries: str | None = None
    optimizer: str | None = None
    model: str = ""
    objective: Objective | None = None
    steps: int | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    rule: StepRule | None = None
    batch_size: int | None = None
    data: ClientData | None = field(default=None, compare=False)
    stream: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.rule is not None and (self.extra or self.keys or self.entries or self.optimizer or self.model
                                      or self.objective or self.momentum is not None
                                      or self.weight_decay is not None):  # fmt: skip
            raise ValueError("a phase with a step rule takes its step from the rule alone")
        if self.steps is not None and self.steps < 0:
            raise ValueError(f"a phase's steps cannot be negative: {self.steps}")

    def sgd(self, train: TrainConfig) -> tuple[float, float]:
        """(momentum, weight decay) of the phase's SGD."""
        return (train.momentum if self.momentum is None else self.momentum,
                train.weight_decay if self.weight_decay is None else self.weight_decay)  # fmt: skip

    def batches(self, idx: torch.Tensor, train: TrainConfig, generator: torch.Generator) -> Iterator[torch.Tensor]:
        """The phase's mini-batches of `idx`: `index_batches` over its epochs, `steps` of them at most (a rule's
        step takes `rule.batches` of them; each counts as the forwards the rule makes on it)."""
        size, passes = self._batch_size_and_passes(train)
        return islice(index_batches(idx, size, self.epochs, generator, passes), self.steps)

    def _batch_size_and_passes(self, train: TrainConfig) -> tuple[int, int]:
        """The phase's batch size, and the work a sample of a batch counts (a rule's step: its forwards per batch)."""
        passes = 1 if self.rule is None else len(self.rule.forwards) // self.rule.batches
        return train.batch_size if self.batch_size is None else self.batch_size, passes

    def batches_at_once(self, idx: torch.Tensor, train: TrainConfig, generator: torch.Generator
                        ) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
        """`batches`, every one of them at once: their indices concatenated and their sizes. The same draws from
        `generator` (an epoch's permutation, drawn only where one of its batches is taken), the same work counted.

        Why: taken one at a time, a client's 16 batches of an epoch cost ≈ 30 µs of the host's Python, most of it
        per batch; a batched round of 100 clients lays out all their batches before its first step
        (`engine.batched`), and on a GPU that time is the device's, idle. Only for a caller that draws nothing
        else from `generator` between the batches (augmentation draws after each batch: `batches` there)."""
        size, passes = self._batch_size_and_passes(train)
        n = len(idx)
        epoch = [size] * (n // size) + ([n % size] if n % size or not n else [])  # an epoch's batch sizes (no
        # sample: one empty batch, as `Tensor.split` gives)
        taken = len(epoch) * self.epochs if self.steps is None else min(self.steps, len(epoch) * self.epochs)
        drawn = -(-taken // len(epoch))  # the epochs begun
        sizes = (epoch * drawn)[:taken]
        orders = [idx[torch.randperm(n, generator=generator, device=generator.device)] for _ in range(drawn)]
        compute.add(sum(sizes) * passes)
        return (torch.cat(orders)[: sum(sizes)] if orders else idx[:0]), sizes

    def data_key(self) -> Same | None:
        """What must be the same object for clients to train this phase together: its `data`."""
        return None if self.data is None else Same(self.data)

    def stream_seed(self, cid: int) -> int:
        """Client `cid`'s seed of the phase's own stream (`stream`): its generator's and its dropout's."""
        assert self.stream is not None
        return rng.derive_seed(*self.stream, cid)


class Objective(Protocol):
    """A batch's loss (a scalar) for the current tensors; see the module docstring.

    An objective whose model's BatchNorm statistics are not plan tensors of their own but derived from them
    (FedBasis: combined from the bases') also has `running(params, consts)` — the statistics the batch's forward
    starts from (the model's state keys) — and `hand_back(params, consts, before, after)` — the plan tensors the
    forward's move of them from `before` to `after` updates (new values, never trained). Both are called around
    every step, in the loop and in a batched step alike.

    An objective may also have `draw(n, generator)`: per-sample random inputs of a batch of n (FedCP's Gumbel noise),
    drawn from the client's generator right after the batch and its augmentation, and passed to the objective as
    `noise` — the batched step draws them in the same order, before its steps. And `models`: key prefixes of further
    sets of BatchNorm statistics among the plan's tensors (FedCP's frozen reference extractor's), for forwards
    beyond the model's own. A forward on such a set passes them among its tensors (`run_blocks`): the loop's forward
    moves them in place, a batched step's carries them per client. Such an objective's dropout calls are traced
    through itself (the model's one forward is not all of them)."""

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor: ...  # fmt: skip


class Gradients(Protocol):
    """What a `StepRule` differentiates: the cross-entropy of the model on the step's batch `j`, at the model
    parameters `params` (state-dict keys; the model's other parameters at the step's start). Every call is one
    forward through the model in train mode: it draws that forward's dropout masks and moves its BatchNorm
    statistics, in call order, as the loop's forwards do."""

    def grad(self, params: Tensors, j: int, model: str = "") -> Tensors:
        """∇ of batch j's loss at `params`, by key. `model`: a key prefix among the rule's `models`; the forward
        starts from and moves the BatchNorm statistics that are the plan's `model + key` (APFL's mixture moves
        v_i's, its w forward w's own)."""
        ...

    def hvp(self, params: Tensors, j: int, v: Tensors) -> Tensors:
        """∇²(batch j's loss) at `params` times `v`: exact, by differentiating ⟨∇loss, v⟩ (one forward)."""
        ...


class StepRule(Protocol):
    """One local step of a rule that is not one SGD step on one gradient, written once for the loop and a
    batched (vmapped) step, as an `Objective` is: from the plan's tensors `params` (every one but the BatchNorm
    statistics, which the forwards move), the step's new values of those it changes, through `grads` alone.
    `batches`: the batches a step consumes; `forwards`: the batch each of its `grads` calls reads, in call order
    (the batched step draws every forward's dropout masks before it runs). Frozen and comparable (a dataclass):
    clients whose rules are equal are trained together.

    A rule may also have `models`: the key prefixes whose BatchNorm statistics its forwards move (`Gradients.grad`'s
    `model`; without it, ("",): the plan's own model's alone). Those statistics are not among `params`."""

    batches: int
    forwards: tuple[int, ...]

    def __call__(self, grads: Gradients, params: Tensors) -> Tensors: ...


@dataclass(frozen=True)
class LocalSGDPlan:
    """Load `start` (the model's full state, plus any extra tensors under keys of their own), run `phases` in
    order, then `finish` maps the trained tensors to (reply, new client state). `objective`: the loss (None:
    cross-entropy of the model's output); `consts`: per-client tensors it reads, never trained. `model`: the
    architecture the plan trains (None: the run's model; KT-pFL's clients each have one of a zoo), clients of one
    architecture trained together."""

    start: Tensors
    phases: tuple[Phase, ...]
    finish: Callable[[Tensors], tuple[Tensors, Tensors]]
    objective: Objective | None = None
    consts: Tensors = field(default_factory=dict)
    model: BlockNet | None = None


def weighted_mean(per_sample: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """The batch mean of per-sample losses: plain in the loop (`w` None), Σ w·ℓ in a batched step."""
    return per_sample.mean() if w is None else (per_sample * w).sum()


def run_blocks(model: BlockNet, params: Tensors, names: Sequence[str], x: torch.Tensor) -> torch.Tensor:
    """`names` blocks of `model` in order on `x`, each with its parameters from `params` (state-dict keys): the
    body alone (`model.body_blocks()`) gives the features, the head blocks the logits. BatchNorm statistics among
    `params` are the forward's (an `Objective`'s `models`); without them, the model's own."""
    for name in names:
        prefix = f"blocks.{name}."
        own = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
        x = functional_call(model.blocks[name], own, (x,))
    return x


def features_and_logits(model: BlockNet, params: Tensors, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the body's output z, the head's logits on z) with the parameters from `params`: for losses on both."""
    z = run_blocks(model, params, model.body_blocks(), x)
    return z, run_blocks(model, params, model.head_blocks(), z)


def model_forward(model: BlockNet, params: Tensors, x: torch.Tensor) -> torch.Tensor:
    """The model's logits with its parameters from `params`."""
    return run_blocks(model, params, model.block_names(), x)


def run_plan(
    model: BlockNet, plan: LocalSGDPlan, data: ClientData, train: TrainConfig, generator: torch.Generator
) -> tuple[Tensors, Tensors]:
    """One client's plan, on the shared model object. A phase of zero epochs draws nothing from the generator."""
    model_keys = list(model.state_dict())
    own_keys = set(model_keys)
    load_params(model, {k: v for k, v in plan.start.items() if k in own_keys})
    extra = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in plan.start.items()
             if k not in own_keys}  # fmt: skip
    optimizers: dict[str, SGD] = {}
    for ph in plan.phases:
        if ph.model:  # the second model's tensors in, the plan's own model kept aside
            own = get_params(model)
            load_params(model, {k: extra[ph.model + k] for k in model_keys})
        with _stream(ph, data.cid, data.x.device) as drawn:
            own_data, gen = data if ph.data is None else ph.data, generator if drawn is None else drawn
            if ph.rule is not None:
                _rule_phase(model, extra, ph, own_data, train, gen)
            elif _plain(plan, ph):
                train_blocks(model, own_data, ph.blocks, epochs=ph.epochs, lr=ph.lr, train=train, generator=gen)
            else:
                _objective_phase(model, extra, plan, ph, own_data, train, gen, optimizers)
        if ph.model:
            extra.update({ph.model + k: v for k, v in get_params(model).items()})
            load_params(model, own)
    return plan.finish({**get_params(model), **{k: v.detach().clone() for k, v in extra.items()}})


@contextmanager
def _stream(ph: Phase, cid: int, device: torch.device) -> Iterator[torch.Generator | None]:
    """Client `cid`'s generator of `ph.stream`, torch's global RNG seeded from the same keys meanwhile and put
    back after; None (and nothing touched) for a phase without a stream of its own."""
    if ph.stream is None:
        yield None
        return
    with rng.fork(device):
        rng.seed_global(ph.stream_seed(cid), device)
        yield rng.generator(*ph.stream, cid)


def _plain(plan: LocalSGDPlan, ph: Phase) -> bool:
    """Whether `ph` is epochs of cross-entropy on whole blocks and nothing else (`train_blocks`)."""
    options = (ph.keys, ph.entries, ph.optimizer, ph.steps, ph.momentum, ph.weight_decay, ph.rule, ph.batch_size)
    return objective_of(plan, ph) is None and not ph.extra and all(o is None for o in options)


def objective_of(plan: LocalSGDPlan, ph: Phase) -> Objective | None:
    """The loss `ph` trains on: its own, else the plan's (None: cross-entropy of the model's output)."""
    return ph.objective if ph.objective is not None else plan.objective


def phase_keys(model: BlockNet, ph: Phase) -> list[str]:
    """The model's parameters `ph` trains, in model order."""
    keys = {k for k in model.state_keys(ph.blocks) if ph.keys is None or k in set(ph.keys)}
    return [k for k, _ in model.named_parameters() if k in keys]


def _objective_phase(
    model: BlockNet, extra: Tensors, plan: LocalSGDPlan, ph: Phase, data: ClientData, train: TrainConfig,
    generator: torch.Generator, optimizers: dict[str, SGD],
) -> None:  # fmt: skip
    """A phase of `plan.objective` (or cross-entropy), one SGD step per batch over the phase's parameters at
    `ph.lr` and its extra tensors at theirs; every other parameter frozen, as `train_blocks` freezes them."""
    if not ph.epochs:
        return
    named = dict(model.named_parameters())
    keys = phase_keys(model, ph)
    loss = objective_of(plan, ph)
    for k in objective_statistics(loss, [k for k, _ in model.named_buffers()], extra):
        extra[k].requires_grad_(False)  # moved in place by its forwards (BatchNorm refuses one requiring grad), and
        # never trained: in a group of `ph.extra`, the optimizer skips it (it gets no gradient)
    opt = optimizers.get(ph.optimizer) if ph.optimizer is not None else None
    if opt is None:
        groups = [{"params": [named[k] for k in keys], "lr": ph.lr}]
        groups += [{"params": [v for k, v in extra.items() if k.startswith(prefix)], "lr": lr}
                   for prefix, lr in ph.extra]  # fmt: skip
        momentum, weight_decay = ph.sgd(train)
        opt = SGD(groups, lr=ph.lr, momentum=momentum, weight_decay=weight_decay)
        if ph.optimizer is not None:
            optimizers[ph.optimizer] = opt
    held = {k: ~plan.consts[ph.entries + k] for k in keys if ph.entries is not None and ph.entries + k in plan.consts}
    anchors = {k: named[k].detach().clone() for k in held}  # the entries this phase must not move
    params = {**named, **extra}
    consts, draws = plan.consts, hasattr(loss, "draw")

    def objective(x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        if loss is None:
            return torch.nn.functional.cross_entropy(model(x), y)
        if noise is not None:
            return loss(model, params, consts, x, y, None, noise=noise)  # type: ignore[call-arg]
        return loss(model, params, consts, x, y, None)

    trained = set(keys)
    others = [p for k, p in named.items() if k not in trained]
    before = [p.requires_grad for p in others]
    hooks = hasattr(loss, "running")
    buffers = dict(model.named_buffers())
    kept = {k: v.clone() for k, v in buffers.items()} if hooks else {}  # the shared model's, put back after
    try:
        for p in others:
            p.requires_grad_(False)
        model.train()
        for b in ph.batches(data.train, train, generator):
            x, y = data.batch(b, generator)
            noise = loss.draw(len(b), generator).to(x.device) if draws else None  # type: ignore[union-attr]
            if hooks:
                with torch.no_grad():
                    start = loss.running(params, consts)  # type: ignore[union-attr]
                    for k, v in start.items():
                        buffers[k].copy_(v)
            opt.zero_grad(set_to_none=True)
            objective(x, y, noise).backward()
            opt.step()
            with torch.no_grad():  # `where`, not `p[m] = …`: boolean indexing syncs with a GPU every step
                for k, m in held.items():
                    named[k].copy_(torch.where(m, anchors[k], named[k]))
                if hooks:  # the forward moved the buffers from `start`; the next batch's `running` overwrites them
                    moved = {k: buffers[k] for k in start}
                    for k, v in loss.hand_back(params, consts, start, moved).items():  # type: ignore[union-attr]
                        extra[k].copy_(v)
    finally:
        for p, rg in zip(others, before, strict=True):
            p.requires_grad_(rg)
        with torch.no_grad():
            for k, v in kept.items():
                buffers[k].copy_(v)


def _rule_phase(
    model: BlockNet, extra: Tensors, ph: Phase, data: ClientData, train: TrainConfig, generator: torch.Generator
) -> None:
    """A phase of `ph.rule`'s steps on one client: each step's `rule.batches` batches taken in turn (each drawn,
    then its augmentation, as `ClientData.batch` draws them), then the rule; the model's parameters and the
    plan's extra tensors take the rule's new values."""
    rule = ph.rule
    assert rule is not None
    named = dict(model.named_parameters())
    tensors = {**{k: p.detach().clone() for k, p in named.items()}, **{k: v.detach() for k, v in extra.items()}}
    stats = set(statistics(rule, [k for k, _ in model.named_buffers()], tensors))
    seen = [k for k in tensors if k not in stats]  # what the rule reads: all but the statistics, as batched
    model.train()
    batch: list[tuple[torch.Tensor, torch.Tensor]] = []
    for b in ph.batches(data.train, train, generator):
        batch.append(data.batch(b, generator))
        if len(batch) == rule.batches:
            new = rule(_OwnGradients(model, tensors, batch), {k: tensors[k] for k in seen})
            tensors.update({k: v.detach() for k, v in new.items()})
            batch = []
    if batch:
        raise ValueError("a rule's phase ended inside a step: its batches are not a whole number of steps")
    with torch.no_grad():
        for k, p in named.items():
            p.copy_(tensors[k])
        for k, v in extra.items():
            v.copy_(tensors[k])


def objective_statistics(objective: Objective | None, buffers: list[str], tensors: Tensors) -> list[str]:
    """The plan's keys of the further BatchNorm statistics `objective`'s forwards move (its `models`' prefixes on
    the model's `buffers`): never trained."""
    return [m + k for m in getattr(objective, "models", ()) for k in buffers if m + k in tensors]


def statistics(rule: StepRule, buffers: list[str], tensors: Tensors) -> list[str]:
    """The plan's keys of the BatchNorm statistics `rule`'s forwards move (its `models`' prefixes on the model's
    `buffers`), which it never sets itself."""
    return [m + k for m in getattr(rule, "models", ("",)) for k in buffers if m + k in tensors]


class _OwnGradients:
    """`Gradients` of one client's step in the loop: the shared model's forward (its buffers moved in place, or a
    second model's statistics among `tensors`; its dropout drawn from torch's global RNG), differentiated by
    autograd."""

    def __init__(self, model: BlockNet, tensors: Tensors, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model, self.batch, self.tensors = model, batch, tensors
        self.base = {k: tensors[k] for k, _ in model.named_parameters()}  # the step's start

    def _loss(self, params: Tensors, j: int, model: str = "") -> tuple[Tensors, torch.Tensor]:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        x, y = self.batch[j]
        own = {k: self.tensors[model + k] for k, _ in self.model.named_buffers()} if model else {}  # moved in place
        out = functional_call(self.model, {**self.base, **own, **leaves}, (x,))
        return leaves, torch.nn.functional.cross_entropy(out, y)

    def grad(self, params: Tensors, j: int, model: str = "") -> Tensors:
        leaves, loss = self._loss(params, j, model)
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))

    def hvp(self, params: Tensors, j: int, v: Tensors) -> Tensors:
        leaves, loss = self._loss(params, j)
        grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=True)
        dot = sum((g * v[k]).sum() for g, k in zip(grads, leaves, strict=True))
        return dict(zip(leaves, torch.autograd.grad(dot, list(leaves.values())), strict=True))


class RegularizedObjective:
    """CE ± Σ_k ⟨w_k, l_k⟩ + μ/2·Σ_k ‖w_k − a_k‖² over the model's parameters `keys`, the linear coefficients l
    (constants `linear` + key; SCAFFOLD's correction c − c_i, FedDyn's g_k with `sign` −1) and the anchor a
    (constants `anchor` + key; FedProx's w^t, FedAMP's u_i, FedDyn's θ^{t−1}) being the plan's constants; either
    term absent where its prefix is None. In the loop (`w` None) the operations those algorithms always ran, in
    their order; in a batched step the cross-entropy weighted per sample and the other terms once per client."""

    def __init__(self, keys: list[str], mu: float = 0.0, anchor: str | None = None, linear: str | None = None,
                 sign: float = 1.0) -> None:  # fmt: skip
        self.keys, self.mu, self.anchor, self.linear, self.sign = keys, mu, anchor, linear, sign

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        logits = model_forward(model, params, x)
        per_sample = torch.nn.functional.cross_entropy(logits, y, reduction="mean" if w is None else "none")
        out = per_sample if w is None else weighted_mean(per_sample, w)
        if self.linear is not None:
            lin = sum((params[k] * consts[self.linear + k]).sum() for k in self.keys)
            out = out + lin if self.sign > 0 else out - lin
        if self.anchor is not None:
            out = out + 0.5 * self.mu * sum(((params[k] - consts[self.anchor + k]) ** 2).sum() for k in self.keys)
        return out

    def plan(self, start: Tensors, anchor: Tensors, phase: Phase,
             finish: Callable[[Tensors], tuple[Tensors, Tensors]]) -> LocalSGDPlan:  # fmt: skip
        """One phase of this (proximal) objective from `start`, anchored at `anchor`."""
        assert self.anchor is not None and self.linear is None
        return LocalSGDPlan(dict(start), (phase,), finish, self, {self.anchor + k: anchor[k] for k in self.keys})
