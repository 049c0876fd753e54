"""What client-level DP and secure aggregation cost per round: the same runs with and without each, side by side.

Both arms draw clients by Poisson sampling (`federation.sampling=poisson`), so the same clients train the same
batches in both and the difference is DP's own work alone: each client's update clipped where it ran (one norm over
the shared entries, a rescale where above C) and the round's noise drawn and added on the server. Arms alternate
repeat by repeat, and so does which runs first; printed: median training seconds per round (`summary.json` →
`timing.s_per_round`, evaluation excluded) of each arm, DP ÷ plain, and each repeat's ratio (the machine's noise);
then DP's own work timed alone: 100 clients' replies clipped and released with noise.

SecAgg+ (`--secagg`): a site-local Flower deployment (`pflbed flower local --site-data`) of 4 sites (Fashion-MNIST,
the McMahan CNN, FedAvg, ≤ 300 training samples a site, `--deployment-rounds` rounds), plain and with `--secagg`,
alternating; printed: median training seconds per round of each and their ratio, and the largest difference of the
secure run's final server state from the plain one's (SecAgg+'s quantization).

Distributed noise (`--distributed`): the same secure deployment under client-level DP (C = 1, σ = 0.01, every client
sampled), the noise added by the server after unmasking (`privacy.noise: central`) or by each site before masking
(`distributed`), alternating; printed: median seconds per round of each and their ratio.

    python benchmarks/privacy_overhead.py [--repeats 3] [--rounds 10] [--secagg] [--distributed]
                                          [--deployment-rounds 3] [--skip-dp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pflbed.config import validate_config
from pflbed.results.experiment import run

SETUP = {  # benchmarks/suites/privacy_fmnist.yaml's federation and training
    "dataset": {"name": "fmnist"}, "model": {"name": "lenet5"},
    "federation": {"clients": 1000, "partition": "dirichlet", "alpha": 0.3, "sample_fraction": 0.1,
                   "sampling": "poisson"},
    "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "checkpoint_every": 0},
    "eval": {"every": 10**6, "finetune": []}, "executor": {"threads": 1},
}  # fmt: skip
DP = {"clip": 1.0, "noise_multiplier": 1.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--algorithms", nargs="*", default=["fedavg", "fedper"])
    ap.add_argument("--secagg", action="store_true", help="also plain vs SecAgg+ site-local deployments")
    ap.add_argument("--distributed", action="store_true", help="also central vs distributed noise on a secure "
                    "site-local deployment")  # fmt: skip
    ap.add_argument("--deployment-rounds", type=int, default=3)
    ap.add_argument("--skip-dp", action="store_true", help="only the deployments (--secagg, --distributed)")
    a = ap.parse_args()
    if not a.skip_dp:
        dp_overhead(a)
    if a.secagg:
        secagg(a.repeats, a.deployment_rounds)
    if a.distributed:
        secagg(a.repeats, a.deployment_rounds, noise=True)


def share_work(repeats: int = 5) -> tuple[float, float]:
    """Milliseconds a site spends on its SecAgg+ update of the FMNIST CNN (one client), without and with its share
    of distributed noise (`secagg_node.site_update`; medians): the option's own cost, outside any deployment."""
    from pflbed.flower.secagg_node import NoiseShare, site_update
    from pflbed.models import build_model

    payload = {k: v.detach().clone() for k, v in build_model("cnn", (1, 28, 28), 10).state_dict().items()}
    replies = [({k: v + 0.01 for k, v in payload.items()}, 1)]
    out = []
    for share in (None, NoiseShare(0.7, 4.0)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            site_update(payload, replies, {}, share)
            times.append(time.perf_counter() - t0)
        out.append(1000 * statistics.median(times))
    return out[0], out[1]


def own_work(clients: int = 100, repeats: int = 5) -> float:
    """Milliseconds of DP's own work in a round of `clients` LeNet-5 replies, outside any run (median)."""
    from pflbed.models import build_model
    from pflbed.privacy import Mechanism, clip_reply

    g = torch.Generator().manual_seed(0)
    payload = {k: v.detach().clone() for k, v in build_model("lenet5", (1, 28, 28), 10).state_dict().items()}
    replies = [(c, {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in payload.items()})
               for c in range(clients)]  # fmt: skip
    mech = Mechanism(clip=1.0, sigma=1.0, rate=0.1, clients=1000, delta=1e-5)
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        clipped = [(c, clip_reply(payload, r, mech.clip)) for c, r in replies]
        for _ in mech.replies(0, 1, payload, iter(clipped), clients):
            pass
        took.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(took)


def secagg(repeats: int, rounds: int, noise: bool = False) -> None:
    """Plain vs `--secagg` site-local deployments, alternating; s/round and the final states' largest gap. With
    `noise`: secure deployments under DP, central vs distributed noise; s/round."""
    from pflbed.flower.local import run_local
    from pflbed.flower.sites import export_sites

    sites = 4
    base = {"dataset": {"name": "fmnist"}, "model": {"name": "cnn"},
            "federation": {"clients": sites, "partition": "dirichlet", "alpha": 0.5, "train_per_client": 300},
            "train": {"rounds": rounds, "checkpoint_every": 0}, "eval": {"every": rounds, "finetune": []},
            "executor": {"threads": 1}}  # fmt: skip
    quiet = lambda *_: None  # noqa: E731
    arms = ["central", "distributed"] if noise else ["plain", "secagg"]
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = export_sites(validate_config(base), Path(tmp) / "sites")
        flower = {**base, "executor": {"name": "flower", "supernodes": sites, "threads": 1}}
        if noise:  # every client each round (q = 1), so both arms train the same clients; σ small, since with 4
            # clients a σ near 1 swamps the CNN (noise of std σC/4 per entry) and the cost does not depend on σ
            flower = {**flower, "federation": {**base["federation"], "sample_fraction": 1.0},
                      "privacy": {"clip": 1.0, "noise_multiplier": 0.01}}  # fmt: skip
        servers = {}
        for i in range(repeats):
            for arm in list(times)[:: 1 if i % 2 == 0 else -1]:
                site = {"local": True, "input_shape": [1, 28, 28], "num_classes": 10,
                        "secagg": noise or arm == "secagg"}  # fmt: skip
                tree = {**flower, "sites": site}
                if noise:
                    tree["privacy"] = {**flower["privacy"], "noise": arm}
                out = Path(tmp) / f"{arm}-{i}"
                summary = run_local(validate_config(tree), out, sites, site_data=dirs, log=quiet)
                times[arm].append(summary["timing"]["s_per_round"])
                servers[arm] = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["server"]
        gap = max(float((servers[arms[1]][k] - servers[arms[0]][k]).abs().max()) for k in servers[arms[0]])
    first, second = statistics.median(times[arms[0]]), statistics.median(times[arms[1]])
    if noise:
        print(f"\nsecure site-local deployment under DP (C = 1, σ = 0.01, q = 1), {sites} sites, FMNIST CNN, FedAvg, "
              f"{rounds} rounds, {repeats} repeats")  # fmt: skip
        print(f"{'central s/round':>15s} {'distributed s/round':>19s} {'distributed÷central':>19s}")
        print(f"{first:15.2f} {second:19.2f} {second / first:19.2f}", flush=True)
        plain, shared = share_work()
        print(f"a site's own update for SecAgg+ (FMNIST CNN, one client): {plain:.0f} ms, with its noise share "
              f"{shared:.0f} ms", flush=True)  # fmt: skip
        return
    print(f"\nsite-local deployment, {sites} sites, FMNIST CNN, FedAvg, {rounds} rounds")
    print(f"{'plain s/round':>13s} {'SecAgg+ s/round':>15s} {'SecAgg+÷plain':>13s} {'max state gap':>13s}")
    print(f"{first:13.2f} {second:15.2f} {second / first:13.2f} {gap:13.2e}", flush=True)


def dp_overhead(a: argparse.Namespace) -> None:
    """Plain vs DP simulated runs, alternating (the module's docstring)."""
    print(f"FMNIST LeNet-5, 1000 clients, Poisson q = 0.1, {a.rounds} rounds, 1 thread; DP: C = 1, σ = 1")
    print(f"{'algorithm':10s} {'plain s/round':>13s} {'DP s/round':>10s} {'DP÷plain':>8s}  (each repeat's DP÷plain)")
    for name in a.algorithms:
        times: dict[str, list[float]] = {"plain": [], "dp": []}
        for i in range(a.repeats):
            for arm in list(times)[:: 1 if i % 2 == 0 else -1]:  # the order alternates too
                tree = {**SETUP, "algorithm": {"name": name}, "train": {**SETUP["train"], "rounds": a.rounds},
                        **({"privacy": DP} if arm == "dp" else {})}  # fmt: skip
                result = run(validate_config(tree), write=False, progress=False)
                times[arm].append(result.summary["timing"]["s_per_round"])
        plain, dp = statistics.median(times["plain"]), statistics.median(times["dp"])
        each = " ".join(f"{d / p:.2f}" for p, d in zip(times["plain"], times["dp"], strict=True))
        print(f"{name:10s} {plain:13.3f} {dp:10.3f} {dp / plain:8.3f}  ({each})", flush=True)
    print(f"DP's own work for 100 clients' LeNet-5 replies (clip each, then the noisy release): {own_work():.1f} ms")


if __name__ == "__main__":
    main()
