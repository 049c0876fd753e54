"""Property tests of the config: any value of any field either runs or is refused cleanly.

For every config field (found by walking the `Config` model, so a new field is covered without editing this file)
hypothesis draws values from two pools: the field's cheap valid domain (kept small where the cost of a run grows
with the value, e.g. rounds and epochs, so a tiny run stays tiny) and junk of every type (None, booleans, text,
NaN/±inf, huge and negative integers, lists, mappings). Each draw goes through the real command line as
`--set field=<YAML>`, one or two fields at a time, on top of a tiny run. The property:

- exit 0 and a `summary.json`; or
- exit 2 with exactly one line naming one of the fields set (or the file/path value it names), and no run
  directory written; or
- exit 3 (a valid but diverging learning rate) with one line saying so.

Anything else — a traceback, another exit code, a half-written directory — fails the test. The examples are
derandomized (the same in every CI run); `HYPOTHESIS_PROFILE=explore` draws fresh, many more (see conftest.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import typing
from pathlib import Path

import yaml
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pflbed.algorithms import ALGORITHMS
from pflbed.cli import main
from pflbed.config import INT_MAX, SEED_MAX, Config, max_threads, validate_config
from pflbed.config.federation import UNREAD_BY_PFLBED
from pflbed.errors import ConfigError
from pflbed.models import MODELS

BASE = {
    "dataset.name": "synthetic", "model.name": "mlp", "federation.clients": 4, "train.rounds": 1,
    "eval.every": 1, "eval.finetune": [], "eval.new_clients.epochs": 1, "eval.new_clients.lrs": [0.05],
    "federation.train_per_client": 40,
}  # fmt: skip


def leaf_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and name != "algorithm":
            out += leaf_fields(ann, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}" if name != "algorithm" else "algorithm.name")
    return out


FIELDS = leaf_fields()

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=8),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(), max_size=2),
)
unit = st.floats(min_value=0, max_value=1)
few = lambda hi: st.integers(min_value=0, max_value=hi)  # noqa: E731
fractions = st.lists(st.floats(min_value=0, max_value=1), min_size=0, max_size=4)

# The valid (or nearly valid) domain of each field, bounded where the cost of a run grows with the value.
VALID: dict[str, st.SearchStrategy] = {
    "seed": st.integers(min_value=0, max_value=SEED_MAX),
    "dataset.name": st.sampled_from(typing.get_args(Config.model_fields["dataset"].annotation.model_fields[
        "name"].annotation)),  # fmt: skip
    "dataset.path": st.one_of(st.none(), st.sampled_from(["/nonexistent/data", "/usr/share/datasets/fashion-mnist"])),
    "dataset.download": st.booleans(),
    "dataset.domains": st.one_of(st.none(), st.lists(st.sampled_from(["rot0", "rot90", "rot180", "rot270", "clean",
                                                                      "noise", "blur", "contrast", "invert", "x"]),
                                                     max_size=4)),  # fmt: skip
    "dataset.image_size": st.integers(min_value=0, max_value=64),
    "dataset.label": st.one_of(st.none(), st.sampled_from(["fine", "coarse", "middle"])),
    "dataset.corruptions": st.one_of(st.none(), st.lists(st.sampled_from(["fog", "snow", "smog"]), max_size=2)),
    "dataset.severity": st.one_of(st.none(), st.integers(min_value=0, max_value=6)),
    "dataset.split": st.one_of(st.none(), st.sampled_from(["balanced", "letters", "words"])),
    "dataset.hf.id": st.one_of(st.none(), st.sampled_from(["", "nonexistent/dataset", "/nonexistent/data"])),
    "dataset.hf.subset": st.one_of(st.none(), st.sampled_from(["", "plain_text"])),
    "dataset.hf.splits": st.lists(st.sampled_from(["train", "test", "validation", ""]), max_size=3),
    "dataset.hf.image_column": st.sampled_from(["image", "img", ""]),
    "dataset.hf.label_column": st.sampled_from(["label", "labels", ""]),
    "dataset.hf.user_column": st.one_of(st.none(), st.sampled_from(["writer", ""])),
    "dataset.hf.image_size": st.one_of(st.none(), st.integers(min_value=0, max_value=64)),
    "dataset.hf.normalize": st.lists(st.floats(min_value=-1, max_value=2), max_size=3),
    "dataset.normalize": st.sampled_from(["symmetric", "imagenet", "x"]),
    "dataset.augment": st.one_of(st.just("none"), st.lists(st.sampled_from(["crop", "flip", "rot"]), max_size=2)),
    "dataset.synthetic.shape": st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=3),
    "dataset.synthetic.num_classes": st.integers(min_value=0, max_value=12),
    "dataset.synthetic.n_train": st.integers(min_value=0, max_value=3000),
    "dataset.synthetic.n_test": st.integers(min_value=0, max_value=600),
    "dataset.synthetic.separation": st.floats(min_value=-1, max_value=10),
    "model.name": st.sampled_from(sorted(MODELS)),
    "model.channels_last": st.booleans(),
    "model.init_from": st.one_of(st.none(), st.sampled_from(["/nonexistent/model.pt", "/nonexistent"])),
    "model.init_blocks": st.lists(st.sampled_from(["all", "body", "head", "conv1", "classifier", "fc9"]), max_size=2),
    "federation.protocol": st.sampled_from(["standard", "pflbed"]),
    "federation.exclude_test_of": st.lists(st.integers(min_value=-1, max_value=3), max_size=2),
    "federation.pflbed.participated": unit,
    "federation.pflbed.new": unit,
    "federation.pflbed.val": unit,
    "federation.pflbed.test": unit,
    "federation.pflbed.clients_per_domain": few(6),
    "federation.pflbed.new_clients_per_domain": few(3),
    "federation.clients": few(12),
    "federation.partition": st.sampled_from(["iid", "dirichlet", "classes", "natural"]),
    "federation.min_samples": st.integers(min_value=0, max_value=600),
    "federation.manifest": st.one_of(st.none(), st.sampled_from(["", "/nonexistent/manifest.json"])),
    "federation.alpha": st.floats(min_value=1e-300, max_value=1e300),
    "federation.classes_per_client": few(12),
    "federation.min_size": st.integers(min_value=0, max_value=600),
    "federation.sample_fraction": unit,
    "federation.new_clients": few(5),
    "federation.public": st.integers(min_value=0, max_value=3000),
    "federation.train_per_client": st.one_of(st.none(), few(60)),
    "federation.val_fraction": unit,
    "federation.test_fraction": unit,
    "train.rounds": few(3),
    "train.local_epochs": few(2),
    "train.batch_size": st.integers(min_value=0, max_value=INT_MAX + 1),
    "train.lr": st.floats(min_value=0, max_value=1e300),
    "train.momentum": unit,
    "train.weight_decay": st.floats(min_value=0, max_value=1e300),
    "train.checkpoint_every": few(4),
    "eval.every": st.integers(min_value=0, max_value=INT_MAX + 1),
    "eval.pfl_test": st.sampled_from(["local", "global"]),
    "eval.finetune": st.lists(st.sampled_from(["ft", "lp"]), max_size=2),
    "eval.ft_epochs": few(2),
    "eval.ft_lr": st.floats(min_value=0, max_value=1e300),
    "eval.batch_size": st.integers(min_value=0, max_value=INT_MAX + 1),
    "eval.test_subsample": st.one_of(st.none(), st.integers(min_value=0, max_value=INT_MAX + 1)),
    "eval.new_clients.methods": st.lists(st.sampled_from(["ft", "lp"]), max_size=2),
    "eval.new_clients.fractions": fractions,
    "eval.new_clients.epochs": few(2),
    "eval.new_clients.lrs": st.lists(st.floats(min_value=0, max_value=10), max_size=3),
    "eval.new_clients.zero_shot": st.booleans(),
    "executor.name": st.sampled_from(["auto", "loop", "procs"]),
    "executor.precision": st.sampled_from(["fp32", "bf16", "fp16"]),
    "executor.deterministic": st.booleans(),
    "executor.autotune": st.booleans(),
    "executor.tf32": st.one_of(st.none(), st.booleans()),
    "executor.compile": st.sampled_from(["off", "default", "reduce-overhead"]),
    "executor.workers": st.one_of(st.none(), st.integers(min_value=1, max_value=2)),
    "executor.strict": st.booleans(),
    "executor.keep_freed_memory": st.booleans(),
    "executor.batch_clients": st.one_of(st.none(), st.booleans()),
    "executor.batch_max_clients": st.one_of(st.none(), st.integers(1, 1000)),
    "executor.threads": st.one_of(st.none(), st.integers(min_value=0, max_value=max_threads() + 1)),
    "executor.device": st.sampled_from(["cpu", "auto"]),  # cuda: tests/engine/test_device.py (refused without a GPU)
    # flower: tests/flower/test_flower.py
    "executor.supernodes": st.one_of(st.none(), st.integers(min_value=0, max_value=3)),
    "executor.round_timeout": st.one_of(st.none(), st.floats(min_value=0, max_value=100)),
    "executor.state_dir": st.one_of(st.none(), st.sampled_from(["", "states"])),
    "algorithm.name": st.sampled_from(sorted(ALGORITHMS)),
    # a deployment with the data on the sites: refused without executor.name=flower (tests/flower/test_flower_sites.py)
    "sites.local": st.booleans(),
    "sites.input_shape": st.one_of(st.none(), st.lists(st.integers(min_value=0, max_value=9), max_size=5)),
    "sites.num_classes": st.one_of(st.none(), st.integers(min_value=0, max_value=12)),
    "sites.test": st.one_of(st.none(), st.sampled_from(["", "/nonexistent/test.npz"])),
    "sites.secagg": st.booleans(),  # refused without sites.local (tests/flower/test_flower_secagg.py)
    # what the server accepts of a site (tests/flower/test_attacks_site.py)
    "sites.max_client_samples": st.integers(min_value=0, max_value=INT_MAX + 1),
    "sites.max_update": st.floats(min_value=0, max_value=1e300),
    "log.tensorboard": st.booleans(),
    "federation.sampling": st.sampled_from([None, "fixed", "poisson", "uniform"]),
    # client-level DP: the clip with a noise level, or a target ε (tests/engine/test_privacy.py)
    "privacy.clip": st.one_of(st.none(), st.floats(min_value=0, max_value=10)),
    "privacy.noise_multiplier": st.one_of(st.none(), st.floats(min_value=0, max_value=5)),
    "privacy.target_epsilon": st.one_of(st.none(), st.floats(min_value=0, max_value=20)),
    "privacy.delta": st.floats(min_value=0, max_value=1),
    "privacy.randomness": st.sampled_from([None, "seeded", "os", "urandom"]),  # tests/engine/test_privacy_deployed.py
    "privacy.accountant": st.sampled_from(["rdp", "prv", "moments"]),
    "privacy.noise": st.sampled_from(["central", "distributed", "local"]),  # tests/flower/test_distributed_noise.py
    # `pflbed pretrain`'s section: validated by every run, used only by pretrain (tests/engine/test_pretrain.py)
    "pretrain.split": st.sampled_from(["train", "test", "val"]),
    "pretrain.domains": st.one_of(st.none(), st.lists(st.sampled_from(["rot0", "clean", "x"]), max_size=2)),
    "pretrain.samples": st.one_of(st.none(), st.integers(min_value=0, max_value=INT_MAX + 1)),
    "pretrain.val_fraction": unit,
    "pretrain.epochs": st.integers(min_value=0, max_value=INT_MAX + 1),
    "pretrain.batch_size": st.integers(min_value=0, max_value=INT_MAX + 1),
    "pretrain.lr": st.floats(min_value=0, max_value=1e300),
    "pretrain.momentum": unit,
    "pretrain.weight_decay": st.floats(min_value=0, max_value=1e300),
}


def test_every_field_has_a_valid_domain():
    """A new config field must be given its valid domain here, or it would only ever be tested with junk."""
    assert set(FIELDS) == set(VALID), set(FIELDS) ^ set(VALID)
    assert set(FIELDS) >= COSTLY, COSTLY - set(FIELDS)


# Fields whose run time grows with the value: junk integers in their valid range would only make a long run (e.g.
# 34,372 local epochs), so their junk leaves out 1 … 10^6 (larger values are refused by the config's bounds).
COSTLY = {"train.rounds", "train.local_epochs", "eval.ft_epochs", "eval.new_clients.epochs", "federation.clients",
          "federation.train_per_client", "federation.pflbed.clients_per_domain",
          "federation.pflbed.new_clients_per_domain", "federation.new_clients", "dataset.synthetic.n_train",
          "dataset.synthetic.n_test", "dataset.synthetic.num_classes"}  # fmt: skip
CHEAP_JUNK = JUNK.filter(lambda v: isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 10**6)


def _value_for(field: str) -> st.SearchStrategy:
    junk = CHEAP_JUNK if field in COSTLY else JUNK
    return st.one_of(*[VALID[field]] * 4, junk)  # valid four times as often as junk: most draws reach a run


overrides = st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2, unique=True).flatmap(
    lambda fields: st.tuples(*[st.tuples(st.just(f), _value_for(f)) for f in fields])
)


def _as_set(field: str, value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip()
    return f"{field}={text.removesuffix('...').strip()}"


def _under(base: dict, sets) -> dict:
    """`base` as the drawn protocol reads it: the standard protocol's settings (`federation.clients`, …) left out
    under pflbed, which refuses them, so that a pflbed draw reaches its run."""
    if ("federation.protocol", "pflbed") not in list(sets):
        return base
    return {k: v for k, v in base.items() if k.removeprefix("federation.") not in UNREAD_BY_PFLBED}


def _names_a_field(err: str, sets: tuple) -> bool:
    for field, value in sets:
        parts = field.split(".")
        if any(".".join(parts[i:]) in err for i in range(len(parts))) or (isinstance(value, str) and value in err):
            return True
    return False


@settings(max_examples=8 * settings.default.max_examples)  # validation only: cheap, so many more draws
@given(sets=overrides)
def test_any_value_validates_or_is_one_config_error_naming_its_field(sets):
    """The fast half of the property (no run): validation never raises anything but a one-line ConfigError."""
    validates_or_names(_under(BASE, sets), sets, sets)


def validates_or_names(base: dict, sets, drawn) -> None:
    """`validate_config` of `base` with `sets` ((dotted field, value) pairs) raises nothing but a one-line
    ConfigError naming one of `drawn`. Shared with `test_algorithm_option_properties`."""
    tree: dict = {}
    for field, value in (*base.items(), *sets):
        node = tree
        *parents, leaf = field.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    try:
        validate_config(tree)
    except ConfigError as e:
        assert "\n" not in str(e) and _names_a_field(str(e), drawn), str(e)


def run_is_clean(sets, capsys, prefix: str = "pflbed-prop-", drawn=None) -> int:
    """`pflbed run` with `sets` ((field, value) pairs, on top of BASE) through the command line; its exit code, once
    asserted to be what the module's property allows, a refusal naming one of `drawn` (default: `sets`). Shared
    with `test_algorithm_option_properties`."""
    drawn = sets if drawn is None else drawn
    base = [_as_set(k, v) for k, v in _under(BASE, sets).items() if k not in {f for f, _ in sets}]
    args = [a for kv in (*base, *(_as_set(f, v) for f, v in sets)) for a in ("--set", kv)]
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    out = tmp / "run"
    try:
        capsys.readouterr()
        rc = main(["run", *args, "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err.strip()
        if rc == 0:
            assert (out / "summary.json").is_file()
        elif rc == 3:
            assert err.startswith("pflbed: error: diverged in round") and "\n" not in err, err
        else:
            assert rc == 2, (rc, err)
            assert err.startswith("pflbed: error:") and "\n" not in err, err
            assert _names_a_field(err, drawn), f"{err!r} names none of {[f for f, _ in drawn]}"
            assert not out.exists(), f"refused, but {sorted(os.listdir(out))} were written"
        return rc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@given(sets=overrides)
def test_any_value_runs_or_exits_2_with_one_line_and_no_directory(sets, capsys):
    event(f"exit {run_is_clean(sets, capsys)}")  # --hypothesis-show-statistics: how many ran, were refused, diverged
