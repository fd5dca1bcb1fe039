"""Do the client-side baselines learn under strong label skew? All of them next to FedAvg
and FedProx, with random and with FedEntOpt selection, over several seeds.

    python benchmarks/baselines_accuracy.py                      # digits, seeds 0 1 2
    python benchmarks/baselines_accuracy.py --dataset mnist      # MNIST test set split 80/20

Data: scikit-learn's digits (real 8x8 scans, shipped with the install; MLP) or the 10,000
MNIST test images in ../shared/data split 8,000 / 2,000 (written in MNIST's own IDX format
for raysim's real loader; simple CNN). 20 clients, Dirichlet(0.1) label skew, half of them
per round, 2 local epochs, SGD momentum 0.9 (lr 0.05, `--lr`), each algorithm's defaults.
For every algorithm x selection it prints the mean +- std of the last 10 evaluations of
every seed pooled (3 seeds: 30 numbers), then the spread of the seeds' means. All runs
share one local Ray started here; each is `raysim.run.main` as from the command line.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ALGORITHMS = ["fedavg", "fedprox", "scaffold", "fednova", "moon", "fedrs", "fedlc"]
COMMON = ["partition=dirichlet", "partition.beta=0.1", "num_clients=20", "participation=0.5", "local.epochs=2",
          "local.batch_size=32", "local.momentum=0.9", "eval_every=1", "checkpoint_every=0", "--quiet"]


def mnist_dir(tmp: str, source: Path) -> list[str]:
    from accuracy_mnist import write_split

    write_split(source, Path(tmp) / "data")
    return ["dataset=mnist", f"data_dir={tmp}/data", "download=false", "model=cnn"]


def last10(run_dir: Path) -> list[float]:
    rows = pq.read_table(run_dir / "metrics.parquet").to_pylist()
    return [r["accuracy"] for r in rows if r.get("accuracy") is not None][-10:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--mnist-dir", type=Path, default=HERE.parent.parent / "shared" / "data" / "mnist-t10k")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.05, help="local SGD learning rate (NIID-Bench uses 0.01)")
    p.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    p.add_argument("--selections", nargs="+", default=["random", "fedentopt"])
    args = p.parse_args()
    from raysim.run import main as run

    ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        data = mnist_dir(tmp, args.mnist_dir) if args.dataset == "mnist" else ["dataset=digits", "model=mlp"]
        print(f"{args.dataset}, 20 clients, Dirichlet(0.1), 10 per round, {args.rounds} rounds, lr {args.lr}, "
              f"seeds {args.seeds}; "
              "last 10 evaluations of every seed pooled: mean +- std [min..max of the seeds' means]")
        print(f"{'algorithm':<10}" + "".join(f"{s:>34}" for s in args.selections))
        for algo in args.algorithms:
            cells = []
            for sel in args.selections:
                pooled, means = [], []
                for seed in args.seeds:
                    name = f"{algo}-{sel}-{seed}"
                    out = io.StringIO()
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):  # the CLI's own lines
                        code = run([*data, *COMMON, f"algorithm={algo}", f"selection={sel}", f"seed={seed}",
                                    f"rounds={args.rounds}", f"local.lr={args.lr}", f"output_dir={tmp}/runs",
                                    f"run_name={name}"])
                    if code != 0:
                        raise SystemExit(f"{name} failed with exit code {code}:\n{out.getvalue()[-2000:]}")
                    acc = last10(Path(tmp) / "runs" / name)
                    pooled += acc
                    means.append(statistics.mean(acc))
                cells.append(f"{statistics.mean(pooled):.4f} +- {statistics.pstdev(pooled):.4f} "
                             f"[{min(means):.3f}..{max(means):.3f}]")
            print(f"{algo:<10}" + "".join(f"{c:>34}" for c in cells), flush=True)
    print("(chance: 0.10)")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
