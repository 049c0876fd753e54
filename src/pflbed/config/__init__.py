"""Typed run configuration: YAML file + `--set key=value` overrides, validated before anything runs.

Validation errors become a single `ConfigError` line naming the dotted field (`train.lr: ...`), so a typo never
turns into a traceback or a half-written run directory. Algorithm-specific keys live under `algorithm` and are
validated by the algorithm's own `Config` model once the name is known.

One module per section (`dataset`, `model`, `federation`, `train`, `pretrain`, `evaluation` for `eval`, `executor`,
`algorithm`, `log`, `privacy`, `sites`), the whole config with its cross-section rules in `root`, reading and
checking in `load`, error messages in `hints`. The package imports nothing heavy (pydantic and PyYAML only): a
config mistake is reported before torch or NumPy is loaded. A new key goes into its section's model; a new section
gets a module and a field of `root.Config`.
"""

from pflbed.config.algorithm import ALGORITHM_NAMES, AlgorithmConfig
from pflbed.config.base import FLOAT_MAX, INT_MAX, SEED_MAX, SYNTHETIC_MAX_VALUES, Strict, check_numbers, max_threads
from pflbed.config.dataset import OWN_DATA, DatasetConfig, HfConfig, SyntheticConfig
from pflbed.config.evaluation import EvalConfig, NewClientsConfig
from pflbed.config.executor import ExecutorConfig, resolve_device
from pflbed.config.federation import FederationConfig, PflbedSplitConfig
from pflbed.config.hints import first_error
from pflbed.config.load import load_config, parse_override, set_dotted, validate_config
from pflbed.config.log import LogConfig
from pflbed.config.model import MODEL_NAMES, ModelConfig
from pflbed.config.pretrain import PretrainConfig
from pflbed.config.privacy import PrivacyConfig
from pflbed.config.root import Config
from pflbed.config.sites import SitesConfig
from pflbed.config.train import TrainConfig
from pflbed.hints import did_you_mean, then

_first_error = first_error  # the name `results.bench` and `results.tune` import

__all__ = [
    "ALGORITHM_NAMES", "FLOAT_MAX", "INT_MAX", "MODEL_NAMES", "OWN_DATA", "SEED_MAX", "SYNTHETIC_MAX_VALUES",
    "AlgorithmConfig", "Config", "DatasetConfig", "EvalConfig", "ExecutorConfig", "FederationConfig", "HfConfig",
    "LogConfig", "ModelConfig", "NewClientsConfig", "PflbedSplitConfig", "PretrainConfig", "PrivacyConfig",
    "SitesConfig", "Strict", "SyntheticConfig", "TrainConfig", "check_numbers", "did_you_mean", "first_error",
    "load_config", "max_threads", "parse_override", "resolve_device", "set_dotted", "then", "validate_config",
]  # fmt: skip
