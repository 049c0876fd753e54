"""The derived streams' own rules (`pflbed.rng`): what a seed is, and what privacy draws from the OS."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

from pflbed import rng


@pytest.fixture(autouse=True)
def _own_global_rng():
    """These tests seed and move torch's global generator: put it back for the tests that run after them."""
    with torch.random.fork_rng(devices=[]):
        yield


def test_a_derived_seed_is_a_63_bit_hash_of_every_key() -> None:
    """63 bits, so that any seed fits torch's `manual_seed` and the streams of 10⁵ keys do not collide: of 4,000
    seeds, none reaches 2⁶³ and some use the top bit (none would with probability 2⁻⁴⁰⁰⁰)."""
    seeds = [rng.derive_seed(7, rng.CLIENT, r, c) for r in range(40) for c in range(100)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert max(seeds) >= 2**62 and len(set(seeds)) == len(seeds)
    assert rng.derive_seed(7, 1, 2) != rng.derive_seed(7, 2, 1) != rng.derive_seed(8, 1, 2)


@pytest.mark.parametrize("n", [0, 1, 2, 1000])
def test_os_uniform_gives_n_float64_numbers_on_the_53_bit_grid_of_0_1(n: int) -> None:
    u = rng.os_uniform(n)
    assert u.shape == (n,) and u.dtype == np.float64
    assert np.all((u >= 0) & (u < 1)) and np.array_equal(u * 2.0**53, np.floor(u * 2.0**53))
    if n == 1000:  # 1,000 draws of 53 bits: distinct, and they cover the interval
        assert len(set(u.tolist())) == n and u.min() < 0.01 and u.max() > 0.99


def test_a_derived_seed_is_the_first_64_bit_word_of_numpy_s_seed_sequence_halved() -> None:
    """The derivation is part of what a config means: a published config reruns to the same figures only while
    every stream's seed is derived the same way (`SeedSequence([seed, *keys])`, first word, top bit dropped)."""
    for seed, keys in [(0, ()), (7, (1, 2)), (2**40, (3, 0, 99))]:
        word = np.random.SeedSequence([seed, *keys]).generate_state(1, dtype=np.uint64)[0]
        assert rng.derive_seed(seed, *keys) == int(word) >> 1
    assert rng.derive_seed(7, 1, 2) == rng.derive_seed(7, 1, 2)  # the same, however often asked
    with pytest.raises(TypeError):  # a float key is refused, whatever was asked before
        rng.derive_seed(7, 1, 2.0)


def test_a_stream_s_generator_is_a_cpu_generator_seeded_with_its_derived_seed() -> None:
    g = rng.generator(5, 1, 2)
    assert g.device == torch.device("cpu") and g.initial_seed() == rng.derive_seed(5, 1, 2)


def test_seeding_a_cpu_run_seeds_the_cpu_s_global_generator_and_no_other_device(monkeypatch) -> None:
    """`torch.manual_seed` would queue a seeding of every device type (0.8 ms a call, once per client update)."""

    def no(*_a, **_k):
        raise AssertionError("torch.manual_seed called in a CPU run")

    monkeypatch.setattr(torch, "manual_seed", no)
    rng.seed_global(11, torch.device("cpu"))
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(11)))


def test_the_global_generator_s_position_is_read_set_and_copied_without_drawing() -> None:
    cpu = torch.device("cpu")
    rng.seed_global(3, cpu)
    torch.rand(2)
    now = rng.global_now(cpu)
    twin = rng.copy(now)
    expected = torch.rand(5)  # what the global generator draws next, read before it was drawn
    assert torch.equal(torch.rand(5, generator=now), expected) and torch.equal(torch.rand(5, generator=twin), expected)
    elsewhere = torch.Generator().manual_seed(123)
    rng.set_global(rng.copy(elsewhere), cpu)  # the global generator goes on from where `elsewhere` stands
    assert torch.equal(torch.rand(3), torch.rand(3, generator=elsewhere))
    rng.seed_global(9, cpu)
    assert torch.equal(rng.global_stream(9, cpu).get_state(), torch.get_rng_state())


def test_a_cpu_run_leaves_torch_s_process_wide_settings_and_other_devices_alone(monkeypatch) -> None:
    """The deterministic-kernel flags are the process's (a library's caller owns them): a CPU run, whose kernels are
    deterministic already, sets none; its RNG fork touches no accelerator's generator."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    def flags():
        return (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
                torch.backends.cuda.matmul.allow_tf32)  # fmt: skip

    before = flags()
    for tf32 in (True, False):
        rng.gpu_kernels(torch.device("cpu"), True, True, tf32)
        assert flags() == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    seen = {}
    monkeypatch.setattr(torch.random, "fork_rng", lambda **kw: seen.update(kw) or contextlib.nullcontext())
    with rng.fork(torch.device("cpu")):
        pass
    assert seen == {"devices": []}


@pytest.fixture
def kernel_flags(monkeypatch):
    """torch's process-wide kernel flags, which `gpu_kernels` sets, put back after the test."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    for flag in ("deterministic", "benchmark", "allow_tf32"):
        monkeypatch.setattr(torch.backends.cudnn, flag, getattr(torch.backends.cudnn, flag))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("autotune", [True, False])
@pytest.mark.parametrize("tf32, matmul, conv", [(None, False, True), (True, True, True), (False, False, False)])
def test_a_gpu_run_sets_the_kernel_flags_its_config_asks_for(monkeypatch, kernel_flags, deterministic, autotune, tf32,
                                                             matmul, conv) -> None:  # fmt: skip
    """On a GPU device, `executor.deterministic`, `executor.autotune` and `executor.tf32` become torch's flags as
    they are: cuDNN's autotuner (`benchmark`) on only when asked, whichever the determinism; TF32 unset: PyTorch's
    defaults (convolutions in TF32, matrix products not), set: both or neither, whatever an earlier run left (the
    flags start opposite to what is asked). Set, not read; no GPU needed."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the caller's, not the one a run sets
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = not matmul, not conv
    rng.gpu_kernels(torch.device("cuda"), deterministic, autotune, tf32)
    assert torch.backends.cudnn.benchmark is autotune
    assert torch.backends.cudnn.deterministic is deterministic
    assert torch.are_deterministic_algorithms_enabled() is deterministic
    assert torch.is_deterministic_algorithms_warn_only_enabled()  # an op with no deterministic kernel: a warning
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (matmul, conv)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # the caller's own workspace kept


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_deterministic_gpu_run_fixes_cublas_s_workspace_where_the_caller_did_not(monkeypatch, kernel_flags,
                                                                                   deterministic):  # fmt: skip
    """cuBLAS is deterministic only with a fixed workspace (`CUBLAS_WORKSPACE_CONFIG`, read at its first use): a
    deterministic run sets it where the process has none; a run that is not leaves the process's environment."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    rng.gpu_kernels(torch.device("cuda"), deterministic)
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == (rng.CUBLAS_DETERMINISTIC_WORKSPACE if deterministic
                                                         else None)  # fmt: skip
