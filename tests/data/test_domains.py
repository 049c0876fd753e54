"""Transform domains (`dataset.domains`): each transform's pixels, the assignment of samples to domains, and what a
domain copy of a dataset keeps.

`test_pflbed` checks the rotations and `invert` inside the protocol; here every transform is checked against what
it is documented to be, on inputs where a wrong kernel, padding, scale, dimension or seed shows, and `with_domains`
against the dataset it copies (both splits, users, the dataset's own seed, a single domain, an empty split).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from pflbed.cli import main
from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.data.domains import TRANSFORMS, assign_domains, with_domains
from pflbed.errors import DataError

NORM = (0.25, 0.5)  # (mean, std) the inputs were normalized with


def apply(name: str, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    return TRANSFORMS[name](x, NORM, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("name", "k"), [("rot0", 0), ("rot90", 1), ("rot180", 2), ("rot270", 3)])
def test_rotations_turn_each_image_by_their_multiple_of_90_degrees(name: str, k: int) -> None:
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    out = apply(name, x)
    assert torch.equal(out, torch.rot90(x, k, dims=(-2, -1))) and out.is_contiguous()


def test_blur_is_the_3x3_binomial_kernel_per_channel_with_edges_replicated() -> None:
    x = torch.zeros(1, 2, 5, 5)
    x[0, 0, 2, 2] = 16.0  # an impulse in channel 0 only
    out = apply("blur", x)
    k = torch.tensor([1.0, 2.0, 1.0])
    expected = torch.zeros(5, 5)
    expected[1:4, 1:4] = k[:, None] * k[None, :]
    assert torch.allclose(out[0, 0], expected) and torch.equal(out[0, 1], torch.zeros(5, 5))  # channels stay apart
    const = torch.full((2, 3, 6, 6), -1.5)
    assert torch.allclose(apply("blur", const), const)  # replicated edges: a constant image keeps its border
    ramp = torch.arange(6.0).repeat(6, 1)[None, None]  # columns 0..5
    edge = apply("blur", ramp)[0, 0, 0]
    assert torch.allclose(edge, torch.tensor([0.25, 1.0, 2.0, 3.0, 4.0, 4.75]))  # (3·0 + 1)/4 at the left edge


def test_contrast_scales_each_image_s_deviation_from_its_own_mean_by_0_4() -> None:
    offsets = torch.tensor([0.0, 5.0, -3.0]).view(3, 1, 1, 1)  # images of different means
    x = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(1)) + offsets
    out = apply("contrast", x)
    m = x.mean(dim=(1, 2, 3), keepdim=True)  # one mean per image, over its channels and pixels
    assert torch.allclose(out, m + 0.4 * (x - m), atol=1e-6)
    assert torch.allclose(out.mean(dim=(1, 2, 3)), m.flatten(), atol=1e-5)


def test_noise_is_gaussian_of_0_3_in_pixel_units_drawn_from_the_given_generator() -> None:
    x = torch.full((64, 1, 32, 32), 0.7)
    out = apply("noise", x, seed=5)
    noise = (out - x) * NORM[1]  # back to pixel units
    assert abs(noise.mean().item()) < 0.01 and abs(noise.std().item() - 0.3) < 0.01
    assert torch.equal(apply("noise", x, seed=5), out) and not torch.equal(apply("noise", x, seed=6), out)


def test_invert_maps_each_pixel_to_one_minus_it_under_the_given_normalization() -> None:
    pixels = torch.rand(2, 1, 3, 3, generator=torch.Generator().manual_seed(2))
    out = apply("invert", (pixels - NORM[0]) / NORM[1])
    assert torch.allclose(out * NORM[1] + NORM[0], 1 - pixels, atol=1e-6)


def test_assign_domains_deals_each_class_round_robin_in_a_seeded_order() -> None:
    labels = torch.tensor([0] * 7 + [1] * 5 + [2] * 1)
    d = assign_domains(labels, 3, torch.Generator().manual_seed(0))
    for c, n in ((0, 7), (1, 5), (2, 1)):
        assert sorted(d[labels == c].tolist()) == sorted(i % 3 for i in range(n))
    assert torch.equal(assign_domains(labels, 3, torch.Generator().manual_seed(0)), d)


def _source(n_train: int = 40, n_test: int = 12, users: bool = True) -> DataSource:
    g = torch.Generator().manual_seed(3)

    def split(n: int) -> ArrayDataset:
        user = torch.arange(n) % 4 if users else None
        return ArrayDataset(torch.randn(n, 1, 4, 4, generator=g), torch.arange(n) % 2, None, user)

    return DataSource(name="toy", train=split(n_train), test=split(n_test), num_classes=2, origin="generated",
                      pixel_norm=NORM)  # fmt: skip


def test_a_domain_copy_transforms_both_splits_keeps_labels_and_users_and_uses_the_dataset_s_seed() -> None:
    base = _source()
    torch.manual_seed(123)  # the global generator plays no part: the data's seed is the dataset's
    first = with_domains(base, ["clean", "noise", "invert"])
    torch.manual_seed(456)
    again = with_domains(base, ["clean", "noise", "invert"])
    assert first.name == "toy[clean,noise,invert]" and first.domain_names == ("clean", "noise", "invert")
    assert with_domains(base, ["clean"], name="toy-c").name == "toy-c"
    for split, orig, other in ((first.train, base.train, again.train), (first.test, base.test, again.test)):
        assert torch.equal(split.x, other.x) and torch.equal(split.domain, other.domain)
        assert torch.equal(split.y, orig.y) and torch.equal(split.user, orig.user)
        clean, noisy, inverted = (split.domain == d for d in range(3))
        assert torch.equal(split.x[clean], orig.x[clean]) and not torch.allclose(split.x[noisy], orig.x[noisy])
        assert torch.allclose(split.x[inverted], apply("invert", orig.x[inverted]))  # with the dataset's norm
    assert base.train.domain is None and base.train.x is not first.train.x  # the source is not changed


def test_a_single_domain_and_an_empty_or_one_sample_split() -> None:
    one = with_domains(_source(), ["blur"])
    assert (one.train.domain == 0).all() and (one.test.domain == 0).all()
    empty = with_domains(_source(n_test=0), ["rot0", "rot90"])
    assert len(empty.test) == 0 and empty.test.domain.shape == (0,) and empty.test.user is not None
    assert empty.test.x.shape == (0, 1, 4, 4) and empty.test.y.shape == (0,)
    single = _source(n_test=1)
    single = replace(single, test=ArrayDataset(single.test.x, torch.tensor([1]), None, torch.tensor([2])))
    out = with_domains(single, ["rot0", "rot90", "rot180"]).test
    assert out.domain.tolist() == [0] and out.user.tolist() == [2] and torch.equal(out.x, single.test.x)


@pytest.mark.parametrize(("domains", "message"), [
    (["rot0", "sepia"], r"dataset.domains: unknown transform\(s\) \['sepia'\]; known: clean, rot0, rot90"),
    (["rot0", "rot0"], r"dataset.domains: need one or more distinct transforms, got \['rot0', 'rot0'\]"),
    ([], r"dataset.domains: need one or more distinct transforms, got \[\]"),
])  # fmt: skip
def test_unknown_repeated_or_no_transforms_are_refused_naming_the_field(domains, message) -> None:
    with pytest.raises(DataError, match=message):
        with_domains(_source(), domains)


def test_a_dataset_with_domains_cannot_be_given_more() -> None:
    with pytest.raises(DataError, match="dataset 'toy\\[rot0\\]' already has domains; dataset.domains cannot be added"):
        with_domains(with_domains(_source(), ["rot0"]), ["rot90"])


@pytest.mark.parametrize(("shape", "domains", "message"), [
    ([20], ["clean", "contrast"], r"transforms act on images \[C, H, W\]; synthetic has samples of shape \[20\]$"),
    ([4, 5], ["clean", "blur"], r"transforms act on images \[C, H, W\]; synthetic has samples of shape \[4, 5\]$"),
    ([1, 4, 5], ["rot0", "rot270"], r"rot270 needs square images; synthetic has 4×5 images$"),
    ([1, 6, 3], ["rot90", "rot180"], r"rot90 needs square images; synthetic has 6×3 images$"),
])  # fmt: skip
def test_domains_of_samples_no_transform_can_take_are_one_line_exit_2_nothing_written(
    tmp_path, capsys, shape, domains, message
) -> None:
    """Vectors, 2-D samples and a quarter turn of an oblong image used to end in a traceback from deep in torch."""
    out = tmp_path / "run"
    args = ["run", "--set", "dataset.name=synthetic", "--set", f"dataset.synthetic.shape={shape}",
            "--set", f"dataset.domains=[{','.join(domains)}]", "--set", "train.rounds=1", "--no-progress",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search("dataset.domains: " + message, err), err
    assert not out.exists()


def test_a_half_turn_and_every_other_transform_keep_an_oblong_image_s_shape() -> None:
    """Only rot90 and rot270 swap height and width; an oblong image may take every other transform."""
    g = torch.Generator().manual_seed(0)
    split = ArrayDataset(torch.randn(12, 2, 4, 6, generator=g), torch.arange(12) % 2, None, None)
    base = DataSource(name="oblong", train=split, test=split, num_classes=2, origin="generated", pixel_norm=NORM)
    kept = [d for d in TRANSFORMS if d not in ("rot90", "rot270")]
    assert with_domains(base, kept).train.x.shape == (12, 2, 4, 6)
