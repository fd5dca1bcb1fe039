"""FedProto's clients' accuracy against the number of classes with a global prototype (issue 72,
the results table's mnist_c2): with the authors' rule (`fedproto.absent=drop`) a class that no
client of the round holds has no prototype and is never predicted, so at partial participation
the clients' accuracy follows the round's count. For finished fedproto runs, from their own
metrics.parquet (columns `prototypes` and `personal_accuracy`, every evaluation from
`--from` on): the share of rounds with every class, and the mean accuracy at each count.

    python benchmarks/fedproto_prototypes.py runs/sweeps/results_table/seed=*,setting=mnist_c2,algorithm=fedproto

Results: benchmarks/results-mnist-c2-causes.txt.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd


def describe(run: Path, start: int) -> None:
    m = pd.read_parquet(run / "metrics.parquet")
    every = m["prototypes"].dropna()
    full = int(every.max())
    shown = m[(m["round"] >= start)].dropna(subset=["personal_accuracy", "prototypes"])
    by = shown.groupby("prototypes")["personal_accuracy"].agg(["count", "mean"])
    last = m.dropna(subset=["personal_accuracy"]).tail(3)
    print(f"{run}: every class has a prototype after {100 * (every == full).mean():.0f} % of the rounds; "
          f"the last 3 evaluations {last.personal_accuracy.mean():.3f} (prototypes "
          f"{', '.join(str(int(p)) for p in last.prototypes)})")
    for count, row in by.sort_index(ascending=False).iterrows():
        print(f"  {int(count):2d} prototypes: {int(row['count']):2d} evaluations from round {start}, "
              f"clients' accuracy {row['mean']:.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished fedproto run directories")
    ap.add_argument("--from", dest="start", type=int, default=100, help="the first round counted (default 100)")
    args = ap.parse_args(argv)
    for run in args.runs:
        describe(run, args.start)


if __name__ == "__main__":
    main()
