"""`executor.device`: every tensor of a run lives on the configured device.

There is no GPU in CI, so the test that catches missing device plumbing runs on the CPU: it makes torch's *default*
device `meta` and runs every algorithm with `executor.device=cpu`. A tensor created without an explicit device
(`torch.zeros(())`, `torch.arange(n)`, `torch.randperm(n, generator=g)`, an `nn.Linear(...)`) then lands on `meta`
instead of the CPU — exactly the tensor that would be on the CPU next to CUDA data in a GPU run. `NoMeta` turns
each such creation into an error at the line that made it (mixing meta with CPU tensors does not always raise:
indexing a CPU tensor with meta indices silently reads garbage). The run must also give the summary of the same run
without the trick, so the plumbing changes nothing on the CPU.

What this cannot catch on a CPU-only machine: a tensor deliberately put on the CPU (`device="cpu"`) and then mixed
with device tensors. The code keeps those to random draws from CPU generators, used as indices into device tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import pflbed
from pflbed.algorithms import ALGORITHMS
from pflbed.config import resolve_device, validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError
from pflbed.federation import federation
from pflbed.results.experiment import run

from ..tiny import DATA, TINY

# As in test_procs: public data for the distillation family, and two light architectures instead of its default zoo.
FED = {**TINY["federation"], "public": 64, "new_clients": 1}  # a new client: the new-client protocol runs too
LIGHT = {"architectures": ["lenet5", "mlp"], "server_steps": 3}
PFLBED = {"protocol": "pflbed", "pflbed": {"clients_per_domain": 2, "new_clients_per_domain": 1}}  # domains
DP = {"clip": 0.5, "noise_multiplier": 0.8}  # client-level DP: clipped replies, noise drawn on the CPU
EVAL = {**TINY["eval"], "finetune": ["ft", "lp"], "new_clients": {"epochs": 1, "lrs": [0.05], "fractions": [1.0]}}

# Every algorithm with its defaults, plus options that take code paths the defaults do not (BatchNorm statistics
# tracked into FedBasis' bases, its joint update, random mask growth, KT-pFL's official variant and its homogeneous
# form, TopK without self, subsampled class-weighted evaluation, the PFLBED protocol on transform domains, FedRoD's
# P-FL on each client's own body, client-level DP on a global and on a partly personal model, FedProto's
# heterogeneous clients): (id, algorithm options, other config sections).
CASES = [(name, {"name": name}, {}) for name in sorted(ALGORITHMS)] + [
    (
        "fedbasis-bn",
        {"name": "fedbasis", "K": 2, "alpha_epochs": 1, "basis_epochs": 1},
        {"model": {"name": "lenet5_bn"}},
    ),
    ("fedbasis-joint", {"name": "fedbasis", "coordinate_descent": False, "major": False}, {}),
    ("fedselect-random", {"name": "fedselect", "selection": "random", "preset": "official"}, {}),
    ("ktpfl-official", {"name": "ktpfl", "preset": "official", "public_batch": 32}, {}),
    ("ktpfl-homogeneous", {"name": "ktpfl", "homogeneous": True}, {}),
    ("topk_pfl-others", {"name": "topk_pfl", "include_self": False, "k": 2}, {}),
    ("fedavg-global-test", {"name": "fedavg"}, {"eval": {**EVAL, "pfl_test": "global", "test_subsample": 5}}),
    ("fedrod-pflbed", {"name": "fedrod"}, {"dataset": {"name": "digits-rot4"}, "federation": PFLBED}),
    ("fedrod-local-body", {"name": "fedrod", "pfl_body": "local"}, {"eval": {**EVAL, "pfl_test": "global"}}),
    ("fedavg-dp", {"name": "fedavg"}, {"privacy": DP}),
    ("fedper-dp", {"name": "fedper"}, {"privacy": DP}),
    ("fedproto-heterogeneous", {"name": "fedproto", "models": ["lenet5", "lenet5_bn"]}, {"model": {"name": "lenet5"}}),
]


def _cfg(algorithm, device="cpu", executor=None, **sections):
    fields = ALGORITHMS[algorithm["name"]].Config.model_fields
    options = {**{k: v for k, v in LIGHT.items() if k in fields}, **algorithm}
    executor = {**TINY["executor"], "device": device, "threads": 1, **(executor or {})}
    tree = {**TINY, "dataset": DATA, "federation": FED, "eval": EVAL, "algorithm": options, "executor": executor,
            **sections}  # fmt: skip
    return validate_config(tree)


def _figures(summary):
    return {k: v for k, v in summary.items() if k not in ("timing", "provenance")}


class NoMeta(TorchFunctionMode):
    """Fail where a torch function returns a `meta` tensor, i.e. where a tensor was made on the default device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise AssertionError(f"{getattr(func, '__qualname__', func)} made a tensor on torch's default device")
        return out


@pytest.fixture
def meta_default(monkeypatch, tmp_path):
    """torch's default device is `meta` (restored afterwards); the federation is rebuilt, not taken from a cache."""
    monkeypatch.setattr(federation, "_MEMORY", {})
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path / "cache"))
    torch.set_default_device("meta")
    try:
        with NoMeta():
            yield
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize(("algorithm", "sections"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_no_tensor_depends_on_the_default_device(algorithm, sections, request):
    """Each run twice: as usual, then with `meta` as torch's default device — same figures, no meta tensor."""
    cfg = _cfg(algorithm, **sections)
    reference = run(cfg, write=False, progress=False)
    request.getfixturevalue("meta_default")
    on_meta_default = run(cfg, write=False, progress=False)
    assert _figures(on_meta_default.summary) == _figures(reference.summary)


def test_the_trick_catches_a_tensor_on_the_default_device(meta_default):
    """The fixture itself: an undeviced tensor fails at its creation, an explicit CPU one does not."""
    with pytest.raises(AssertionError, match="default device"):
        torch.zeros(3)
    assert torch.zeros(3, device="cpu").device.type == "cpu"


def test_context_models_and_data_are_on_the_configured_device():
    algo = prepare(_cfg({"name": "fedrod"}))
    ctx, cpu = algo.ctx, torch.device("cpu")
    assert ctx.device == cpu
    assert {p.device for p in ctx.model.parameters()} == {cpu}
    assert {v.device for v in ctx.initial_params.values()} == {cpu}
    assert {p.device for p in ctx.new_model("lenet5").parameters()} == {cpu}
    for split in (ctx.source.train, ctx.source.test):
        assert split.x.device == split.y.device == cpu
    fed = ctx.federation
    assert fed.global_test.device == fed.public.device == cpu
    assert all(t.device == cpu for c in fed.clients for t in (c.train, c.val, c.test, c.prior))


def test_auto_resolves_to_what_the_machine_has():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert prepare(_cfg({"name": "fedavg"}, "auto")).ctx.device.type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_is_a_config_error(device):
    with pytest.raises(ConfigError, match=r"^executor\.device: CUDA is not available"):
        validate_config({"executor": {"device": device}})


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "cuda:0:1", "meta", ""])
def test_unknown_device_is_a_config_error(device):
    with pytest.raises(ConfigError, match=r"^executor\.device: must be cpu, cuda, cuda:N"):
        validate_config({"executor": {"device": device}})


def test_a_cuda_device_past_the_last_is_a_config_error():
    """Holds on any machine: cuda:<device count> never exists (with no CUDA at all, the message says so)."""
    with pytest.raises(ConfigError, match=r"^executor\.device: (no such CUDA device|CUDA is not available)"):
        pflbed.config.validate_config({"executor": {"device": f"cuda:{torch.cuda.device_count()}"}})


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two CUDA devices, the second current: the CUDA branch of `resolve_device` on any machine
    (torch only reports devices here; no tensor is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_cuda_devices_resolve_with_their_index(two_gpus):
    """`cuda` and `auto` are the current device, by its index (tensors report `cuda:1`, never `cuda`); `cuda:N` is
    device N up to the last; past it, one line naming the devices there are."""
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^executor\.device: no such CUDA device: this machine has 2 \(cuda:0 to "
                                          r"cuda:1\) \(got 'cuda:2'\)$"):  # fmt: skip
        validate_config({"executor": {"device": "cuda:2"}})
