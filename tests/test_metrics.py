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
