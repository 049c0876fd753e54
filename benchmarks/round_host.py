"""The host's work around a batched round's steps, each beside the form it replaced, in one process on the CPU.

On a GPU the host's Python at a round's start (the clients' plans, the layout of their batches) is time the device
waits for its first step, and at its end the server folds the replies in with one launch per call while the
device sits idle. Neither can be timed on the GPU without one, so this times the host's part here and counts the
calls: (1) 100 clients' plans (`BatchedExecutor.plans`, new rounds: each client's seed hashed once, not twice,
the global RNG forked once for them all, not once each);
(2) their batches laid out (`batched._schedule`: each client's batches drawn at once, `Phase.batches_at_once`,
beside the batch-by-batch loop it replaced); (3) the replies and states checked for divergence
(`guard.check_clients_later`, computed before the replies are handed on and read after, beside the one screen
read before, `guard.screen_finite`: more calls, but none of them after a wait for the device); (4) the replies
folded into the weighted mean (`WeightedMean.add`: one multi-tensor call a reply, beside one `add_` a tensor).
Prints ms (median of `--repeats`) and ratios.

    python benchmarks/round_host.py [--clients 100] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import EXECUTORS, config  # noqa: E402

from pflbed import rng  # noqa: E402
from pflbed.algorithms.base import ClientContext  # noqa: E402
from pflbed.algorithms.training import WeightedMean  # noqa: E402
from pflbed.engine import batched  # noqa: E402
from pflbed.engine.build import make_executor, prepare  # noqa: E402
from pflbed.engine.executor import client_generator, precision  # noqa: E402
from pflbed.engine.guard import check_clients_later, screen_finite  # noqa: E402


def timed(f: Callable[[], object], repeats: int) -> float:
    """Median ms of `repeats` calls of `f`."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def calls(f: Callable[[], object]) -> int:
    """The torch operators `f` calls at the top level (on a GPU, one launch or more each)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        f()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and
               (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))  # fmt: skip


def batch_by_batch(datas: list, train, ph, gens: list[torch.Generator]) -> tuple:
    """The layout as `_schedule` built it before `Phase.batches_at_once`: each client's batches taken one by one."""
    orders, sizes, counts = [], [], []
    host = torch.cat([d.train for d in datas]).cpu().split([d.num_train for d in datas])
    for indices, g in zip(host, gens, strict=True):
        before = len(sizes)
        for b in ph.batches(indices, train, g):
            orders.append(b)
            sizes.append(len(b))
        counts.append(len(sizes) - before)
    rows, weights, lengths, _, _ = batched._laid_out(torch.cat(orders), sizes, counts)
    active = [None if all(s < n for n in counts) else [c for c, n in enumerate(counts) if s < n]
              for s in range(len(rows))]  # fmt: skip
    return rows, weights, active, None, lengths, None


def fold_per_tensor(weights: dict[int, float], replies: dict[int, dict[str, torch.Tensor]]) -> dict:
    """The weighted mean as `WeightedMean.add` folded it in before: one `add_` per tensor of every reply."""
    w = torch.tensor(list(weights.values()), dtype=torch.float64)
    norm = dict(zip(weights, (w / w.sum()).tolist(), strict=True))
    out = {k: torch.zeros_like(v) for k, v in next(iter(replies.values())).items()}
    for c, reply in replies.items():
        for k, v in reply.items():
            out[k].add_(v, alpha=norm[c])
    return out


def fold_at_once(weights: dict[int, float], replies: dict[int, dict[str, torch.Tensor]]) -> dict:
    agg = WeightedMean(weights)
    for c, reply in replies.items():
        agg.add(c, reply)
    return agg.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    shape = argparse.Namespace(quick=False, models=["cnn", "resnet18"], rounds=3, big_rounds=2, device="cpu")
    algo = prepare(config("fedavg", "cnn", EXECUTORS["batched"], shape, "paper", a.clients))  # 500 samples each
    ex, _ = make_executor(algo, None)
    ctx, cids = algo.ctx, list(range(a.clients))
    payload = algo.init_server()
    rounds = iter(range(10, 10_000))  # new rounds, as in a run

    def plans(rnd: int | None = None) -> dict:
        return ex.plans(rnd or next(rounds), {c: payload for c in cids})

    def plans_one_by_one(rnd: int | None = None) -> dict:
        """The plans as `BatchedExecutor.plan` built them before: one fork of the RNG and one precision context a
        client, its seed hashed twice (as `seeded` did: once for the global RNG, once for its generator)."""
        rnd = rnd or next(rounds)
        built = {}
        for c in cids:
            with rng.fork(ctx.device):
                rng.seed_global(rng.derive_seed(ctx.seed, rng.CLIENT, rnd, c), ctx.device)
                cctx = ClientContext(rnd, c, client_generator(ctx.seed, rnd, c))
                with precision(algo):
                    plan = algo.round_plan(payload, ex.state(c), ctx.client_data(c), cctx)
                built[c] = plan, cctx.generator, rng.global_now(ctx.device)
        return built

    ph = plans(1)[0][0].phases[0]
    assert all(old[0].phases == new[0].phases and torch.equal(old[1].get_state(), new[1].get_state())
               for old, new in zip(plans_one_by_one(1).values(), plans(1).values(), strict=True))  # fmt: skip
    datas = [ctx.client_data(c) for c in cids]

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(c) for c in cids]

    got, want = batched._schedule(datas, ctx.cfg.train, ph, gens()), batch_by_batch(datas, ctx.cfg.train, ph, gens())
    assert all((x == y) if x is None or isinstance(x, list) else torch.equal(x, y)
               for x, y in zip(got, want, strict=True))  # fmt: skip
    replies = {c: {k: v + 0.01 * c for k, v in payload.items()} for c in cids}
    weights = {c: float(ctx.federation.num_train(c)) for c in cids}
    new, old = fold_at_once(weights, replies), fold_per_tensor(weights, replies)
    assert all(torch.equal(new[k], old[k]) for k in old)

    rows = [("plans", plans_one_by_one, plans, False),
            ("batches laid out", lambda: batch_by_batch(datas, ctx.cfg.train, ph, gens()),
             lambda: batched._schedule(datas, ctx.cfg.train, ph, gens()), False),
            ("replies checked", lambda: screen_finite(v for r in replies.values() for v in r.values()),
             lambda: check_clients_later(1, [(c, r, {}) for c, r in replies.items()])(), True),
            ("replies folded in", lambda: fold_per_tensor(weights, replies), lambda: fold_at_once(weights, replies),
             True)]  # fmt: skip
    print(f"{a.clients} clients × {ctx.federation.num_train(0)} training samples, FedAvg, cnn, batch "
          f"{ctx.cfg.train.batch_size}, one thread; ms per round (median of {a.repeats}); calls: the torch operators "
          "called on the run's device (on a GPU each a launch; the plans and the layout run on the host)")
    print(f"{'':20s} {'before ms':>10s} {'now ms':>8s} {'before ÷ now':>13s} {'calls before':>13s} {'calls now':>10s}")
    for name, before, now, on_device in rows:
        t_before, t_now = timed(before, a.repeats), timed(now, a.repeats)
        n_before, n_now = (str(calls(before)), str(calls(now))) if on_device else ("-", "-")
        print(f"{name:20s} {t_before:10.2f} {t_now:8.2f} {t_before / t_now:13.2f} {n_before:>13s} {n_now:>10s}")
    print("(the screen's calls before: on a CPU one norm per tensor; on a GPU a few multi-tensor calls, but read "
          "before the replies are handed on)")


if __name__ == "__main__":
    main()
