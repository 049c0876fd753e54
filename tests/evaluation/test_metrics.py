import pytest
import torch

from pflbed.evaluation.metrics import class_counts, class_weighted_accuracy, client_stats


def test_class_weighted_accuracy_hand_computed():
    # shared test set: classes 0,0,1,1,2 ; predictions right, wrong, right, right, wrong
    y = torch.tensor([0, 0, 1, 1, 2])
    pred = torch.tensor([0, 1, 1, 1, 0])
    prior = torch.tensor([0.5, 0.25, 0.25])
    # Σ_i P(y_i)·1[correct] / Σ_i P(y_i) = (0.5 + 0.25 + 0.25) / (0.5+0.5+0.25+0.25+0.25) = 1.0 / 1.75
    correct, total = class_counts(pred, y, 3)
    assert correct.tolist() == [1, 2, 0] and total.tolist() == [2, 2, 1]
    assert class_weighted_accuracy(correct, total, prior) == pytest.approx(1.0 / 1.75)


def test_class_weighted_accuracy_ignores_classes_the_client_lacks():
    y = torch.tensor([0, 1, 2, 2])
    pred = torch.tensor([0, 0, 0, 0])  # only class 0 right
    correct, total = class_counts(pred, y, 3)
    assert class_weighted_accuracy(correct, total, torch.tensor([1.0, 0.0, 0.0])) == 1.0
    assert class_weighted_accuracy(correct, total, torch.tensor([0.0, 0.5, 0.5])) == 0.0


def test_client_stats():
    s = client_stats([0.5, 1.0, 0.75, 0.25])
    assert s["mean"] == pytest.approx(0.625)
    assert s["min"] == 0.25
    assert s["std"] == pytest.approx(0.2795084971874737)
    assert s["p10"] == pytest.approx(0.325)


def test_accuracy_is_the_fraction_correct_and_nan_when_empty():
    """Plain accuracy (P-FL `local`, G-FL): mean of 1[ŷ = y]; an empty split has no accuracy (NaN, skipped later)."""
    from pflbed.evaluation.metrics import accuracy

    assert accuracy(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2])) == 0.75
    assert accuracy(torch.tensor([1, 1, 1]), torch.tensor([1, 0, 0])) == pytest.approx(1 / 3)
    empty = torch.zeros(0, dtype=torch.int64)
    assert accuracy(empty, empty) != accuracy(empty, empty)  # NaN, not 0 or 1


def test_class_counts_cover_every_class_even_absent_ones():
    """Counts have one entry per class of the task (so they line up with a client's prior), zeros included."""
    y = torch.tensor([1, 1, 0])
    pred = torch.tensor([1, 0, 0])
    correct, total = class_counts(pred, y, 4)
    assert correct.tolist() == [1, 1, 0, 0] and total.tolist() == [1, 2, 0, 0]
    assert correct.dtype == total.dtype == torch.float64


def test_class_weighted_accuracy_is_not_plain_or_balanced_accuracy():
    """Σ_c P(c)·correct_c / Σ_c P(c)·n_c — distinct from plain accuracy, the per-class mean, and prior-free forms.

    Test counts [4, 2] with 3 / 1 right; prior [0.2, 0.8]:
    weighted = (0.2·3 + 0.8·1) / (0.2·4 + 0.8·2) = 1.4 / 2.4; plain = 4/6; per-class mean weighted by the prior
    = 0.2·3/4 + 0.8·1/2 = 0.55; balanced (uniform prior) = 4/6.
    """
    correct, total = torch.tensor([3.0, 1.0], dtype=torch.float64), torch.tensor([4.0, 2.0], dtype=torch.float64)
    assert class_weighted_accuracy(correct, total, torch.tensor([0.2, 0.8])) == pytest.approx(1.4 / 2.4)
    # a prior given as counts (unnormalized) means the same thing: the formula is scale-free
    assert class_weighted_accuracy(correct, total, torch.tensor([1.0, 4.0])) == pytest.approx(1.4 / 2.4)


def test_client_stats_on_a_skewed_distribution():
    """Mean (not median), population std (ddof 0), min and the linearly interpolated 10th percentile.

    [0, 0.2, 0.4, 1.0]: mean 0.4 (median 0.3); deviations −0.4, −0.2, 0, 0.6 → Σ² = 0.56, population std
    √0.14 (sample std would be √(0.56/3)); p10 at rank 0.1·3 = 0.3 → 0 + 0.3·0.2 = 0.06.
    """
    s = client_stats([0.4, 0.0, 1.0, 0.2])  # order must not matter
    assert s["mean"] == pytest.approx(0.4)
    assert s["std"] == pytest.approx(0.14**0.5)
    assert s["min"] == 0.0
    assert s["p10"] == pytest.approx(0.06)
    one = client_stats([0.7])  # a single client: std 0 (population), not NaN
    assert one == {"mean": 0.7, "std": 0.0, "min": 0.7, "p10": 0.7}
