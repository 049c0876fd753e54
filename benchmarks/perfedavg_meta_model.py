"""Why Per-FedAvg's meta-model scores near chance on G-FL while its one-step personal models score well.

Reads the finished Per-FedAvg cells of `benchmarks/suites/fmnist_pfl_baselines.yaml` (their checkpoints: run the
suite first) and prints, per cell, for every participated client's training data:
- the meta-model's predictions: how many distinct classes it predicts, and the share of its most frequent class;
- the squared norm of the penultimate features ‖h‖² and α‖h‖²: one full-batch gradient step of size α on the
  classifier alone moves the logit of class c by α·‖h‖²·(ȳ_c − p̄_c) (ȳ = the batch's label frequencies, p̄ = the
  mean softmax), so α‖h‖² is how far a single step can shift each logit toward the client's label mix;
- the mean absolute logit change of the personal (one-step) model against the meta-model, and both accuracies.
The suite's FedAvg cells are read the same way (its generic model is its personal model; α of Per-FedAvg's
default) as the contrast: a model trained to classify without adaptation.

    python benchmarks/perfedavg_meta_model.py [--suite benchmarks/suites/fmnist_pfl_baselines.yaml]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pflbed.results.bench import Bench, load_suite
from pflbed.results.trained import load_run


def cell_figures(path: Path) -> dict[str, float]:
    run = load_run(path)
    meta = run.generic_model()
    assert meta is not None
    alpha = float(getattr(run.algo.opts, "alpha", 0.01))  # FedAvg: Per-FedAvg's default α, for contrast
    feats: list[torch.Tensor] = []
    hook = meta.blocks.classifier.register_forward_hook(lambda m, i, o: feats.append(i[0]))
    distinct, top_share, h2, shift, acc_meta, acc_pers = [], [], [], [], [], []
    for cid in sorted(run.algo.ctx.federation.participated):
        data = run.algo.ctx.client_data(cid)
        x, y = data.x[data.train], data.y[data.train]
        feats.clear()
        with torch.no_grad():
            out = meta(x)
        pred = out.argmax(1)
        counts = torch.bincount(pred, minlength=out.shape[1])
        distinct.append(float((counts > 0).sum()))
        top_share.append(float(counts.max()) / len(pred))
        h2.append(float(feats[0].pow(2).sum(1).mean()))
        personal = run.personal_model(cid)
        with torch.no_grad():
            out_p = personal(x)
        shift.append(float((out_p - out).abs().mean()))
        acc_meta.append(float((pred == y).float().mean()))
        acc_pers.append(float((out_p.argmax(1) == y).float().mean()))
    hook.remove()

    def mean(v: list[float]) -> float:
        return sum(v) / len(v)

    return {"classes predicted": mean(distinct), "top-class share": mean(top_share), "|h|^2": mean(h2),
            "alpha*|h|^2": alpha * mean(h2), "mean |logit change|": mean(shift),
            "train acc meta": mean(acc_meta), "train acc personal": mean(acc_pers)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="benchmarks/suites/fmnist_pfl_baselines.yaml")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bench = Bench(load_suite(args.suite))
    read = 0
    for table, (setting, method, seed) in bench.cells():
        path = table.run_dir(setting, method, seed)
        if method not in ("Per-FedAvg", "FedAvg") or not (path / "checkpoints").is_dir():
            continue
        figs = cell_figures(path)
        read += 1
        print(f"{method}, {setting}, seed {seed}: " + ", ".join(f"{k} {v:.3g}" for k, v in figs.items()), flush=True)
    if not read:  # the committed results keep no checkpoints: an empty output read as "nothing to say"
        print(f"no finished Per-FedAvg or FedAvg cell with a checkpoint in {bench.out}: run the suite first")


if __name__ == "__main__":
    main()
