"""Pretrained starts: `pflbed pretrain` trains on a declared source disjoint from the federation (checked, and
recorded so a run checks again), and `model.init_from` / `model.init_blocks` load exactly the blocks asked for."""

import json

import pytest
import torch

from pflbed.cli import main
from pflbed.config import validate_config
from pflbed.data import load_source
from pflbed.engine.loop import prepare
from pflbed.engine.pretrain import pretrain, source_indices
from pflbed.errors import ConfigError, DataError
from pflbed.federation import build_federation
from pflbed.federation.federation import check_disjoint

ROT = {"dataset": {"name": "digits-rot4"}, "model": {"name": "lenet5"}, "executor": {"threads": 1},
       "federation": {"protocol": "pflbed", "pflbed": {"clients_per_domain": 4, "new_clients_per_domain": 2}},
       "train": {"rounds": 1}, "eval": {"finetune": [], "new_clients": {"epochs": 1}},
       "pretrain": {"split": "test", "domains": ["rot0", "rot90"], "epochs": 3, "lr": 0.05,
                    "val_fraction": 0.25}}  # fmt: skip


def _cfg(**over):
    tree = json.loads(json.dumps(ROT))
    for dotted, v in over.items():
        *path, last = dotted.split("__")
        node = tree
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    return validate_config(tree)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pre") / "lenet5"
    summary = pretrain(_cfg(), out, log=lambda *_: None)
    return out, summary


def test_source_is_the_declared_split_and_domains_and_disjoint_from_the_federation(pretrained):
    out, summary = pretrained
    blob = torch.load(out / "model.pt", weights_only=True)
    src = blob["source"]
    source = load_source(_cfg().dataset)
    idx = src["indices"]
    assert src["dataset"] == "digits" and src["split"] == "test"
    names = [source.domain_names[int(d)] for d in source.test.domain[idx]]
    assert set(names) == {"rot0", "rot90"}
    assert len(idx) == int(torch.isin(source.test.domain, torch.tensor([0, 1])).sum())  # every such sample
    used = build_federation(source, _cfg().federation, 0).used_indices()
    assert not set(idx.tolist()) & set(used["test"].tolist())
    assert summary["source"]["train"] + summary["source"]["val"] == len(idx)


def test_samples_draws_that_many_and_is_seeded():
    source = load_source(_cfg().dataset)
    a, b = source_indices(source, _cfg(pretrain__samples=20)), source_indices(source, _cfg(pretrain__samples=20))
    c = source_indices(source, _cfg(pretrain__samples=20, seed=1))
    assert len(a) == 20 and torch.equal(a, b) and not torch.equal(a, c)


def test_the_epoch_kept_is_the_best_held_out_one(pretrained):
    out, summary = pretrained
    accs = [e["val_acc"] for e in summary["epochs"]]
    assert summary["selected_epoch"] == accs.index(max(accs)) + 1 and summary["val_acc"] == max(accs)


def test_pretraining_is_deterministic(pretrained, tmp_path):
    out, _ = pretrained
    pretrain(_cfg(), tmp_path / "again", log=lambda *_: None)
    a = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "again" / "model.pt", weights_only=True)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_used_indices_cover_every_client_split_the_public_set_and_the_shared_sets():
    source = load_source(validate_config({"dataset": {"name": "digits"}}).dataset)
    fed = build_federation(source, validate_config(
        {"dataset": {"name": "digits"}, "federation": {"clients": 5, "public": 40, "new_clients": 1}}).federation, 0)
    used = fed.used_indices()
    parts = [t for c in fed.clients for t in (c.train, c.val, c.test)] + [fed.public]
    for t in parts:
        assert set(t.tolist()) <= set(used["train"].tolist())
    assert set(fed.global_test.tolist()) == set(used["test"].tolist())
    rot = build_federation(load_source(_cfg().dataset), _cfg().federation, 0)
    used = rot.used_indices()
    for t in [*rot.domain_val, *rot.domain_test]:
        assert set(t.tolist()) <= set(used["train"].tolist())
    assert len(used["test"]) == 0  # PFLBED draws everything from the train split


def test_an_overlapping_source_is_refused_and_nothing_is_written(tmp_path, capsys):
    # the train split is the federation's; the test split is what the non-PFLBED global test set uses
    with pytest.raises(DataError, match=r"^pretrain: the pretraining source \(\d+ samples of digits's train split\) "
                                        r"shares \d+ samples with this federation's client data or evaluation sets; "
                                        r"choose a split or domains it does not use \(under federation.protocol pflbed "
                                        r"all of them come from the train split, so pretrain.split test is free\)$"):
        pretrain(_cfg(pretrain__split="train"), tmp_path / "a", log=lambda *_: None)
    assert not (tmp_path / "a").exists()
    code = main(["pretrain", "--set", "dataset.name=digits", "--set", "pretrain.epochs=1", "--out",
                 str(tmp_path / "b")])  # fmt: skip
    assert code == 2 and not (tmp_path / "b").exists()
    assert "shares" in capsys.readouterr().err
    fed = build_federation(load_source(_cfg().dataset), _cfg().federation, 0)
    check_disjoint(fed, "fmnist", {"dataset": "digits-x", "split": "train", "indices": torch.arange(5)}, "x")


def test_init_from_loads_exactly_the_blocks_asked_for(pretrained):
    out, _ = pretrained
    saved = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    random = prepare(_cfg()).ctx
    body = prepare(_cfg(model__init_from=str(out), model__init_blocks=["body"])).ctx
    full = prepare(_cfg(model__init_from=str(out / "model.pt"))).ctx
    head_keys = random.model.state_keys(random.model.head_blocks())
    for k, v in saved.items():
        assert torch.equal(full.initial_params[k], v)
        expect = random.initial_params[k] if k in head_keys else v
        assert torch.equal(body.initial_params[k], expect), k
    assert not torch.equal(random.initial_params["blocks.conv1.0.weight"], saved["blocks.conv1.0.weight"])


def test_init_from_a_plain_state_dict_and_its_errors(pretrained, tmp_path):
    out, _ = pretrained
    saved = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    plain = tmp_path / "plain.pt"
    torch.save(saved, plain)
    ctx = prepare(_cfg(model__init_from=str(plain), model__init_blocks=["conv1"])).ctx
    assert torch.equal(ctx.initial_params["blocks.conv1.0.weight"], saved["blocks.conv1.0.weight"])
    bad = dict(saved)
    bad["blocks.fc1.1.weight"] = torch.zeros(3, 3)
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match=r"model.init_from: 'blocks.fc1.1.weight' has shape \[3, 3\]"):
        prepare(_cfg(model__init_from=str(tmp_path / "bad.pt")))
    torch.save({k: v for k, v in saved.items() if "classifier" not in k}, tmp_path / "nohead.pt")
    prepare(_cfg(model__init_from=str(tmp_path / "nohead.pt"), model__init_blocks=["body"]))  # body only: fine
    with pytest.raises(ConfigError, match="model.init_from: .* has no 'blocks.classifier"):
        prepare(_cfg(model__init_from=str(tmp_path / "nohead.pt")))
    with pytest.raises(ConfigError, match="model.init_blocks"):
        prepare(_cfg(model__init_from=str(plain), model__init_blocks=["fc9"]))
    with pytest.raises(ConfigError, match="holds a lenet5 model, the run's model.name is mlp"):
        prepare(_cfg(model__init_from=str(out), model__name="mlp"))
    (tmp_path / "junk.pt").write_text("not torch")
    with pytest.raises(ConfigError, match="not a torch weights file"):
        prepare(_cfg(model__init_from=str(tmp_path / "junk.pt")))


def test_a_run_refuses_weights_pretrained_on_its_own_data(pretrained, tmp_path, capsys):
    out, _ = pretrained
    # the same source under the default protocol: its global test set is drawn from the test split
    code = main(["run", "--set", "dataset.name=digits-rot4", "--set", "model.name=lenet5", "--set",
                 f"model.init_from={out}", "--out", str(tmp_path / "r")])  # fmt: skip
    assert code == 2 and not (tmp_path / "r").exists()
    assert "model.init_from: the pretraining source" in capsys.readouterr().err


def test_a_run_records_the_weights_it_started_from(pretrained, tmp_path):
    out, _ = pretrained
    args = ["run", "--no-progress", "--out", str(tmp_path / "r"), "--set", f"model.init_from={out}"]
    for k, v in {"dataset.name": "digits-rot4", "model.name": "lenet5", "federation.protocol": "pflbed",
                 "federation.pflbed.clients_per_domain": 4, "federation.pflbed.new_clients_per_domain": 2,
                 "train.rounds": 1, "eval.finetune": "[]", "eval.new_clients.epochs": 1}.items():  # fmt: skip
        args += ["--set", f"{k}={v}"]
    assert main(args) == 0
    rec = json.loads((tmp_path / "r" / "summary.json").read_text())["init_from"]
    import hashlib

    assert rec["sha256"] == hashlib.sha256((out / "model.pt").read_bytes()).hexdigest() and rec["blocks"] == ["all"]
