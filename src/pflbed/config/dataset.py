"""`dataset.*`: which data, where it is found, and how its samples are prepared."""

from __future__ import annotations

import importlib.util
import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pflbed.config.base import INT_MAX, SYNTHETIC_MAX_VALUES, Strict


class SyntheticConfig(Strict):
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
        if any(s < 1 for s in v):  # no upper bound of its own: `_fits` bounds the sizes' product
            raise ValueError("every size must be at least 1")
        return v

    @model_validator(mode="after")
    def _fits(self) -> SyntheticConfig:
        if (self.n_train + self.n_test) * math.prod(self.shape) > SYNTHETIC_MAX_VALUES:
            raise ValueError(f"(n_train + n_test) × the shape's size must be at most {SYNTHETIC_MAX_VALUES:,} values "
                             f"({SYNTHETIC_MAX_VALUES * 4 // 2**30} GiB of float32)")  # fmt: skip
        return self


class HfConfig(Strict):
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


class DatasetConfig(Strict):
    name: Literal[
        "fmnist", "digits", "synthetic", "fmnist-rot4", "digits-rot4", "folder",
        "cifar10", "cifar100", "cifar10c", "mnist", "emnist", "femnist", "tinyimagenet", "miniimagenet",
        "officehome", "pacs", "domainnet", "flickr-aes", "hf",
    ] = Field("digits", description="the dataset (Datasets in the user guide; `pflbed data list` says which are "
                                    "found where)")  # fmt: skip
    path: str | None = Field(None, description="directory with the dataset files; overrides the look-up")
    download: bool = Field(False, description="download the official archive (checksum-verified) if no local copy "
                           "is found")  # fmt: skip
    label: Literal["fine", "coarse"] | None = Field(None, description="cifar100: fine (100 classes, default) or "
                                                    "coarse (20 superclasses)")  # fmt: skip
    corruptions: list[str] | None = Field(None, description="cifar10c: the corruptions (domains); default the "
                                          "benchmark's 15 (the 4 extra only when named)")
    severity: int | None = Field(None, ge=1, le=5, description="cifar10c: corruption severity 1–5 (default 5)")
    split: Literal["byclass", "bymerge", "balanced", "letters", "digits", "mnist"] | None = Field(
        None, description="emnist: the split (default balanced)"
    )
    domains: list[str] | None = Field(
        None, description="transform domains, e.g. [rot0, rot90, rot180, rot270] or [clean, noise, blur, invert]"
    )
    image_size: int = Field(32, ge=1, le=4096, description="folder, officehome, pacs, domainnet, tinyimagenet, "
                            "flickr-aes: images are resized to this square size (unset for tinyimagenet: its native "
                            "64)")  # fmt: skip
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

    @model_validator(mode="before")
    @classmethod
    def _native_size(cls, data: object) -> object:
        """Tiny-ImageNet's images are 64 px: unset, its size is that, written into the run's config (so a resumed or
        reloaded run reads the same size), not the folder datasets' 32."""
        if isinstance(data, dict) and data.get("name") == "tinyimagenet" and data.get("image_size") is None:
            return {**data, "image_size": 64}
        return data

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


# Said where `dataset.name` names no built-in dataset: the way to train on data of one's own (docs/guide/datasets.md).
OWN_DATA = ("for your own images: dataset.name=folder, dataset.path=DIR holding DIR/<domain>/<class>/<image> (one "
            "domain folder is enough) and federation.protocol=pflbed")  # fmt: skip
