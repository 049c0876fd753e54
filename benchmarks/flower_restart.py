"""A SuperNode killed and restarted during a local deployment (`pflbed flower local`), with client states kept on
the nodes (`executor.state_dir`) — or, with `--site-data`, a site of a deployment whose data stays on the sites
(`--site-data`, one client per site, 4 sites) — : what the run logs, and how its results compare with `loop`.

FedPer (personal heads: the state a node must not lose) on the embedded digits, 20 clients, `--rounds` rounds,
evaluated every round, 2 SuperNodes, `executor.round_timeout=--timeout`. When the record of `--kill-after` appears,
SuperNode 1's process group is killed (SIGKILL); `--down` seconds later the same SuperNode command is started again
(same node config and state directory; a new process, so nothing in memory survives). Printed: each record's
failed clients and P-FL, the final figures next to `loop`'s, and whether any Flower process is left.

    python benchmarks/flower_restart.py [--rounds 5] [--kill-after 2] [--down 5] [--timeout 90] [--auth] [--site-data]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pflbed.config import validate_config
from pflbed.results.experiment import run


def processes(word: str) -> dict[int, str]:
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if word in cmd:
                out[int(d)] = cmd
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kill-after", type=int, default=2)
    ap.add_argument("--down", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--auth", action="store_true")
    ap.add_argument("--site-data", action="store_true", help="4 sites, each one client's data (sites.local)")
    a = ap.parse_args()
    sets = {"algorithm.name": "fedper", "train.rounds": a.rounds, "eval.every": 1, "eval.finetune": "[]",
            "executor.threads": 1, "executor.round_timeout": a.timeout}  # fmt: skip
    base = {"algorithm": {"name": "fedper"}, "train": {"rounds": a.rounds}, "eval": {"every": 1, "finetune": []},
            "executor": {"threads": 1}}  # fmt: skip
    if a.site_data:
        sets["federation.clients"] = 4
        base["federation"] = {"clients": 4}
    with tempfile.TemporaryDirectory() as tmp:
        out, states = Path(tmp) / "run", Path(tmp) / "states"
        nodes = ["--supernodes", "2"]
        if a.site_data:
            from pflbed.flower.sites import export_sites

            dirs = export_sites(validate_config(base), Path(tmp) / "sites")
            nodes = ["--site-data", *map(str, dirs)]
            states = out / "flower"
        else:
            sets["executor.state_dir"] = states
        args = [sys.executable, "-m", "pflbed", "flower", "local", *nodes, "--out", str(out),
                *(["--auth"] if a.auth else [])]  # fmt: skip
        args += [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
        before = set(processes("flower-"))
        t0 = time.perf_counter()
        deployment = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        restarted = None
        try:
            while not any(r["round"] >= a.kill_after for r in records(out / "metrics.jsonl")):
                if deployment.poll() is not None:
                    raise SystemExit(f"the deployment ended early: {deployment.stderr.read().decode()}")
                time.sleep(0.2)
            node = next(p for p, c in processes("flower-supernode").items()
                        if "partition-id=1" in c and str(out) in Path(f"/proc/{p}/environ").read_text())  # fmt: skip
            cmd = Path(f"/proc/{node}/cmdline").read_bytes().split(b"\0")[:-1]
            env = dict(e.split("=", 1) for e in Path(f"/proc/{node}/environ").read_text().split("\0") if "=" in e)
            os.killpg(node, signal.SIGKILL)
            killed = time.perf_counter() - t0
            time.sleep(a.down)
            log = open(out / "flower" / "supernode-1-restarted.log", "w")  # noqa: SIM115 (lives with the process)
            restarted = subprocess.Popen([c.decode() for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip
            code = deployment.wait()
            wall = time.perf_counter() - t0
        finally:
            for p in (deployment, restarted):
                if p is not None and p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        history = records(out / "metrics.jsonl")
        summary = json.loads((out / "summary.json").read_text()) if code == 0 else {}
        files = len(list(states.glob("*/*/client-*/round-*.pt" if a.site_data else "*/client-*/round-*.pt")))
        time.sleep(1)
        left = set(processes("flower-")) - before
    torch.set_num_threads(1)
    loop = run(validate_config(base), write=False, progress=False)
    layout = "4 sites holding their own data (--site-data)" if a.site_data else "20 clients, 2 SuperNodes"
    print(f"FedPer, digits, {layout}, {a.rounds} rounds{' (auth)' if a.auth else ''}, states on the nodes; "
          f"SuperNode 1 killed at {killed:.0f} s (after the round-{a.kill_after} record), restarted "
          f"{a.down:.0f} s later; round timeout {a.timeout:.0f} s")  # fmt: skip
    print(f"deployment exit code {code}, {wall:.0f} s; {files} state files on the nodes at the end")
    print("| round | failed clients (round: ids) | P-FL % | loop P-FL % |\n|---|---|---|---|")
    for r, lr in zip(history, loop.history, strict=False):
        pfl, loop_pfl = 100 * r["pfl_acc"], 100 * lr["pfl_acc"]
        print(f"| {r['round']} | {r.get('failed_clients', '')} | {pfl:.2f} | {loop_pfl:.2f} |")
    if summary:
        f, lf = summary["final"], loop.summary["final"]
        print(f"final: P-FL {100 * f['pfl_acc']:.2f} (loop {100 * lf['pfl_acc']:.2f}); P-FL std "
              f"{100 * f['pfl_acc_std']:.2f} (loop {100 * lf['pfl_acc_std']:.2f})")  # fmt: skip
    print(f"Flower processes left: {len(left)}")


if __name__ == "__main__":
    main()
