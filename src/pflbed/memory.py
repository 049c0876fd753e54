"""Refusing, before it is built, a network or a decoded dataset whose size an option sets and that cannot fit in the
run's memory.

Most of what a run holds is bounded by the data or the model zoo. A few algorithms build networks of their own whose
size grows with an option without bound: pFedHN's hypernetwork (`hidden`, `hidden_layers`, `embed_dim`) and
FedRoD's hyper head (`hidden`). Too large a value does not fail cleanly: a huge request raises from deep inside torch
(a traceback), and a merely too large one is allocated lazily and the operating system kills the process mid-run,
with a half-written run directory. The size is known from the options before anything is allocated, so the
algorithm checks it here and refuses in one line naming the options. Decoded image datasets are the same case:
`dataset.image_size` (up to 4096) squares every image's pixel count, and the loader knows the bytes before it
allocates them (`check_decoded`).

Only a certain failure is refused: the network's parameters times the fewest copies a training round holds at once
(`ROUND_COPIES`: the parameters, their gradient, the optimizer's momentum and the next round's parameters), against
the device's whole memory. A network that passes may still not fit beside everything else; one refused could never
have trained.
"""

from __future__ import annotations

import math
import os

import torch

from pflbed.errors import ConfigError

ROUND_COPIES = 4  # parameters, gradient, momentum, the next round's: pFedHN's round measured ≈ 10 at its peak
FLOAT32_BYTES = 4


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of `device` (the machine's physical memory for the CPU); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name: no check
        return None


def _bytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def check_processes(count: int, bytes_each: int, what: str, field: str) -> None:
    """`ConfigError` naming `field` unless `count` processes of at least `bytes_each` resident bytes each (`what`:
    "SuperNodes") fit in this machine's memory: started one after another, they would fill it and the operating
    system's killer, not a message, would end the command."""
    memory = device_memory(torch.device("cpu"))
    need = count * bytes_each
    if memory is not None and need > memory:
        raise ConfigError(f"{field}: {count:,} {what} need at least {_bytes(need)} of memory ({_bytes(bytes_each)} "
                          f"each, at rest), more than this machine's {_bytes(memory)}; at most "
                          f"{memory // bytes_each:,} here")  # fmt: skip


def check_fits(parameters: int, device: torch.device, what: str, fields: str, advice: str = "lower them") -> None:
    """`ConfigError` naming `fields` unless `ROUND_COPIES` float32 copies of `parameters` fit in `device`'s memory.
    `what` names the network ("pfedhn's hypernetwork"); `fields`, the options that size it; `advice`, what to do."""
    memory = device_memory(device)
    need = parameters * FLOAT32_BYTES * ROUND_COPIES
    if memory is not None and need > memory:
        where = "this machine's" if device.type == "cpu" else f"{device}'s"
        raise ConfigError(f"{fields}: {what} would hold {parameters:,} parameters; a training round holds at least "
                          f"{ROUND_COPIES} copies of them ({_bytes(need)}), more than {where} {_bytes(memory)} of "
                          f"memory; {advice}")  # fmt: skip


def check_decoded(images: int, size: int, what: str) -> None:
    """`ConfigError` naming `dataset.image_size` unless `images` decoded float32 images of 3 × `size` × `size` fit
    in this machine's memory; `what` names them ("FLICKR-AES's 9,800 ratings"). A larger request raises from inside
    torch (a traceback) or is allocated lazily and filled until the operating system kills the process."""
    memory = device_memory(torch.device("cpu"))
    need = images * 3 * size * size * FLOAT32_BYTES
    if memory is not None and need > memory:
        fits = math.isqrt(memory // max(1, images * 3 * FLOAT32_BYTES))
        raise ConfigError(f"dataset.image_size: {what} at {size} px would take {_bytes(need)}, more than this "
                          f"machine's {_bytes(memory)} of memory; at most {fits} px here")  # fmt: skip
