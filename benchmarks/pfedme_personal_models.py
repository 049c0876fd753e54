"""Why pFedMe's personal models score below its own global model in KT-pFL's homogeneous table.

Reads the finished pFedMe cells of `benchmarks/suites/fmnist_ktpfl_homogeneous.yaml` (their checkpoints: run the
suite first) and prints, per cell, the mean accuracy on the clients' own test splits (the table's P-FL) of
- θ_i: each client's personal model as the run scores it — the inner solution of Eq. 7 left from the last mini-batch
  of the client's last participated round (w⁰ for a client never sampled);
- w: the final global model;
- θ̂_i(w): the personal model re-solved from the final w on all of the client's training data (full-batch gradient
  steps on f_i(θ) + λ/2‖θ − w‖² at the run's η_p, `--steps` of them) — what a fresh, whole-data personalization of
  the final model gives.
Clients are grouped by the last round they were sampled in (the schedule is recomputed from the seed), so the
cost of stale personal models under partial participation shows separately from the one-batch inner solution. The
suite's other cells are grouped the same way (their P-FL as scored, from `summary.json`): FedAvg's and
Per-FedAvg's personal models are computed from the current global model, the contrast; FedAMP's, FedFomo's and
KT-pFL's are stored per client and age like pFedMe's; pFedHN's come from the current hypernetwork. Re-solving needs
the checkpoints (cells without them are only grouped); it runs for the pFedMe cells of `--seeds` (default 0). For
the FedAMP cells of `--seeds` it also prints the cloud-model weights a next round would use (self weight ξ_ii, and
the weight on models uploaded long ago), for the pFedHN cells how personal the generated models are (each
client's own, the mean embedding's, another client's).

    python benchmarks/pfedme_personal_models.py [--suite …] [--seeds 0 1 2] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from pflbed.algorithms.base import Predictor
from pflbed.config import Config, validate_config
from pflbed.federation import sample_clients
from pflbed.results.bench import Bench, load_suite
from pflbed.results.trained import load_run


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def resolved(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lam: float, lr: float, steps: int) -> None:
    """θ̂(w) in place: full-batch gradient steps on f(θ) + λ/2‖θ − w‖² from θ = w (the model's current weights)."""
    anchor = [p.detach().clone() for p in model.parameters()]
    model.train()
    for _ in range(steps):
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        with torch.no_grad():
            for p, g, w in zip(model.parameters(), grads, anchor, strict=True):
                p.sub_(lr * (g + lam * (p - w)))
    model.eval()


def last_sampled(cfg: Config, participated: list[int], rounds: int) -> dict[int, int]:
    """The last round each client was sampled in (0: never), recomputed from the run's seed."""
    last = dict.fromkeys(participated, 0)
    for rnd in range(1, rounds + 1):
        for c in sample_clients(cfg.seed, rnd, participated, cfg.federation.sample_fraction):
            last[c] = rnd
    return last


def grouped(per: dict[int, tuple[float, ...]], last: dict[int, int], rounds: int) -> dict[str, list[float]]:
    """Mean of each figure over the clients last sampled in: never, each third of the rounds, the last round."""
    a, b = rounds // 3, 2 * rounds // 3
    groups = {"never sampled": (0, 0), f"last sampled in 1–{a}": (1, a), f"in {a + 1}–{b}": (a + 1, b),
              f"in {b + 1}–{rounds - 1}": (b + 1, rounds - 1), f"in {rounds}": (rounds, rounds),
              "all": (0, rounds)}
    out = {}
    for name, (lo, hi) in groups.items():
        cids = [c for c in per if lo <= last[c] <= hi]
        if cids:
            out[f"{name} ({len(cids)})"] = [100 * sum(per[c][i] for c in cids) / len(cids)
                                            for i in range(len(per[cids[0]]))]  # fmt: skip
    return out


def cell_figures(path: Path, resolve_steps: int | None) -> tuple[list[str], dict[str, list[float]]]:
    """Per group: the P-FL the run scored; for pFedMe with `resolve_steps`, also w and θ̂_i(w) (the checkpoint)."""
    summary = json.loads((path / "summary.json").read_text())
    cfg = validate_config(yaml.safe_load((path / "config.yaml").read_text()))
    scored = dict(zip(summary["per_client"]["cid"], summary["per_client"]["pfl_acc"], strict=True))
    last = last_sampled(cfg, sorted(scored), summary["rounds"])
    if resolve_steps is None:
        return ["P-FL"], grouped({c: (a,) for c, a in scored.items()}, last, summary["rounds"])
    run = load_run(path)
    fed, opts = run.algo.ctx.federation, run.algo.opts
    glob = run.generic_model()
    assert glob is not None
    per: dict[int, tuple[float, ...]] = {}
    for cid in sorted(fed.participated):
        data = run.algo.ctx.client_data(cid)
        x, y = data.x[fed.clients[cid].test], data.y[fed.clients[cid].test]
        fresh = run.generic_model()
        assert fresh is not None
        resolved(fresh, data.x[data.train], data.y[data.train], opts.lam, opts.personal_lr, resolve_steps)
        per[cid] = (accuracy(run.personal_model(cid), x, y), accuracy(glob, x, y), accuracy(fresh, x, y))
    return ["θ_i", "w", "θ̂_i(w)"], grouped(per, last, summary["rounds"])


def fedamp_weights(path: Path, rounds: int, last: dict[int, int]) -> str:
    """FedAMP's cloud-model weights a next round would use (from the final checkpoint): each participated client's
    self weight ξ_ii, and the weight its u_i puts on other clients' models last uploaded ≥ rounds/3 rounds ago."""
    run = load_run(path)
    algo, server = run.algo, run.server
    uploaded, cache = algo.uploaded(server), {}
    models = {c: algo.stored(server, c) for c in sorted({*uploaded, *last})}
    self_w, stale = [], []
    for i in sorted(last):
        row = algo.weights(rounds + 1, i, {j: models[j] for j in sorted({*uploaded, i})}, cache)
        self_w.append(row[i])
        stale.append(sum(w for j, w in row.items() if j != i and last[j] <= rounds - rounds // 3))
    n = len(self_w)
    return (f"  FedAMP weights for round {rounds + 1} ({len(uploaded)} stored models): self weight ξ_ii mean "
            f"{sum(self_w) / n:.3f} (min {min(self_w):.3f}, max {max(self_w):.3f}); weight on models uploaded "
            f"≥ {rounds // 3} rounds ago, mean {sum(stale) / n:.3f}")  # fmt: skip


def pfedhn_models(path: Path) -> str:
    """How personal pFedHN's models are: mean test accuracy of each client's generated model h(v_i; φ), of the one
    model generated from the mean embedding, and of the next client's model (clients in id order, cyclic)."""
    run = load_run(path)
    algo, server, fed = run.algo, run.server, run.algo.ctx.federation
    cids = sorted(fed.participated)
    buffers = algo.initial_buffers()

    def acc(theta, cid: int) -> float:
        data, test = algo.ctx.client_data(cid), fed.clients[cid].test
        pred = Predictor(algo.ctx.model, {**theta, **buffers}).logits(data.x[test])
        return float((pred.argmax(1) == data.y[test]).float().mean())

    mean_model = algo.generate(server, server["emb"].mean(0))
    own = [acc(algo.generate(server, algo.embedding(server, c)), c) for c in cids]
    shared = [acc(mean_model, c) for c in cids]
    other = [acc(algo.generate(server, algo.embedding(server, cids[(k + 1) % len(cids)])), c)
             for k, c in enumerate(cids)]  # fmt: skip
    n = len(cids)
    return (f"  pFedHN: own generated model {100 * sum(own) / n:.2f}, the mean embedding's model "
            f"{100 * sum(shared) / n:.2f}, the next client's model {100 * sum(other) / n:.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="benchmarks/suites/fmnist_ktpfl_homogeneous.yaml")
    ap.add_argument("--steps", type=int, default=50, help="full-batch steps re-solving the inner problem")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0], help="seeds whose pFedMe cells are re-solved")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bench = Bench(load_suite(args.suite))
    seen: set[Path] = set()
    for table, (setting, method, seed) in bench.cells():
        path = table.run_dir(setting, method, seed)
        if path in seen or not (path / "summary.json").is_file():
            continue
        seen.add(path)
        has_checkpoint = (path / "checkpoints").is_dir()
        resolve = args.steps if method == "pFedMe" and seed in args.seeds and has_checkpoint else None
        names, groups = cell_figures(path, resolve)
        print(f"{method} · {setting} · seed {seed} — accuracy (%) on the clients' test splits", flush=True)
        for group, accs in groups.items():
            print(f"  {group:<28} " + "  ".join(f"{k} {v:6.2f}" for k, v in zip(names, accs, strict=True)), flush=True)
        if method == "pFedHN" and seed in args.seeds and has_checkpoint:
            print(pfedhn_models(path))
        if method == "FedAMP" and seed in args.seeds and has_checkpoint:
            cfg = validate_config(yaml.safe_load((path / "config.yaml").read_text()))
            summary = json.loads((path / "summary.json").read_text())
            rounds = summary["rounds"]
            print(fedamp_weights(path, rounds, last_sampled(cfg, sorted(summary["per_client"]["cid"]), rounds)))

if __name__ == "__main__":
    main()
