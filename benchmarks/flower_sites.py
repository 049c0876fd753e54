"""Site-local Flower deployments (`pflbed flower local --site-data`) against the simulation and against today's
deployment with the whole dataset on every node, side by side, for FedAvg, FedPer, FedRoD, FedSelect and FedBasis.

Fashion-MNIST, 4 clients of different sizes (Dirichlet 0.5, at most 300 training samples each), the McMahan CNN,
`--rounds` rounds evaluated every round, +FT at the end. Per algorithm:
- `loop` (the simulation, in this process), then each client's samples written as a site (`pflbed flower sites`);
- the site-local deployment: 4 SuperNodes, each reading only its site directory; the server holds no client data
  and G-FL is the sample-weighted mean over the sites' test data (`gfl_source`);
- the plain deployment (`pflbed flower local --supernodes 4`: every node and the server load Fashion-MNIST).
Printed: final P-FL of each, the largest difference of any P-FL / validation figure of any record from the
simulation's, whether the +FT figures and the server's final state are equal bit for bit; training seconds per
round of both deployments and their ratio; and what crosses the network per round and site: the payload and reply
tensors of a training round (`down_bytes_per_round` / `up_bytes_per_round` ÷ sites), plus, for each evaluation, the
server state sent to every site (the numbers coming back are a few hundred bytes).
Resumable: one JSON line per finished algorithm in `--out` (default benchmarks/results/flower_sites.jsonl).

    python benchmarks/flower_sites.py [--rounds 3] [--only fedavg fedper]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from pflbed.config import validate_config
from pflbed.engine import wire
from pflbed.flower.local import run_local
from pflbed.flower.sites import export_sites
from pflbed.results.experiment import run

ALGOS = ["fedavg", "fedper", "fedrod", "fedselect", "fedbasis"]
FIGURES = ("pfl_acc", "pfl_acc_std", "pfl_acc_min", "pfl_acc_p10", "pfl_val", "gfl_val")
SITES = 4


def tree(name: str, rounds: int) -> dict:
    return {"dataset": {"name": "fmnist"}, "model": {"name": "cnn"},
            "federation": {"clients": SITES, "partition": "dirichlet", "alpha": 0.5, "train_per_client": 300},
            "train": {"rounds": rounds, "checkpoint_every": 0}, "eval": {"every": 1, "finetune": ["ft"]},
            "executor": {"threads": 1}, "algorithm": {"name": name}}  # fmt: skip


def measure(name: str, rounds: int, tmp: Path) -> dict:
    base = tree(name, rounds)
    sim = run(validate_config(base), write=False, progress=False)
    dirs = export_sites(validate_config(base), tmp / "sites")
    shape = list(sim.executor.algo.ctx.source.input_shape)
    flower = {**base, "executor": {"name": "flower", "supernodes": SITES, "threads": 1}}
    sites_cfg = validate_config({**flower, "sites": {"local": True, "input_shape": shape, "num_classes": 10}})
    quiet = lambda *_: None  # noqa: E731
    sites = run_local(sites_cfg, tmp / "sites-run", SITES, site_data=dirs, log=quiet)
    plain = run_local(validate_config(flower), tmp / "plain-run", SITES, log=quiet)
    records = [json.loads(x) for x in (tmp / "sites-run" / "metrics.jsonl").read_text().splitlines()]
    gap = max(abs(a[k] - b[k]) for a, b in zip(sim.history, records, strict=True) for k in FIGURES
              if a[k] is not None)  # fmt: skip
    server = torch.load(tmp / "sites-run" / "checkpoints" / "last.pt", weights_only=True)["server"]
    state_bytes = wire.num_bytes(server)
    return {
        "algorithm": name, "rounds": rounds,
        "pfl_sim": sim.summary["final"]["pfl_acc"], "pfl_sites": sites["final"]["pfl_acc"],
        "pfl_plain": plain["final"]["pfl_acc"],
        "gfl_sim": sim.summary["final"]["gfl_acc"], "gfl_sites": sites["final"]["gfl_acc"],
        "max_record_gap": gap, "ft_equal": sim.summary["final"].get("ft") == sites["final"].get("ft"),
        "server_equal": all(torch.equal(server[k], sim.server[k]) for k in sim.server),
        "s_round_sites": sites["timing"]["s_per_round"], "s_round_plain": plain["timing"]["s_per_round"],
        "wall_sites": sites["timing"]["wall_s"], "wall_plain": plain["timing"]["wall_s"],
        "down_per_site": records[0]["down_bytes_per_round"] / SITES,
        "up_per_site": records[0]["up_bytes_per_round"] / SITES,
        "eval_down_per_site": state_bytes,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    kb = lambda b: f"{b / 1024:,.0f} KiB"  # noqa: E731
    out = [f"Fashion-MNIST, {SITES} sites (one client each, Dirichlet 0.5, ≤ 300 training samples), cnn, "
           f"{rows[0]['rounds']} rounds; P-FL % final round",
           "| algorithm | P-FL simulation | P-FL site-local | P-FL plain deployment | largest record gap | +FT equal "
           "| server state equal | G-FL simulation (global test) | G-FL site-local (sites' tests) "
           "| s/round site-local | s/round plain | ratio | down / up per site per round | per site per evaluation |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    pct = lambda v: "—" if v is None else f"{100 * v:.2f}"  # noqa: E731
    for r in rows:
        out.append(f"| {r['algorithm']} | {pct(r['pfl_sim'])} | {pct(r['pfl_sites'])} | {pct(r['pfl_plain'])} "
                   f"| {r['max_record_gap']:.1e} | {'yes' if r['ft_equal'] else 'no'} "
                   f"| {'yes' if r['server_equal'] else 'no'} | {pct(r['gfl_sim'])} | {pct(r['gfl_sites'])} "
                   f"| {r['s_round_sites']:.2f} | {r['s_round_plain']:.2f} "
                   f"| {r['s_round_sites'] / r['s_round_plain']:.2f} "
                   f"| {kb(r['down_per_site'])} / {kb(r['up_per_site'])} | {kb(r['eval_down_per_site'])} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=ALGOS, choices=ALGOS)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "flower_sites.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(1)
    done = {json.loads(x)["algorithm"] for x in a.out.read_text().splitlines()} if a.out.exists() else set()
    for name in a.only:
        if name in done:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            row = measure(name, a.rounds, Path(tmp))
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{name}: done", flush=True)
    rows = [json.loads(x) for x in a.out.read_text().splitlines()]
    text = table(sorted(rows, key=lambda r: ALGOS.index(r["algorithm"])))
    a.out.with_suffix(".txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
