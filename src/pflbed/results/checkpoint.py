"""Checkpoints: everything a run needs to continue bit-identically, as tensors and plain values.

Client randomness is derived from (seed, round, client id) and client sampling from (seed, round), so no RNG
state has to be saved: the server state, the client states, the round and the metrics so far are enough. The
file holds only tensors, strings and numbers, so it loads with `torch.load(..., weights_only=True)`.

The client states are packed into one buffer (`engine.packed`, `_pack_states`): a run checkpoints after every
evaluation, and `torch.save` of 10,000 clients' states one tensor at a time took longer than the evaluation.
Format 1 (states as dicts of tensors, before packing) is still read: a run checkpointed by an earlier version
continues.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import torch

from pflbed.algorithms.base import Algorithm, Tensors
from pflbed.config import Config
from pflbed.engine.packed import Packed, pack, unpack
from pflbed.errors import PflbedError
from pflbed.private_files import private_dir, save_private
from pflbed.results.rundir import PLACEMENT, config_record
from pflbed.rng import fork

_FORMAT = 2


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.pt"


def save_checkpoint(
    run_dir: Path, rnd: int, server: dict[str, torch.Tensor], states: dict[int, dict[str, torch.Tensor]],
    history: list[dict[str, Any]], timing: dict[str, float], extra: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    path = checkpoint_path(run_dir)
    private_dir(path.parent)  # it holds client states: private, as a node's state files
    blob = {
        "format": _FORMAT, "round": rnd, "server": _on_cpu(server), "clients": _pack_states(states),
        "history": json.dumps(history), "timing": json.dumps(timing), "extra": json.dumps(extra or {}),
    }  # fmt: skip
    save_private(blob, path)  # atomic: a kill mid-write leaves the previous checkpoint intact


def _pack_states(states: dict[int, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The client states as one buffer of distinct tensors (`engine.packed`) and, as JSON, each tensor's layout and
    each client's references into them (one string loads at once; `weights_only`'s unpickler takes 45 µs per
    tuple). A tensor held by several clients (the initial state of clients never sampled yet) is stored once, and
    shared again when loaded, as `torch.save` does: 10,000 untrained clients do not make 10,000 copies."""
    distinct: dict[tuple, int] = {}
    tensors: dict[str, torch.Tensor] = {}
    refs = {}
    for cid, state in states.items():
        refs[str(cid)] = ref = {}
        for k, v in state.items():
            same = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride(), v.dtype, v.device)
            if same not in distinct:
                distinct[same] = len(tensors)
                tensors[str(len(tensors))] = v
            ref[k] = distinct[same]
    packed = pack(tensors)
    layout = [(str(dtype).removeprefix("torch."), shape, stride, at) for _, dtype, shape, stride, at in
              packed.layouts[0]]  # fmt: skip
    return {"buffer": packed.buffer, "layout": json.dumps(layout), "refs": json.dumps(refs)}


def _unpack_states(blob: dict[str, Any], device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
    def dtype(name: str) -> torch.dtype:
        if not isinstance(found := getattr(torch, name, None), torch.dtype):
            raise ValueError(f"not a dtype: {name[:20]}")
        return found

    layout = [(str(i), dtype(d), tuple(shape), tuple(stride), int(at)) for i, (d, shape, stride, at) in
              enumerate(json.loads(blob["layout"]))]  # fmt: skip
    tensors = list(unpack(Packed(blob["buffer"], [layout]), device)[0].values())
    return {int(c): {k: tensors[i] for k, i in ref.items()} for c, ref in json.loads(blob["refs"]).items()}


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints hold CPU tensors: a run saved on a GPU resumes on any device (`load_checkpoint`'s `device`)."""
    return {k: v.cpu() for k, v in tensors.items()}


def checkpoint_round(run_dir: Path) -> int | None:
    """The round of `run_dir`'s last checkpoint, read without loading its tensors (memory-mapped); None where
    there is none or it cannot be read."""
    try:
        return int(torch.load(checkpoint_path(run_dir), mmap=True, weights_only=True)["round"])
    except Exception:
        return None


def load_checkpoint(run_dir: Path, device: torch.device | str = "cpu") -> dict[str, Any] | None:
    """The last checkpoint of `run_dir` (None: none yet), its tensors on `device`, the resumed run's device."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if blob.get("format") not in (1, _FORMAT):
            raise ValueError(f"format {blob.get('format')}")
        server = {k: v.to(device) for k, v in blob["server"].items()}
        if blob["format"] == 1:
            clients = {int(c): {k: v.to(device) for k, v in s.items()} for c, s in blob["clients"].items()}
        else:
            clients = _unpack_states(blob["clients"], torch.device(device))
        rnd, history, timing, extra = blob["round"], *(json.loads(blob[k]) for k in ("history", "timing", "extra"))
        if type(rnd) is not int or rnd < 1:
            raise ValueError(f"round {str(rnd)[:20]}")
        if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
            raise ValueError("history is not a list of records")
        if not isinstance(timing, dict) or not all(type(v) in (int, float) for v in timing.values()):
            raise ValueError("timing is not a mapping of seconds")
        if not isinstance(extra, dict) or not isinstance(extra.get("per_client", {}), dict):
            raise ValueError("extra is not a mapping")
    except Exception as e:
        reason = " ".join(str(e).split())[:80]
        raise PflbedError(f"{path}: unreadable checkpoint ({type(e).__name__}: {reason}); {_advice(run_dir)}") from None
    return {"round": rnd, "server": server, "clients": clients, "history": history, "timing": timing, "extra": extra}


def _advice(run_dir: Path) -> str:
    """What to do about a checkpoint that cannot serve: start over, or rerun a finished run."""
    if (run_dir / "summary.json").is_file():  # a finished run: its trained models were in it, --resume has none
        again = shlex.join(["pflbed", "run", "-c", str(run_dir / "config.yaml"), "--out", str(run_dir), "--force"])
        return f"the finished run's models were in it: run it again with '{again}'"
    return (f"to start the run over, delete that file and run 'pflbed run --resume {run_dir}' again (or rerun it "
            "with --force)")  # fmt: skip


def check_config(saved: dict[str, Any], cfg: Config, run_dir: Path) -> None:
    """Refuse a run whose config.yaml was edited after its checkpoint was written, naming the first key changed
    (called after `check_fits`, whose message names a checkpoint copied from another run).
    A checkpoint that still fits (`check_fits`) went on under the edited config: FedAvg's rounds resumed as
    FedProx's, another seed's federation, more rounds, and the summary named the edited config as the whole run's.
    Keys only one side has are not compared: a run written before a key was added (or after one was removed)
    continues. A checkpoint from before checkpoints kept their config is not checked."""
    then = saved["extra"].get("config")
    if not isinstance(then, dict):
        return
    changed = _first_change(then, config_record(cfg))
    if changed is not None:
        key, was, now = changed
        raise PflbedError(f"{run_dir / 'config.yaml'}: not the config the run's checkpoint (round "
                          f"{saved['round']}) was written with: {key} is {_shown(now)}, was {_shown(was)}; only "
                          f"executor.{', executor.'.join(PLACEMENT)} and the files' locations may change: restore "
                          "it")  # fmt: skip


def _first_change(then: dict[str, Any], now: dict[str, Any], prefix: str = "") -> tuple[str, Any, Any] | None:
    for key in (k for k in then if k in now):  # in the config's order: one message for one edit, every time
        a, b = then[key], now[key]
        if isinstance(a, dict) and isinstance(b, dict):
            if (inner := _first_change(a, b, f"{prefix}{key}.")) is not None:
                return inner
        elif a != b:
            return f"{prefix}{key}", a, b
    return None


def _shown(value: Any) -> str:
    return " ".join(json.dumps(value).split())[:60]


def check_fits(saved: dict[str, Any], algo: Algorithm, rounds: int, run_dir: Path) -> None:
    """Refuse, in one line naming the file, a checkpoint that the run's own config did not write: one copied from
    another run, or a config edited since. Loading it would fail deep inside the model (a tensor of another
    shape, a missing parameter) or, worse, go on from a round the config does not have. The run's fresh states
    are its reference: every entry of `init_server()` and of each checkpointed client's `init_client` must be
    there with the same shape and kind (entries added by training, as some algorithms' servers keep, are free);
    every checkpointed client must be one of the federation's; the round at most `rounds`. A site-local run's
    checkpoint holds no client's state (its sites keep them): its clients' entries are not compared."""
    path = checkpoint_path(run_dir)

    def misfit(got: Tensors, want: Tensors, what: str) -> str | None:
        for k, v in want.items():
            if k not in got:
                return f"{what} has no {k!r}"
            if tuple(got[k].shape) != tuple(v.shape) or got[k].is_floating_point() != v.is_floating_point():
                return f"{what}'s {k!r} is {_kind(got[k])} where the run's set-up makes {_kind(v)}"
        return None

    why = None
    if saved["round"] > rounds:
        why = f"it is at round {saved['round']}, after the config's last round ({rounds})"
    clients = set(algo.ctx.federation.participated)
    on_sites = algo.ctx.cfg.sites.local  # a site-local run's states stay on the sites: here, each one's version only
    with fork(algo.ctx.device):  # an initial state drawn at random: the run's own streams stay untouched
        why = why or misfit(saved["server"], algo.init_server(), "the server state")
        for cid, state in saved["clients"].items():
            if why:
                break
            if cid not in clients:
                why = f"it holds a state for client {cid}, which the federation does not have"
            elif not on_sites:
                why = misfit(state, algo.init_client(cid), f"client {cid}'s state")
    if why:
        raise PflbedError(f"{path}: the checkpoint does not fit the run's config ({why}: another run's checkpoint, "
                          f"or a config changed since?); {_advice(run_dir)}")  # fmt: skip


def _kind(t: torch.Tensor) -> str:
    return f"{'float' if t.is_floating_point() else 'integer'} {list(t.shape)}"
