"""Do the client-side baselines learn under strong label skew? All of them next to FedAvg
and FedProx, with random and with FedEntOpt selection, over several seeds.

    python benchmarks/baselines_accuracy.py                      # digits, seeds 0 1 2
    python benchmarks/baselines_accuracy.py --dataset mnist      # MNIST test set split 80/20
    python benchmarks/baselines_accuracy.py --setup c2 --dataset mnist --selections random \
        --rounds 20 --lr 0.01 --set input_scale=unit --per-class   # NIID-Bench's #C=2, 10 clients

`--setup c2`: NIID-Bench's quantity label skew #C=2 (10 clients with 2 labels each, all
of them every round, batch 64). An algorithm may carry its own overrides,
`NAME:key=value,key=value` (e.g. `scaffold-m0:algorithm=scaffold,local.momentum=0`).
`--per-class` also prints each algorithm's per-class test accuracy (mean of the last 10
evaluations, pooled over seeds): which classes an algorithm loses.

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
SETUPS = {
    "dir01": ["partition=dirichlet", "partition.beta=0.1", "num_clients=20", "participation=0.5",
              "local.batch_size=32"],
    "c2": ["partition=classes", "partition.k=2", "num_clients=10", "participation=1.0", "local.batch_size=64"],
}
COMMON = ["local.epochs=2", "local.momentum=0.9", "eval_every=1", "checkpoint_every=0", "--quiet"]


def mnist_dir(tmp: str, source: Path) -> list[str]:
    from accuracy_mnist import write_split

    write_split(source, Path(tmp) / "data")
    return ["dataset=mnist", f"data_dir={tmp}/data", "download=false", "model=cnn"]


def last10(run_dir: Path, key: str = "accuracy") -> list:
    rows = pq.read_table(run_dir / "metrics.parquet").to_pylist()
    return [r[key] for r in rows if r.get(key) is not None][-10:]


def variant(spec: str) -> tuple[str, list[str]]:
    """`fedavg` or `NAME:key=value,key=value` -> (label, overrides)."""
    if ":" not in spec:
        return spec, [f"algorithm={spec}"]
    label, over = spec.split(":", 1)
    over = over.split(",")
    if not any(o.startswith("algorithm=") for o in over):
        over.insert(0, f"algorithm={label}")
    return label, over


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--mnist-dir", type=Path, default=HERE.parent.parent / "shared" / "data" / "mnist-t10k")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.05, help="local SGD learning rate (NIID-Bench uses 0.01)")
    p.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    p.add_argument("--selections", nargs="+", default=["random", "fedentopt"])
    p.add_argument("--setup", choices=sorted(SETUPS), default="dir01")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    p.add_argument("--per-class", action="store_true", help="also print per-class accuracy")
    args = p.parse_args()
    from raysim.run import main as run

    ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        data = mnist_dir(tmp, args.mnist_dir) if args.dataset == "mnist" else ["dataset=digits", "model=mlp"]
        print(f"{args.dataset}, {' '.join(SETUPS[args.setup])}, {args.rounds} rounds, lr {args.lr}, "
              f"{' '.join(args.set)}, seeds {args.seeds}; "
              "last 10 evaluations of every seed pooled: mean +- std [min..max of the seeds' means]; "
              "a diverged seed counts as chance (0.10) for the rounds it did not run")
        print(f"{'algorithm':<14}" + "".join(f"{s:>34}" for s in args.selections))
        per_class_lines = []
        for spec in args.algorithms:
            algo, over = variant(spec)
            cells = []
            for sel in args.selections:
                pooled, means, classes, diverged = [], [], [], []
                for seed in args.seeds:
                    name = f"{algo}-{sel}-{seed}"
                    out = io.StringIO()
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):  # the CLI's own lines
                        code = run([*data, *SETUPS[args.setup], *COMMON, f"selection={sel}", f"seed={seed}",
                                    f"rounds={args.rounds}", f"local.lr={args.lr}", f"output_dir={tmp}/runs",
                                    f"run_name={name}", *args.set, *over])
                    if code not in (0, 3):  # 3: diverged, reported below
                        raise SystemExit(f"{name} failed with exit code {code}:\n{out.getvalue()[-2000:]}")
                    acc = last10(Path(tmp) / "runs" / name)
                    if code == 3:  # the rounds it did not run count as chance
                        diverged.append(seed)
                        ran = last10(Path(tmp) / "runs" / name, "round")
                        missing = args.rounds - (ran[-1] if ran else 0)
                        acc = (acc + [0.1] * missing)[-10:]
                    pooled += acc
                    means.append(statistics.mean(acc))
                    classes += last10(Path(tmp) / "runs" / name, "per_class_accuracy")
                cells.append(f"{statistics.mean(pooled):.4f} +- {statistics.pstdev(pooled):.4f} "
                             f"[{min(means):.3f}..{max(means):.3f}]" + (f" diverged: seeds {diverged}" if diverged else ""))
                if classes:
                    mean_cls = [statistics.mean(c[j] for c in classes) for j in range(len(classes[0]))]
                    per_class_lines.append(f"{algo:<14}{sel:<10}" + " ".join(f"{a:.2f}" for a in mean_cls))
            print(f"{algo:<14}" + "".join(f"{c:>34}" for c in cells), flush=True)
    print("(chance: 0.10)")
    if args.per_class:
        print("per-class test accuracy, mean of the last 10 evaluations over the seeds (classes 0..9):")
        print("\n".join(per_class_lines))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
