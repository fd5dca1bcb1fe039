"""CReFF's Table 1 on data at hand: FedAvg, FedProx, FedAvgM, FedNova, CCVR, Fed-Focal,
FedAvg + tau-norm and CReFF on a long-tailed, label-skewed training set, over seeds.

    python benchmarks/longtail_accuracy.py --dataset digits     # scikit-learn's digits, MLP
    python benchmarks/longtail_accuracy.py --dataset mnist      # MNIST test set split 80/20, simple CNN

The paper's set-up, scaled to these small sets: the training set shaped to IF=100
(`long_tail.imbalance`: class c keeps n_max * IF^(-c/9)), Dirichlet(0.5) over 20 clients,
40% of them per round, batch 32, plain SGD at lr 0.1 (the reference's), `--epochs` local
epochs (the paper: 10), CReFF's m=100, I=100, J=300; the balanced test set. Many / medium /
few-shot classes at the paper's thresholds scaled by n_max / 5000 (CIFAR-10-LT's > 1500 and
< 200 training samples). Cells: mean +- std over the seeds of the mean of the last 10
evaluations (all classes; few-shot classes); the paper's CIFAR-10-LT IF=100 row for
reference. All runs share one local Ray started here. Results: benchmarks/results-longtail-*.txt.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PAPER = {"fedavg": 56.17, "ccvr": 69.53, "fedavg_taunorm": 49.95, "creff": 70.55}  # CIFAR-10-LT, IF=100
ALGORITHMS = ["fedavg", "fedprox", "fedavgm", "fednova", "ccvr", "fedfocal", "fedavg_taunorm", "creff"]


def last10(rows: list, key: str) -> float:
    got = [r[key] for r in rows if r.get(key) is not None][-10:]
    return statistics.mean(got) if got else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--mnist-dir", type=Path, default=HERE.parent.parent / "shared" / "data" / "mnist-t10k")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--imbalance", type=float, default=100)
    p.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    args = p.parse_args()
    from raysim.run import main as run

    ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        if args.dataset == "mnist":
            from accuracy_mnist import write_split

            write_split(args.mnist_dir, Path(tmp) / "data")
            data, n_max = ["dataset=mnist", f"data_dir={tmp}/data", "download=false", "model=cnn"], 800
        else:
            data, n_max = ["dataset=digits", "model=mlp"], 1437 / 10
        shots = [int(round(1500 * n_max / 5000)), int(round(200 * n_max / 5000))]
        common = [*data, f"long_tail.imbalance={args.imbalance}", "partition=dirichlet", "partition.beta=0.5",
                  "num_clients=20", "participation=0.4", f"rounds={args.rounds}", f"local.epochs={args.epochs}",
                  "local.batch_size=32", "local.lr=0.1", "local.momentum=0", "local.weight_decay=0",
                  f"eval.shots=[{shots[0]},{shots[1]}]", "eval_every=1", "checkpoint_every=0", "--quiet"]
        print(f"{args.dataset}: IF={args.imbalance:g}, Dirichlet(0.5), 20 clients, 8 per round, {args.epochs} local "
              f"epochs, batch 32, SGD lr 0.1, {args.rounds} rounds, shots > {shots[0]} / < {shots[1]} training "
              f"samples, seeds {args.seeds} {' '.join(args.set)}")
        print("mean of the last 10 evaluations, mean +- std over seeds (%); paper: CIFAR-10-LT IF=100")
        print(f"{'algorithm':<16}{'all classes':>16}{'many':>8}{'medium':>8}{'few':>16}{'paper':>8}{'s/run':>7}")
        for algo in args.algorithms:
            acc, many, medium, few, secs = [], [], [], [], []
            for seed in args.seeds:
                name = f"{algo}-{seed}"
                out = io.StringIO()
                t0 = time.time()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    code = run([*common, f"algorithm={algo}", f"seed={seed}", f"output_dir={tmp}/runs",
                                f"run_name={name}", *args.set])
                secs.append(time.time() - t0)
                if code != 0:
                    raise SystemExit(f"{name} failed with exit code {code}:\n{out.getvalue()[-2000:]}")
                rows = pq.read_table(Path(tmp) / "runs" / name / "metrics.parquet").to_pylist()
                acc.append(100 * last10(rows, "accuracy"))
                many.append(100 * last10(rows, "many_accuracy"))
                medium.append(100 * last10(rows, "medium_accuracy"))
                few.append(100 * last10(rows, "few_accuracy"))
            m, sd = statistics.mean, statistics.pstdev
            print(f"{algo:<16}{m(acc):>8.1f} +- {sd(acc):>4.1f}{m(many):>8.1f}{m(medium):>8.1f}"
                  f"{m(few):>8.1f} +- {sd(few):>4.1f}{PAPER.get(algo, float('nan')):>8.2f}{m(secs):>7.0f}", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
