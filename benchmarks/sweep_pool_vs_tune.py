"""A sweep's points on Ray Tune (one client actor a point, as many at once as the CPUs) against
the same points in N processes of this machine with no Ray (`--processes N`, raysim/sweep_pool.py),
side by side in one run, and whether the two give the same models (issue 84: the results
table's ~2,000 small points, each a Tune trial).

The points: the results table's mnist_c2 (NIID-Bench's #C=2 over 100 clients, 10 a round,
the simple CNN, 5 local epochs at lr 0.1, batch 32), FedAvg, `--points` seeds of `--rounds`
rounds. Needs the MNIST split of the results table (`python benchmarks/accuracy_mnist.py
--write-split runs/data/mnist-split`, from ../shared/data):

    python benchmarks/sweep_pool_vs_tune.py [--points 4] [--rounds 30] [--processes 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTING = ["dataset=mnist", "model=cnn", "input_scale=unit", "num_clients=100", "participation=0.1",
           "partition.name=classes", "partition.k=2", "partition.test_fraction=0.2", "download=false",
           "local.epochs=5", "local.batch_size=32", "local.lr=0.1", "local.momentum=0.0", "eval_every=5",
           "algorithm=fedavg"]


def sweep(out: Path, name: str, data: Path, points: int, rounds: int, extra: list[str]) -> float:
    """Wall seconds of one sweep command, start to end (its Ray's or processes' start included)."""
    args = [sys.executable, "-m", "raysim.sweep", *SETTING, f"data_dir={data}", f"rounds={rounds}",
            "seed=" + ",".join(map(str, range(points))), *extra, "--output-dir", str(out), "--name", name]
    t = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{name}: exit {r.returncode}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", type=int, default=4)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    p.add_argument("--data", type=Path, default=Path("runs/data/mnist-split"))
    p.add_argument("--out", type=Path, default=None, help="where the two sweeps go (default: a temporary folder)")
    args = p.parse_args()
    if not args.data.is_dir():
        sys.exit(f"{args.data}: no MNIST split; python benchmarks/accuracy_mnist.py --write-split {args.data}")
    out = args.out or Path(tempfile.mkdtemp(prefix="sweep-processes-"))
    data = args.data.resolve()
    tune = sweep(out, "tune", data, args.points, args.rounds, ["resources.num_actors=1"])
    here = sweep(out, "processes", data, args.points, args.rounds, ["--processes", str(args.processes)])
    same = all(json.loads((out / "tune" / f"seed={s}" / "summary.json").read_text())["model_sha256"]
               == json.loads((out / "processes" / f"seed={s}" / "summary.json").read_text())["model_sha256"]
               for s in range(args.points))
    print(f"{args.points} points of mnist_c2 FedAvg, {args.rounds} rounds, on {os.cpu_count()} CPUs ({out})")
    print(f"  Ray Tune, 1 client actor a point:      {tune:7.1f} s  ({tune / args.points:5.1f} s a point)")
    print(f"  --processes {args.processes}, no Ray:             {here:7.1f} s  ({here / args.points:5.1f} s a point)")
    print(f"  Tune / processes: {tune / here:.2f}x; the same models (model_sha256) either way: {same}")


if __name__ == "__main__":
    main()
