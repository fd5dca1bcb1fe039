"""Fed2 against FedAvg on a 5-classes-per-node partition, with the GroupNorm ablation of the
paper's Fig. 12 (FedAvg, FedAvg+GN, Fed2+BN, Fed2+GN) and FedAvg+BN, over seeds.

    python benchmarks/fed2_accuracy.py --dataset digits    # scikit-learn's digits (8x8)
    python benchmarks/fed2_accuracy.py --dataset mnist     # MNIST test set split 80/20 (28x28)

Set-up, the paper's N x C scaled to these small sets: VGG-9 (FedMA's, no normalisation for
the plain model), `partition=classes k=5` over 10 nodes, every node every round (N x C =
10x5), Fed2 with L=6 grouped layers and G=10 groups (one class per group), SGD with
momentum. Cells: the final accuracy (mean of the last 5 evaluations), the best, and the
first round at which each variant reaches the best FedAvg variant's final accuracy (mean
over seeds; 'never' counts seeds that do not), mean +- std over seeds. All runs share one local Ray started here.
Results: benchmarks/results-fed2-*.txt.
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

VARIANTS = {  # name: overrides (the paper's Fig. 12 ablation)
    "fedavg": ["algorithm=fedavg"],
    "fedavg+bn": ["algorithm=fedavg", "model_options.norm=batch"],
    "fedavg+gn": ["algorithm=fedavg", "model_options.norm=group"],
    "fed2+bn": ["algorithm=fed2", "fed2.norm=batch", "fed2.layers=6", "fed2.groups=10"],
    "fed2+gn": ["algorithm=fed2", "fed2.norm=group", "fed2.layers=6", "fed2.groups=10"],
    # ours, not the paper's: the decoupled classifier averaged over every client (fed2.classifier=all)
    "fed2+gn-clsall": ["algorithm=fed2", "fed2.norm=group", "fed2.layers=6", "fed2.groups=10", "fed2.classifier=all"],
}


def pm(values: list) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return f"{statistics.mean(values):.1f} +- {statistics.stdev(values) if len(values) > 1 else 0:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--mnist-dir", type=Path, default=HERE.parent.parent / "shared" / "data" / "mnist-t10k")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--participation", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    args = p.parse_args()
    from raysim.run import main as run

    ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        if args.dataset == "mnist":
            from accuracy_mnist import write_split

            write_split(args.mnist_dir, Path(tmp) / "data")
            data = ["dataset=mnist", f"data_dir={tmp}/data", "download=false"]
        else:
            data = ["dataset=digits"]
        common = [*data, "model=vgg9", "partition=classes", "partition.k=5", f"num_clients={args.clients}",
                  f"participation={args.participation}", f"rounds={args.rounds}", f"local.epochs={args.epochs}",
                  "local.batch_size=32", f"local.lr={args.lr}", "local.momentum=0.9", "local.weight_decay=0",
                  "eval_every=1", "checkpoint_every=0", *args.set, "--quiet"]
        print(f"{args.dataset}: VGG-9, partition=classes k=5 over {args.clients} nodes, participation "
              f"{args.participation}, {args.epochs} local epoch(s), batch 32, SGD lr {args.lr} momentum 0.9, "
              f"{args.rounds} rounds, Fed2 L=6 G=10, seeds {args.seeds} {' '.join(args.set)}")
        curves: dict[str, list[list[float]]] = {}
        secs: dict[str, list[float]] = {}
        for name in args.variants:
            for seed in args.seeds:
                out = io.StringIO()
                t0 = time.time()
                with contextlib.redirect_stdout(out):
                    code = run([*common, *VARIANTS[name], f"seed={seed}", f"output_dir={tmp}/runs",
                                f"run_name={name}-{seed}"])
                if code != 0:
                    print(f"{name} seed {seed}: exit {code}", file=sys.stderr)
                    return 1
                rows = pq.read_table(Path(tmp) / "runs" / f"{name}-{seed}" / "metrics.parquet").to_pylist()
                curves.setdefault(name, []).append([100 * r["accuracy"] for r in rows])
                secs.setdefault(name, []).append(time.time() - t0)
                print(f"  {name} seed {seed}: final {statistics.mean(curves[name][-1][-5:]):.1f} "
                      f"({secs[name][-1]:.0f} s)", flush=True)
        final = {n: statistics.mean(statistics.mean(c[-5:]) for c in cs) for n, cs in curves.items()}
        base = max((n for n in final if n.startswith("fedavg")), key=final.get, default=args.variants[0])
        target = final[base]
        print(f"\naccuracy (%), mean +- std over {len(args.seeds)} seeds; target = the best FedAvg's ({base}) final "
              f"accuracy {target:.1f}")
        print(f"{'variant':<12}{'final (last 5)':>17}{'best':>15}{'round reaching target':>24}{'s/run':>8}")
        for name, cs in curves.items():
            reach = [next((i + 1 for i, a in enumerate(c) if a >= target), float("nan")) for c in cs]
            never = sum(r != r for r in reach)
            print(f"{name:<12}{pm([statistics.mean(c[-5:]) for c in cs]):>17}{pm([max(c) for c in cs]):>15}"
                  f"{pm(reach) + (f' ({never} never)' if never else ''):>24}{statistics.mean(secs[name]):>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
