"""Accuracy metrics.

Class-weighted accuracy (FedRoD, PFLBED): client m's accuracy on a shared test set, each test sample weighted by
how common its class is in m's training data,

    P-acc_m = Σ_i P_m(y_i)·1[y_i = ŷ_i] / Σ_i P_m(y_i).

Grouping the sum by class turns it into Σ_c P_m(c)·correct_c / Σ_c P_m(c)·n_c, so one set of per-class counts
from a shared model serves every client.
"""

from __future__ import annotations

import numpy as np
import torch


def accuracy(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float((pred == y).float().mean()) if len(y) else float("nan")


def class_counts(pred: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct per class, samples per class) as float64 tensors."""
    correct = torch.bincount(y[pred == y], minlength=num_classes).double()
    total = torch.bincount(y, minlength=num_classes).double()
    return correct, total


def class_weighted_accuracy(correct: torch.Tensor, total: torch.Tensor, prior: torch.Tensor) -> float:
    p = prior.double()
    return float((p * correct).sum() / (p * total).sum())


def client_stats(values: list[float]) -> dict[str, float]:
    """Mean, population std, min and 10th percentile over clients."""
    a = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "std": float(a.std()),
        "min": float(a.min()),
        "p10": float(np.percentile(a, 10)),
    }
