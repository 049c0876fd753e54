"""`benchmarks/gpu.py` writes to a new directory of its own unless told otherwise: a trial run on a CPU
(`--device cpu --quick`, as docs/guide/gpu.md shows it) must not overwrite the committed GPU results."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_script():
    spec = importlib.util.spec_from_file_location("gpu_script", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_out_is_a_fresh_directory_never_the_committed_results(tmp_path, monkeypatch):
    gpu = _gpu_script()
    monkeypatch.chdir(tmp_path)
    a = gpu.parse_args(["--device", "cpu", "--quick"])
    assert a.out.resolve().parent == tmp_path / "runs" and a.out.name.startswith("gpu-")
    assert a.out.is_dir() and not list(a.out.iterdir())  # new and empty
    b = gpu.parse_args(["--device", "cpu", "--quick"])
    assert b.out != a.out  # a second call within the same second: a directory of its own
    assert gpu.parse_args(["--out", "benchmarks/results"]).out == Path("benchmarks/results")  # only when asked
