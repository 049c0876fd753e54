"""Probe the executors' promises on random combinations of features and algorithm options.

The parity tests run every algorithm under one tiny config and a few variants; the promises hold for every
combination: `procs` and Flower give the loop's results bit for bit, batched clients give them up to float
rounding, and a run stopped after a checkpoint and resumed ends as an uninterrupted one. Each draw here combines
an algorithm, one to three of its own options (from the valid domain `tests/project/test_algorithm_option_properties`
reads from each option's annotation and bounds), a model (MLP, LeNet-5, LeNet-5 with BatchNorm, AlexNet with
dropout), a partition and sampling, new clients, +FT/+LP, P-FL on local or global test, subsampled evaluation,
local epochs, momentum, weight decay, augmentation, client-level DP and the PFLBED protocol (transform domains,
per-domain validation and test sets, new clients per domain), on a small synthetic dataset:

    python benchmarks/executor_probe.py procs --draws 100                  # loop vs procs (2 workers)
    python benchmarks/executor_probe.py flower --draws 50                  # loop vs Flower's simulation
    python benchmarks/executor_probe.py batched --draws 100                # loop vs batched clients
    python benchmarks/executor_probe.py resume --executor batched --draws 100
    python benchmarks/executor_probe.py compiled --draws 50               # batched: eager vs executor.compile

Draw i is the same in every run (hypothesis, seeded with i): `--start I --draws 1` repeats one. Results are appended to
`--out` (default `probe-<what>.jsonl`), one JSON line per draw with its config; a draw already there is skipped,
so a probe stopped midway goes on. A config the library refuses (one line naming the field, or the data it cannot
split) and a run that diverges in both executors alike count as agreeing.

Batched results differ from the loop's by float32 rounding, which these untrained tiny runs can amplify at the kinks
of ReLU, max-pooling and BatchNorm. A batched draw is flagged when its states are further from the loop's than
max(1e-4, 100 × the loop's own sensitivity: the same run with the learning rate moved by 1e-6, relative), then
judged by the float64 parity of its round-1 plans (batched vs each client's own `run_plan`, as `tests/engine/
test_batched.py` does): within 1e-9 it is float sensitivity (`rounding`), beyond it a rule differs (`RULE`). The
verdict also says how far each executor's own float32 training of those plans is from the float64 one (`loop_f32`,
`batched_f32`): the one whose rounding met a kink is far from it.
`compiled` compares batched clients with their step under `torch.compile` (`executor.compile: default`) to the
same run's eager step, both on the CPU. Inductor, the compiler's own backend, takes a minute per graph here, so the
probe compiles with the `aot_eager` backend: the same capture of the step (dynamo, then AOT autograd) run with the
eager kernels. It checks what the capture changes — a phase kept at one shape, its finished clients computed and
their results dropped, what the step reads guarded or baked in — and not inductor's kernels, whose rounding the
GPU's tests measure. Its draws are judged as the batched ones, against the eager batched run's sensitivity, and
flagged draws by round 1's plans trained eagerly vs compiled, both in float64.
The judge sees round 1's local steps only: not a plan's `finish` as the batched executor runs it, nor a rule that
depends on a later round's state (a bug of either kind is reported `rounding`). A `rounding` draw far beyond its
sensitivity is worth a float64 parity from the loop's later states, and a look at its `finish`.

The exit code is 1 when a draw disagreed (`MISMATCH`, `RULE`, `CRASH`, or a divergence in one executor only).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import random
import shutil
import sys
import tempfile
import traceback
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pflbed import rng  # noqa: E402
from pflbed.algorithms import ALGORITHMS  # noqa: E402
from pflbed.algorithms.base import ClientContext  # noqa: E402
from pflbed.config import validate_config  # noqa: E402
from pflbed.engine import batched  # noqa: E402
from pflbed.engine.build import prepare  # noqa: E402
from pflbed.engine.executor import client_generator  # noqa: E402
from pflbed.errors import ConfigError, DataError, DivergedError  # noqa: E402
from pflbed.results import experiment  # noqa: E402
from pflbed.results.experiment import run  # noqa: E402
from tests.engine.test_batched import _each_own, _in_float64, _max_diff  # noqa: E402
from tests.engine.test_batched_compile import on_aot_eager  # noqa: E402
from tests.project.test_algorithm_option_properties import LIGHT, domain  # noqa: E402
from tests.seeded_examples import no_local_constants  # noqa: E402
from tests.tiny import figures, same_tensors  # noqa: E402

MODELS = ["mlp", "lenet5", "lenet5_bn", "alexnet_small_x025"]
AGREE = {"equal", "rounding", "refused", "both diverged"}
EXECUTORS = {"loop": {"name": "loop", "threads": 1, "batch_clients": False},
             "batched": {"name": "loop", "threads": 1, "batch_clients": True},
             "procs": {"name": "procs", "workers": 2, "threads": 1},
             "flower": {"name": "flower", "threads": 1},
             "compiled": {"name": "loop", "threads": 1, "batch_clients": True, "compile": "default"}}  # fmt: skip
CLOSE = {"batched": "loop", "compiled": "batched"}  # equal up to float rounding, to the run of this executor


def _options(algo: str) -> st.SearchStrategy[dict[str, Any]]:
    fields = ALGORITHMS[algo].Config.model_fields
    light = {k: v for k, v in LIGHT.items() if k in fields}
    names = sorted(fields)
    chosen = st.permutations(names).flatmap(lambda p: st.integers(0, min(3, len(p))).map(lambda k: p[:k]))
    return chosen.flatmap(lambda ns: st.fixed_dictionaries(
        {n: domain(n, fields[n].annotation, list(fields[n].metadata)) for n in ns}).map(lambda o: {**light, **o}))


DRAWS = st.sampled_from(sorted(ALGORITHMS)).flatmap(
    lambda a: st.tuples(st.just(a), _options(a), st.integers(0, 2**32 - 1)))


def config(algo: str, options: dict[str, Any], features: int) -> dict[str, Any]:
    """The draw's config: `algo` with `options`, its other features from `random.Random(features)`."""
    r = random.Random(features)
    model = r.choice(MODELS)
    fed = {"clients": r.choice([4, 6]), "partition": r.choice(["dirichlet", "iid", "classes"]), "alpha": 0.5,
           "sample_fraction": r.choice([0.5, 1.0]), "public": 64, "new_clients": r.choice([0, 0, 2])}
    if r.random() < 0.25:
        fed["sampling"] = "poisson"
    data = {"name": "synthetic", "synthetic": {"n_train": 600, "shape": [1, 8, 8] if model == "mlp" else [1, 28, 28]}}
    if model != "mlp" and r.random() < 0.2:
        data["augment"] = ["crop", "flip"]
    train = {"rounds": 3, "batch_size": 16, "lr": r.choice([0.01, 0.05]), "local_epochs": r.choice([1, 1, 2]),
             "momentum": r.choice([0.0, 0.0, 0.9]), "weight_decay": r.choice([0.0, 1e-4]), "checkpoint_every": 2}
    ev = {"every": r.choice([1, 2]), "finetune": r.choice([[], ["ft"], ["ft", "lp"]]),
          "pfl_test": r.choice(["local", "global"]), "new_clients": {"epochs": 2, "lrs": [0.01, 0.05]}}
    if r.random() < 0.2:
        ev["test_subsample"] = 100
    cfg = {"seed": r.randint(0, 99), "dataset": data, "model": {"name": model}, "federation": fed, "train": train,
           "eval": ev, "algorithm": {"name": algo, **options}}
    if r.random() < 0.1:
        cfg["privacy"] = {"clip": 0.5, "noise_multiplier": 0.5, "randomness": "seeded"}
    if r.random() < 0.2:  # the PFLBED protocol: transform domains, per-domain val/test sets, new clients per domain
        data["domains"] = r.choice([["rot0", "rot90"], ["rot0", "rot90", "rot180"], ["clean", "noise", "blur"]])
        data["synthetic"]["n_train"] = 1200  # a class-balanced val and test set in each domain
        for key in ("clients", "partition", "new_clients"):  # the standard protocol's: refused under pflbed
            del fed[key]
        ev["pfl_test"] = "local"  # (a client is scored on its domain's test set)
        fed.update(protocol="pflbed", pflbed={"clients_per_domain": r.choice([2, 3]),
                                              "new_clients_per_domain": r.choice([0, 1])})
    return cfg


def _run(cfg: dict[str, Any], executor: str, **kw: Any) -> Any:
    """The run's result, or the divergence's message."""
    try:
        return run(validate_config({**cfg, "executor": EXECUTORS[executor]}), progress=False, **kw)
    except DivergedError as e:
        return f"diverged: {e}"


def _same(a: Any, b: Any) -> bool:
    return figures(a.summary) == figures(b.summary) and same_tensors(a.server, b.server) and \
        a.executor.states.keys() == b.executor.states.keys() and \
        all(same_tensors(a.executor.states[c], b.executor.states[c]) for c in a.executor.states)  # fmt: skip


def _distance(a: Any, b: Any) -> float:
    """The largest difference between two runs' server and client states (floating entries)."""
    pairs = [(a.server, b.server), *((a.executor.states[c], b.executor.states[c]) for c in a.executor.states)]
    return max([(x[k].double() - y[k].double()).abs().max().item() for x, y in pairs for k in x
                if x[k].is_floating_point() and x[k].numel()] or [0.0])  # fmt: skip


def _round1(cfg: dict[str, Any]) -> tuple[Any, Any, list[int], list[Any]] | None:
    """(validated config, run context, clients, their round-1 plans without `finish`) of the draw's first four
    participating clients; None where the algorithm runs client by client (its batched run is the loop's code)."""
    c = validate_config({**cfg, "executor": EXECUTORS["loop"]})
    algo = prepare(c)
    ctx, server = algo.ctx, algo.init_server()
    cids = sorted(ctx.federation.participated)[:4]
    payloads = algo.configure(1, server, cids)
    plans = [algo.round_plan(payloads[k], algo.init_client(k), ctx.client_data(k),
                             ClientContext(1, k, client_generator(c.seed, 1, k))) for k in cids]  # fmt: skip
    if any(p is None for p in plans):
        return None
    return c, ctx, cids, [replace(p, finish=lambda t: (t, {})) for p in plans]


def _plan_parity(cfg: dict[str, Any]) -> dict[str, float]:
    """Round 1's plans trained together vs each alone (`run_plan`), in float64 (`float64`): a rule difference shows
    here, float32 rounding does not. Beside it, how far each executor's own float32 training of those plans is from
    the float64 one (`loop_f32`, `batched_f32`): the executor whose rounding met a kink is the one far from it."""
    got = _round1(cfg)
    if got is None:
        return {"float64": 0.0}
    c, ctx, cids, plans = got
    together, alone = _each_own(c, ctx, cids, plans)
    together32, alone32 = _each_own(c, ctx, cids, plans, float64=False)
    return {"float64": _apart(together, alone), "loop_f32": _apart(alone32, alone),
            "batched_f32": _apart(together32, alone)}  # fmt: skip


def _compiled_parity(cfg: dict[str, Any]) -> dict[str, float]:
    """Round 1's plans trained together eagerly vs with the step compiled (`compile: default`), both in float64
    (`float64`): a difference of the capture's rules shows here, float32 rounding does not."""
    got = _round1(cfg)
    if got is None:
        return {"float64": 0.0}
    c, ctx, cids, plans = got
    with _in_float64(ctx, plans) as (model, data, plans64):
        eager, fast = (batched.train_together(
            model, plans64, [data(k) for k in cids], c.train, [client_generator(c.seed, 1, k) for k in cids],
            [rng.global_stream(rng.derive_seed(c.seed, rng.CLIENT, 1, k), ctx.device) for k in cids], mode, model)
            for mode in ("off", "default"))  # fmt: skip
    return {"float64": _apart(fast, eager)}


def _apart(xs: list[dict[str, torch.Tensor]], ys: list[dict[str, torch.Tensor]]) -> float:
    return max(_max_diff(x, y) for x, y in zip(xs, ys, strict=True))


def compare(what: str, cfg: dict[str, Any], executor: str, pool: Any, sim: Any) -> dict[str, Any]:
    """One draw's verdict: `result` and what supports it."""
    if what == "resume":
        return _resume(cfg, executor, pool)
    base = CLOSE.get(what, "loop")
    a = _run(cfg, base, write=False)
    b = _run(cfg, what, write=False, **({"pool": pool} if what == "procs" else {"simulation": sim} if sim else {}))
    if isinstance(a, str) or isinstance(b, str):
        return {"result": "both diverged" if isinstance(a, str) and isinstance(b, str) else "DIVERGED IN ONE",
                "why": a if isinstance(a, str) else b}  # fmt: skip
    if what not in CLOSE:
        return {"result": "equal" if _same(a, b) else "MISMATCH"}
    moved = copy.deepcopy(cfg)
    moved["train"]["lr"] *= 1 + 1e-6
    t = _run(moved, base, write=False)
    d, s = _distance(a, b), (_distance(a, t) if not isinstance(t, str) else float("inf"))
    if d <= max(1e-4, 100 * s):
        return {"result": "equal", "distance": d, "sensitivity": s}
    p = _plan_parity(cfg) if what == "batched" else _compiled_parity(cfg)
    return {"result": "rounding" if p["float64"] <= 1e-9 else "RULE", "distance": d, "sensitivity": s, **p}


class _Stop(KeyboardInterrupt):
    """Ctrl-C right after round 2's checkpoint."""


def _resume(cfg: dict[str, Any], executor: str, pool: Any) -> dict[str, Any]:
    kw = {"pool": pool} if executor == "procs" else {}
    tmp = Path(tempfile.mkdtemp())
    save = experiment.save_checkpoint

    def save_then_stop(path: Path, rnd: int, *rest: Any, **k: Any) -> None:
        save(path, rnd, *rest, **k)
        if rnd == 2:
            raise _Stop

    try:
        a = _run(cfg, executor, out=tmp / "straight", **kw)
        experiment.save_checkpoint = save_then_stop
        try:
            b = _run(cfg, executor, out=tmp / "resumed", **kw)
        except _Stop:
            b = None
        finally:
            experiment.save_checkpoint = save
        if b is None:
            b = _run(cfg, executor, out=tmp / "resumed", resume=True, **kw)
        if isinstance(a, str) or isinstance(b, str):
            return {"result": "both diverged" if isinstance(a, str) and isinstance(b, str) else "DIVERGED IN ONE",
                    "why": a if isinstance(a, str) else b}  # fmt: skip
        written = [json.loads((tmp / d / "summary.json").read_text()) for d in ("straight", "resumed")]
        equal = figures(written[0]) == figures(written[1]) and _same(a, b)
        return {"result": "equal" if equal else "MISMATCH"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _last_example(strategy: st.SearchStrategy[Any], i: int) -> Any:
    """Of the two examples a run of hypothesis seeded with i alone generates, the last: hypothesis tries its simplest
    example first."""
    got: list[Any] = []

    @seed(i)
    @settings(max_examples=2, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def generate(drawn: Any) -> None:
        got.append(drawn)

    with warnings.catch_warnings(), no_local_constants():  # draw i: the seed i alone
        warnings.simplefilter("ignore")
        generate()
    return got[-1]


FIRST = sorted(ALGORITHMS)[0]


def draw(i: int) -> tuple[str, dict[str, Any], int]:
    """Draw i: (algorithm, its options, the seed of its other features), from hypothesis seeded with i alone.

    The example after the simplest one never takes its first choice's simplest value, so `DRAWS` never draws the
    first algorithm (`FIRST`, APFL). One draw in len(ALGORITHMS), chosen by `i` alone (not by a drawn value:
    hypothesis favours a few, 0 among them), is given to it instead, its other features kept, its options drawn
    from their own example (behind a first choice of no consequence); every other draw is `DRAWS`'s."""
    algo, options, features = _last_example(DRAWS, i)
    if random.Random(f"{FIRST} {i}").randrange(len(ALGORITHMS)) == 0:
        algo, options = FIRST, _last_example(st.tuples(st.booleans(), _options(FIRST)), i)[1]
    return algo, options, features


def probe(what: str, executor: str, start: int, draws: int, out: Path) -> collections.Counter:
    done = {json.loads(line)["draw"] for line in out.read_text().splitlines()} if out.exists() else set()
    counts: collections.Counter = collections.Counter()
    pool = sim = None
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:  # the pool and the simulation are closed however the probe ends
        if "procs" in (what, executor):
            from pflbed.engine.procs import WorkerPool

            pool = stack.enter_context(WorkerPool(2, 1))
        if what == "compiled":
            stack.enter_context(on_aot_eager())  # why: the module's docstring
        if what == "flower":
            from pflbed.flower.simulation import FlowerSimulation

            sim = stack.enter_context(FlowerSimulation(supernodes=3, workers=2))
        for i in (i for i in range(start, start + draws) if i not in done):
            cfg = config(*draw(i))
            try:
                validate_config({**cfg, "executor": EXECUTORS[executor if what == "resume" else what]})
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    verdict = compare(what, cfg, executor, pool, sim)
            except (ConfigError, DataError) as e:  # one line naming the field, or the data it cannot split
                verdict = {"result": "refused", "why": str(e)}
            except Exception:  # noqa: BLE001 - a crash is what the probe reports
                verdict = {"result": "CRASH", "why": traceback.format_exc()[-2000:]}
            counts[verdict["result"]] += 1
            with out.open("a") as f:
                f.write(json.dumps({"draw": i, "compare": what, "executor": executor, **verdict, "config": cfg}) + "\n")
            print(f"draw {i}: {cfg['algorithm']['name']} on {cfg['model']['name']}: {verdict['result']}", flush=True)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["procs", "flower", "batched", "resume", "compiled"])
    p.add_argument("--executor", choices=["loop", "batched", "procs"], default="loop", help="resume: whose run")
    p.add_argument("--start", type=int, default=0, help="the first draw's index")
    p.add_argument("--draws", type=int, default=20)
    p.add_argument("--out", type=Path, help="JSON lines, appended (default: probe-<what>.jsonl)")
    a = p.parse_args(argv)
    out = a.out or Path(f"probe-{a.what}{'-' + a.executor if a.what == 'resume' else ''}.jsonl")
    counts = probe(a.what, a.executor, a.start, a.draws, out)
    print(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "no new draw", f"({out})")
    return 0 if set(counts) <= AGREE else 1


if __name__ == "__main__":
    sys.exit(main())
