"""The round driver (DESIGN §5): sample → configure → client work → aggregate → evaluate on schedule.

One driver for every executor — in this process (`loop`, batched clients, `procs`) and inside a Flower ServerApp
(`flower`): what differs between them is only where `executor.stream` runs the clients. The driver does no I/O
but a DP run's ledger (`privacy.Ledger`, passed in), which writes one line per release.
The experiment around it (`loop.run`: run directory, checkpoints, progress, the final fine-tuning and new-client
stages) consumes the rounds it yields, so a Flower ServerApp can drive the same rounds and write the same files.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pflbed import privacy
from pflbed.algorithms.base import Algorithm, Context, Tensors
from pflbed.engine import wire
from pflbed.engine.guard import check_server
from pflbed.evaluation.evaluate import Forward, evaluate, subsampled
from pflbed.federation import sample_clients


class Executor(Protocol):
    """Where client updates run. `stream` yields (client, reply) in client order, each as soon as it is ready,
    and keeps each client's new state, which `state` returns (created by `init_client` on first use).

    An executor that can lose clients (Flower: a node died, a round timed out) returns from `stream` an iterable
    whose `failed` (the sampled clients that did not reply) is known before its first reply is taken.
    """

    states: dict[int, Tensors]
    forward: Forward | None  # where evaluation forwards may run besides this process (procs: the idle workers)

    def stream(self, rnd: int, payloads: dict[int, Tensors]) -> Iterable[tuple[int, Tensors]]: ...

    def state(self, cid: int) -> Tensors: ...


@dataclass
class Round:
    """What one round produced: the new server state, its evaluation record (None when not evaluated this round)
    and the per-client P-FL test accuracies of that evaluation."""

    rnd: int
    server: Tensors
    record: dict[str, Any] | None
    per_client: dict[int, float] | None
    train_s: float
    eval_s: float
    comm: dict[str, int] = field(default_factory=dict)


class Driver:
    """Runs rounds of `algo` on `executor`; evaluates every `eval.every` rounds and after the last one.

    Intermediate evaluations score on `subsampled` shared test sets (`eval.test_subsample`), the final one on the
    full sets (DESIGN §6).
    """

    def __init__(self, algo: Algorithm, executor: Executor, ledger: privacy.Ledger | None = None) -> None:
        """`ledger`: where a DP run counts its releases (`privacy.Ledger`; the experiment passes the run
        directory's); default, one in memory."""
        self.algo, self.executor = algo, executor
        self.cfg = algo.ctx.cfg
        self.quick: Context = subsampled(algo.ctx, self.cfg.eval.test_subsample)
        self.failed: dict[str, list[int]] = {}  # round → sampled clients that did not reply, since the last record
        self.dp = privacy.mechanism(self.cfg, len(algo.ctx.federation.participated))
        if ledger is None and self.dp is not None:
            ledger = privacy.Ledger(None, self.dp.randomness)
        self.ledger = ledger
        # round → noise draws released by its end (the ledger's count, earlier attempts' included), for its ε
        self.draws: dict[int, int] = ledger.draws_by_round() if ledger is not None else {}

    def rounds(self, server: Tensors, first: int = 1) -> Iterator[Round]:
        """Rounds `first`…`train.rounds`, starting from `server`. A diverged client or server state raises
        `DivergedError` (from the executor or `check_server`) with the round it happened in."""
        for rnd in range(first, self.cfg.train.rounds + 1):
            t0 = time.perf_counter()
            server, comm = self.train_round(rnd, server)
            train_s = time.perf_counter() - t0
            record = per_client = None
            t1 = time.perf_counter()
            if rnd % self.cfg.eval.every == 0 or rnd == self.cfg.train.rounds:
                record, per_client = self.evaluate(rnd, server, comm)
            yield Round(rnd, server, record, per_client, train_s, time.perf_counter() - t1, comm)

    def train_round(self, rnd: int, server: Tensors) -> tuple[Tensors, dict[str, int]]:
        """One round of training: (new server state, bytes sent down and up). Sampled clients that did not reply
        are left out: the server aggregates over those that did, with their weights, and the next record lists the
        lost ones under `failed_clients` (round → client ids).

        Under DP the sample and the noise come from the mechanism's source (`privacy.randomness`), and the round's
        release is entered in the ledger before this returns: nothing can send the new state on (the next round's
        payloads, an evaluation on the sites) before it is counted."""
        algo, fed = self.algo, self.algo.ctx.federation
        cids = sample_clients(self.cfg.seed, rnd, fed.participated, self.cfg.federation.sample_fraction,
                              self.cfg.poisson_sampling(), entropy=self.dp is not None and self.dp.entropy)  # fmt: skip
        payloads = algo.configure(rnd, server, cids)
        comm: dict[str, int] = {"up_bytes_per_round": 0,
                                "down_bytes_per_round": sum(map(wire.num_bytes, payloads.values()))}  # fmt: skip
        if not cids and self.dp is None:  # Poisson sampling drew no one: nothing to aggregate
            return server, comm
        replies = self.executor.stream(rnd, payloads) if cids else iter(())
        failed = list(getattr(replies, "failed", []))
        if failed:
            self.failed[str(rnd)] = failed
        lost = set(failed)
        arrived = [c for c in cids if c not in lost]
        weights: dict[int, float] = {c: fed.num_train(c) for c in arrived}
        if self.dp is not None:  # uniform weights; the clipped replies shifted so that their mean is the release
            first = cids[0] if cids else fed.participated[0]  # no one drawn: the payload's shape, for the noise
            shared = payloads[first] if cids else algo.configure(rnd, server, [first])[first]
            # noised: the float entries; an integer one is an instruction to the clients (L2GD's run lengths), not
            # replied (a reply's integer entry is refused by `privacy.clip_reply`)
            shared = {k: v for k, v in shared.items() if v.is_floating_point()}
            replies = self.dp.replies(self.cfg.seed, rnd, shared, iter(replies), len(arrived))
            weights = {c: 1.0 for c in arrived} if arrived else {-1: 1.0}
        agg = algo.aggregator(rnd, server, weights)
        for cid, reply in replies:  # replies folded in as they come (weighted means)
            if cid >= 0:
                comm["up_bytes_per_round"] += wire.num_bytes(reply)
            agg.add(cid, reply)
        del payloads  # with `agg` and the replies: the largest things alive, never two rounds' at once
        server = agg.result()
        check_server(rnd, server)
        if self.ledger is not None:  # counted (durably) before the release can leave
            self.draws[rnd] = self.ledger.release(rnd)
        return server, comm

    def evaluate(self, rnd: int, server: Tensors, comm: dict[str, int]) -> tuple[dict[str, Any], dict[int, float]]:
        """The round's record (G-FL, P-FL, communication, the algorithm's diagnostics) and per-client P-FL."""
        final = rnd == self.cfg.train.rounds
        state: Callable[[int], Tensors] = self.executor.state
        on_sites = getattr(self.executor, "evaluate_on_sites", None)  # the data is on the sites: they score
        if on_sites is not None:
            scores, per_client = on_sites(server, None if final else self.quick)
        else:
            scores, per_client = evaluate(self.algo, server, state, None if final else self.quick,
                                          self.executor.forward)  # fmt: skip
        record = {"round": rnd, **scores, **comm, "full_test": final or self.quick is self.algo.ctx}
        if self.dp is not None:  # ε after this round, and after each round since the previous evaluation
            since = (rnd - 1) // self.cfg.eval.every * self.cfg.eval.every
            record["privacy"] = self.dp.record(rnd, since, self.draws)
        if self.failed:  # which clients each round since the last record lost
            record["failed_clients"], self.failed = self.failed, {}
        diag = None if on_sites is not None else self.algo.diagnostics(rnd, server, state)
        if diag:
            record["diag"] = diag
        return record, per_client
