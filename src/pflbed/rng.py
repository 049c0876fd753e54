"""Derived random streams: every random draw is keyed by what it is for, never by what ran before it — except
what privacy draws from the operating system in a deployment (`os_uniform`), which must not be reproducible."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import torch


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed from (seed, *keys) via NumPy's SeedSequence hashing."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU generator on whatever device the run uses: one seed draws the same numbers everywhere."""
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, *keys))


def seed_global(seed: int, device: torch.device) -> None:
    """Seed torch's global RNG on the CPU and, in a run on an accelerator, on that device: what `torch.manual_seed`
    does for the devices a run draws from.

    Why not `torch.manual_seed` itself: it also queues a seeding of every other device type (CUDA, XPU, MTIA) that
    is not initialized, each with a captured stack trace, ≈ 0.8 ms a call on a CPU-only machine. Called before
    every client update, that was 5 % of a training round at 10,000 clients.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    elif device.type != "cpu":
        torch.manual_seed(seed)


def global_stream(seed: int, device: torch.device) -> torch.Generator:
    """A generator of `device` whose numbers are those torch's global generator of `device` gives after
    `seed_global(seed, device)`: code that must draw what a client's update draws from the global RNG (its
    dropout masks) without touching it, such as batched clients (`engine.batched`)."""
    return torch.Generator(device=device).manual_seed(seed)


def global_now(device: torch.device) -> torch.Generator:
    """A generator of `device` that draws what torch's global generator of `device` would draw next, leaving it
    untouched: where a client's update stands in the global RNG after a part of it that ran first (a plan built
    under the client's seeding, `engine.batched`), for its training to go on from."""
    own = torch if device.type == "cpu" else torch.get_device_module(device.type)
    state = own.get_rng_state() if device.type == "cpu" else own.get_rng_state(device)
    return torch.Generator(device=device).set_state(state)


def set_global(generator: torch.Generator, device: torch.device) -> None:
    """Torch's global generator of `device` set to where `generator` stands (`global_now`'s inverse)."""
    if device.type == "cpu":
        torch.set_rng_state(generator.get_state())
    else:
        torch.get_device_module(device.type).set_rng_state(generator.get_state(), device)


def copy(generator: torch.Generator) -> torch.Generator:
    """A generator drawing what `generator` will draw next, apart from it (a retry draws the same again)."""
    return torch.Generator(device=generator.device).set_state(generator.get_state())


def fork(device: torch.device) -> contextlib.AbstractContextManager:
    """`torch.random.fork_rng` of the CPU's global RNG and, in a run on an accelerator, of that device's: code that
    reseeds torch's global RNG (`torch.manual_seed` seeds every device) leaves both as they were."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


@contextlib.contextmanager
def global_from(generator: torch.Generator, device: torch.device) -> Iterator[None]:
    """Torch's global RNG seeded, for the duration, from `generator`'s own seed (a seed derived from it, so that
    the two draw different numbers; nothing is drawn from `generator`), and put back after (`fork`).

    Why: code outside a client update that draws from the global RNG — the dropout masks of a personalization
    (+FT, new clients, `pflbed personalize`) — would otherwise draw whatever the process's last use left there: the
    loop's last client update, or nothing at all in a process whose clients ran elsewhere (procs, Flower), so its
    figures would depend on the executor. Seeded here, they depend on what the draw is for, as `generator`'s do."""
    with fork(device):
        seed_global(derive_seed(generator.initial_seed(), GLOBAL), device)
        yield


# cuBLAS's workspace configuration for reproducible results (`:SIZE_KiB:BUFFERS`, NVIDIA's documented setting): read
# when a process first uses cuBLAS, so it must be set before then
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def gpu_kernels(device: torch.device, deterministic: bool, autotune: bool = False, tf32: bool | None = None) -> None:
    """On a GPU, set how torch chooses its kernels for a run: reproducible ones (`executor.deterministic`), timed
    ones (`executor.autotune`), and the float32 precision of matrix products and convolutions (`executor.tf32`).

    Why reproducible kernels are needed: by default cuDNN picks convolution algorithms whose weight gradients
    accumulate with atomics, in an order that varies run to run, and cuBLAS likewise with more than one workspace.
    The differences are float rounding, but training grows them: two GPU runs of FedBasis on a BatchNorm LeNet
    differed by 5 % of a parameter's magnitude after four rounds (benchmarks/results/gpu_h100.txt). Torch's
    deterministic mode makes cuDNN, cuBLAS (with a fixed workspace, set here before its first use) and torch's own
    scatter-style kernels deterministic; an op with no deterministic kernel warns instead of failing. Off: the faster
    defaults.

    `autotune`: cuDNN times its convolution algorithms on each new shape and keeps the fastest (`cudnn.benchmark`)
    instead of choosing by heuristics. Under `deterministic` it times only deterministic ones, so a run stays
    reproducible within itself; but which algorithm wins a timing may differ from one process to the next, and with
    it the rounding — two runs, or two `procs` workers, may then differ by float rounding.

    `tf32`: None, PyTorch's defaults on a GPU — convolutions in TensorFloat-32 (products of inputs rounded to 10
    mantissa bits, sums in float32), matrix products (linear layers) in float32; True: both in TF32, faster where
    linear layers weigh (tensor cores); False: both in float32, the most exact (FedDF's Adam distillation, whose
    step takes a near-zero gradient's sign, moves by a whole learning rate under TF32: docs/guide/gpu.md). Set with
    torch's `allow_tf32` flags, which torch's own code (cuDNN's context, inductor) reads.

    Every flag is set, never left as an earlier run left it; they are per process (torch's flags are global), so
    each `procs` worker applies them too. Nothing changes on the CPU, whose kernels are deterministic and float32.
    """
    if device.type != "cuda":
        return
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = autotune
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch.backends.cudnn.allow_tf32 = tf32 is not False


def os_uniform(n: int) -> np.ndarray:
    """`n` float64 numbers uniform on [0, 1), each from 53 bits of the operating system's cryptographic random
    source (`os.urandom`).

    Why not a seeded generator: what privacy's mechanism draws (the noise, the round's sample) must be unknown to
    anyone who knows the run's config, and the seed is in it. And why not a generator seeded from the OS either:
    torch's and NumPy's (Mersenne Twister, PCG64) are not built to hide their state, so values of theirs that leak
    (noise visible where no update moved an entry) could predict the rest; the OS's generator is cryptographic.
    """
    if n == 0:
        return np.empty(0)
    bits = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
    return bits.astype(np.float64) * 2.0**-53


# Stream tags, so that e.g. round 3 of client 5 never collides with the fine-tuning stream of client 5.
CLIENT, INIT, FINETUNE, NEWCLIENT, SITE, PRIVACY, GLOBAL = 1, 2, 3, 4, 5, 6, 7
