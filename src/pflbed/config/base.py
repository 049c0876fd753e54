"""What every section of the config shares: the numeric bounds, the strict base model (an unknown key, a non-finite
float or one beyond float32 is refused), and the same bounds for free-form numbers (an algorithm's options)."""

from __future__ import annotations

import math
import os
from typing import Annotated, Any, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

from pflbed.errors import ConfigError

# Bounds every numeric field shares (docs/guide/configuration.md): floats must be finite, and counts must fit the int32
# index range — a batch larger than any dataset is one batch anyway, and larger values overflow inside torch.
INT_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # seeds feed NumPy's SeedSequence (non-negative) and torch.manual_seed (< 2**64)
# Generated samples × their size: 4 GiB of float32 (CIFAR-10's size is 2**27.5; 100 clients × 500 samples at
# 3×64×64, ImageNet-style, with their validation and test samples 2**29.5)
SYNTHETIC_MAX_VALUES = 2**30
FLOAT_MAX = 3.4e38  # tensors are float32: an lr or coefficient beyond its range overflows inside torch


def _distinct(seeds: list[int]) -> list[int]:
    if len(set(seeds)) < len(seeds):
        raise ValueError("each seed once: a repeated seed reruns the same run and counts it twice in mean ± std")
    return seeds


Seeds = Annotated[list[Annotated[int, Field(ge=0, le=SEED_MAX)]], Field(min_length=1), AfterValidator(_distinct)]
"""A suite's seeds: each a run seed, each once (its mean ± std is over distinct runs)."""


def max_threads() -> int:
    """Upper bound of `executor.threads`: four per core. More only oversubscribes (and huge counts crash torch)."""
    return 4 * (os.cpu_count() or 1)


def number_error(x: Any) -> str | None:
    """What is wrong with a number under the shared bounds (None: nothing); the caller adds "(got …)"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "must be a finite number"
    if isinstance(x, float) and abs(x) > FLOAT_MAX:
        return f"must be within float32's range, ±{FLOAT_MAX:g}"
    if isinstance(x, int) and abs(x) > INT_MAX:  # a bool is an int, within any bound
        return f"must be at most {INT_MAX} in magnitude"
    return None


class Numbers(BaseModel):
    """A model whose number fields refuse true and false (and YAML's yes, on, True): pydantic took them for 1 and 0,
    so `--set train.rounds=true` ran one round, `train.lr: on` trained at 1.0 and a suite's `seeds: [true]` ran
    seed 1, silently."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and boolean_for_a_number(field.annotation, v):
            raise ValueError("must be a number, not a boolean")
        return v


class Strict(Numbers):
    """A config section: unknown keys are refused, so a typo never passes as a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _float32(cls, v: Any) -> Any:
        """Floats within float32's range (integers have their own per-field bounds: seeds go up to 2⁶³ − 1)."""
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, float) and (error := number_error(x)):
                raise ValueError(error)
        return v


def boolean_for_a_number(annotation: Any, value: Any) -> bool:
    """Whether `value` (or an item or a value of it) is a boolean given to a field of type `annotation` that takes
    numbers and no boolean."""
    items = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
    return any(isinstance(x, bool) for x in items) and _numbers_only(annotation)


def _numbers_only(annotation: Any) -> bool:
    """Whether a field's type takes numbers and no boolean anywhere (`int`, `float | None`, `list[int]`, …)."""
    kinds, todo = set(), [annotation]
    while todo:
        t = todo.pop()
        args = get_args(t)
        if args:
            todo.extend(a for a in args if not isinstance(a, int | float | str | FieldInfo))  # Annotated's extras
            todo.append(get_origin(t))
        else:
            kinds.add(t)
    return bool(kinds & {int, float}) and bool not in kinds


def check_numbers(tree: dict[str, Any], prefix: str) -> None:
    """The shared bounds for every algorithm's options (each algorithm adds its own lower bounds): floats finite and
    within float32's range, integers within the int32 range. Checked here once, so a new algorithm gets them
    without writing them."""
    for key, v in tree.items():
        field = f"{prefix}{key}"
        values = v if isinstance(v, list) else [v]
        for x in values:
            if isinstance(x, dict):
                check_numbers(x, f"{field}.")
            elif error := number_error(x):
                raise ConfigError(f"{field}: {error} (got {x!r})")
