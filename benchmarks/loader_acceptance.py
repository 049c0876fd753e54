"""Every file-format loader end to end: `pflbed data list`, then `pflbed data show` and one round of `pflbed run`
on a small copy of each dataset written in its published on-disk format (`tests/data_formats.py`).

Each command runs through the real command line in a fresh process; the script prints each command's key lines
(the partition summary, the final accuracy row, the run time) and exits non-zero if any command failed.

    PYTHONPATH=src python benchmarks/loader_acceptance.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import data_formats as fx  # noqa: E402

PFLBED = ["federation.protocol=pflbed", "federation.pflbed.participated=0.5", "federation.pflbed.new=0.1",
          "federation.pflbed.val=0.2", "federation.pflbed.test=0.2", "federation.pflbed.clients_per_domain=2",
          "federation.pflbed.new_clients_per_domain=0", "federation.min_size=2"]  # fmt: skip
STANDARD = ["federation.clients=4", "federation.min_size=5"]


def named_tree(root: Path, domains: tuple[str, ...], classes: int, per_class: int) -> Path:
    for d, domain in enumerate(domains):
        for c in range(classes):
            for i in range(per_class):
                path = root / domain / f"c{c:03d}" / f"{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(fx.png_bytes((c % 256, 40 * d, 20 * i % 256), size=4))
    return root


def fixtures(data: Path) -> dict[str, list[str]]:
    """Write each dataset under `data` (as `$PFLBED_DATA` expects it); return its `--set` options."""
    fx.make_cifar10(data / "cifar10", per_batch=40, n_test=40)
    fx.make_cifar100(data / "cifar100", n_train=400, n_test=100)
    fx.make_cifar10c(data / "cifar10c", per_severity=200, corruptions=("fog", "snow", "pixelate"))
    fx.make_mnist(data / "mnist", n_train=200, n_test=50)
    fx.make_emnist(data / "emnist", split="balanced", n_train=470, n_test=94)
    fx.make_emnist(data / "emnist", split="letters", n_train=260, n_test=52)
    fx.make_femnist_all_data(data / "femnist", users=8, per_user=30, files=2)
    fx.make_tinyimagenet(data / "tinyimagenet", wnids=tuple(f"n{i:02d}" for i in range(5)), per_class=20,
                         val_per_class=4)  # fmt: skip
    fx.make_miniimagenet(data / "miniimagenet", classes_per_split=2, per_class=30)
    named_tree(data / "officehome", ("Art", "Clipart", "Product", "Real World"), 65, 5)
    named_tree(data / "pacs" / "PACS", ("art_painting", "cartoon", "photo", "sketch"), 7, 10)
    named_tree(data / "domainnet", ("clipart", "real"), 345, 5)
    return {
        "cifar10": STANDARD,
        "cifar100": [*STANDARD, "dataset.label=coarse"],
        "cifar10c": [*PFLBED, "dataset.corruptions=[fog, snow, pixelate]", "dataset.severity=3"],
        "mnist": STANDARD,
        "emnist": STANDARD,
        "emnist letters": [*STANDARD, "dataset.split=letters"],
        "femnist": STANDARD,
        "tinyimagenet": STANDARD,
        "miniimagenet": STANDARD,
        "officehome": [*PFLBED, "dataset.image_size=8"],
        "pacs": [*PFLBED, "dataset.image_size=8"],
        "domainnet": [*PFLBED, "dataset.image_size=8"],
    }


def pflbed(args: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pflbed", *args], env=env, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr, time.perf_counter() - t


def key_lines(text: str, starts: tuple[str, ...]) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().lstrip("│ ").startswith(starts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="write the fixtures and runs here (default: a temporary directory)")
    args = ap.parse_args()
    failed = []
    with tempfile.TemporaryDirectory(prefix="pflbed-loaders-") as tmp:
        root = args.keep or Path(tmp)
        data = root / "data"
        cases = fixtures(data)
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PFLBED_DATA": str(data),
               "PFLBED_CACHE": str(root / "cache")}  # fmt: skip
        rc, out, _ = pflbed(["data", "list"], env)
        print(f"$ pflbed data list  (PFLBED_DATA holds every fixture) -> exit {rc}")
        print("\n".join("  " + line for line in out.splitlines()))
        failed += ["data list"] if rc else []
        for case, sets in cases.items():
            name = case.split()[0]
            opts = [a for s in [f"dataset.name={name}", *sets] for a in ("--set", s)]
            print(f"\n## {case}: {' '.join(sets)}")
            rc, out, secs = pflbed(["data", "show", *opts], env)
            show = key_lines(out, (f"{name}", "pflbed: error"))
            print(f"  data show -> exit {rc} ({secs:.1f} s): {show[0] if show else out.strip()[-300:]}")
            run_dir = root / "runs" / case.replace(" ", "_")
            rc2, out2, secs2 = pflbed(["run", *opts, "--set", "train.rounds=1", "--set", "eval.finetune=[]",
                                       "--out", str(run_dir), "--no-progress"], env)  # fmt: skip
            lines = key_lines(out2, ("FedAvg", "selected on validation", "pflbed: error"))
            print(f"  run (1 round) -> exit {rc2} ({secs2:.1f} s)")
            for line in lines or [out2.strip()[-300:]]:
                print(f"    {line}")
            failed += [case] * bool(rc or rc2)
    print(f"\n{len(cases) - len(set(failed) - {'data list'})}/{len(cases)} loaders: data show and one run round OK"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))  # fmt: skip
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
