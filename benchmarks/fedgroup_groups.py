"""Whom FedGroup's groups serve (issue 72, the results table's mnist_c2): for finished runs of
fedgroup / fedgrouprox / ifca / fesem (their checkpoint.pt keeps `group_of`), print each group's
training samples per class and the clients' own test accuracy (the mean of the last 3
evaluations, clients.parquet) by how many clients of their group hold their rarer class.

On #C=2 (each client two classes) the groups form around a dominant class, so a client's
second class can be one that few of its group's clients hold: its group model has seen
little of it.

    python benchmarks/fedgroup_groups.py runs/sweeps/results_table/seed=0,setting=mnist_c2,algorithm=fedgroup

The run's own config makes the partition again (its data_dir must be there).
Results: benchmarks/results-mnist-c2-causes.txt.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from raysim.config import load_config
from raysim.experiment import prepare

BANDS = ((1, 1), (2, 3), (4, 10 ** 9))


def describe(run: Path) -> None:
    cfg = load_config([str(run / "config.yaml")])
    data, part, classes = prepare(cfg)
    labels = np.asarray(data.y_train)
    group_of = torch.load(run / "checkpoint.pt", weights_only=False)["algorithm"]["group_of"].numpy()
    n = len(part.train)
    counts = np.stack([np.bincount(labels[part.train[i]], minlength=classes) for i in range(n)])
    groups = int(group_of.max()) + 1
    clients = pd.read_parquet(run / "clients.parquet")
    evaluations = clients[clients.method == "evaluate"]
    last = sorted(evaluations["round"].unique())[-3:]
    accuracy = evaluations[evaluations["round"].isin(last)].groupby("cid").accuracy.mean().reindex(range(n)).to_numpy()
    print(f"{run}: {n} clients, groups of {np.bincount(group_of, minlength=groups).tolist()}; "
          f"training samples per class in each group:")
    for k in range(groups):
        print(f"  group {k}: {counts[group_of == k].sum(0).tolist()}")
    holders = np.array([min(int((counts[group_of == group_of[i]][:, c] > 0).sum()) for c in np.nonzero(counts[i])[0])
                        for i in range(n)])
    print(f"  clients' own test accuracy (rounds {', '.join(map(str, last))}), mean {np.nanmean(accuracy):.3f}; "
          "by how many of their group's clients hold their rarer class:")
    for lo, hi in BANDS:
        m = (holders >= lo) & (holders <= hi)
        if m.any():
            band = f"{lo}" if lo == hi else f"{lo}+" if hi > n else f"{lo}-{hi}"
            print(f"    {band:>4}: {int(m.sum()):3d} clients, accuracy {np.nanmean(accuracy[m]):.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished run directories")
    for run in ap.parse_args(argv).runs:
        describe(run)


if __name__ == "__main__":
    main()
