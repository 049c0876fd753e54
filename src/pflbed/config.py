"""Typed run configuration: YAML file + `--set key=value` overrides, validated before anything runs.

Validation errors become a single `ConfigError` line naming the dotted field (`train.lr: ...`), so a typo never
turns into a traceback or a half-written run directory. Algorithm-specific keys live under `algorithm` and are
validated by the algorithm's own `Config` model once the name is known.
"""

from __future__ import annotations

import importlib.util
import math
import os
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pflbed.errors import ConfigError
from pflbed.hints import closest, did_you_mean, then
from pflbed.search import IntSearch, Search, Space

if TYPE_CHECKING:
    import torch

# Bounds every numeric field shares (docs/guide/configuration.md): floats must be finite, and counts must fit the int32
# index range — a batch larger than any dataset is one batch anyway, and larger values overflow inside torch.
INT_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # seeds feed NumPy's SeedSequence (non-negative) and torch.manual_seed (< 2**64)
SYNTHETIC_MAX_VALUES = 2**28  # generated samples × their size: 1 GiB of float32 (CIFAR-10's size is 2**27.5)
FLOAT_MAX = 3.4e38  # tensors are float32: an lr or coefficient beyond its range overflows inside torch


def max_threads() -> int:
    """Upper bound of `executor.threads`: four per core. More only oversubscribes (and huge counts crash torch)."""
    return 4 * (os.cpu_count() or 1)


def _number_error(x: Any) -> str | None:
    """What is wrong with a number under the shared bounds (None: nothing); the caller adds "(got …)"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "must be a finite number"
    if isinstance(x, float) and abs(x) > FLOAT_MAX:
        return f"must be within float32's range, ±{FLOAT_MAX:g}"
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > INT_MAX:
        return f"must be at most {INT_MAX} in magnitude"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _float32(cls, v: Any) -> Any:
        """Floats within float32's range (integers have their own per-field bounds: seeds go up to 2⁶³ − 1)."""
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, float) and (error := _number_error(x)):
                raise ValueError(error)
        return v


class SyntheticConfig(_Strict):
    """`dataset.name: synthetic`: Gaussian classes of any input shape (`data.synthetic`). Sized like a real
    benchmark (3×32×32, 10 classes, 50,000 samples: CIFAR-10's compute, no download) it measures speed."""

    shape: list[int] = Field(default_factory=lambda: [1, 8, 8], min_length=1, description="input shape: [3, 32, 32]")
    num_classes: int = Field(10, ge=2, le=INT_MAX, description="classes of the generated data")
    n_train: int = Field(2000, ge=2, le=INT_MAX, description="training pool size (partitioned among the clients)")
    n_test: int = Field(500, ge=2, le=INT_MAX, description="global test set size (class-balanced)")
    separation: float = Field(2.0, ge=0, description="distance between class means, in noise standard deviations / 2")

    @field_validator("shape")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(s < 1 or s > INT_MAX for s in v):
            raise ValueError("every size must be at least 1")
        return v

    @model_validator(mode="after")
    def _fits(self) -> SyntheticConfig:
        if (self.n_train + self.n_test) * math.prod(self.shape) > SYNTHETIC_MAX_VALUES:
            raise ValueError(f"(n_train + n_test) × the shape's size must be at most {SYNTHETIC_MAX_VALUES:,} values "
                             "(1 GiB of float32)")  # fmt: skip
        return self


class HfConfig(_Strict):
    """`dataset.name: hf`: a Hugging Face dataset read with the `datasets` library (the `hf` extra), offline only:
    from a `save_to_disk` directory (`dataset.path`, or `id` naming one) or the Hugging Face cache (`data.hf`)."""

    id: str | None = Field(None, min_length=1, description="the dataset's Hub id (read from the Hugging Face cache) "
                           "or a local directory (save_to_disk output, or data files)")  # fmt: skip
    subset: str | None = Field(None, min_length=1, description="the dataset's configuration name, where it has several")
    splits: list[str] = Field(
        default_factory=lambda: ["train", "test"], min_length=1, max_length=2,
        description="[train split, test split]: the split partitioned into clients and the global test split; one "
        "name: no test split (federation.protocol pflbed)",
    )
    image_column: str = Field("image", min_length=1, description="images (PIL images or arrays of pixels)")
    label_column: str = Field("label", min_length=1, description="labels (ClassLabel, integers or strings)")
    user_column: str | None = Field(
        None, min_length=1, description="per-sample user ids (integers or strings): federation.partition natural"
    )
    image_size: int | None = Field(
        None, ge=1, le=4096, description="resize every image to this square size; unset: images must share one size"
    )
    normalize: list[float] = Field(
        default_factory=lambda: [0.5, 0.5], min_length=2, max_length=2,
        description="[mean, std]: x = (pixel / 255 − mean) / std (float arrays: pixel already in [0, 1])",
    )

    @field_validator("normalize")
    @classmethod
    def _std(cls, v: list[float]) -> list[float]:
        if v[1] <= 0:
            raise ValueError("the std (second value) must be > 0")
        return v

    @field_validator("splits")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or not all(v):
            raise ValueError("two different, non-empty split names: [train, test] (or one: [train])")
        return v


class DatasetConfig(_Strict):
    name: Literal[
        "fmnist", "digits", "synthetic", "fmnist-rot4", "digits-rot4", "folder",
        "cifar10", "cifar100", "cifar10c", "mnist", "emnist", "femnist", "tinyimagenet", "miniimagenet",
        "officehome", "pacs", "domainnet", "hf",
    ] = Field("digits", description="the dataset (Datasets in the user guide; `pflbed data list` says which are "
                                    "found where)")  # fmt: skip
    path: str | None = Field(None, description="directory with the dataset files; overrides the look-up")
    download: bool = Field(False, description="download the official archive (checksum-verified) if no local copy "
                           "is found")  # fmt: skip
    label: Literal["fine", "coarse"] | None = Field(None, description="cifar100: fine (100 classes, default) or "
                                                    "coarse (20 superclasses)")  # fmt: skip
    corruptions: list[str] | None = Field(None, description="cifar10c: the corruptions (domains); default all 19")
    severity: int | None = Field(None, ge=1, le=5, description="cifar10c: corruption severity 1–5 (default 5)")
    split: Literal["byclass", "bymerge", "balanced", "letters", "digits", "mnist"] | None = Field(
        None, description="emnist: the split (default balanced)"
    )
    domains: list[str] | None = Field(
        None, description="transform domains, e.g. [rot0, rot90, rot180, rot270] or [clean, noise, blur, invert]"
    )
    image_size: int = Field(32, ge=1, le=4096, description="folder, officehome, pacs, domainnet: images are resized "
                            "to this square size")  # fmt: skip
    augment: list[Literal["crop", "flip"]] = Field(
        default_factory=list, description="training mini-batches of client data: crop (random crop with 4-pixel "
        "padding), flip (random horizontal flip); none or [] for no augmentation (pflbed.data.augment)"
    )
    normalize: Literal["symmetric", "imagenet"] = Field(
        "symmetric", description="folder datasets (folder, officehome, pacs, domainnet): pixels to [-1, 1] "
        "(symmetric) or standardized with ImageNet's channel mean/std (imagenet: for ImageNet-pretrained weights, "
        "with image_size 224)"
    )
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig, description="synthetic: its shape and sizes")
    hf: HfConfig = Field(default_factory=HfConfig, description="hf: which Hugging Face dataset, splits and columns")

    @model_validator(mode="after")
    def _check(self) -> DatasetConfig:
        if self.name == "hf":
            if self.hf.id is None and self.path is None:
                raise ValueError("dataset.name hf needs dataset.hf.id (a Hub id in the Hugging Face cache, or a local "
                                 "directory) or dataset.path (a save_to_disk directory)")  # fmt: skip
            if importlib.util.find_spec("datasets") is None:
                raise ValueError("dataset.name hf needs the hf extra: pip install 'pflbed[hf]'")
        return self


    @field_validator("augment", mode="before")
    @classmethod
    def _augment(cls, v: object) -> object:
        if v is None or v == "none":
            return []
        if isinstance(v, list) and len(set(map(str, v))) != len(v):
            raise ValueError("each of crop, flip at most once")
        return v


class ModelConfig(_Strict):
    name: str = Field("cnn", description="a model of the zoo (pflbed.models.MODELS)")
    channels_last: bool = Field(
        False, description="store conv weights channels-last (NHWC): faster convolutions on CPU, float results "
        "change by rounding, so opt-in (docs/guide/speed.md)"
    )
    init_from: str | None = Field(
        None, description="start from these weights instead of a random init: a `pflbed pretrain` output "
        "(its directory or model.pt), a model saved by `pflbed personalize --out`, a plain state dict (.pt), or for "
        "resnet18_imagenet a torchvision/timm ResNet-18 state dict (.pt/.pth; its classifier is replaced by the run's)"
    )
    init_blocks: list[str] = Field(
        default_factory=lambda: ["all"], min_length=1, description="what init_from loads: [all], [body], [head] "
        "or block names (e.g. [conv1, conv2]); the other blocks keep the seed's random init"
    )

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from pflbed.models import MODELS

        if v not in MODELS:
            raise ValueError(f"unknown model; known: {', '.join(sorted(MODELS))}")
        return v


class PflbedSplitConfig(_Strict):
    """PFLBED split of each domain (FedBasis paper §5): fractions of the domain's samples, clients per portion."""

    participated: float = Field(0.6, ge=0, le=1, description="PFLBED: share of each domain's clients that train")
    new: float = Field(0.2, ge=0, le=1, description="PFLBED: share of each domain's clients held out as new clients")
    val: float = Field(0.05, gt=0, le=1,
        description="PFLBED: share of each domain's pool kept as its shared validation set")
    test: float = Field(0.15, gt=0, le=1, description="PFLBED: share of each domain's pool kept as its shared test set")
    clients_per_domain: int = Field(20, ge=1, le=INT_MAX, description="PFLBED: clients per domain")
    new_clients_per_domain: int = Field(10, ge=0, le=INT_MAX, description="PFLBED: new clients per domain")

    @model_validator(mode="after")
    def _check(self) -> PflbedSplitConfig:
        total = self.participated + self.new + self.val + self.test
        if total > 1 + 1e-9:
            raise ValueError(f"participated + new + val + test = {total:g} exceeds 1")
        if self.participated <= 0:
            raise ValueError("participated must be > 0")
        if self.new_clients_per_domain > 0 and self.new <= 0:
            raise ValueError("new clients need new > 0")
        return self


class FederationConfig(_Strict):
    protocol: Literal["standard", "pflbed"] = Field(
        "standard",
        description="standard: partition the training split, per-client local test splits; pflbed: per-domain "
        "shared class-balanced val/test sets, participated and new clients per domain (federation.pflbed)",
    )
    pflbed: PflbedSplitConfig = Field(default_factory=PflbedSplitConfig)
    clients: int = Field(20, ge=1, le=INT_MAX, description="number of clients (standard protocol)")
    partition: Literal["iid", "dirichlet", "classes", "natural"] = Field(
        "dirichlet", description="natural: each user of the data (dataset.hf.user_column, a dataset's writers, else "
        "its domains) is one client; federation.clients of them are drawn (seeded)"
    )
    alpha: float = Field(0.3, gt=0, description="Dirichlet concentration (partition=dirichlet, and pflbed)")
    classes_per_client: int = Field(2, ge=1, le=INT_MAX, description="labels per client (partition=classes)")
    min_size: int = Field(10, ge=1, le=INT_MAX, description="minimum samples per client (partition=dirichlet)")
    min_samples: int = Field(10, ge=1, le=INT_MAX, description="partition=natural: users with fewer samples dropped")
    manifest: str | None = Field(
        None, min_length=1, description="a partition manifest (`pflbed data export`): run on its clients instead of "
        "partitioning; refused unless made from the same data"
    )
    sample_fraction: float = Field(1.0, gt=0, le=1, description="fraction of participated clients per round")
    sampling: Literal["fixed", "poisson"] | None = Field(
        None, description="how a round's clients are drawn: fixed (exactly round(sample_fraction × participated), "
        "without replacement) or poisson (each participated client independently with probability "
        "sample_fraction, as privacy's accountant assumes); default: poisson with privacy, fixed otherwise"
    )
    new_clients: int = Field(0, ge=0, le=INT_MAX, description="clients held out of training (evaluated as new clients)")
    public: int = Field(
        0, ge=0, le=INT_MAX,
        description="hold out this many training-pool samples as public (unlabelled) data, held by no client",
    )
    train_per_client: int | None = Field(
        None, ge=1, le=INT_MAX, description="keep at most this many training samples per client (e.g. FedSelect's 100)"
    )
    val_fraction: float = Field(0.1, ge=0, lt=1,
        description="each client's share of its samples kept as its validation split")
    test_fraction: float = Field(0.2, gt=0, lt=1,
        description="each client's share of its samples kept as its test split")

    @model_validator(mode="after")
    def _check(self) -> FederationConfig:
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must be < 1")
        if self.new_clients >= self.clients:
            raise ValueError("new_clients must leave at least one participated client")
        return self


class TrainConfig(_Strict):
    # tuned for every method by `pflbed tune` (pflbed.search)
    search: ClassVar[dict[str, Space]] = {"lr": Search(1e-3, 0.3, log=True), "local_epochs": IntSearch(1, 5),
                                          "momentum": Search(0.0, 0.9)}  # fmt: skip
    rounds: int = Field(30, ge=1, le=1_000_000, description="communication rounds")
    local_epochs: int = Field(1, ge=1, le=100_000, description="local epochs per round")
    batch_size: int = Field(32, ge=1, le=INT_MAX, description="client mini-batch size")
    lr: float = Field(0.05, gt=0, description="client SGD learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="client SGD momentum (restarts each round)")
    weight_decay: float = Field(0.0, ge=0, description="client SGD weight decay")
    checkpoint_every: int = Field(
        10, ge=0, le=INT_MAX, description="checkpoint every N rounds for --resume (0: only the final state)"
    )


class PretrainConfig(_Strict):
    """`pflbed pretrain`: centralized training on a declared source that no client and no evaluation of this
    config's federation uses (checked), for `model.init_from` (docs/guide/after-the-run.md, "Pretrained start")."""

    split: Literal["train", "test"] = Field("test", description="the dataset split the source is drawn from")
    domains: list[str] | None = Field(None, description="only samples of these domains (datasets with domains)")
    samples: int | None = Field(None, ge=1, le=INT_MAX, description="at most this many (a seeded draw; None: all)")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="held out of the source to pick the epoch kept")
    epochs: int = Field(10, ge=1, le=100_000,
        description="pflbed pretrain: epochs (the best on its validation share is kept)")
    batch_size: int = Field(64, ge=1, le=INT_MAX, description="pflbed pretrain: mini-batch size")
    lr: float = Field(0.01, gt=0, description="pflbed pretrain: SGD learning rate")
    momentum: float = Field(0.9, ge=0, lt=1, description="pflbed pretrain: SGD momentum")
    weight_decay: float = Field(5e-4, ge=0, description="pflbed pretrain: SGD weight decay")


class NewClientsConfig(_Strict):
    """The new-client protocol (FedBasis paper §5 / Table 2): personalize held-out clients after training."""

    methods: list[Literal["ft", "lp"]] = Field(default_factory=lambda: ["ft", "lp"],
        description="how new clients personalize: ft (fine-tune all) and / or lp (the head only)")
    fractions: list[float] = Field(
        default_factory=lambda: [0.5, 1.0], description="training-data fractions, reported as S, M, L"
    )
    epochs: int = Field(20, ge=1, le=100_000, description="new clients: personalization epochs")
    lrs: list[float] = Field(default_factory=lambda: [0.005, 0.01, 0.05], min_length=1,
        description="new clients: the learning rates tried, the best chosen on each client's validation data")
    zero_shot: bool = Field(True, description="also evaluate with no adaptation, where the method allows it")

    @model_validator(mode="after")
    def _check(self) -> NewClientsConfig:
        if not 1 <= len(self.fractions) <= 3 or any(not 0 < f <= 1 for f in self.fractions):
            raise ValueError("fractions: one to three values in (0, 1]")
        if any(lr <= 0 for lr in self.lrs):
            raise ValueError("lrs must be > 0")
        return self


class EvalConfig(_Strict):
    every: int = Field(5, ge=1, le=INT_MAX, description="evaluate every N rounds (the last round always)")
    pfl_test: Literal["local", "global"] = Field(
        "local",
        description="P-FL test data: the client's own test split, or the global balanced test set "
        "class-weighted by the client's training class distribution",
    )
    finetune: list[Literal["ft", "lp"]] = Field(
        default_factory=lambda: ["ft", "lp"],
        description="at the final round, also personalize the generic model per client: ft = full fine-tune, "
        "lp = linear probe (head only)",
    )
    ft_epochs: int = Field(1, ge=1, le=100_000, description="+FT / +LP after training: epochs")
    ft_lr: float = Field(0.01, gt=0, description="+FT / +LP after training: learning rate")
    batch_size: int = Field(
        256, ge=1, le=INT_MAX,
        description="most rows per inference forward; fewer for models whose widest activation would pass 8 MiB "
        "(pflbed.models.inference: measured fastest on CPU)",
    )
    test_subsample: int | None = Field(
        None, ge=1, le=INT_MAX,
        description="intermediate evaluations use at most this many shared-test samples per class",
    )
    new_clients: NewClientsConfig = Field(default_factory=NewClientsConfig)


class ExecutorConfig(_Strict):
    name: Literal["auto", "loop", "procs", "flower"] = Field(
        "auto", description="auto: the fastest of loop and procs for the run (engine.auto: batched loop on a GPU, "
        "procs on a multi-core CPU when the run's training outweighs the workers' start-up, loop otherwise; the "
        "figures are the same either way); loop: clients one after another in this process; procs: a round's "
        "clients in parallel worker processes (identical results at the same thread count per process); flower: "
        "clients as Flower ClientApps in Flower's simulation runtime (the `flower` extra)"
    )
    workers: int | None = Field(
        None, description="procs: worker processes; flower: ClientApp processes running at once; 1 to 4 × cores; "
        "unset: one per core"
    )
    supernodes: int | None = Field(
        None, ge=1, description="flower: simulated SuperNodes; node k serves the clients whose id is k modulo their "
        "number; unset: one per client"
    )
    round_timeout: float | None = Field(
        None, gt=0, description="flower: seconds a round waits for its replies; clients that have not replied by "
        "then (or whose node failed) are left out of the round and listed in its record's failed_clients; unset: "
        "wait for every reply"
    )
    state_dir: str | None = Field(
        None, min_length=1, description="flower: keep each client's state on its SuperNode, in files under this "
        "directory (or the node's state-dir node config), so a node that restarts continues its clients; states "
        "then travel only when the server evaluates or checkpoints. Unset: states stay with the server and travel "
        "with each round's messages"
    )
    strict: bool = Field(False, description="round-trip every payload, reply and client state through bytes")
    threads: int | None = Field(
        None,
        description="torch CPU threads (per process), 1 to 4 × cores; unset (auto): 1 for small models (measured "
        "fastest, and safe when several runs share the machine), all cores for large ones "
        "(engine.threads.choose_threads); procs workers: 1",
    )

    batch_clients: bool | None = Field(
        None, description="executor.name=loop: train a round's plain-SGD clients (FedAvg, FedPer, FedRep, LG-FedAvg, "
        "FedBABU on models without BatchNorm or dropout) together as one batched computation (engine.batched; equal "
        "to one by one up to float rounding); unset: on when executor.device is a GPU, off on CPU, where it is slower"
    )
    device: str = Field(
        "cpu", description="where the data, the models and every tensor of the run live: cpu, cuda (the current "
        "GPU), cuda:N or auto (cuda when available, else cpu); random draws stay on CPU generators"
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: forwards and backwards under torch.autocast in bfloat16 (parameters, optimizer "
        "updates and exchanged tensors stay float32) — faster on GPUs with bf16 tensor cores, and it changes "
        "results (docs/guide/gpu.md); fp32: plain float32"
    )
    deterministic: bool = Field(
        True, description="on a GPU: reproducible kernels (cuDNN, cuBLAS and torch's deterministic modes), so one "
        "config and seed give the same figures run after run; false: the faster defaults, whose figures vary by "
        "float rounding from run to run (docs/guide/gpu.md). No effect on a CPU"
    )

    @model_validator(mode="after")
    def _check(self) -> ExecutorConfig:
        if self.batch_clients and self.name not in ("loop", "auto"):
            raise ValueError("batch_clients applies to executor.name=loop or auto (batched clients run in the loop "
                             "executor)")  # fmt: skip
        for key in ("supernodes", "round_timeout", "state_dir"):
            if getattr(self, key) is not None and self.name != "flower":
                raise ValueError(f"{key} applies to executor.name=flower")
        if self.name == "flower" and importlib.util.find_spec("flwr") is None:
            raise ValueError("executor.name=flower needs the flower extra: pip install 'pflbed[flower]'")
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        resolve_device(v)  # refuse now (one config line) what `torch.device` would refuse mid-run
        return v

    @field_validator("threads", "workers")
    @classmethod
    def _per_core(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= max_threads():
            raise ValueError(f"must be unset (auto) or 1 to {max_threads()} (4 × this machine's cores)")
        return v


def resolve_device(name: str) -> torch.device:
    """`executor.device` as a `torch.device`: `auto` becomes `cuda` where CUDA is available, else `cpu`.

    Raises ValueError (a config error) for anything else than cpu / cuda / cuda:N / auto, and for a CUDA device this
    machine does not have — checked at validation, so a run never starts and then fails on its first tensor.
    """
    import torch  # late: reading or checking a config needs no torch until a device is asked for

    if name == "auto":
        return resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    kind, sep, index = name.partition(":")
    if kind != "cuda" or (sep and not (index.isascii() and index.isdigit())):
        raise ValueError("must be cpu, cuda, cuda:N (N = 0, 1, …) or auto")
    if not torch.cuda.is_available():
        raise ValueError("CUDA is not available on this machine; use cpu or auto")
    count = torch.cuda.device_count()
    if sep and int(index) >= count:
        raise ValueError(f"no such CUDA device: this machine has {count} (cuda:0 to cuda:{count - 1})")
    # with its index: tensors report `cuda:0`, never `cuda`, so only an indexed device compares equal to theirs
    return torch.device("cuda", int(index) if sep else torch.cuda.current_device())


class AlgorithmConfig(BaseModel):
    """`name` plus algorithm-specific keys, validated by the algorithm's own Config."""

    model_config = ConfigDict(extra="allow")
    name: str = "fedavg"


class LogConfig(_Strict):
    tensorboard: bool = Field(
        False, description="also log every evaluation's figures as TensorBoard scalars into <run>/tensorboard/ (the "
        "tensorboard extra)"
    )

    @model_validator(mode="after")
    def _check(self) -> LogConfig:
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("tensorboard needs the tensorboard extra: pip install 'pflbed[tensorboard]'")
        return self


class PrivacyConfig(_Strict):
    """Client-level differential privacy (`pflbed.privacy`): the shared part of each reply clipped, their sum noised."""

    clip: float | None = Field(None, gt=0, description="client-level DP: each client's update of the shared "
                               "parameters is clipped to this L2 norm C (unset: no DP)")  # fmt: skip
    noise_multiplier: float | None = Field(None, ge=0, description="σ: Gaussian noise of standard deviation σ·C is "
                                           "added to the sum of the round's clipped updates")  # fmt: skip
    target_epsilon: float | None = Field(None, gt=0, description="instead of noise_multiplier: the ε to reach at "
                                         "delta after train.rounds rounds (σ derived by the accountant)")  # fmt: skip
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of the (ε, δ) guarantee reported")
    randomness: Literal["seeded", "os"] | None = Field(None, description="where the noise and the round's sample "
                                                       "are drawn from: seeded (the run's seed: reproducible, for "
                                                       "research; anyone who knows the config can subtract the "
                                                       "noise) or os (the operating system's random source, for a "
                                                       "deployment); default: os with executor.name=flower, seeded "
                                                       "otherwise")  # fmt: skip
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus's accountant for ε: rdp (Rényi DP) or prv "
                                              "(privacy random variables: tighter, e.g. ε 3.53 where rdp gives "
                                              "4.0)")  # fmt: skip
    noise: Literal["central", "distributed"] = Field("central", description="who adds the Gaussian noise: central "
                                                     "(the server, to the sum it receives) or distributed (with "
                                                     "sites.secagg: each site adds its share before masking, so "
                                                     "neither the server nor any site sees a noise-free sum; guide: "
                                                     "privacy)")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.clip is not None

    @model_validator(mode="after")
    def _check(self) -> PrivacyConfig:
        if self.clip is None:
            for key in ("noise_multiplier", "target_epsilon", "randomness"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} needs privacy.clip (the norm each client's update is clipped to)")
            for key, default in (("accountant", "rdp"), ("noise", "central")):
                if getattr(self, key) != default:
                    raise ValueError(f"{key} needs privacy.clip (the norm each client's update is clipped to)")
        elif (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("clip needs exactly one of privacy.noise_multiplier and privacy.target_epsilon")
        if (self.clip is not None or self.noise_multiplier is not None or self.target_epsilon is not None) and \
                importlib.util.find_spec("opacus") is None:  # fmt: skip
            raise ValueError("privacy needs the privacy extra (Opacus's accountants): pip install 'pflbed[privacy]'")
        return self


class SitesConfig(_Strict):
    """A Flower deployment whose clients' data stays on the sites (`pflbed.flower.sites`)."""

    local: bool = Field(False, description="the clients' data is on the SuperNodes (each one's `data` node config): "
                        "the server holds none, and every figure but a server-side G-FL is computed on the sites. "
                        "Needs executor.name=flower")  # fmt: skip
    input_shape: list[int] | None = Field(None, description="local: one sample's shape, e.g. [1, 28, 28]; every "
                                          "site's data is checked against it")  # fmt: skip
    num_classes: int | None = Field(None, ge=2, le=100_000, description="local: the label space 0…num_classes−1; "
                                    "every site's labels are checked against it")  # fmt: skip
    secagg: bool = Field(False, description="local: secure aggregation (Flower's SecAgg+): the server learns only "
                         "the round's mean update of the shared model, not a site's (guide: privacy)")  # fmt: skip
    test: str | None = Field(None, min_length=1, description="local: a test set on the server (.npz with x and y) "
                             "for G-FL; unset: G-FL is the sample-weighted mean of the sites' figures for the "
                             "generic model on their own test data")  # fmt: skip
    max_client_samples: int = Field(10_000_000, ge=1, description="local: the most training samples the server "
                                    "accepts a site to report for one client; a count is a client's weight in "
                                    "the server's means, so an unbounded one would let one site dictate the "
                                    "model")  # fmt: skip
    max_update: float = Field(100.0, gt=0, description="local: the largest change of the shared model the server "
                              "accepts in one reply, as a multiple of max(1, the payload's norm) (honest replies "
                              "stay near or below 1); a site's reply beyond it is refused for the round")  # fmt: skip

    @model_validator(mode="after")
    def _check(self) -> SitesConfig:
        if not self.local:
            for key in ("input_shape", "num_classes", "test"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} applies to sites.local=true")
            if self.secagg:
                raise ValueError("secagg applies to sites.local=true: with the data on the server, it would protect "
                                 "nothing the server does not hold already")  # fmt: skip
        elif self.input_shape is None or self.num_classes is None:
            raise ValueError("local needs sites.input_shape and sites.num_classes (what the server knows of the "
                             "sites' data)")  # fmt: skip
        if self.input_shape is not None and not (1 <= len(self.input_shape) <= 4 and min(self.input_shape) >= 1):
            raise ValueError("input_shape must be 1 to 4 positive sizes, e.g. [1, 28, 28]")
        return self


class Config(_Strict):
    seed: int = Field(0, ge=0, le=SEED_MAX,
        description="seeds the federation, the initial model, client sampling and every client's RNG")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    sites: SitesConfig = Field(default_factory=SitesConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)

    @model_validator(mode="after")
    def _privacy(self) -> Config:
        """Privacy's accountant assumes Poisson sampling of clients: fixed-size sampling with it is refused."""
        if self.privacy.enabled and self.federation.sampling == "fixed":
            raise ValueError("federation.sampling: privacy's accountant assumes Poisson sampling of clients; "
                             "use federation.sampling=poisson (the default with privacy)")  # fmt: skip
        return self

    def privacy_randomness(self) -> str:
        """Where privacy's noise and sample come from (`privacy.randomness`): `os` by default in a Flower run,
        whose sites all receive the config and its seed, so that a deployment never draws them from the seed
        unless its config asks for that by name; `seeded` elsewhere, so that a research run is reproducible."""
        return self.privacy.randomness or ("os" if self.executor.name == "flower" else "seeded")

    def poisson_sampling(self) -> bool:
        """Whether a round's clients are drawn independently (`federation.sampling`, default: with privacy)."""
        return (self.federation.sampling or ("poisson" if self.privacy.enabled else "fixed")) == "poisson"

    @model_validator(mode="after")
    def _sites(self) -> Config:
        """What a deployment with the data on the sites cannot do (yet): each refused with the key that asks it."""
        if self.privacy.noise == "distributed" and not self.sites.secagg:
            raise ValueError("privacy.noise: distributed needs sites.secagg=true (the sites' noise shares are hidden "
                             "from the server only inside SecAgg+'s masked sum)")  # fmt: skip
        if self.privacy.noise == "distributed" and self.privacy_randomness() != "os":
            raise ValueError("privacy.randomness: seeded does not apply with privacy.noise=distributed (the sites "
                             "draw their noise shares from the operating system)")  # fmt: skip
        if not self.sites.local:
            return self
        refused = {
            "executor.name": (self.executor.name != "flower", "sites.local needs executor.name=flower"),
            "executor.state_dir": (self.executor.state_dir is not None, "a site keeps its clients' states in its own "
                                   "state-dir node config; the server does not choose it"),
            "federation.protocol": (self.federation.protocol == "pflbed", "PFLBED's shared domain val/test sets "
                                    "are not on the sites"),
            "federation.new_clients": (self.federation.new_clients > 0, "a site that joins after training "
                                       "personalizes on its own (pflbed personalize)"),
            "federation.public": (self.federation.public > 0, "public data is not on the sites"),
            "federation.manifest": (self.federation.manifest is not None, "the sites hold the data"),
            "eval.pfl_test": (self.eval.pfl_test != "local", "a site scores its clients on its own test data"),
            "model.init_from": (self.model.init_from is not None, "the sites would each need the weights file"),
            "dataset.path": (self.dataset.path is not None, "the server holds no client data"),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"{key} does not apply with sites.local=true: {why}")
        return self

    def algorithm_options(self) -> dict[str, Any]:
        return dict(self.algorithm.model_extra or {})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# Said where `dataset.name` names no built-in dataset: the way to train on data of one's own (docs/guide/datasets.md).
OWN_DATA = ("for your own images: dataset.name=folder, dataset.path=DIR holding DIR/<domain>/<class>/<image> (one "
            "domain folder is enough) and federation.protocol=pflbed")  # fmt: skip


def _section(model: type[BaseModel] | None, path: list[str]) -> type[BaseModel] | None:
    """The model class of the section at `path` under `model` (None: no such section)."""
    for part in path:
        info = model.model_fields.get(part) if model is not None else None
        if info is None:
            return None
        model = _model_class(info.annotation)
    return model


def _model_class(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _literals(annotation: Any) -> list[Any]:
    """The values of the Literal inside `annotation` (through list[…] and … | None), empty if none."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    if get_origin(annotation) in (list, Union, types.UnionType):
        return [v for a in get_args(annotation) for v in _literals(a)]
    return []


def _fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key under `model`, sections and their fields."""
    out = []
    for name, info in model.model_fields.items():
        out.append(f"{prefix}{name}")
        if (sub := _model_class(info.annotation)) is not None:
            out += _fields(sub, f"{prefix}{name}.")
    return out


def _unknown_key_hint(model: type[BaseModel], parts: list[str], prefix: str, given: Any) -> str:
    """A near miss among the keys of the section (`train.round` → `train.rounds`; `trian: {rounds: 3}` →
    `train.rounds`), or the same key in another section (`train.alpha` → `federation.alpha`)."""
    parent, leaf = parts[:-1], parts[-1]
    section = _section(model, parent)
    if section is None:
        return ""
    close = closest(leaf, section.model_fields)
    if close:
        dotted = prefix + ".".join([*parent, close])
        sub = _model_class(section.model_fields[close].annotation)
        if sub is not None and isinstance(given, dict) and len(given) == 1:
            key = str(next(iter(given)))
            dotted += f".{closest(key, sub.model_fields) or key}"
        return f"; did you mean {dotted}?"
    elsewhere = [f for f in _fields(model) if f.rsplit(".", 1)[-1] == leaf]
    return f"; did you mean {prefix}{elsewhere[0]}?" if len(elsewhere) == 1 else ""


def _first_error(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """The first validation error as one line naming the dotted field; with `model` (the validated class), a
    near-miss suggestion for an unknown key or an unknown choice."""
    e = err.errors()[0]
    parts = [str(p) for p in e["loc"] if not str(p).startswith("function-after")]
    loc = ".".join(parts)
    field = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "config"
    if e["type"] == "extra_forbidden":
        return f"{field}: unknown key" + (_unknown_key_hint(model, parts, prefix, e.get("input")) if model else "")
    msg = e["msg"].removeprefix("Value error, ")
    got = repr(e.get("input"))
    if e["type"] == "model_type" or isinstance(e.get("input"), dict) or len(got) > 80:
        return f"{field}: {msg}"  # a whole section (model-level checks) would not fit on one readable line
    hint = ""
    if field == "model.name" and e["type"] == "value_error":
        from pflbed.models import MODELS

        hint = did_you_mean(e.get("input"), MODELS)
    if e["type"] == "literal_error" and model is not None:
        section = _section(model, [p for p in parts[:-1] if not p.isdigit()])
        info = section.model_fields.get(parts[-1]) if section else None
        if info is None and len(parts) > 1 and parts[-1].isdigit():  # an item of a list of choices
            section = _section(model, parts[:-2])
            info = section.model_fields.get(parts[-2]) if section else None
        if info is not None:
            hint = did_you_mean(e.get("input"), _literals(info.annotation))
    message = f"{field}: {msg} (got {got}){hint}"
    return then(message, OWN_DATA) if field == "dataset.name" else message


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c = value` in a nested dict, creating levels as needed."""
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        node = child
    node[leaf] = value


def parse_override(item: str) -> tuple[str, Any]:
    """`key=value` with the value read as YAML (so numbers, booleans and lists get their types)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read an optional YAML file, apply overrides and validate, raising `ConfigError` with one line."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"{p}: cannot read config ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{p}: invalid YAML{where}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of config keys")
        tree = loaded or {}
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(tree, key, value)
    return validate_config(tree)


def validate_config(tree: dict[str, Any]) -> Config:
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_first_error(e, model=Config)) from None
    from pflbed.algorithms import get_algorithm  # late: algorithms import the engine-facing types

    algo_cls = get_algorithm(cfg.algorithm.name)
    try:
        options = algo_cls.Config.model_validate(cfg.algorithm_options())
    except ValidationError as e:
        message = _first_error(e, "algorithm.", algo_cls.Config)
        if e.errors()[0]["type"] == "extra_forbidden":
            message = _algorithm_options_hint(message, cfg.algorithm.name, str(e.errors()[0]["loc"][0]))
        raise ConfigError(message) from None
    _check_numbers(options.model_dump(), "algorithm.")
    if cfg.sites.secagg and algo_cls.dp_refused is not None:
        raise ConfigError(f"sites.secagg: SecAgg+ gives the server only the mean of the replies, and "
                          f"{cfg.algorithm.name} needs more: {algo_cls.dp_refused}")  # fmt: skip
    if cfg.sites.secagg and (why := algo_cls.secagg_refusal(options)) is not None:
        raise ConfigError(why)
    if cfg.privacy.enabled and algo_cls.dp_refused is not None:
        raise ConfigError(f"privacy.clip: client-level DP does not apply to {cfg.algorithm.name}: "
                          f"{algo_cls.dp_refused}")  # fmt: skip
    if cfg.privacy.target_epsilon is not None:
        from pflbed.privacy import noise_multiplier

        try:  # derived here, so that an unreachable target is refused before anything runs
            noise_multiplier(cfg.privacy.target_epsilon, cfg.privacy.delta, cfg.federation.sample_fraction,
                             cfg.train.rounds, cfg.privacy.accountant)  # fmt: skip
        except ValueError as e:
            raise ConfigError(f"privacy.target_epsilon: {e}") from None
    return cfg


def _algorithm_options_hint(message: str, name: str, key: str) -> str:
    """`message` about an unknown `algorithm.<key>`, with the options `name` takes and the algorithms taking `key`."""
    from pflbed.algorithms import ALGORITHMS

    own = list(ALGORITHMS[name].Config.model_fields)
    message = then(message, f"options of {name}: {', '.join(own)}" if own else f"{name} has no options of its own")
    takers = sorted(n for n, c in ALGORITHMS.items() if key in c.Config.model_fields)
    return f"{message}; {key} is an option of {', '.join(takers)}" if takers else message


def _check_numbers(tree: dict[str, Any], prefix: str) -> None:
    """The shared bounds for every algorithm's options (each algorithm adds its own lower bounds): floats finite and
    within float32's range, integers within the int32 range. Checked here once, so a new algorithm gets them
    without writing them."""
    for key, v in tree.items():
        field = f"{prefix}{key}"
        values = v if isinstance(v, list) else [v]
        for x in values:
            if isinstance(x, dict):
                _check_numbers(x, f"{field}.")
            elif error := _number_error(x):
                raise ConfigError(f"{field}: {error} (got {x!r})")
