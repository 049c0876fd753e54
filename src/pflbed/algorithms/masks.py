"""Entry-level binary masks: packing for the wire, count-masked averaging, top-p growth, overlap (IoU), and which
tensors may hold personal entries.

Shared pieces for methods that personalize individual *entries* of a tensor rather than whole layers (FedSelect).
Only functions live here: `pflbed.algorithms` imports every module of the package to register algorithms, so this
module must import cleanly and define no `Algorithm`.

Conventions: a mask is a bool tensor shaped like its parameter, True = personal (kept on the client), False =
global (shared with the server). On the wire a mask travels as bits (`pack_bits`, 1/8 byte per entry, the layout of
`numpy.packbits`: big-endian bit order, zero padding) and a masked tensor as the flat vector of its selected entries
in row-major order (`take`), so that what crosses the network — and what the engine counts as communication — is
exactly the shared entries plus one bit per entry, and shrinks as masks grow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from pflbed.errors import ConfigError
from pflbed.models import BlockNet

Selection = Literal["largest", "smallest", "random"]

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device="cpu")
_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8, device="cpu")  # bit k of a byte is (byte >> 7 - k) & 1
_ON: dict[tuple[torch.device, int], torch.Tensor] = {}  # (device, id of a constant above) → its copy there


def _on(constant: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`constant` on `device`, copied there once per process.

    Why: a mask is packed or unpacked per tensor per client, thousands of times a round. A copy from the host's
    pageable memory to a GPU waits for the work queued before it, so one per call stalled the host on the device
    each time; a constant made per call is a kernel launch each time."""
    key = (device, id(constant))
    if key not in _ON:
        _ON[key] = constant.to(device)
    return _ON[key]


# --- wire format -------------------------------------------------------------------------------------------------
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor (any shape) as a flat uint8 tensor of ceil(n/8) bytes, identical to `numpy.packbits`.

    Done in torch (no numpy round trip) so it works on any device; the shape is not stored — both ends know it
    from the model.
    """
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _on(_BIT_WEIGHTS, flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, shape: Sequence[int] | torch.Size) -> torch.Tensor:
    """Inverse of `pack_bits`: the bool tensor of `shape` (padding bits dropped)."""
    n = math.prod(shape)
    if bits.dtype != torch.uint8 or bits.numel() != (n + 7) // 8:
        raise ValueError(f"packed mask of {bits.numel()} {bits.dtype} bytes does not fit shape {tuple(shape)}")
    flat = (bits.reshape(-1, 1) >> _on(_SHIFTS, bits.device)) & 1
    return flat.reshape(-1)[:n].to(torch.bool).reshape(tuple(shape))


def take(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """The entries of `values` where `where` is True, as a new flat (row-major) vector — what goes on the wire
    (boolean indexing copies: the result shares no memory with `values`)."""
    return values[where]


def fill(where: torch.Tensor, inside: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like `where` holding the flat `inside` at True entries and `outside` at False entries.

    `outside` may also be a full tensor of that shape (only its False entries are used). Sizes are checked, so a
    mask that disagrees with the values it is meant to place fails loudly instead of scrambling parameters.
    """
    n_in = int(where.sum())
    if inside.numel() != n_in:
        raise ValueError(f"{inside.numel()} values for {n_in} selected entries")
    if outside.shape == where.shape:
        out = outside.clone()
    else:
        if outside.numel() != where.numel() - n_in:
            raise ValueError(f"{outside.numel()} values for {where.numel() - n_in} unselected entries")
        out = torch.empty(where.shape, dtype=inside.dtype, device=inside.device).masked_scatter_(~where, outside)
    return out.masked_scatter_(where, inside)  # in row-major order, as indexing with `where` would place them


def any_each(masks: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each mask has a True entry, read from the device in one go.

    Why: a client's reply and state ask this of every eligible tensor's mask, before and after its growth; asked
    one tensor at a time, each answer is a wait for the device (thousands a round on a GPU)."""
    return torch.stack([m.any() for m in masks]).tolist() if masks else []


# --- aggregation -------------------------------------------------------------------------------------------------
def masked_mean(old: torch.Tensor, values: Sequence[torch.Tensor], shared: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per entry, the uniform mean of `values[i]` over the i whose `shared[i]` is True; `old` where none shares.

    FedSelect's server rule (Alg. 1: a sum and a count tensor ω, divided where ω ≠ 0). Uniform because a client
    contributes to an entry only while that entry is global for it — the paper weighs every contributing client
    equally, not by |D_m|. An entry every replying client keeps personal has no fresh value, so the server keeps the
    last one it had (what a client whose entry is still global, or a new client, then receives).
    """
    if len(values) != len(shared):
        raise ValueError("one sharing mask per value tensor")
    total = torch.zeros_like(old)
    count = torch.zeros(old.shape, dtype=old.dtype, device=old.device)
    for v, s in zip(values, shared, strict=True):
        total += torch.where(s, v, torch.zeros((), dtype=v.dtype, device=v.device))
        count += s
    return torch.where(count > 0, total / count.clamp(min=1), old)


# --- selection ---------------------------------------------------------------------------------------------------
def grow_mask(
    mask: torch.Tensor,
    delta: torch.Tensor,
    *,
    rate: float,
    limit: float,
    selection: Selection = "largest",
    cap: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """GradSelect's mask update for one tensor (Alg. 3): mark `rate` of the still-global entries personal.

    - A tensor whose personal fraction has reached `limit` (α) stops growing. The check comes before the growth, as
      in Alg. 3 ("if sparsity < α then grow") and the official code, so the last step may overshoot α — unless
      `cap`, which trims that step to ⌊α·n⌋ personal entries in all.
    - The number of new entries is ⌊rate·n_global + ½⌋ (round half up), chosen among global entries only, so masks
      only grow (Idx(v⁰) ⊆ Idx(v¹) ⊆ …).
    - `largest`: the entries that changed most (|Δ|, the paper's hypothesis); `smallest`: least changed (Table 3's
      "Personalize Least"); `random`: uniformly at random from `generator` (Table 3's "Random").
    Returns a new mask; the input is not modified.
    """
    n = mask.numel()
    n_personal = int(mask.sum())
    if n == 0 or n_personal >= limit * n - 1e-9:
        return mask.clone()
    candidates = (~mask).reshape(-1).nonzero().squeeze(1)
    k = math.floor(rate * candidates.numel() + 0.5)
    if cap:
        k = min(k, math.floor(limit * n + 1e-9) - n_personal)
    out = mask.clone().reshape(-1)
    if k <= 0:
        return out.reshape(mask.shape)
    if selection == "random":
        score = torch.rand(candidates.numel(), generator=generator, device="cpu")  # CPU draw: same on every device
    else:
        d = delta.reshape(-1)[candidates].abs()
        score = d if selection == "largest" else -d
    chosen = candidates[torch.topk(score, k, sorted=False).indices]
    out[chosen] = True
    return out.reshape(mask.shape)


# --- overlap -----------------------------------------------------------------------------------------------------
def iou(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a ∧ b| / |a ∨ b| of two masks; NaN when both are empty (no personal entry to compare)."""
    union = int((a | b).sum())
    return float("nan") if union == 0 else int((a & b).sum()) / union


def iou_matrix(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Pairwise IoU of flat masks (paper Fig. 4), as a float64 matrix; NaN where both masks are empty."""
    if not masks:
        return torch.zeros(0, 0, dtype=torch.float64, device="cpu")
    m = torch.stack([x.reshape(-1) for x in masks]).to(torch.float64)
    inter = m @ m.T
    sizes = m.sum(1)
    union = sizes[:, None] + sizes[None, :] - inter
    return torch.where(union > 0, inter / union.clamp(min=1), torch.full_like(inter, float("nan")))


def personal_fraction(mask: torch.Tensor) -> float:
    """Share of a mask's entries that are personal."""
    return float(mask.sum()) / max(mask.numel(), 1)


# --- which tensors may hold personal entries ---------------------------------------------------------------------
# Modules whose `weight` is a learned linear map: the tensors `eligible="weights"` may personalize.
WEIGHT_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
)  # fmt: skip


def eligible_keys(model: BlockNet, which: str, layers: str = "all") -> list[str]:
    """State keys of the tensors whose entries may become personal, chosen by module type and block, in model order.

    Raises `ConfigError` for an unknown block or a choice that leaves nothing to personalize.
    """
    if which == "weights":
        modules = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, WEIGHT_MODULES)]
        wanted = {f"{name}.weight" for name, mod in modules if isinstance(getattr(mod, "weight", None), nn.Parameter)}
    else:
        wanted = {k for k, p in model.named_parameters() if p.is_floating_point()}
    if layers != "all":
        if layers not in model.block_names():
            known = ", ".join(model.block_names())
            raise ConfigError(f"algorithm.layers: unknown block {layers!r}; the model has {known}")
        wanted &= set(model.state_keys([layers]))
    keys = [k for k in model.state_dict() if k in wanted]
    if not keys:
        raise ConfigError(f"algorithm.layers: block {layers!r} has no {which} tensor to personalize")
    return keys
