"""`dataset.augment`: random crop with 4-pixel padding and horizontal flip on every training mini-batch of client
data, drawn from the work's own generator (never torch's global RNG), never on evaluation; the batched-clients
executor draws and applies the same choices. Loop / procs / Flower parity with augmentation on: the
`fedavg+augment` case of tests/tiny.py's VARIANTS."""

from dataclasses import replace

import pytest
import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.algorithms.local_sgd import run_plan
from pflbed.config import validate_config
from pflbed.data.augment import Augment, make_augment
from pflbed.engine import driver
from pflbed.engine.batched import train_together
from pflbed.engine.build import prepare
from pflbed.engine.executor import client_generator
from pflbed.errors import ConfigError
from pflbed.results.experiment import run

from ..tiny import TINY, figures, parity_config

CROP_FLIP = ["crop", "flip"]


def reference(x: torch.Tensor, draws: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Sample by sample, as the recipe is written: pad 4 pixels of `fill` on every side, cut the H×W window at
    (row, col), mirror the last axis (width) where flip is 1."""
    n, c, h, w = x.shape
    out = torch.empty_like(x)
    for k in range(n):
        padded = fill.view(c, 1, 1).expand(c, h + 8, w + 8).clone()
        padded[:, 4 : 4 + h, 4 : 4 + w] = x[k]
        i, j, flip = draws[k].tolist()
        window = padded[:, i : i + h, j : j + w]
        out[k] = window.flip(-1) if flip else window
    return out


def _images(n=64, c=3, h=6, w=7, seed=0):
    return torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(seed))


def test_crop_with_4_pixel_padding_then_horizontal_flip_sample_by_sample():
    aug = make_augment(CROP_FLIP, (3, 6, 7), ((0.1, 0.2, 0.3), (0.5, 0.25, 0.2)))
    fill = torch.tensor([-0.2, -0.8, -1.5])  # a black pixel: (0 − mean) / std per channel
    assert torch.allclose(torch.tensor(aug.fill), fill)
    x = _images()
    draws = aug.draw(len(x), torch.Generator().manual_seed(1))
    assert draws[:, :2].min() == 0 and draws[:, :2].max() == 8  # offsets 0 … 2·4
    assert set(draws[:, 2].tolist()) == {0, 1}
    got = aug.apply(x, draws)
    assert torch.equal(got, reference(x, draws, torch.tensor(aug.fill)))
    centre = torch.tensor([[4, 4, 0]] * len(x))
    assert torch.equal(aug.apply(x, centre), x)  # no shift, no flip: the image itself
    assert torch.equal(aug.apply(x, torch.tensor([[4, 4, 1]] * len(x))), x.flip(-1))


@pytest.mark.parametrize("names", [["crop"], ["flip"]])
def test_crop_or_flip_alone(names):
    aug = make_augment(names, (1, 5, 5), (0.5, 0.5))
    x = _images(40, 1, 5, 5)
    draws = aug.draw(len(x), torch.Generator().manual_seed(2))
    assert draws[:, 2].any() == ("flip" in names) and (draws[:, :2].max() == 8) == ("crop" in names)
    window = draws.clone()
    if "crop" not in names:
        window[:, :2] = 4  # the unshifted window in the reference's padded coordinates
    assert torch.equal(aug.apply(x, draws), reference(x, window, torch.tensor([-1.0])))


def test_draws_come_from_the_given_generator_never_the_global_rng():
    aug = make_augment(CROP_FLIP, (3, 6, 7), (0.5, 0.5))
    x = _images()
    state = torch.get_rng_state()
    a = aug(x, torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, aug(x, torch.Generator().manual_seed(7)))
    assert not torch.equal(a, aug(x, torch.Generator().manual_seed(8)))


def test_augment_config_and_its_errors():
    assert validate_config({"dataset": {"augment": "none"}}).dataset.augment == []
    assert validate_config({"dataset": {"augment": CROP_FLIP}}).dataset.augment == CROP_FLIP
    assert make_augment([], (3, 8, 8), (0.5, 0.5)) is None
    with pytest.raises(ConfigError, match="dataset.augment"):
        validate_config({"dataset": {"augment": ["crop", "rotate"]}})
    with pytest.raises(ConfigError, match="dataset.augment"):
        validate_config({"dataset": {"augment": ["flip", "flip"]}})
    flat = {**TINY, "dataset": {"name": "synthetic", "synthetic": {"shape": [64]}, "augment": ["flip"]}}
    with pytest.raises(ConfigError, match=r"dataset.augment: crop and flip need image samples \[C, H, W\]"):
        prepare(validate_config(flat))


def test_the_padding_is_a_raw_black_pixel_in_the_batch_s_own_dtype_and_device():
    """The fill is (0 − mean)/std in the batch's dtype: a float64 batch after a float32 one is not padded with
    float32-rounded values. On another device (here `meta`) every index tensor follows the batch there."""
    aug = make_augment(["crop"], (3, 4, 4), ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)))
    assert aug.fill == tuple(-m / s for m, s in zip((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), strict=True))
    corner = torch.tensor([[0, 0, 0]])  # the window at the top-left: its first row and column are padding
    for dtype in (torch.float32, torch.float64):
        out = aug.apply(torch.ones(1, 3, 4, 4, dtype=dtype), corner)
        assert out.dtype == dtype and torch.equal(out[0, :, 0, 0], torch.tensor(aug.fill, dtype=dtype))
    assert aug.apply(torch.ones(2, 3, 4, 4, device="meta"), aug.draw(2, torch.Generator())).device.type == "meta"
    with pytest.raises(ValueError):  # a source whose mean and std disagree in length
        make_augment(["flip"], (3, 4, 4), ((0.5, 0.5, 0.5), (0.2, 0.2)))


def _tiny(augment, **over):
    return validate_config({**TINY, "dataset": {**TINY["dataset"], "augment": augment}, "executor": {"threads": 1},
                            **over})  # fmt: skip


def test_same_seed_same_results_and_augmentation_changes_training():
    on = run(_tiny(CROP_FLIP), write=False, progress=False)
    again = run(_tiny(CROP_FLIP), write=False, progress=False)
    off = run(_tiny([]), write=False, progress=False)
    assert figures(on.summary) == figures(again.summary)
    assert all(torch.equal(on.server[k], again.server[k]) for k in on.server)
    assert not all(torch.equal(on.server[k], off.server[k]) for k in on.server)


def test_training_batches_are_augmented_evaluation_never(monkeypatch):
    """Every call of the augmentation happens outside the rounds' evaluation (test and validation scoring)."""
    seen, scored, evaluating = [], [], [False]
    apply, evaluate = Augment.apply, driver.evaluate

    def counted(self, x, draws):
        seen.append(evaluating[0])
        return apply(self, x, draws)

    def scoring(*args, **kwargs):
        scored.append(True)
        evaluating[0] = True
        try:
            return evaluate(*args, **kwargs)
        finally:
            evaluating[0] = False

    monkeypatch.setattr(Augment, "apply", counted)
    monkeypatch.setattr(driver, "evaluate", scoring)
    run(_tiny(CROP_FLIP, eval={"every": 1, "finetune": []}), write=False, progress=False)
    assert seen and not any(seen) and scored


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithms_local_training_augments(name, monkeypatch):
    """Each algorithm's client update takes its training batches through `ClientData.batch`, its choices drawn
    from a generator it was given, never torch's global RNG (None: deterministic too, since the executor seeds
    the global RNG per client, but another stream than the one the docs and the batched executor use)."""
    calls, generators = [], []
    apply, draw = Augment.apply, Augment.draw
    monkeypatch.setattr(Augment, "apply", lambda self, x, d: calls.append(len(x)) or apply(self, x, d))
    monkeypatch.setattr(Augment, "draw", lambda self, n, g: generators.append(g) or draw(self, n, g))
    # past FedBasis' FedAvg warm-up (the bases' own training loop) and FedALA's first round (ALA off: no local model)
    rounds = 3 if name in ("fedbasis", "fedala") else 1
    cfg = parity_config(name, {"threads": 1}, evaluation={"every": 100}, rounds=rounds).model_dump(mode="json")
    cfg["dataset"]["augment"] = CROP_FLIP
    if name == "fedbasis":
        cfg["algorithm"]["K"] = 2  # the warm-up trains 3 clients
    run(validate_config(cfg), write=False, progress=False)
    assert calls and all(isinstance(g, torch.Generator) and g is not torch.default_generator for g in generators)


@pytest.mark.parametrize("model", ["lenet5", "mlp"])
def test_batched_clients_see_the_loops_augmented_batches(model):
    """train_together with augmentation = each client's own run_plan (two phases, unequal clients, partial last
    batches): the batched executor draws each batch's choices from the client's generator right after its indices."""
    torch.set_num_threads(1)
    cfg = validate_config({"dataset": {"name": "digits", "augment": CROP_FLIP}, "model": {"name": model},
                           "federation": {"clients": 6, "partition": "dirichlet", "alpha": 0.3},
                           "train": {"batch_size": 8, "lr": 0.02, "momentum": 0.5, "local_epochs": 2},
                           "algorithm": {"name": "fedper", "head_finetune_epochs": 1}})  # fmt: skip
    algo = prepare(cfg)
    ctx, server = algo.ctx, algo.init_server()
    cids = sorted(ctx.federation.participated)[:3]
    plans = [algo.sgd_plan(server, algo.init_client(c), ctx.client_data(c)) for c in cids]
    together = train_together(ctx.model, plans, [ctx.client_data(c) for c in cids], cfg.train,
                              [client_generator(cfg.seed, 1, c) for c in cids])  # fmt: skip
    for c, plan, got in zip(cids, plans, together, strict=True):
        reply, state = run_plan(ctx.model, plan, ctx.client_data(c), cfg.train, client_generator(cfg.seed, 1, c))
        assert max((got[k] - v).abs().max().item() for k, v in {**reply, **state}.items()) <= 1e-5
        bare = replace(ctx.client_data(c), augment=None)  # without augmentation it lands elsewhere
        reply, state = run_plan(ctx.model, plan, bare, cfg.train, client_generator(cfg.seed, 1, c))
        assert max((got[k] - v).abs().max().item() for k, v in {**reply, **state}.items()) > 1e-3


def test_batch_draws_after_its_indices_from_the_same_generator():
    """`ClientData.batch`: the choices of a batch are the next draws of the generator its indices came from."""
    algo = prepare(_tiny(CROP_FLIP))
    data = algo.ctx.client_data(0)
    g, h = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    b = data.train[torch.randperm(data.num_train, generator=g)][:5]
    torch.randperm(data.num_train, generator=h)
    x, y = data.batch(b, g)
    expected = reference(data.x[b], algo.ctx.augment.draw(5, h), torch.tensor(algo.ctx.augment.fill))
    assert torch.equal(x, expected) and torch.equal(y, data.y[b])
