"""A trained run, loaded for use (`pflbed.load_run`, `pflbed personalize`; docs/guide/after-the-run.md).

A run directory holds what is needed: `config.yaml` rebuilds the run's data, federation and model (`engine.build.
prepare`), and `checkpoints/last.pt` holds the last checkpointed round's server and client states (the final ones
once the run is finished). From these: the generic model, each participating client's personal model, predictions
on raw samples (transformed as the run's loader transformed its own data: `DataSource.inputs`), and
personalization for a new client — the method's own (`Algorithm.personalize`: FedBasis learns its combination
weights and classifier, FedRoD-hyper starts from the head its hypernetwork generates, FedRep and FedPer train the
head…), or fine-tuning / a linear probe of the generic model.

Models come back as plain `torch.nn.Module`s in eval mode that take *transformed* inputs; `predict` takes raw ones.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, ClientData, Predictor
from pflbed.algorithms.training import finetune_epochs
from pflbed.config import SEED_MAX, Config, resolve_device
from pflbed.errors import PersonalizationDiverged, PflbedError
from pflbed.models import build_model
from pflbed.models.blocks import BlockNet
from pflbed.models.pretrained import MODEL_FILE, load_tensors, save_model
from pflbed.results.checkpoint import check_config, check_fits, checkpoint_path, load_checkpoint
from pflbed.results.rundir import read_config_tree, read_history, read_summary, require_run, run_config
from pflbed.writable import check_writable

Method = Literal["native", "ft", "lp"]
EPOCHS_MAX = 100_000  # as eval.new_clients.epochs
SUMMARY_FILE = "summary.json"


def _module(pred: Predictor) -> torch.nn.Module:
    """The predictor as a module of its own (`Predictor.module`)."""
    return pred.module()


def _labels(model: torch.nn.Module, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(x[i : i + batch_size]).argmax(1) for i in range(0, max(len(x), 1), batch_size)])


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((_labels(model, x) == y).float().mean()) if len(y) else float("nan")


class _Diverged(Exception):
    """One learning rate's personalization left a parameter non-finite in epoch `epoch`."""

    def __init__(self, epoch: int) -> None:
        super().__init__(epoch)
        self.epoch = epoch


@dataclass
class Personalized:
    """A model personalized for one new client, with how it was obtained.

    `epochs`: per epoch, its validation accuracy (when validation data was given); `selected_epoch`: the epoch kept
    (the best on validation, earliest on ties; the last without validation data); `zero_shot`: the model the
    personalization started from, unadapted (the method's zero-shot model for `native`, the generic model for ft /
    lp; None where the method has none: Local, FedPer, FedRep, … whose new clients start with untrained parts)."""

    model: torch.nn.Module
    run: TrainedRun | None
    method: str
    lr: float
    epochs: list[dict[str, float]]
    selected_epoch: int
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)
    zero_shot: torch.nn.Module | None = None

    def predict(self, x: np.ndarray | torch.Tensor, scale: float | None = None) -> np.ndarray:
        """Labels of raw samples (the run's native format; `scale`: their raw range if not the dataset's)."""
        if self.run is None:
            raise PflbedError("this personalized model was loaded without its run; pass transformed inputs to .model")
        return _labels(self.model, self.run.inputs(x, scale)).numpy()

    def accuracy(self, x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor, scale: float | None = None) -> float:
        """Accuracy on raw samples `x` with labels `y`."""
        return self._score(self.model, x, y, scale)

    def zero_shot_accuracy(self, x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor,
                           scale: float | None = None) -> float | None:  # fmt: skip
        """Accuracy of the unadapted start (`zero_shot`) on raw samples `x` with labels `y`; None without one."""
        return None if self.zero_shot is None else self._score(self.zero_shot, x, y, scale)

    def _score(self, model: torch.nn.Module, x: Any, y: Any, scale: float | None) -> float:
        """`model`'s accuracy on raw test samples `x` with labels `y`, both checked and named as the test set's."""
        assert self.run is not None
        labels = self.run.labels(y, "test y", len(x))
        if not len(labels):  # the accuracy of no samples is no number
            raise PflbedError("test x: no samples to score")
        return _accuracy(model, self.run.inputs(x, scale, "test x"), labels)

    def save(self, out: str | Path, force: bool = False) -> Path:
        """`out/model.pt` (state dict, architecture, input shape, classes) and `out/summary.json`, where
        `check_out` allows them."""
        out = Path(out)
        check_out(out, force)
        save_model(self.model, out, getattr(self.model, "zoo_name", None), self.info["input_shape"],
                   self.info["num_classes"])  # fmt: skip
        summary = {"method": self.method, "lr": self.lr, "selected_epoch": self.selected_epoch,
                   "epochs": self.epochs, "seconds": round(self.seconds, 3), **self.info}  # fmt: skip
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        return out


def check_out(out: Path, force: bool) -> None:
    """Refuse an `out` whose files a personalization's would replace without being asked to (`force`), and one whose
    files are never a personalization's to replace: a run's or a pretrained model's directory (its config.yaml),
    whose summary.json would become the personalization's. Other files in `out` (the new client's samples, say)
    stay: only model.pt and summary.json are written."""
    if out.exists() and not out.is_dir():
        raise PflbedError(f"--out {out}: is a file; give the directory to write {MODEL_FILE} and {SUMMARY_FILE} into")
    check_writable(out, f"--out {out}")
    if (out / "config.yaml").exists():
        raise PflbedError(f"--out {out}: is a run's or a pretrained model's directory (it has config.yaml), whose "
                          f"{SUMMARY_FILE} a personalization's would replace; choose another --out")  # fmt: skip
    held = [name for name in (MODEL_FILE, SUMMARY_FILE) if (out / name).exists()]
    if held and not force:
        raise PflbedError(f"--out {out}: holds a personalized model already ({', '.join(held)}); --force replaces "
                          "it")  # fmt: skip


def load_model(path: str | Path, run: TrainedRun | str | Path | None = None) -> torch.nn.Module:
    """A model saved by `Personalized.save` (`pflbed personalize --out`), in eval mode; it takes transformed
    inputs (`load_run(RUN).inputs(raw)`).

    A model of one of the zoo's architectures is rebuilt from the file alone. A method's own personal model that is
    not one (FedRoD's body with two heads, FedProto's prototypes, FedCP's policy, FedDBE's, GPFL's) is rebuilt from
    its `run` (a `TrainedRun` or its directory): the file holds tensors only, and the code that makes a module of
    them is the run's algorithm, never anything the file names (no unpickling)."""
    blob = _read_model(Path(path))
    if blob["architecture"] is not None:
        try:
            model = build_model(blob["architecture"], tuple(blob["input_shape"]), blob["num_classes"])
        except (KeyError, PflbedError, ValueError, RuntimeError) as e:  # a name no zoo has; shapes it cannot take
            why = "no model of the zoo" if isinstance(e, KeyError) else " ".join(str(e).split())[:120]
            raise PflbedError(f"{Path(path) / MODEL_FILE}: cannot rebuild its {blob['architecture']!r} model "
                              f"({why})") from None  # fmt: skip
    elif run is None:
        raise PflbedError(f"{path}: the model is a method's own personal model, not one of the zoo's architectures: "
                          "load it with its run (load_model(path, run=RUN_DIR))")  # fmt: skip
    else:
        run = run if isinstance(run, TrainedRun) else TrainedRun(run)
        model = run.personal_structure()
    try:
        model.load_state_dict(blob["state_dict"])
    except RuntimeError as e:  # another method's model, or another run's shapes
        first = str(e).strip().splitlines()[1:2] or [str(e)]
        raise PflbedError(f"{path}: its tensors do not fit the model rebuilt ({first[0].strip()})") from None
    return model.eval()


def _read_model(path: Path) -> dict[str, Any]:
    """The blob `save_model` wrote in `path`, its entries of their types; one line naming the file for anything
    else. A missing file, a truncated one, a checkpoint or a bare state dict saved as model.pt were FileNotFound,
    torch, Key and Index errors from inside `load_model`."""
    f = path / MODEL_FILE
    if path.is_file():
        raise PflbedError(f"{path}: is a file; give the directory holding {MODEL_FILE}")
    if not f.is_file():
        raise PflbedError(f"{path}: no {MODEL_FILE} in it; give the directory `pflbed personalize --out` (or "
                          f"`Personalized.save`) wrote")  # fmt: skip
    try:
        blob = load_tensors(f)
    except Exception as e:  # noqa: BLE001 — any unreadable file is the user's input error, said in one line
        raise PflbedError(f"{f}: not a readable model file ({type(e).__name__})") from None
    ok = isinstance(blob, dict) and isinstance(blob.get("state_dict"), dict) and "architecture" in blob
    arch, shape, classes = (blob.get(k) for k in ("architecture", "input_shape", "num_classes")) if ok else [None] * 3
    sized = isinstance(shape, list) and bool(shape) and all(type(d) is int and d > 0 for d in shape) and \
        type(classes) is int and classes > 1  # fmt: skip
    if not ok or not (arch is None or (isinstance(arch, str) and sized)):
        raise PflbedError(f"{f}: not a model pflbed saved (a mapping of its state_dict, architecture, input_shape "
                          "and num_classes)")  # fmt: skip
    return blob


class TrainedRun:
    """A run directory, loaded. `config`, `summary` (None while unfinished), `history` (metrics.jsonl), `round`
    (the checkpoint's)."""

    def __init__(self, path: str | Path, device: str | None = None) -> None:
        from pflbed.engine.build import prepare  # the engine builds what the run built

        self.path = Path(path)
        conf = require_run(self.path) / "config.yaml"
        if checkpoint_path(self.path).exists() and not checkpoint_path(self.path).is_file():
            raise PflbedError(f"{checkpoint_path(self.path)}: is a directory, not a checkpoint")  # "has none"
        if not checkpoint_path(self.path).is_file():
            raise PflbedError(f"{self.path}: has no checkpoint (the run stopped before its first checkpointed "
                              "round): nothing to load")  # fmt: skip
        tree = read_config_tree(conf)
        if device is not None:  # asked for: a device this machine lacks is an error, not the run's CPU fallback
            try:
                resolve_device(str(device))
            except ValueError as e:
                raise PflbedError(f"device {str(device)!r}: {e}") from None
            tree = {**tree, "executor": {**(tree.get("executor") or {}), "device": str(device)}}
        self.config: Config = run_config(tree, path=conf)  # a GPU run loads on the CPU where it has no GPU
        summary = self.path / "summary.json"
        self.summary: dict[str, Any] | None = read_summary(summary) if summary.is_file() else None
        metrics = self.path / "metrics.jsonl"
        self.history = read_history(metrics)
        self.algo: Algorithm = prepare(self.config) if not self.config.sites.local else self._without_data()
        saved = load_checkpoint(self.path, self.algo.ctx.device)
        assert saved is not None  # checked above
        check_fits(saved, self.algo, self.config.train.rounds, self.path)
        check_config(saved, self.config, self.path)
        self.round: int = saved["round"]
        self.server, self.states = saved["server"], saved["clients"]

    def _without_data(self) -> Algorithm:
        """A run whose data stayed on the sites (`sites.local`): the server's context, with no client data (and
        without the server's own test set, which the machine loading the run may not have)."""
        from pflbed.flower.sites import server_algorithm

        cfg = self.config.model_copy(update={"sites": self.config.sites.model_copy(update={"test": None})})
        return server_algorithm(cfg, [[1]] * cfg.federation.clients)  # sample counts: the server's means only

    @property
    def source(self):
        return self.algo.ctx.source

    def inputs(self, x: np.ndarray | torch.Tensor, scale: float | None = None, what: str = "x") -> torch.Tensor:
        """Raw samples → the model's inputs (`DataSource.inputs`), on the run's device."""
        return self.source.inputs(x, scale, what).to(self.algo.ctx.device)

    def generic_model(self) -> torch.nn.Module | None:
        """The model scored for G-FL (None for methods without one)."""
        pred = self.algo.generic_model(self.server)
        return None if pred is None else _module(pred)

    def personal_model(self, cid: int) -> torch.nn.Module:
        """Participating client `cid`'s personal model (the one scored for its P-FL)."""
        if not isinstance(cid, numbers.Integral) or isinstance(cid, bool):  # "3" was "client 3 did not participate"
            raise TypeError(f"cid: a client id (int), got {type(cid).__name__} {cid!r}")
        fed = self.algo.ctx.federation
        if self.config.sites.local:
            raise PflbedError(f"client {cid}'s personal model stayed on its site (sites.local): the run holds the "
                              "server's state only; a site personalizes it with its own data")  # fmt: skip
        if cid not in fed.participated:
            raise PflbedError(f"client {cid} did not participate in this run ({len(fed.participated)} clients did, "
                              f"{len(fed.new)} held out); personalize a model for a new client instead")  # fmt: skip
        state = self.states.get(cid)
        return _module(self.algo.personal_model(self.server, state if state is not None else
                                                self.algo.init_client(cid)))  # fmt: skip

    def personal_structure(self) -> torch.nn.Module:
        """A new client's personal model before any training: the module a saved personalized model's tensors are
        loaded into when it is not one of the zoo's architectures (`load_model`)."""
        cid = self._new_cid()
        return _module(self.algo.personal_model(self.server, self.algo.init_client(cid)))

    def predict(self, x: np.ndarray | torch.Tensor, cid: int | None = None, scale: float | None = None) -> np.ndarray:
        """Labels of raw samples by client `cid`'s personal model, or by the generic model."""
        model = self.personal_model(cid) if cid is not None else self.generic_model()
        if model is None:
            raise PflbedError(f"{self.config.algorithm.name} has no generic model: pass a client id")
        return _labels(model, self.inputs(x, scale)).numpy()

    def chosen_lr(self) -> float | None:
        """The new-client learning rate the run chose on validation (full-size data, fine-tuning), if it had new
        clients."""
        methods = ((self.summary or {}).get("new_clients") or {}).get("methods", {})
        chosen = methods.get("ft", {}).get("M", {}).get("lr_best")
        return float(chosen) if chosen is not None else None

    def personalize(
        self, x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor, *, method: Method = "native",
        epochs: int | None = None, lr: float | None = None, val: tuple[Any, Any] | None = None,
        scale: float | None = None, seed: int = 0,
    ) -> Personalized:  # fmt: skip
        """A personal model for a new client holding raw samples `x` with labels `y`.

        native: the method's own personalization (`Algorithm.personalize`, full budget); ft / lp: fine-tune all of
        the generic model / its head only. `epochs` defaults to the run's new-client epochs. `lr`: given, or the
        one the run chose on validation for new clients, or else — with `val` — each of the run's new-client grid
        (`eval.new_clients.lrs`), keeping the best on validation; without either, the grid's first. With `val` =
        (x, y), every epoch is scored on it and the best epoch is kept (earliest on ties)."""
        for name, value, kind in (("epochs", epochs, numbers.Integral), ("lr", lr, numbers.Real),
                                  ("seed", seed, numbers.Integral)):  # "3" failed deep in a comparison: TypeError
            if (value is not None or name == "seed") and (not isinstance(value, kind) or isinstance(value, bool)):
                raise TypeError(f"{name}: a {'whole ' if kind is numbers.Integral else ''}number, got "
                                f"{type(value).__name__} {value!r}")  # fmt: skip
        epochs, lr, seed = None if epochs is None else int(epochs), None if lr is None else float(lr), int(seed)
        if method not in ("native", "ft", "lp"):
            raise PflbedError(f"--method: unknown {method!r}; choose native, ft or lp")
        ctx = self.algo.ctx
        xs, ys = self.inputs(x, scale, "x"), self.labels(y, "y", len(x))
        if not len(ys):  # nothing to learn from: the model would come back untouched, as if personalized
            raise PflbedError("x: no samples to personalize from")
        if val is not None:
            if not isinstance(val, tuple | list) or len(val) != 2:
                raise PflbedError(f"val: expected (x, y), the validation samples and their labels; got "
                                  f"{type(val).__name__}{f' of {len(val)}' if isinstance(val, tuple | list) else ''}")
            xv, yv = self.inputs(val[0], scale, "val x"), self.labels(val[1], "val y", len(val[0]))
            if not len(yv):
                raise PflbedError("val x: no samples to choose an epoch on (leave out the validation set instead)")
        else:
            xv, yv = xs[:0], ys[:0]
        epochs = epochs if epochs is not None else self.config.eval.new_clients.epochs
        grid = self.config.eval.new_clients.lrs
        lrs = [lr] if lr is not None else [c] if (c := self.chosen_lr()) is not None else grid if len(yv) else grid[:1]
        if not 1 <= epochs <= EPOCHS_MAX:
            raise PflbedError(f"--epochs must be in 1…{EPOCHS_MAX:,} (got {epochs})")
        if not all(v > 0 and math.isfinite(v) for v in lrs):
            raise PflbedError(f"--lr must be a finite number > 0 (got {', '.join(f'{v:g}' for v in lrs)})")
        if not 0 <= seed <= SEED_MAX:
            raise PflbedError(f"--seed must be in 0…{SEED_MAX} (got {seed})")
        name = self.config.algorithm.name
        if method != "native" and (generic := self.algo.generic_model(self.server)) is None:
            raise PflbedError(f"{name} has no generic model to fine-tune: use --method native")
        if method != "native" and not isinstance(generic.model, BlockNet):  # GPFL's: with its conditional inputs
            raise PflbedError(f"{name}'s generic model is not one network of body and head to fine-tune or probe: "
                              "use --method native")  # fmt: skip
        n = len(ys)
        prior = torch.bincount(ys, minlength=self.source.num_classes).float()
        ids = torch.arange(n + len(yv), device=ctx.device)
        data = ClientData(self._new_cid(), torch.cat([xs, xv]), torch.cat([ys, yv]), ids[:n], ids[n:],
                          (prior / prior.sum()).to(ctx.device), ctx.augment)  # fmt: skip
        t0 = time.perf_counter()
        tried, diverged = [], {}
        for rate in lrs:  # an lr that diverges is not a candidate: a model of NaN still predicts some class
            try:
                tried.append((rate, *self._adapt(method, data, rate, epochs, seed, xv, yv)))
            except _Diverged as e:
                diverged[f"{rate:g}"] = e.epoch
        if not tried:
            where = ", ".join(f"lr {k} in epoch {v}" for k, v in diverged.items())
            raise PersonalizationDiverged(f"personalizing diverged ({where}): a parameter is not finite — lower --lr")
        rate, model, history, selected, score = max(tried, key=lambda t: t[4])  # earliest lr on ties
        seconds = time.perf_counter() - t0
        start = self.algo.zero_shot(self.server, data) if method == "native" else self.algo.generic_model(self.server)
        zero_shot = _module(start) if start is not None else None  # where personalization started, unadapted
        info = {"run": str(self.path), "algorithm": self.config.algorithm.name, "samples": n, "val_samples": len(yv),
                "input_shape": list(self.source.input_shape), "num_classes": self.source.num_classes}  # fmt: skip
        if len(lrs) > 1:  # the best-epoch validation accuracy of each lr; None for one that diverged
            info["lr_val"] = {f"{v:g}": next((t[4] for t in tried if t[0] == v), None) for v in lrs}
        if diverged:
            info["diverged"] = diverged  # lr → the epoch its parameters stopped being finite
        return Personalized(model, self, method, rate, history, selected, seconds, info, zero_shot)

    def _adapt(self, method: str, data: ClientData, lr: float, epochs: int, seed: int, xv: torch.Tensor,
               yv: torch.Tensor) -> tuple[torch.nn.Module, list[dict[str, float]], int, float]:  # fmt: skip
        """One personalization: (the kept model, per-epoch history, its epoch, its validation accuracy)."""
        t = self.config.train
        budget = Budget.of("ft" if method == "native" else method, epochs, lr, t)
        gen = torch.Generator().manual_seed(seed)
        if method == "native":
            steps = self.algo.personalize(self.server, data, budget, gen)
        else:
            generic = self.algo.generic_model(self.server)
            assert generic is not None  # checked by the caller
            steps = finetune_epochs(generic.model, generic.params, data, budget, gen)  # a BlockNet: checked
        history, best, best_val, selected = [], None, -1.0, 0
        with rng.global_from(gen, self.algo.ctx.device):  # dropout masks from the seed too (`rng.global_from`)
            for e, pred in enumerate(steps, 1):
                if not all(bool(torch.isfinite(p).all()) for p in pred.params.values() if p.is_floating_point()):
                    raise _Diverged(e)
                model = _module(pred)
                acc = _accuracy(model, xv, yv)
                history.append({"epoch": e, "val_acc": acc} if len(yv) else {"epoch": e})
                if best is None or (len(yv) and acc > best_val) or not len(yv):
                    best, best_val, selected = model, acc, e
        assert best is not None
        return best, history, selected, best_val

    def labels(self, y: Any, what: str, n: int) -> torch.Tensor:
        """`n` integer labels of this run's classes, checked (`what` names them in errors)."""
        raw = np.asarray(y)
        if raw.dtype.kind not in "biuf":  # text or objects: torch's own error named its dtypes, not the labels
            raise PflbedError(f"{what}: labels must be integers (got {raw.dtype} values)")
        labels = torch.as_tensor(raw)
        k = self.source.num_classes
        if labels.ndim != 1 or len(labels) != n:
            raise PflbedError(f"{what}: expected {n} labels (one per sample), got shape {list(labels.shape)}")
        if labels.dtype.is_floating_point and not bool((torch.isfinite(labels) & (labels == labels.round())).all()):
            # an infinite label equals its rounding: it became int64's minimum, "labels must be in 0…9, got -922…"
            raise PflbedError(f"{what}: labels must be integers")
        labels = labels.long()
        if n and (int(labels.min()) < 0 or int(labels.max()) >= k):
            raise PflbedError(f"{what}: labels must be in 0…{k - 1} ({self.source.name} has {k} classes), got "
                              f"{int(labels.min())}…{int(labels.max())}")  # fmt: skip
        return labels.to(self.algo.ctx.device)

    def _new_cid(self) -> int:
        """The id a new client takes: the run's first held-out client, else its last client (heterogeneous methods
        pick the new client's architecture from it)."""
        fed = self.algo.ctx.federation
        return fed.new[0] if fed.new else len(fed.clients) - 1


def load_run(path: str | Path, device: str | None = None) -> TrainedRun:
    """Load the run in directory `path` (see `TrainedRun`) onto `device` (cpu, cuda, cuda:N, auto); unset: the
    run's own device where this machine has it, else the CPU. A `device` this machine does not have is refused.
    """
    return TrainedRun(path, device)
