"""How much of FedBN's participated P-FL is lost to stale BatchNorm statistics.

FedBN scores a client with the server's aggregated weights and the client's own BatchNorm entries (Algorithm 1; the
authors' code evaluates the same way, after the communication step). The BN *running statistics* in those entries
were accumulated during the client's last local training, i.e. under its locally trained weights, not under the
aggregated weights they are now paired with. When local training moves the weights far from the average (momentum,
several epochs, rotated domains), the statistics no longer describe the features the aggregated layers produce.

For every finished FedBN cell of a suite (from its final checkpoint) this prints, per domain and overall, each
client's P-FL as the run scored it and after re-estimating only the running statistics on the client's own
training data under the final weights (one pass in training mode, cumulative average, no parameter changes).
The gap is what the pairing costs; the re-estimation is a diagnostic, not part of FedBN.

    python benchmarks/fedbn_bn_statistics.py [suite.yaml]     # default: the fmnist-rot4 PFLBED suite
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import nn

from pflbed.algorithms.base import Predictor
from pflbed.algorithms.fedbn import BN_KINDS
from pflbed.evaluation.evaluate import Predictions, client_score
from pflbed.results.bench import Bench, load_suite
from pflbed.results.trained import load_run


def restat(model: nn.Module, x: torch.Tensor, batch: int = 64) -> nn.Module:
    """A copy of `model` whose BN running statistics are re-estimated on `x` (every other entry unchanged)."""
    out = copy.deepcopy(model)
    for m in out.modules():
        if isinstance(m, BN_KINDS):
            m.reset_running_stats()
            m.momentum = None  # cumulative moving average: the plain mean over the batches
    out.train()
    with torch.no_grad():
        for xb in x.split(batch):
            out(xb)
    return out.eval()


def cell(path: Path) -> dict[int, list[tuple[float, float]]]:
    """Per domain: (P-FL as scored, P-FL with re-estimated statistics) of each participated client."""
    run = load_run(path)
    ctx = run.algo.ctx
    fed, P = ctx.federation, Predictions(ctx.source, ctx.cfg.eval.batch_size)
    out: dict[int, list[tuple[float, float]]] = {}
    for cid in sorted(fed.participated):
        model = run.personal_model(cid).eval()
        data = ctx.client_data(cid)
        # both predictors stay alive until scored: `Predictions` caches labels by the params dict's identity
        preds = [Predictor(ctx.model, m.state_dict()) for m in (model, restat(model, data.x[data.train]))]
        scored, restated = (client_score(p, cid, ctx, P, "test") for p in preds)
        P.forget_models()
        out.setdefault(fed.clients[cid].domain, []).append((scored, restated))
    return out


def mean(pairs: list[tuple[float, float]], i: int) -> float:
    return 100 * sum(p[i] for p in pairs) / len(pairs)


def main() -> None:
    torch.set_num_threads(1)
    bench = Bench(load_suite(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/suites/fmnist_rot4_fedbasis.yaml"))
    seen: set[Path] = set()
    for table, (setting, method, seed) in bench.cells():
        path = table.run_dir(setting, method, seed)
        if path in seen or table.cell_config(setting, method, seed).algorithm.name != "fedbn":
            continue
        seen.add(path)
        if not (path / "summary.json").is_file() or not (path / "checkpoints").is_dir():
            print(f"{method} · seed {seed}: no finished run with a checkpoint, skipped")
            continue
        groups = cell(path)
        print(f"{method} · {setting or '-'} · seed {seed} — participated P-FL (%): as scored / BN statistics "
              "re-estimated (lowest client)")  # fmt: skip
        for dom, v in sorted(groups.items()):
            print(f"  domain {dom} ({len(v)} clients): {mean(v, 0):6.2f} / {mean(v, 1):6.2f}   "
                  f"({100 * min(p[0] for p in v):5.1f} / {100 * min(p[1] for p in v):5.1f})")  # fmt: skip
        every = [p for v in groups.values() for p in v]
        print(f"  all ({len(every)} clients):      {mean(every, 0):6.2f} / {mean(every, 1):6.2f}", flush=True)


if __name__ == "__main__":
    main()
