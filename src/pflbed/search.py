"""Search spaces: the hyperparameters worth tuning, declared where the options live (`pflbed tune`).

An option model (an algorithm's `Config`, or `TrainConfig` for the shared `train.*` keys) lists its tunable fields
in a class attribute `search: ClassVar[dict[str, Space]]` beside the fields themselves:

    class FedProxOptions(BaseModel):
        search: ClassVar[dict[str, Space]] = {"mu": Search(1e-4, 1.0, log=True)}
        mu: float = Field(0.01, ge=0, ...)

A `Space` is `Search(low, high, log=False)` (float), `IntSearch(low, high, log=False)` or `Choice([...])`. A tune
suite narrows or extends a method's space with the same three forms in YAML (`parse_space`). This module imports
no search library: `suggest` calls the `suggest_float` / `suggest_int` / `suggest_categorical` methods of the trial
it is given (Optuna's), so the declarations cost the core nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pflbed.errors import ConfigError


@dataclass(frozen=True)
class Search:
    """A float in [low, high], uniform or (`log`) log-uniform."""

    low: float
    high: float
    log: bool = False

    def __post_init__(self) -> None:
        _check_range(self.low, self.high, self.log)

    def suggest(self, trial: Any, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high, log=self.log)

    def text(self) -> str:
        return f"{'log-uniform' if self.log else 'uniform'} [{self.low:g}, {self.high:g}]"


@dataclass(frozen=True)
class IntSearch:
    """An integer in [low, high] (both included), uniform or (`log`) log-uniform."""

    low: int
    high: int
    log: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.low, int) and isinstance(self.high, int)):
            raise ValueError("an integer range needs integer low and high")
        _check_range(self.low, self.high, self.log)

    def suggest(self, trial: Any, name: str) -> int:
        return trial.suggest_int(name, self.low, self.high, log=self.log)

    def text(self) -> str:
        return f"int{' log' if self.log else ''} [{self.low}, {self.high}]"


_NONE = object()  # no offending option found (None is an option)


@dataclass(frozen=True)
class Choice:
    """One of a few values (numbers, strings, booleans or None)."""

    options: tuple[Any, ...]

    def __init__(self, options: list[Any] | tuple[Any, ...]) -> None:
        if not isinstance(options, list | tuple):  # a string was taken as its characters: "0.1" offered 0, . and 1
            raise ValueError(f"choices must be a list of options, got {type(options).__name__} {options!r}")
        if not options:
            raise ValueError("a choice needs at least one option")
        odd = next((o for o in options if o is not None and not isinstance(o, bool | int | float | str)), _NONE)
        if odd is not _NONE:  # Optuna stores numbers, strings, booleans and None alone
            raise ValueError(f"an option must be a number, a string, a boolean or null, got {type(odd).__name__} "
                             f"{odd!r}")  # fmt: skip
        object.__setattr__(self, "options", tuple(options))

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_categorical(name, list(self.options))

    def text(self) -> str:
        return "one of " + ", ".join(repr(o) for o in self.options)


Space = Search | IntSearch | Choice


def _check_range(low: float, high: float, log: bool) -> None:
    if not low <= high:
        raise ValueError(f"low {low} must not exceed high {high}")
    if log and low <= 0:
        raise ValueError(f"a log range needs low > 0, got {low}")


def same_as(key: str) -> dict[str, str]:
    """A field's `json_schema_extra` for an option whose `None` means "the value of config key `key`" (`head_lr`
    None = `train.lr`). Why declare it: `pflbed tune`'s first trial runs the default configuration, and a
    `None` default lies in no search space, so without the source it would be drawn and the trial would not be the
    default; `sources` lets the tuner fill it in."""
    return {"same_as": key}


def sources(model: type[BaseModel]) -> dict[str, str]:
    """field → the config key its `None` stands for (`same_as`), for the option model `model`."""
    return {name: f.json_schema_extra["same_as"] for name, f in model.model_fields.items()
            if isinstance(f.json_schema_extra, dict) and "same_as" in f.json_schema_extra}  # fmt: skip


def declared(model: type[BaseModel]) -> dict[str, Space]:
    """The search space a model declares (empty if none)."""
    return dict(getattr(model, "search", None) or {})


def parse_space(value: Any, where: str) -> Space:
    """A space from its YAML form: `{low, high[, log][, int]}` or `{choices: [...]}`, or a list (a choice)."""
    if isinstance(value, list):
        value = {"choices": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: give {{low: L, high: H[, log: true][, int: true]}} or {{choices: [...]}}")
    keys = set(value)
    try:
        if keys == {"choices"}:
            return Choice(value["choices"])
        if {"low", "high"} <= keys <= {"low", "high", "log", "int"}:
            if any(not isinstance(value.get(k, False), bool) for k in ("log", "int")):  # bool("no") is True
                raise ValueError("log and int must be true or false")
            log, is_int = value.get("log", False), value.get("int", False)
            low, high = value["low"], value["high"]
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)):
                raise ValueError("low and high must be numbers")
            return IntSearch(low, high, log) if is_int else Search(float(low), float(high), log)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None
    raise ConfigError(f"{where}: unknown keys {sorted(keys)}; give {{low: L, high: H[, log: true][, int: true]}} "
                      "or {choices: [...]}")  # fmt: skip


def check_declared(model: type[BaseModel], where: str) -> None:
    """Every name `model.search` declares is a field of `model` (a declaration may not outlive a rename)."""
    for name in declared(model):
        if name not in model.model_fields:
            raise ConfigError(f"{where}.search: {name!r} is not an option of {model.__name__}")
