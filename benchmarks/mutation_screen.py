"""Screen mutmut's mutants against each file's own tests, many mutants per pytest process.

`mutmut run` starts one forked test run per mutant and reruns every test that reaches the mutated function —
for a survivor of the rule code that includes the config property tests and the worker-process parity tests,
minutes per mutant. This screen instead tests each mutant against the test files of its source file only (the
table below), switching mutmut's `MUTANT_UNDER_TEST` between `pytest.main` calls of one process, so imports and
data loading are paid once. A mutant it reports killed is killed by the whole suite too; a survivor here may
still be killed by another test file, so the score is a lower bound of mutmut's.

    python benchmarks/mutation_screen.py generate                 # mutants/ from src/ (mutmut's own generator)
    python benchmarks/mutation_screen.py run --shard 0 --shards 2 # one process per core; resumable
    python benchmarks/mutation_screen.py report                   # per-file table from every results file
    python benchmarks/mutation_screen.py run --only survivors.txt --tests test_contract --keyword "{stem}" \
        --out screen-r                                            # survivors against other tests of their file

Results go to `mutants/screen-<shard>.txt` (`--out NAME`: `mutants/NAME-<shard>.txt`; `report` reads every
`screen-*` file in name order, a later verdict replacing an earlier one), one `KILLED|SURVIVED|TIMEOUT <mutant>`
line each (a timeout counts as killed, as in mutmut: past `--timeout` seconds, or three times the tests' own time
on the unmutated code where longer; the screen then goes on in a fresh process, since the tests it cut short may
have left state behind). `--skip FILE` leaves out the mutants named in FILE (one per line: e.g. those an earlier run
already killed with a subset of today's tests). Each test selection first runs on the unmutated code, and a failure
there stops the screen: with a stale `mutants/` copy of src (a file edited after `generate`) or of the tests, every
mutant would count as killed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import io
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"

_KT = ["test_ktpfl", "test_fedmd", "test_sim_pfl", "test_topk_pfl"]
TESTS_FOR = {  # source file under src/pflbed -> test modules; default tests/<folder>/test_<name>.py (test_files)
    "algorithms/__init__.py": ["test_contract"],
    "algorithms/base.py": [
        "test_contract", "test_fedavg", "test_training", "test_local", "test_evaluation", "test_fedrod_hyper",
        "test_payload_fits", "test_view_fits",
    ],
    "algorithms/basis.py": ["test_fedbasis"],
    # algorithms whose payload_fits or view_fits is their own: a site's check of their payloads and views
    **{f"algorithms/{name}.py": [f"test_{name}", "test_payload_fits", "test_view_fits"]
       for name in ("fedbasis", "feddbe", "fedfomo", "fedselect", "pfedme", "apple", "pfedhn", "fedamp", "fedcac",
                    "fedpac")},  # fmt: skip
    "algorithms/reply_shapes.py": ["test_reply_fits", "test_payload_fits", "test_view_fits"],
    "algorithms/basis_plots.py": ["test_fedbasis"],
    "algorithms/distill.py": [*_KT, "test_feddf", "test_pfeddf"],
    "algorithms/masks.py": ["test_fedselect"],
    "algorithms/partial.py": ["test_fedper", "test_fedrep", "test_lg_fedavg", "test_fedbabu"],
    "algorithms/training.py": ["test_training", "test_fedavg", "test_local", "test_fedrod"],
    "algorithms/ktpfl.py": [*_KT, "test_payload_fits", "test_view_fits"],
    "algorithms/feddf.py": ["test_feddf", "test_pfeddf", "test_payload_fits", "test_view_fits"],
    "algorithms/local_sgd.py": ["test_fedavg", "test_training", "test_batched", "test_compute"],
    "algorithms/server_extras.py": ["test_scaffold", "test_feddyn"],
    "evaluation/evaluate.py": ["test_evaluation", "test_metrics"],
    "evaluation/newclients.py": ["test_evaluation", "test_metrics"],
    "evaluation/metrics.py": ["test_metrics", "test_evaluation"],
    "results/summary.py": ["test_summary", "test_evaluation"],
    "federation/partition.py": ["test_partition", "test_natural", "test_pflbed"],
    "federation/pflbed.py": ["test_pflbed", "test_exclude_test"],
    "federation/federation.py": [
        "test_partition", "test_pflbed", "test_natural", "test_exclude_test", "test_manifest", "test_pretrain",
        "test_privacy_deployed",  # `sample_clients` from the OS (privacy.randomness: os)
    ],
    "federation/build.py": ["test_partition", "test_pflbed", "test_natural", "test_manifest", "test_exclude_test"],
    "federation/new_client.py": ["test_new_client", "test_data_commands"],
    "federation/manifest.py": ["test_manifest"],
    "privacy.py": ["test_privacy", "test_privacy_deployed", "test_flower_privacy", "test_flower_noise_warning"],
    "flower/reply_check.py": ["test_attacks_site", "test_reply_fits"],
    **dict.fromkeys(  # a site's own defenses against the server, and the site's side of a deployed run
        ["flower/site_policy.py", "flower/site_claims.py", "flower/site_executor.py", "flower/site_node.py",
         "flower/site_eval.py", "flower/sites.py", "flower/site_message.py"],
        ["test_attacks_server", "test_attacks_site", "test_attacks_server_state", "test_flower_sites",
         "test_site_samples", "test_site_waits", "test_flower_secagg"],
    ),
    "flower/client.py": [  # the ClientApp: every message type a node answers, site-local or not
        "test_attacks_server", "test_flower_secagg", "test_flower_node_states", "test_attacks_site",
        "test_flower_sites", "test_flower",
    ],
    # secure aggregation, the server's side and a site's, and what a node keeps of its clients (files only it reads)
    "flower/secagg.py": ["test_flower_secagg", "test_attacks_site", "test_distributed_noise"],
    "flower/secagg_node.py": ["test_flower_secagg", "test_distributed_noise", "test_attacks_site"],
    "flower/node_states.py": ["test_flower_node_states", "test_private_files", "test_flower_secagg"],
    "flower/executor.py": [  # a deployment's rounds on the server, the site-local and secure executors' base
        "test_flower", "test_attacks_site", "test_flower_node_states", "test_flower_sites", "test_site_waits",
        "test_attacks_server", "test_flower_secagg",
    ],
    "private_files.py": ["test_private_files", "test_flower_node_states"],
    # `pflbed flower local`: its processes, ports, progress and causes (the deployment tests start real ones)
    "flower/local.py": ["test_flower_local", "test_flower_local_nodes", "test_flower_local_progress",
                        "test_flower_local_processes", "test_flower_local_commands"],
    "flower/certificates.py": ["test_flower_certificates", "test_private_files"],
    "flower/project.py": ["test_flower", "test_flower_sites", "test_flower_server"],
    "flower/server.py": ["test_flower_server"],  # its run directory; `main` (decorated) is not mutated
    "flower/simulation.py": ["test_flower"],  # the in-process runtime: its tests that start one
    "flower/records.py": ["test_flower"],
    "memory.py": ["test_memory", "test_pfedhn", "test_fedrod_hyper"],
    "results/rundir.py": ["test_rundir", "test_report", "test_trained", "test_resume", "test_cli",
                          "test_flower_server"],  # `has_results`: what the ServerApp takes as prepared
    "results/bench.py": ["test_bench", "test_bench_tables"],
    "results/tune/tables.py": ["test_tune_tables", "test_tune", "test_tune_protocol"],
    "results/config_diff.py": ["test_report", "test_config_diff"],
    "results/report.py": ["test_report", "test_report_pages"],
    "data/samples.py": ["test_samples", "test_trained", "test_site_samples"],
    "data/arrays.py": ["test_trained", "test_data", "test_site_samples", "test_loaders"],
    "data/flickr_aes.py": ["test_loaders"],
    "models/pretrained.py": ["test_imagenet_resnet", "test_pretrain"],
    "models/zoo.py": ["test_models", "test_fedper_models", "test_imagenet_resnet"],
    # a model's blocks: which parameters are the head, the body, the top K (what personalization keeps)
    "models/blocks.py": ["test_models", "test_fedper_models", "test_fedper", "test_fedbn", "test_fedrod"],
    "engine/batched.py": ["test_batched", "test_augment", "test_precision", "test_privacy"],
    "engine/per_client_layers.py": ["test_batched"],
    "engine/conv_weight_grad.py": ["test_conv_weight_grad", "test_batched"],
    "engine/driver.py": ["test_driver", "test_fedavg", "test_privacy", "test_privacy_deployed", "test_guard"],
    "engine/guard.py": ["test_guard", "test_driver", "test_cli"],
    "engine/wire.py": ["test_wire", "test_contract", "test_executor"],
    "engine/packed.py": ["test_procs", "test_resume"],
    "engine/procs.py": ["test_procs", "test_streaming", "test_orphans", "test_compute"],
    "engine/executor.py": [
        "test_executor", "test_driver", "test_fedavg", "test_training", "test_privacy", "test_precision",
    ],
    # a run's set-up and the experiment around its rounds: seeding, resuming, safe unpickling, downloads, augmentation
    "engine/build.py": ["test_executor", "test_driver", "test_fedavg", "test_auto", "test_pretrain", "test_privacy"],
    "results/experiment.py": ["test_driver", "test_resume", "test_interrupt", "test_cli", "test_progress",
                              "test_executor"],
    "rng.py": ["test_rng", "test_executor", "test_driver", "test_privacy", "test_privacy_deployed", "test_batched"],
    "results/checkpoint.py": ["test_resume", "test_interrupt"],
    "data/safepickle.py": ["test_safepickle", "test_loaders"],
    "data/store.py": ["test_store", "test_store_download", "test_loaders", "test_data"],
    "data/augment.py": ["test_augment", "test_batched"],
    # the loaders of the published formats: each is tested on small files the tests write in that format
    **{f"data/{name}.py": ["test_loaders", "test_data", "test_folders", "test_malformed_files", "test_array_datasets",
                           "test_image_datasets"]
       for name in ("idx", "fmnist", "mnist", "emnist", "femnist", "cifar", "cifar10c", "tinyimagenet",
                    "miniimagenet", "named_folders", "folders", "digits")},  # fmt: skip
    "data/domains.py": ["test_domains", "test_pflbed", "test_natural", "test_data", "test_exclude_test"],
    "data/hf.py": ["test_hf", "test_loaders"],
    # generated data, and `pflbed data list`'s rows
    "data/synthetic.py": ["test_data", "test_partition", "test_natural", "test_exclude_test"],
    "data/catalog.py": ["test_catalog", "test_data_commands", "test_loaders"],
    # datasets by name: a config's dataset section to its loader's arguments, and `pflbed data list`
    "data/__init__.py": ["test_sources_by_name", "test_data", "test_data_commands", "test_catalog", "test_domains",
                         "test_folders", "test_loaders", "test_hf"],
    "hints.py": ["test_hints", "test_config_hints", "test_config_package", "test_config_checks", "test_data"],
    "errors.py": ["test_errors", "test_guard", "test_driver", "test_cli"],
    # `pflbed algorithms`: what each method accepts
    "results/catalog.py": ["test_algorithm_catalog", "test_public_surface", "test_cli"],
    # the command line: its parser (the generated reference pins every option), each command's checks and messages
    "cli.py": ["test_cli_parser", "test_cli", "test_data_commands", "test_interrupt", "test_resume", "test_report",
               "test_trained", "test_executor_probe", "test_pretrain", "test_docs", "test_bench",
               "test_flower_local_commands"],
    "results/tune/__init__.py": ["test_tune", "test_tune_protocol"],  # the Tuner: equal budgets, the trial seed
    "results/tensorboard.py": ["test_cli"],
    # `pflbed data show` and the report's figures: the partition table and heat-map, the curves
    "results/partition_plot.py": ["test_partition_plot", "test_report", "test_report_pages", "test_data_commands"],
    "results/report_figures.py": ["test_report", "test_report_pages"],
    "results/console.py": ["test_console", "test_algorithm_catalog"],  # what every command prints through
    "version.py": ["test_private_files"],  # the torch whose weights_only loading holds
    "results/tune/trials.py": ["test_tune_protocol", "test_tune"],
    "results/tune/studies.py": ["test_tune_protocol", "test_tune"],
    "results/tune/reruns.py": ["test_tune_protocol", "test_tune"],
    "results/tune/suite.py": ["test_tune", "test_tune_protocol"],
    # the config's checks and its messages for bad input (`pflbed run --set ...`: one line naming the field)
    **{f"config/{name}.py": [
        "test_config_checks", "test_config_bounds", "test_config_hints", "test_config_load", "test_config_package",
        "test_config_properties", "test_cli", "test_device"]
       for name in ("algorithm", "base", "dataset", "evaluation", "executor", "federation", "hints", "load", "log",
                    "model", "privacy", "root", "sites")},  # fmt: skip
}


def test_path(name: str) -> str:
    """A test module by its name (`test_contract`): `tests/<folder>/<name>.py`. Test module names are unique
    across tests/'s folders (tests/algorithms/, tests/engine/, tests/evaluation/, ...)."""
    found = sorted((ROOT / "tests").glob(f"*/{name}.py"))
    if len(found) != 1:
        sys.exit(f"mutation_screen: {len(found)} test modules named {name} under tests/*/")
    return found[0].relative_to(ROOT).as_posix()


def test_files(source: str) -> list[str]:
    """The test files of a source file under src/pflbed: the table's, else the one that mirrors it
    (`algorithms/fedavg.py` -> `tests/algorithms/test_fedavg.py`; a top-level module's are in tests/project/)."""
    if source in TESTS_FOR:
        return [test_path(n) for n in TESTS_FOR[source]]
    folder = Path(source).parent.as_posix()
    return [f"tests/{'project' if folder == '.' else folder}/test_{Path(source).stem}.py"]


def all_mutants() -> dict[str, str]:
    """Mutant name -> its source file (relative to src/pflbed), from mutmut's per-file metadata."""
    out = {}
    for meta in sorted(glob.glob(str(MUTANTS / "src/pflbed/**/*.py.meta"), recursive=True)):
        source = meta.split("/src/pflbed/")[1].removesuffix(".meta")
        for name in json.loads(Path(meta).read_text())["exit_code_by_key"]:
            out[name] = source
    return out


def generate() -> None:
    """mutmut's mutant generation only (its `run` would go on to test every mutant its own way), and a fresh copy of
    tests/ (mutmut keeps the one it made first)."""
    import shutil

    import mutmut.__main__ as mm

    os.chdir(ROOT)
    mm.set_mutant_under_test("mutant_generation")
    MUTANTS.mkdir(exist_ok=True)
    mm.copy_src_dir()
    mm.copy_also_copy_files()
    mm.setup_source_paths()
    mm.store_lines_covered_by_tests()
    print(mm.create_mutants(os.cpu_count() or 1))
    shutil.rmtree(MUTANTS / "tests", ignore_errors=True)
    shutil.copytree(ROOT / "tests", MUTANTS / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    print(f"{len(all_mutants())} mutants")


# Caches keyed by everything their result depends on, none of it mutated code: kept between mutants (the data
# loaders read files; the accountant's ε is Opacus's, of its arguments).
PURE_CACHES = ("pflbed.data.", "pflbed.privacy._epsilon", "pflbed.privacy.noise_multiplier")
# Module-level memos that are plain dicts (module, name): emptied before every test, as the functools caches are.
# A memo filled under the unmutated code (or another mutant) keeps the code that fills it from running: masks'
# constants copied to a device once, the convolutions' timed choices.
MEMOS = (("pflbed.algorithms.masks", "_ON"), ("pflbed.engine.conv_weight_grad", "_CHOICES"))
# Tests that fail on mutmut's copy of the code, mutated or not, in any process: left out of every selection (else the
# selection's check on the unmutated code stops the screen). The compiled product step: dynamo cannot trace the
# `ContextVar.get` of mutmut's trampolines around `batched.py`'s functions and breaks the graph, which the test
# counts; its rule (`keep_in_graph`) is planted by hand (benchmarks/results/mutation.md).
UNSCREENABLE = ("tests/engine/test_batched.py::test_a_compiled_step_takes_the_product_form_in_its_graph",)
DESELECT = [arg for test in UNSCREENABLE for arg in ("--deselect", test)]
# A mutant's time limit is `--timeout` or this many times its tests' seconds on the unmutated code, whichever is
# longer: a fixed limit shorter than the tests counts a mutant they would let survive as killed (a timeout).
SLOWER = 3


def kept_caches(mutant: str) -> tuple[str, ...]:
    """The `PURE_CACHES` a mutant leaves alone: all but those whose code holds it."""
    module = mutant.rpartition(".x")[0]  # pflbed.data.digits.x__to_dataset__mutmut_3 -> pflbed.data.digits
    return tuple(p for p in PURE_CACHES if not (module and (module.startswith(p) or p.startswith(module + "."))))


def clear_caches(mutant: str = "", pure: bool = False) -> None:
    """Empty the in-process caches of pflbed and the tests before the next mutant: the memoized federations
    (`federation._MEMORY`, keyed by the config, not by the code that built them), the `MEMOS` and each `functools`
    cache (`tests.tiny.loop_run`, ...) but the `PURE_CACHES` — and those too where `mutant` lies in their code (a data
    loader's mutant: its cache holds what the unmutated loader decoded). Modules stay imported across `pytest.main`
    calls, so without this a result computed under one mutant (or the original) is read back under the next one,
    whose own code then never runs: a false survivor. `pure`: empty every cache."""
    kept = () if pure else kept_caches(mutant)
    for name, mod in list(sys.modules.items()):
        if not (name == "pflbed" or name.startswith(("pflbed.", "tests"))):
            continue
        for value in list(vars(mod).values()):
            qualified = f"{name}.{getattr(value, '__name__', '')}"
            if callable(getattr(value, "cache_clear", None)) and not qualified.startswith(kept):
                value.cache_clear()
    for module, name in (("pflbed.federation.federation", "_MEMORY"), *MEMOS):
        if module in sys.modules:  # not imported: nothing memoized
            getattr(sys.modules[module], name).clear()


def _on_timeout(fh: TextIO, mutant: list[str], start: str) -> Callable[..., None]:
    """SIGALRM's handler while mutants are screened: the mutant under test (`mutant[0]`) timed out, which counts as
    killed (as in mutmut); it is recorded in `fh` and the screen goes on in a fresh process, which the results file
    resumes. Why not raise an exception where the signal lands and go on in this process: there it can be lost —
    in a finalizer that the garbage collector runs, Python reports the exception and drops it (a mutant looping
    over `gc.collect()` ran on past its limit so, until stopped), and the code's own `except Exception` takes it for
    one of its errors — and the tests it does cut short may leave their state behind (a `monkeypatch` not undone, a
    fixture not torn down) for the next mutants' tests."""
    own = os.dup(1), os.dup(2)  # the process's stdout and stderr: pytest's capture points them elsewhere while a
    # test runs, and the fresh process would inherit that

    def handler(*_: object) -> None:
        fh.write(f"TIMEOUT {mutant[0]}\n")
        fh.flush()
        os.dup2(own[0], 1)
        os.dup2(own[1], 2)
        os.write(2, f"mutation_screen: {mutant[0]} timed out; going on in a fresh process\n".encode())
        os.environ.pop("MUTANT_UNDER_TEST", None)
        os.chdir(start)  # the command line's paths are relative to where it ran
        os.execv(sys.executable, sys.orig_argv)

    return handler


def _key(nodeid: str) -> str:
    """A test's node id with every run of backslashes as one: pytest escapes a parametrized id that holds one (a
    parameter shown by `str`, `b'\\x00'`) again at each collection of a module already imported, so in one
    process a test's `item.nodeid` grows from one `pytest.main` to the next."""
    return re.sub(r"\\+", r"\\", nodeid)


class _Only:
    """Keep only the collected tests that are `ids` (by `_key`). Why not name them on the command line: an id that
    has changed since it was recorded (`_key`) is not found, and pytest exits 4, once counted here as a kill."""

    def __init__(self, ids: set[str]) -> None:
        self.keys = {_key(i) for i in ids}

    def pytest_collection_modifyitems(self, config, items) -> None:
        keep = [_key(item.nodeid) in self.keys for item in items]
        config.hook.pytest_deselected(items=[item for item, k in zip(items, keep, strict=True) if not k])
        items[:] = [item for item, k in zip(items, keep, strict=True) if k]


def reach(args: list[str], pure: bool = False) -> tuple[dict[str, list[str]], dict[str, float]] | None:
    """The tests of a selection (`args`: pytest's) that reach each mutated function, and each test's seconds (node id
    -> seconds), None if the selection fails: one run of them on the unmutated code (so it is also the check that
    the unmutated code passes) with mutmut's trampolines recording every call per test (`MUTANT_UNDER_TEST=stats`,
    as `mutmut run` records them before testing), the caches emptied before each test so that each one's calls are
    its own (`pure`: the data loaders' too, when their own mutants are screened: else only the first test to load a
    file is seen to reach the loader). Calls made in a process a test starts are not seen (it runs unmutated and
    unrecorded: recording fails outside mutants/): a test that reaches a function only there is left out (`--reach`
    then misses it; screen such mutants without it)."""
    import pytest
    from mutmut.state import state

    hits: dict[str, list[str]] = collections.defaultdict(list)
    seconds: dict[str, float] = {}

    class Recorder:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            clear_caches(pure=pure)
            state()._stats.clear()
            os.environ["MUTANT_UNDER_TEST"] = "stats"
            began = time.perf_counter()
            yield
            seconds[item.nodeid] = time.perf_counter() - began
            for name in state()._stats:
                hits[name].append(item.nodeid)

    import subprocess

    popen_init = subprocess.Popen.__init__

    def unrecorded(self, *args, env=None, **kwargs):  # mutmut's recording fails in a process started elsewhere
        return popen_init(self, *args, env={**(os.environ if env is None else env), "MUTANT_UNDER_TEST": "none"},
                          **kwargs)  # fmt: skip

    subprocess.Popen.__init__ = unrecorded
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = pytest.main(["-p", "no:cacheprovider", "-q", *DESELECT, *args], plugins=[Recorder()])
    finally:
        subprocess.Popen.__init__ = popen_init
    return (hits, seconds) if rc == 0 else None


def run(shard: int, shards: int, skip: set[str], timeout: int, only: set[str] | None = None,
        tests: list[str] | None = None, out_name: str = "screen", keyword: str | None = None,
        reached: bool = False) -> None:
    files_given = [test_path(n) for n in tests] if tests else None  # before chdir: a misspelt name stops here
    start = os.getcwd()
    os.chdir(MUTANTS)  # mutmut's copy of the tests and the mutated src
    sys.path.insert(0, str(MUTANTS / "src"))
    # ... in this process and in every one a test starts (`python -m pflbed`, a worker): else a test that runs
    # the code in a subprocess tests the unmutated package, and its mutants all survive
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(MUTANTS / "src"), os.environ.get("PYTHONPATH")]))
    # and from bytecode: a mutated module is several times its source, and compiling the package afresh in
    # every worker a test starts took 20 s of each worker's start-up
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    import pytest

    import pflbed

    if not pflbed.__file__.startswith(str(MUTANTS)):
        sys.exit(f"mutation_screen: imported {pflbed.__file__}, not the mutants/ copy")
    todo = [(m, s) for m, s in all_mutants().items() if m not in skip and (only is None or m in only)][shard::shards]
    out = MUTANTS / f"{out_name}-{shard}.txt"
    done = {line.split()[1] for line in out.read_text().splitlines()} if out.exists() else set()
    passing: set[tuple[str, ...]] = set()  # test selections the unmutated code passes
    reaching: dict[tuple[str, ...], tuple[dict[str, list[str]], dict[str, float]]] = {}  # selection -> `reach`'s
    took: dict[tuple[str, ...], float] = {}  # selection -> its seconds on the unmutated code

    def pytest_rc(files: list[str], k: list[str], mutant: str, only_ids: set[str] | None = None) -> int:
        clear_caches(mutant)
        os.environ["MUTANT_UNDER_TEST"] = mutant
        plugins = [_Only(only_ids)] if only_ids is not None else []
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return pytest.main(["-p", "no:cacheprovider", "-q", "-x", *DESELECT, *k, *files], plugins=plugins)

    with out.open("a") as fh:
        under_test = [""]
        signal.signal(signal.SIGALRM, _on_timeout(fh, under_test, start))
        for name, source in todo:
            if name in done:
                continue
            files = files_given or test_files(source)
            k = ["-k", keyword.format(stem=Path(source).stem)] if keyword else []
            selection = tuple(files + k)
            if selection not in passing:  # else every mutant would count as killed
                began = time.perf_counter()
                if reached:  # one run both checks the selection and records which test reaches what
                    found = reach([*k, *files], pure=any(kept_caches(m) != PURE_CACHES for m, _ in todo))
                    ok = found is not None
                    reaching[selection] = found or ({}, {})
                else:
                    ok = pytest_rc(files, k, "none") == 0
                took[selection] = time.perf_counter() - began
                if not ok:
                    sys.exit(f"mutation_screen: the unmutated code fails {' '.join(files + k)}: mutants/ or its "
                             "tests/ copy is stale (run `generate` again)")
                passing.add(selection)
            only_ids, baseline = None, took[selection]
            if reached:  # only the tests that call the mutated function: their files, the rest deselected
                hits, seconds = reaching[selection]
                only_ids = set(hits.get(name.partition("__mutmut_")[0], []))
                if not only_ids:
                    fh.write(f"NOTESTS {name}\n")
                    fh.flush()
                    continue
                files = sorted({nodeid.split("::")[0] for nodeid in only_ids})
                baseline = sum(seconds[i] for i in only_ids)
            under_test[0] = name
            signal.alarm(max(timeout, math.ceil(SLOWER * baseline)))  # past it: `_on_timeout`
            try:
                rc = pytest_rc(files, k, name, only_ids)
            finally:
                signal.alarm(0)
            if rc == pytest.ExitCode.USAGE_ERROR:  # a selection pytest cannot read: no verdict
                sys.exit(f"mutation_screen: pytest cannot select the tests of {name} (a usage error)")
            verdict = {0: "SURVIVED", 5: "NOTESTS"}.get(rc, "KILLED")  # 5: pytest collected nothing
            fh.write(f"{verdict} {name}\n")
            fh.flush()


def report(skip: set[str]) -> None:
    """Per-file table; mutants in `skip` count as killed (the caller vouches for them)."""
    source_of = all_mutants()
    verdict = {m: "KILLED" for m in skip if m in source_of}
    for path in sorted(MUTANTS.glob("screen-*.txt")):
        for line in path.read_text().splitlines():
            v, name = line.split()[:2]
            if v != "NOTESTS":  # a run that tested nothing leaves the earlier verdict
                verdict[name] = v
    rows = collections.defaultdict(collections.Counter)
    for name, source in source_of.items():
        rows[source][verdict.get(name, "untested")] += 1
        rows[source]["mutants"] += 1
    print("| file | mutants | killed | survived | untested | score |\n|---|---|---|---|---|---|")
    total = collections.Counter()
    for source, c in sorted(rows.items()):
        total.update(c)
        killed = c["KILLED"] + c["TIMEOUT"]
        print(f"| `{source}` | {c['mutants']} | {killed} | {c['SURVIVED']} | {c['untested']} | "
              f"{100 * killed / c['mutants']:.1f} % |")  # fmt: skip
    killed = total["KILLED"] + total["TIMEOUT"]
    print(f"| **all** | {total['mutants']} | {killed} | {total['SURVIVED']} | {total['untested']} | "
          f"{100 * killed / total['mutants']:.1f} % |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["generate", "run", "report"])
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--timeout", type=int, default=120, help="seconds per mutant at least (then it counts as killed); "
                   f"{SLOWER}× its tests' seconds on the unmutated code where longer")
    p.add_argument("--skip", type=Path, help="file of mutant names to leave out (run) / count as killed (report)")
    p.add_argument("--only", type=Path, help="file of the mutant names to run (run)")
    p.add_argument("--tests", help="comma-separated test modules to run instead of each file's own (run)")
    p.add_argument("--out", default="screen", help="results file prefix under mutants/ (run)")
    p.add_argument("--keyword", help="pytest -k expression; {stem} is the mutated file's name (run)")
    p.add_argument("--reach", action="store_true", help="run each mutant against the tests (of the selection) that "
                   "call its function only, as mutmut does (run)")
    a = p.parse_args()
    skip = set(a.skip.read_text().split()) if a.skip else set()
    if a.command == "generate":
        generate()
    elif a.command == "run":
        only = set(a.only.read_text().split()) if a.only else None
        run(a.shard, a.shards, skip, a.timeout, only, a.tests.split(",") if a.tests else None, a.out, a.keyword,
            a.reach)
    else:
        report(skip)


if __name__ == "__main__":
    main()
