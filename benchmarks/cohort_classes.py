"""A class's accuracy against how many of the round's clients hold it (issue 72, the results
table's mnist_c2 Fed2 row): for finished runs, every evaluation from `--from` on, each class's
accuracy on the global test set after the round, grouped by the number of that round's
selected clients with samples of the class (metrics.parquet's `selected` and
`per_class_accuracy`; the partition made again from the run's own config).

Fed2's grouped layers give each class its own features, trained in a round by every selected
client, most of whom lack the class when few hold it (algorithms/fed2.py, "Seed 2's dip"); a
plain network's features are shared by the classes. Runs of one seed select the same clients,
so two methods' rows compare class by class on the same cohorts.

    python benchmarks/cohort_classes.py runs/sweeps/results_table/seed=0,setting=mnist_c2,algorithm=fed2 \\
        runs/sweeps/results_table/seed=0,setting=mnist_c2,algorithm=fedavg_vgg9

The run's own config makes the partition again (its data_dir must be there).
Results: benchmarks/results-mnist-c2-causes.txt.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from raysim.config import load_config
from raysim.experiment import prepare

BANDS = ((0, 0), (1, 1), (2, 2), (3, 10 ** 9))


def holders_and_accuracy(run: Path, start: int) -> tuple[np.ndarray, np.ndarray]:
    """(holders, accuracy): one entry per (evaluation from `start`, class)."""
    cfg = load_config([str(run / "config.yaml")])
    data, part, classes = prepare(cfg)
    labels = np.asarray(data.y_train)
    holds = np.stack([np.bincount(labels[part.train[i]], minlength=classes) > 0 for i in range(len(part.train))])
    m = pd.read_parquet(run / "metrics.parquet")
    m = m[(m["round"] >= start) & m["per_class_accuracy"].notna()]
    holders = np.stack([holds[np.asarray(s, dtype=int)].sum(0) for s in m["selected"]])
    accuracy = np.stack([np.asarray(a, dtype=float) for a in m["per_class_accuracy"]])
    return holders.ravel(), accuracy.ravel()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished run directories")
    ap.add_argument("--from", dest="start", type=int, default=100, help="first round counted (default 100)")
    a = ap.parse_args(argv)
    for run in a.runs:
        holders, accuracy = holders_and_accuracy(run, a.start)
        parts = []
        for lo, hi in BANDS:
            sel = (holders >= lo) & (holders <= hi)
            if sel.any():
                band = f"{lo}" if lo == hi else f"{lo}+"
                parts.append(f"{band} holders: {accuracy[sel].mean():.3f} (n={int(sel.sum())}, min {accuracy[sel].min():.2f})")
        print(f"{run.name}: a class's accuracy after a round from round {a.start}, by the round's clients holding it: "
              + "; ".join(parts))


if __name__ == "__main__":
    main()
