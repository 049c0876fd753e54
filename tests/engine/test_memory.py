"""`pflbed.memory`: the device memory a network too large for it is refused against."""

import os

import pytest
import torch

from pflbed import memory
from pflbed.errors import ConfigError


def test_the_cpu_s_memory_is_the_machine_s_physical_memory():
    assert memory.device_memory(torch.device("cpu")) == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") > 0


def test_memory_that_cannot_be_read_is_not_checked(monkeypatch):
    """No sysconf name (another OS), or a device whose memory torch does not report: None, and nothing refused."""
    assert memory.device_memory(torch.device("meta")) is None
    monkeypatch.setattr(os, "sysconf", lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert memory.device_memory(torch.device("cpu")) is None
    memory.check_fits(10**15, torch.device("cpu"), "a network", "algorithm.width")


@pytest.mark.parametrize("spare, refused", [(0, False), (-1, True)])
def test_a_network_is_refused_only_if_its_round_s_copies_exceed_the_memory(monkeypatch, spare, refused):
    n = 1000
    monkeypatch.setattr(memory, "device_memory", lambda device: n * 4 * memory.ROUND_COPIES + spare)
    if not refused:
        memory.check_fits(n, torch.device("cpu"), "a network", "algorithm.width")
        return
    with pytest.raises(ConfigError, match=r"^algorithm\.width: a network would hold 1,000 parameters; a training round "
                                          r"holds at least 4 copies of them \(0\.0 MB\), more than this machine's "
                                          r"0\.0 MB of memory; lower them$"):  # fmt: skip
        memory.check_fits(n, torch.device("cpu"), "a network", "algorithm.width")


def test_a_gpu_s_memory_is_that_device_s_and_a_refusal_names_it(monkeypatch):
    """On CUDA the device's own total memory (each card its own), without a GPU here: torch's query replaced."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: asked.append(device) or type("P", (), {"total_memory": 80 * 10**9})())
    gpu = torch.device("cuda:1")
    assert memory.device_memory(gpu) == 80 * 10**9 and asked == [gpu]
    with pytest.raises(ConfigError, match=r"\(96\.0 GB\), more than cuda:1's 80\.0 GB of memory; lower them$"):
        memory.check_fits(6 * 10**9, gpu, "a network", "algorithm.width")


@pytest.mark.parametrize("n, shown", [(10**9, "1.0 GB"), (2_500_000_000, "2.5 GB"), (999_000_000, "999.0 MB"),
                                      (16_000, "0.0 MB")])  # fmt: skip
def test_sizes_are_shown_in_gb_from_a_billion_bytes(n, shown):
    assert memory._bytes(n) == shown


@pytest.mark.parametrize("spare, refused", [(0, False), (-1, True)])
def test_processes_are_refused_only_if_they_exceed_the_machine_s_memory(monkeypatch, spare, refused):
    """`check_processes`: count × bytes each against the machine's memory, refused past it by one byte; the line
    says how many would fit."""
    monkeypatch.setattr(memory, "device_memory", lambda device: 3 * 200 * 10**6 + spare)
    if not refused:
        memory.check_processes(3, 200 * 10**6, "SuperNodes", "executor.supernodes")
        return
    with pytest.raises(ConfigError, match=r"^executor\.supernodes: 3 SuperNodes need at least 600\.0 MB of memory "
                                          r"\(200\.0 MB each, at rest\), more than this machine's 600\.0 MB; at most 2 "
                                          r"here$"):  # fmt: skip
        memory.check_processes(3, 200 * 10**6, "SuperNodes", "executor.supernodes")


@pytest.mark.parametrize("spare, refused", [(0, False), (-1, True)])
def test_decoded_images_are_refused_only_if_they_exceed_the_machine_s_memory(monkeypatch, spare, refused):
    """`check_decoded`: images × 3 × size² float32 against the machine's memory, refused past it by one byte; the
    line names `dataset.image_size` and the largest size that would fit."""
    memory.check_decoded(10, 64, "10 images")  # against this machine's own memory: passes
    monkeypatch.setattr(memory, "device_memory", lambda device: 10 * 3 * 64 * 64 * 4 + spare)
    if not refused:
        memory.check_decoded(10, 64, "10 images")
        return
    with pytest.raises(ConfigError, match=r"^dataset\.image_size: 10 images at 64 px would take 0\.5 MB, more than "
                                          r"this machine's 0\.5 MB of memory; at most 63 px here$"):  # fmt: skip
        memory.check_decoded(10, 64, "10 images")
