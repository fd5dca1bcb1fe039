"""Long-tailed training sets for any dataset (CReFF's set-up, after Cao et al. 2019, LDAM):
keep n_c = n_max * IF^(-c / (C - 1)) samples of class c, n_max = (training samples) / C,
so class 0 keeps n_max and class C-1 keeps n_max / IF (`long_tail.imbalance` = IF; 1: off).
Which samples of a class are kept is drawn from the seed; a class with fewer samples than
its n_c keeps all it has. The test set is left balanced. Done before partitioning, so any
partition (the paper: Dirichlet 0.5) splits the long-tailed set.

Reference: shangxinyi/CReFF-FL, Dataset/long_tailed_cifar10.py (`train_long_tail`:
img_max = len(data) / C, img_num = img_max * (1/IF)^(c / (C - 1))).
"""
from __future__ import annotations

import numpy as np


def profile(n_total: int, num_classes: int, imbalance: float) -> np.ndarray:
    """Samples to keep per class: int(n_max * IF^(-c / (C - 1)))."""
    n_max = n_total / num_classes
    c = np.arange(num_classes)
    return (n_max * float(imbalance) ** (-c / max(num_classes - 1, 1))).astype(np.int64)


def long_tail_index(y: np.ndarray, num_classes: int, imbalance: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of the training samples a long-tailed set keeps."""
    keep = []
    for c, n in enumerate(profile(len(y), num_classes, imbalance)):
        members = np.flatnonzero(y == c)
        keep.append(rng.permutation(members)[:n])
    return np.sort(np.concatenate(keep))


def shot_groups(train_counts: np.ndarray, shots) -> dict[str, np.ndarray]:
    """Classes by training samples: many (> shots[0]), medium, few (< shots[1]); empty groups left out."""
    many, few = int(shots[0]), int(shots[1])
    groups = {"many": train_counts > many, "medium": (train_counts <= many) & (train_counts >= few),
              "few": train_counts < few}
    return {k: np.flatnonzero(v) for k, v in groups.items() if v.any()}


def shot_accuracy(per_class: list, test_counts: np.ndarray, groups: dict[str, np.ndarray]) -> dict[str, float]:
    """Accuracy on the test samples of each group's classes: {many_accuracy, medium_accuracy, few_accuracy}."""
    acc = np.asarray(per_class, dtype=np.float64)
    out = {}
    for name, classes in groups.items():
        n = test_counts[classes]
        if n.sum() > 0:
            out[f"{name}_accuracy"] = float((acc[classes] * n).sum() / n.sum())
    return out
