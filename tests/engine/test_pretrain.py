"""Pretrained starts: `pflbed pretrain` trains on a declared source disjoint from the federation (checked, and
recorded so a run checks again), and `model.init_from` / `model.init_blocks` load exactly the blocks asked for."""

import json
import re

import pytest
import torch

from pflbed.cli import main
from pflbed.config import validate_config
from pflbed.data import load_source
from pflbed.engine.build import prepare
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
    for value in (float("nan"), float("inf")):  # was a divergence in round 1 blaming train.lr, a run directory left
        broken = {**saved, "blocks.fc1.1.weight": saved["blocks.fc1.1.weight"].clone()}
        broken["blocks.fc1.1.weight"][0, 1] = value
        torch.save(broken, tmp_path / "nan.pt")
        with pytest.raises(ConfigError) as info:
            prepare(_cfg(model__init_from=str(tmp_path / "nan.pt"), model__init_blocks=["conv1"]))
        assert str(info.value) == (f"model.init_from: {tmp_path / 'nan.pt'}: 'blocks.fc1.1.weight' holds non-finite "
                                   "values (NaN or inf); no run can start from it")  # fmt: skip
    import collections
    import pickle
    import warnings

    (tmp_path / "pickled.pt").write_bytes(pickle.dumps(collections.OrderedDict(x=1)))  # not torch's own file
    with warnings.catch_warnings(record=True) as caught:  # torch's warning of a foreign pickle: not printed
        warnings.simplefilter("always")
        with pytest.raises(ConfigError, match="not a torch weights file"):
            prepare(_cfg(model__init_from=str(tmp_path / "pickled.pt")))
    assert not caught, [str(w.message) for w in caught]


def test_a_run_refuses_weights_pretrained_on_its_own_data(pretrained, tmp_path, capsys):
    out, _ = pretrained
    # the same source under the default protocol: its global test set is drawn from the test split
    code = main(["run", "--set", "dataset.name=digits-rot4", "--set", "model.name=lenet5", "--set",
                 f"model.init_from={out}", "--out", str(tmp_path / "r")])  # fmt: skip
    assert code == 2 and not (tmp_path / "r").exists()
    assert "model.init_from: the pretraining source" in capsys.readouterr().err


def test_a_run_records_the_weights_it_started_from(pretrained, tmp_path):
    """The file, its hash and blocks, and how `pflbed pretrain` made it: source, epochs, the epoch kept, its
    held-out accuracy (from the pretraining's summary beside the weights)."""
    out, summary = pretrained
    args = ["run", "--no-progress", "--out", str(tmp_path / "r"), "--set", f"model.init_from={out}"]
    for k, v in {"dataset.name": "digits-rot4", "model.name": "lenet5", "federation.protocol": "pflbed",
                 "federation.pflbed.clients_per_domain": 4, "federation.pflbed.new_clients_per_domain": 2,
                 "train.rounds": 1, "eval.finetune": "[]", "eval.new_clients.epochs": 1}.items():  # fmt: skip
        args += ["--set", f"{k}={v}"]
    assert main(args) == 0
    rec = json.loads((tmp_path / "r" / "summary.json").read_text())["init_from"]
    import hashlib

    assert rec["sha256"] == hashlib.sha256((out / "model.pt").read_bytes()).hexdigest() and rec["blocks"] == ["all"]
    kept = {"selected_epoch": summary["selected_epoch"], "val_acc": summary["val_acc"]}
    assert rec["pretraining"] == {"source": summary["source"], "epochs": len(summary["epochs"]), **kept}
    assert summary["source"]["samples"] > 0 and len(summary["epochs"]) == _cfg().pretrain.epochs


def test_weights_from_elsewhere_have_no_pretraining_record(tmp_path):
    """No summary beside the weights, one too large, unreadable, or of another kind: the record is left out."""
    from pflbed.results.summary import pretraining_record

    f = tmp_path / "summary.json"
    assert pretraining_record(f) is None
    for text in ("not json", json.dumps({"final": {}}), json.dumps({"source": {}, "epochs": 3}),
                 json.dumps({"source": {"samples": 1}, "epochs": []}) + " " * 1_000_000):  # fmt: skip
        f.write_text(text)
        assert pretraining_record(f) is None, text[:40]
    f.write_text(json.dumps({"source": {"samples": 7}, "epochs": [{}, {}], "selected_epoch": 2, "val_acc": 0.5}))
    assert pretraining_record(f) == {"source": {"samples": 7}, "epochs": 2, "selected_epoch": 2, "val_acc": 0.5}


# --- what is kept and written (each rule pinned by a test that a wrong version turns red) ----------------------------
def _spy_epochs(monkeypatch, accs):
    """Script the held-out accuracy of each epoch, and record the weights the model had when it was measured."""
    import pflbed.engine.pretrain as pre

    scripted, states = iter(accs), []

    def measured(model, x, y, idx):
        states.append({k: v.clone() for k, v in model.state_dict().items()} | {"held_out": idx.clone()})
        return next(scripted)

    monkeypatch.setattr(pre, "_accuracy", measured)
    return states


def test_the_kept_epoch_is_the_earliest_best_one_with_the_weights_it_had_then(tmp_path, monkeypatch):
    """Held-out accuracies 0.5, 0.7, 0.7, 0.6: epoch 2 is kept (the best, the earlier of a tie, not the last), and the
    saved weights are the ones measured then, not the training's last."""
    states, lines = _spy_epochs(monkeypatch, [0.5, 0.7, 0.7, 0.6]), []
    summary = pretrain(_cfg(pretrain__epochs=4), tmp_path / "p", log=lines.append)
    assert (summary["selected_epoch"], summary["val_acc"]) == (2, 0.7)
    assert [(e["epoch"], e["val_acc"]) for e in summary["epochs"]] == [(1, 0.5), (2, 0.7), (3, 0.7), (4, 0.6)]
    saved = torch.load(tmp_path / "p" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(saved[k], states[1][k]) for k in saved)  # (`held_out` is no weight)
    assert not all(torch.equal(saved[k], states[3][k]) for k in saved)
    loss = summary["epochs"][1]["train_loss"]
    assert lines[1] == f"epoch 2/4: loss {loss:.4f}, held-out acc 70.00" and len(lines) == 4


def test_without_held_out_data_the_last_epoch_is_kept(tmp_path, monkeypatch):
    states, lines = _spy_epochs(monkeypatch, []), []  # never measured: an accuracy asked for would stop the run
    summary = pretrain(_cfg(pretrain__epochs=2, pretrain__val_fraction=0), tmp_path / "p", log=lines.append)
    assert states == [] and (summary["selected_epoch"], summary["val_acc"]) == (2, None)
    assert [e["val_acc"] for e in summary["epochs"]] == [None, None] and summary["source"]["val"] == 0
    assert lines[0] == f"epoch 1/2: loss {summary['epochs'][0]['train_loss']:.4f}"


def test_held_out_accuracy_is_the_share_of_the_indexed_samples_predicted_right():
    from pflbed.engine.pretrain import _accuracy

    model = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3, 2))  # predicts class 0 where x0 > x1, else 1
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 2])
    assert _accuracy(model, x, y, torch.tensor([0, 1, 2])) == pytest.approx(2 / 3)
    assert _accuracy(model, x, y, torch.tensor([3])) == 0.0 and _accuracy(model, x, y, torch.tensor([0])) == 1.0
    assert _accuracy(model, x, y, torch.tensor([], dtype=torch.long)) == 0.0


def test_the_summary_and_files_say_what_was_trained_on_and_checked(tmp_path):
    import time

    import yaml

    from pflbed.version import __version__

    cfg, began = _cfg(pretrain__epochs=2), time.perf_counter()
    summary = pretrain(cfg, tmp_path / "p", log=lambda *_: None)
    elapsed = time.perf_counter() - began
    n = len(source_indices(load_source(cfg.dataset), cfg))
    assert summary["source"] == {"dataset": "digits", "split": "test", "domains": ["rot0", "rot90"], "samples": n,
                                 "train": n - round(0.25 * n), "val": round(0.25 * n)}  # fmt: skip
    fed = build_federation(load_source(cfg.dataset), cfg.federation, 0)
    assert summary["checked_against"] == {"federation": fed.key,
                                          "samples_used": {k: len(v) for k, v in fed.used_indices().items()}}
    assert {k: summary[k] for k in ("pflbed_version", "dataset", "model", "seed")} == {
        "pflbed_version": __version__, "dataset": "digits-rot4", "model": "lenet5", "seed": 0}
    assert [set(e) for e in summary["epochs"]] == [{"epoch", "train_loss", "val_acc"}] * 2
    assert 0 < summary["seconds"] <= elapsed and summary["seconds"] == round(summary["seconds"], 3)
    assert (tmp_path / "p" / "summary.json").read_text() == json.dumps(summary, indent=1) + "\n"
    written = (tmp_path / "p" / "config.yaml").read_text()
    assert yaml.safe_load(written) == cfg.to_dict() and written == yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    blob = torch.load(tmp_path / "p" / "model.pt", weights_only=True)
    assert blob["source"]["domains"] == ["rot0", "rot90"] and blob["architecture"] == "lenet5"


def test_each_optimizer_setting_and_the_seed_reach_the_training(tmp_path):
    def weights(**over):  # one epoch: two steps of 64 (momentum acts on the second)
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        pretrain(_cfg(pretrain__epochs=1, **over), out, log=lambda *_: None)
        return torch.cat([v.flatten() for v in torch.load(out / "model.pt", weights_only=True)["state_dict"].values()])

    base = weights()
    assert torch.equal(base, weights())  # the comparison below is not noise
    for over in ({"pretrain__momentum": 0.0}, {"pretrain__weight_decay": 0.0}, {"pretrain__lr": 0.01},
                 {"pretrain__batch_size": 32}, {"seed": 1}):  # fmt: skip
        assert not torch.equal(weights(**over), base), over


def test_an_output_directory_is_replaced_only_when_empty_or_an_earlier_pretraining_s_and_forced(tmp_path):
    """`--force` replaces an earlier pretraining's output, nothing else: forcing a directory with other files in it
    (a parent of several pretrained models, a run's, the working directory) deleted them all."""
    from pflbed.errors import PflbedError

    cfg, quiet = _cfg(pretrain__epochs=1), (lambda *_: None)
    (tmp_path / "empty").mkdir()
    pretrain(cfg, tmp_path / "empty", log=quiet)  # an empty directory: used
    written = sorted(p.name for p in (tmp_path / "empty").iterdir())
    assert written == ["config.yaml", "model.pt", "summary.json"]
    before = (tmp_path / "empty" / "summary.json").read_text()
    with pytest.raises(PflbedError) as e:
        pretrain(cfg, tmp_path / "empty", log=quiet)
    assert str(e.value) == f"--out {tmp_path / 'empty'}: holds an earlier pretraining's output (--force replaces it)"
    assert (tmp_path / "empty" / "summary.json").read_text() == before
    pretrain(_cfg(pretrain__epochs=2), tmp_path / "empty", force=True, log=quiet)  # replaced
    assert len(json.loads((tmp_path / "empty" / "summary.json").read_text())["epochs"]) == 2
    (tmp_path / "empty" / "summary.json").unlink()  # some of the earlier output: still the earlier output's
    pretrain(cfg, tmp_path / "empty", force=True, log=quiet)
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == written
    full = tmp_path / "full"
    (full / "lenet5").mkdir(parents=True)
    for name in ("mine.txt", "model.pt", "a", "b", "c"):
        (full / name).write_text("keep")
    for force in (False, True):
        with pytest.raises(PflbedError) as e:
            pretrain(cfg, full, force=force, log=quiet)
        assert str(e.value) == (f"--out {full}: holds files pflbed pretrain did not write (a, b, c, …); choose "
                                "another --out (--force replaces only an earlier pretraining's)")  # fmt: skip
    assert sorted(p.name for p in full.iterdir()) == ["a", "b", "c", "lenet5", "mine.txt", "model.pt"]
    (full / "a").unlink()
    with pytest.raises(PflbedError, match=r"did not write \(b, c, lenet5, …\); choose"):  # four: three named
        pretrain(cfg, full, force=True, log=quiet)
    (full / "b").unlink()
    with pytest.raises(PflbedError, match=r"did not write \(c, lenet5, mine\.txt\); choose"):  # three: no …
        pretrain(cfg, full, force=True, log=quiet)
    (tmp_path / "file").write_text("a file")
    with pytest.raises(PflbedError) as e:
        pretrain(cfg, tmp_path / "file", force=True, log=quiet)
    assert str(e.value) == (f"--out {tmp_path / 'file'}: is a file; give the directory to write model.pt, "
                            "summary.json, config.yaml into")  # fmt: skip
    assert (tmp_path / "file").read_text() == "a file"
    with pytest.raises(PflbedError) as e:  # was a temporary directory's "Not a directory", after the training
        pretrain(cfg, tmp_path / "file" / "under", log=quiet)
    assert str(e.value) == f"--out {tmp_path / 'file' / 'under'}: {tmp_path / 'file'} is a file, not a directory"


def test_bad_sources_and_a_diverging_pretraining_stop_in_one_line_writing_nothing(tmp_path):
    from pflbed.errors import DivergedError

    quiet = lambda *_: None  # noqa: E731
    for over, error, message in (
        ({"pretrain__val_fraction": 0.9999}, ConfigError, "pretrain.val_fraction: leaves no training sample"),
        ({"pretrain__domains": ["rot0", "nope"]}, ConfigError,
         "pretrain.domains: unknown ['nope']; digits-rot4 has ['rot0', 'rot90', 'rot180', 'rot270']"),
        ({"pretrain__lr": 1e12}, DivergedError,
         "diverged in round 1: pretraining loss (epoch, not round) — lower pretrain.lr"),
    ):  # fmt: skip
        with pytest.raises(error) as e:
            pretrain(_cfg(**over), tmp_path / "p", log=quiet)
        assert str(e.value) == message
        assert list(tmp_path.iterdir()) == []
    cfg = _cfg(dataset__name="digits", pretrain__domains=["rot0"], pretrain__split="test")
    with pytest.raises(ConfigError, match=r"^pretrain.domains: digits has no domains$"):
        source_indices(load_source(cfg.dataset), cfg)


def test_the_held_out_share_is_a_draw_of_the_run_s_seed_alone(tmp_path, monkeypatch):
    """The held-out samples: `val_fraction` of the source, drawn from the run's seed — another seed draws others, and
    whatever the process drew before (the global generator) changes nothing."""
    cfg, source = _cfg(pretrain__epochs=1), load_source(_cfg().dataset)
    drawn = []
    for seed, before in ((0, 1), (0, 2), (1, 1)):
        states = _spy_epochs(monkeypatch, [0.5])
        torch.manual_seed(before)
        pretrain(_cfg(pretrain__epochs=1, seed=seed), tmp_path / f"{seed}-{before}", log=lambda *_: None)
        drawn.append(states[0]["held_out"])
    idx = source_indices(source, cfg)
    assert set(drawn[0].tolist()) <= set(idx.tolist()) and len(drawn[0]) == round(0.25 * len(idx))
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])


def test_each_random_stream_is_the_run_s_seed_and_its_own_number(tmp_path, monkeypatch):
    """The source draw, the held-out split, the batches and the initial weights each come from `derive_seed(seed,
    STREAM, k)`: the run's seed in each (another seed, other draws) and one number each (no two share a stream). The
    numbers are part of what a seed means: changing one changes every published pretrained model of that seed."""
    import types

    import pflbed.engine.pretrain as pre
    from pflbed import rng

    calls = []
    monkeypatch.setattr(pre, "rng", types.SimpleNamespace(
        derive_seed=lambda *args: calls.append(args) or rng.derive_seed(*args)))  # fmt: skip
    pretrain(_cfg(pretrain__epochs=1, pretrain__samples=50, seed=7), tmp_path / "p", log=lambda *_: None)
    assert sorted(calls) == [(7, pre.STREAM, 0), (7, pre.STREAM, 1), (7, pre.STREAM, 2), (7, pre.STREAM, 3)]


def test_the_thread_count_is_the_config_s_else_the_model_s(tmp_path):
    from pflbed.engine.threads import choose_threads
    from pflbed.models import build_model

    before = torch.get_num_threads()
    try:
        pretrain(_cfg(pretrain__epochs=1, executor__threads=2), tmp_path / "a", log=lambda *_: None)
        assert torch.get_num_threads() == 2
        pretrain(_cfg(pretrain__epochs=1, executor__threads=None), tmp_path / "b", log=lambda *_: None)
        source = load_source(_cfg().dataset)
        lenet = build_model("lenet5", source.input_shape, source.num_classes, torch.device("cpu"))
        assert torch.get_num_threads() == choose_threads(lenet) != 2
    finally:
        torch.set_num_threads(before)


def test_a_stale_temporary_directory_is_not_carried_into_the_output(tmp_path):
    (tmp_path / ".p.tmp").mkdir()
    (tmp_path / ".p.tmp" / "stale.txt").write_text("from a run that stopped")
    pretrain(_cfg(pretrain__epochs=1), tmp_path / "p", log=lambda *_: None)
    assert sorted(q.name for q in (tmp_path / "p").iterdir()) == ["config.yaml", "model.pt", "summary.json"]
    assert not (tmp_path / ".p.tmp").exists()


def test_an_empty_split_or_domains_without_samples_in_it_are_named():
    import types

    class Split:
        def __init__(self, domains):
            self.domain = torch.tensor(domains, dtype=torch.long)

        def __len__(self):
            return len(self.domain)

    def source(test):
        return types.SimpleNamespace(name="toy", test=test, domain_names=["a", "b"])

    cfg = _cfg(pretrain__domains=["b"])
    with pytest.raises(DataError) as e:
        source_indices(source(Split([])), cfg)
    assert str(e.value) == "pretrain.split: toy has no test split"
    with pytest.raises(ConfigError) as e:
        source_indices(source(Split([0, 0])), cfg)
    assert str(e.value) == "pretrain.domains: no test sample of toy is in ['b']"
    assert source_indices(source(Split([0, 1])), cfg).tolist() == [1]


def test_pretrain_command_says_what_it_trained_on_and_how_to_use_it(tmp_path, capsys):
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**ROT, "pretrain": {**ROT["pretrain"], "epochs": 2}}))
    out = tmp_path / "pre"
    assert main(["pretrain", "-c", str(tmp_path / "c.yaml"), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    src = s["source"]
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.endswith(
        f"pretrained lenet5 on {src['train']} samples of digits's test split (domains rot0, rot90), disjoint "
        f"from the federation's data: epoch {s['selected_epoch']} kept, held-out accuracy {100 * s['val_acc']:.2f} "
        f"%; {s['seconds']:.1f} s model: {out / 'model.pt'} (use: --set model.init_from={out})")  # fmt: skip
    assert main(["pretrain", "-c", str(tmp_path / "c.yaml"), "--out", str(out)]) == 2  # there already: --force
    assert main(["pretrain", "-c", str(tmp_path / "c.yaml"), "--out", str(out), "--force"]) == 0
    assert src["domains"] == ["rot0", "rot90"]
    capsys.readouterr()
    # --set over the file; nothing held out: no held-out accuracy to print, the last epoch kept
    assert main(["pretrain", "-c", str(tmp_path / "c.yaml"), "--set", "pretrain.val_fraction=0", "--set",
                 "pretrain.epochs=1", "--out", str(out), "--force"]) == 0  # fmt: skip
    s = json.loads((out / "summary.json").read_text())
    assert len(s["epochs"]) == 1 and s["val_acc"] is None
    assert re.search(r"from the federation's data: epoch 1 kept; \d+\.\d s\n", capsys.readouterr().out)
    assert main(["pretrain", "-c", str(tmp_path / "c.yaml"), "--set", "pretrain.domains=null", "--set",
                 "pretrain.epochs=1", "--out", str(tmp_path / "all")]) == 0  # every domain  # fmt: skip
    assert "samples of digits's test split (domains all), disjoint" in " ".join(capsys.readouterr().out.split())
