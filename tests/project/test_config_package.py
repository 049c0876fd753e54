"""The config package knows the zoo's and the algorithms' names without importing them (torch), and the lists it
keeps stay the real ones; an algorithm's options are checked by the registry, reached through `pflbed.hooks`."""

import pytest

import pflbed.config
from pflbed import hooks
from pflbed.algorithms import ALGORITHMS, REGISTERED_HERE, check_config, register
from pflbed.algorithms.fedavg import FedAvg
from pflbed.config import ALGORITHM_NAMES, MODEL_NAMES, validate_config
from pflbed.errors import ConfigError
from pflbed.models import MODELS


def test_the_model_names_are_the_zoos():
    assert sorted(MODEL_NAMES) == sorted(MODELS)


def test_the_algorithm_names_are_the_built_in_registrys():
    """A new algorithm file fails here until its name is added to `pflbed.config.algorithm.ALGORITHM_NAMES`."""
    built_in = sorted(n for n, c in ALGORITHMS.items() if c.__module__.startswith("pflbed.algorithms."))
    assert sorted(ALGORITHM_NAMES) == built_in, "list every built-in algorithm in src/pflbed/config/algorithm.py"


def test_the_registry_is_registered_for_the_config():
    assert hooks.registered_algorithms() is ALGORITHMS
    with pytest.raises(ConfigError, match=r"^algorithm.mu: unknown key; fedavg has no options of its own"):
        check_config(pflbed.config.Config.model_validate({"algorithm": {"mu": 0.1}}))


def test_the_check_imports_the_registry_once_when_it_is_not_yet_and_says_so_when_it_cannot(monkeypatch):
    """`check_algorithm` before `pflbed.algorithms` is imported: the API layer's loader runs once (it registers the
    check, used from then on); with no loader, or one that registers nothing, a clear error instead of no check."""
    calls = []
    monkeypatch.setattr(hooks, "_registry", hooks._registry)  # restored after the registrations below
    monkeypatch.setattr(hooks, "_check", None)
    monkeypatch.setattr(hooks, "load_algorithms",
                        lambda: (calls.append("load"), hooks.register_algorithms({}, calls.append)))  # fmt: skip
    hooks.check_algorithm("config 1")
    hooks.check_algorithm("config 2")
    assert calls == ["load", "config 1", "config 2"] and hooks.registered_algorithms() == {}
    for loader in (None, lambda: calls.append("load")):
        monkeypatch.setattr(hooks, "_check", None)
        monkeypatch.setattr(hooks, "load_algorithms", loader)
        with pytest.raises(RuntimeError, match=r"^pflbed.algorithms is not imported: a config's algorithm options "
                                               r"cannot be checked$"):  # fmt: skip
            hooks.check_algorithm("config 3")
    assert calls[3:] == ["load"]


def test_an_algorithm_registered_from_outside_is_known_by_name():
    """Once the registry is imported it is the authority on names, so an algorithm registered from outside pflbed
    runs by name, and one taken out of it is unknown again."""

    class Mine(FedAvg):
        name = "mine"

    register(Mine)
    try:
        assert validate_config({"algorithm": {"name": "mine"}}).algorithm.name == "mine"
    finally:
        ALGORITHMS.pop("mine")
        REGISTERED_HERE.discard("mine")
    with pytest.raises(ConfigError, match=r"^algorithm.name: unknown algorithm 'mine'; known: apfl, "):
        validate_config({"algorithm": {"name": "mine"}})


@pytest.mark.parametrize("name", [
    "load_config", "validate_config", "parse_override", "set_dotted", "resolve_device", "max_threads", "Config",
    "DatasetConfig", "SyntheticConfig", "HfConfig", "ModelConfig", "FederationConfig", "PflbedSplitConfig",
    "TrainConfig", "PretrainConfig", "EvalConfig", "NewClientsConfig", "ExecutorConfig", "AlgorithmConfig",
    "LogConfig", "PrivacyConfig", "SitesConfig", "INT_MAX", "SEED_MAX", "FLOAT_MAX", "SYNTHETIC_MAX_VALUES",
    "OWN_DATA", "did_you_mean", "then", "_first_error",
])  # fmt: skip
def test_every_name_the_code_base_imports_from_the_config_is_there(name):
    assert hasattr(pflbed.config, name)


def test_a_model_registered_in_the_zoo_is_known_to_the_config(monkeypatch):
    """Once the zoo is imported its live registry decides, as the algorithms' does: a model added from outside
    pflbed (as tests and users do) is accepted, and one removed is not."""
    from pflbed.config import load_config
    from pflbed.errors import ConfigError
    from pflbed.models import MODELS

    monkeypatch.setitem(MODELS, "outside_net", MODELS["mlp"])
    assert load_config(None, ["model.name=outside_net"]).model.name == "outside_net"
    monkeypatch.delitem(MODELS, "lenet5")
    with pytest.raises(ConfigError, match="model.name: unknown model"):
        load_config(None, ["model.name=lenet5"])
