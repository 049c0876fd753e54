"""The default thread count (one for a small model, every core for a large one) and the provenance a summary records."""

import builtins
import io
import os
import platform

import numpy as np
import pytest
import torch
from torch import nn

from pflbed.engine import threads
from pflbed.engine.threads import LARGE_MODEL_PARAMS, choose_threads, cpu_model, provenance


def _model(params: int) -> nn.Module:
    """A model of exactly `params` parameters, in two tensors: the count is over all of them."""
    m = nn.Module()
    m.a = nn.Parameter(torch.zeros(1))
    m.b = nn.Parameter(torch.zeros(params - 1))
    return m


def test_a_model_below_the_threshold_gets_one_thread_from_it_on_every_core(monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 7)
    assert choose_threads(_model(LARGE_MODEL_PARAMS - 1)) == 1
    assert choose_threads(_model(LARGE_MODEL_PARAMS)) == 7
    monkeypatch.setattr(threads.os, "cpu_count", lambda: None)  # unknown: one
    assert choose_threads(_model(LARGE_MODEL_PARAMS)) == 1


def test_the_cpu_model_is_read_from_its_line_of_proc_cpuinfo_and_else_from_the_platform(monkeypatch):
    cpuinfo = "processor\t: 0\nvendor_id\t: X\nmodel name\t: Some CPU @ 2.0GHz: rev 2 \nflags\t: a b\n"
    real_open = builtins.open

    def fake_open(path, *a, **kw):
        return io.StringIO(cpuinfo) if path == "/proc/cpuinfo" else real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert cpu_model() == "Some CPU @ 2.0GHz: rev 2"  # split at the first colon only, stripped

    def no_cpuinfo(path, *a, **kw):
        raise FileNotFoundError(path)

    monkeypatch.setattr(builtins, "open", no_cpuinfo)
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert cpu_model() == "arm64"
    monkeypatch.setattr(platform, "processor", lambda: "i386")
    assert cpu_model() == "i386"
    cpuinfo = "processor\t: 0\n"  # no model line: the platform's answer
    monkeypatch.setattr(builtins, "open", fake_open)
    assert cpu_model() == "i386"


def test_provenance_names_what_a_bit_for_bit_comparison_depends_on(monkeypatch):
    monkeypatch.setattr(threads, "cpu_model", lambda: "Some CPU")
    torch.set_num_threads(1)
    p = provenance()
    assert p == {
        "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(), "threads": 1,
        "device": "cpu", "cpu": "Some CPU", "cores": os.cpu_count(), "platform": platform.platform(),
    }  # fmt: skip
    assert provenance(torch.device("cpu")) == p


def test_a_gpu_runs_provenance_names_the_gpu(monkeypatch):
    names = {}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: names.setdefault(str(d), "Some GPU"))
    p = provenance(torch.device("cuda", 1))
    assert (p["device"], p["gpu"]) == ("cuda:1", "Some GPU")
    assert names == {"cuda:1": "Some GPU"}  # the run's device, not the default one
    with pytest.raises(KeyError):
        provenance(torch.device("meta"))["gpu"]
