"""What a run's starting weights alone score (`evaluation.pretrained`, the summary's `init_from.test_acc`): the whole
file, its own classifier included whatever blocks the run loaded, on G-FL's test set and each domain's."""

import json
from dataclasses import replace

import pytest
import torch
import yaml

from pflbed.cli import main
from pflbed.engine.build import prepare
from pflbed.engine.executor import LoopExecutor
from pflbed.engine.pretrain import pretrain
from pflbed.evaluation.evaluate import evaluate
from pflbed.evaluation.pretrained import pretrained_accuracy
from pflbed.results import experiment

from ..engine.test_pretrain import _cfg as _rot4
from ..models.test_imagenet_resnet import _cfg as imagenet_cfg
from ..models.test_imagenet_resnet import imagenet_layout


def _cfg(**over):
    """digits-rot4 under PFLBED, pretrained on two domains of its test split: an MLP, which learns them in 20
    epochs (held-out accuracy 0.8)."""
    return _rot4(**{"model__name": "mlp", "pretrain__epochs": 20, "pretrain__lr": 0.1, **over})


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("pre") / "mlp"
    pretrain(_cfg(), out, log=lambda *_: None)
    return out


def _by_hand(ctx, path):
    """The file's model, loaded whole with torch, run over each test set at once: the share predicted right."""
    model = ctx.new_model()
    model.load_state_dict(torch.load(path / "model.pt", weights_only=True)["state_dict"])
    model.eval()

    def acc(split, idx):
        data = getattr(ctx.source, split)
        with torch.no_grad():
            return float((model(data.x[idx]).argmax(1) == data.y[idx]).float().mean())

    fed = ctx.federation
    return {"global": acc(fed.global_split, fed.global_test),
            "domains": {n: acc("train", i) for n, i in zip(("rot0", "rot90", "rot180", "rot270"), fed.domain_test,
                                                              strict=True)}}  # fmt: skip


def test_the_whole_file_is_scored_on_the_global_and_each_domain_s_test_set(weights):
    """The run loads the body only (its head random): the figures are still the file's own classifier's, per domain
    by name, and the pretraining's domains (rot0, rot90) score above the two it never saw."""
    ctx = prepare(_cfg(model__init_from=str(weights), model__init_blocks=["body"])).ctx
    head = ctx.model.state_keys(ctx.model.head_blocks())
    saved = torch.load(weights / "model.pt", weights_only=True)["state_dict"]
    assert not any(torch.equal(ctx.initial_params[k], saved[k]) for k in head if saved[k].numel() > 1)
    got = pretrained_accuracy(ctx)
    assert got == _by_hand(ctx, weights)
    seen, unseen = (got["domains"]["rot0"], got["domains"]["rot90"]), (got["domains"]["rot180"],
                                                                       got["domains"]["rot270"])  # fmt: skip
    assert min(seen) > max(unseen)


def test_domains_without_names_are_numbered_in_the_federation_s_order(weights):
    """A source whose domains carry no names (the PFLBED split numbers them 0, 1, …): the same figures, by number."""
    ctx = prepare(_cfg(model__init_from=str(weights))).ctx
    named = pretrained_accuracy(ctx)
    numbered = pretrained_accuracy(replace(ctx, source=replace(ctx.source, domain_names=())))
    assert numbered == {"global": named["global"], "domains": dict(zip("0123", named["domains"].values(), strict=True))}


def test_scoring_draws_nothing_from_torch_s_random_stream(weights):
    ctx = prepare(_cfg(model__init_from=str(weights))).ctx
    torch.manual_seed(5)
    pretrained_accuracy(ctx)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))


def test_weights_without_a_classifier_for_the_run_s_classes_say_why(weights, tmp_path):
    """A body alone, another class count and an ImageNet classifier (dropped on loading) are not scored."""
    saved = torch.load(weights / "model.pt", weights_only=True)["state_dict"]
    body = {k: v for k, v in saved.items() if not k.startswith("blocks.classifier")}
    torch.save(body, tmp_path / "body.pt")
    ctx = prepare(_cfg(model__init_from=str(tmp_path / "body.pt"), model__init_blocks=["body"])).ctx
    assert pretrained_accuracy(ctx) == {"why": f"{tmp_path / 'body.pt'} has no 'blocks.classifier.weight' (2 of the "
                                               f"{len(saved)} keys of blocks ['all'] missing)"}  # fmt: skip
    wide = {**saved, "blocks.classifier.weight": torch.zeros(12, saved["blocks.classifier.weight"].shape[1]),
            "blocks.classifier.bias": torch.zeros(12)}  # fmt: skip
    torch.save(wide, tmp_path / "wide.pt")
    ctx = prepare(_cfg(model__init_from=str(tmp_path / "wide.pt"), model__init_blocks=["body"])).ctx
    assert pretrained_accuracy(ctx)["why"].startswith("'blocks.classifier.weight' has shape [12, ")
    ctx = prepare(imagenet_cfg(tmp_path, imagenet_layout())).ctx
    assert pretrained_accuracy(ctx) == {"why": "the weights hold no classifier for the run's classes (an ImageNet one "
                                               "is dropped)"}  # fmt: skip


def test_a_run_s_summary_records_the_score_and_where_the_sites_hold_the_test_data_says_why(weights, tmp_path,
                                                                                         monkeypatch):  # fmt: skip
    cfg = _cfg(model__init_from=str(weights), model__init_blocks=["body"])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert main(["run", "--no-progress", "-c", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "r")]) == 0
    rec = json.loads((tmp_path / "r" / "summary.json").read_text())["init_from"]
    assert rec["test_acc"] == _by_hand(prepare(cfg).ctx, weights)

    class OnSites(LoopExecutor):
        def evaluate_on_sites(self, server, quick):
            return evaluate(self.algo, server, self.state, quick)

    monkeypatch.setattr(experiment, "make_executor", lambda algo, pool=None: (OnSites(algo, strict=True), None))
    cfg = _cfg(model__init_from=str(weights), train__rounds=1, eval__new_clients__epochs=1)
    got = experiment.run(cfg, write=False, progress=False).summary["init_from"]
    assert got["test_acc"] == {"why": "the test data is on the sites"}
