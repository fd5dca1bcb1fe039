"""FedGroup's Table III rows on data at hand: FedAvg, FedProx, IFCA, FeSEM and FedGroup /
FedGrouProx (EDC, MADC, and the RCC / RAC ablations) side by side over several seeds.

    python benchmarks/clustered_accuracy.py --setup synthetic            # Synthetic(1,1), MCLR, 100 clients
    python benchmarks/clustered_accuracy.py --setup mnist                # MNIST test set split 80/20

The paper's settings (Section IV-A, FedProx's recommended learning rates and mu): E=20
local epochs, K=20 clients per round, batch 10, plain SGD, alpha=20, inter-group
aggregation off; m=5 groups on Synthetic (lr 0.01, mu 1), m=3 on MNIST (lr 0.03, mu 1).
- synthetic: FedProx's Synthetic(1,1), 100 users (log-normal sizes), MCLR; each client's
  test data is its own user's held-out 20% (`partition=natural`), as in LEAF.
- mnist: the 10,000 MNIST test images in ../shared/data split 8,000 / 2,000, FedProx's MNIST
  recipe (`partition=classes_power_law`: 2 consecutive digits per client, log-normal sizes)
  over `--clients` clients (default 200: the paper's ~69 samples per client on 69,035 images
  would be ~115 clients here), 20% of each client's samples as its local test set; MCLR.
The score is the paper's: the maximum over rounds of the weighted accuracy on the clients'
own test data (total correct / total local test samples; each client served by its group's
model, in FedAvg / FedProx by the global model), mean +- std over the seeds; also the final
round's. All runs share one local Ray started here; each is `raysim.run.main` as from the
command line. Results: benchmarks/results-clustered-*.txt.
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

PAPER = {  # Table III
    "synthetic": {"FedAvg": 74.7, "FedProx": 81.5, "IFCA": 95.5, "FeSEM": 92.1, "FG-RCC-EDC": 92.9,
                  "FG-RAC-EDC": 88.4, "FG-EDC": 87.4, "FGP-EDC": 92.1, "FG-MADC": 88.5},
    "mnist": {"FedAvg": 89.8, "FedProx": 90.7, "IFCA": 95.3, "FeSEM": 89.1, "FG-RCC-EDC": 92.6,
              "FG-RAC-EDC": 88.8, "FG-EDC": 96.0, "FGP-EDC": 96.1, "FG-MADC": 95.6, "FGP-MADC": 95.3},
}
SETUPS = {
    "synthetic": dict(groups=5, lr=0.01, mu=1.0, data=["dataset=synthetic", "synthetic.alpha=1", "synthetic.beta=1",
                                                       "partition=natural", "num_clients=100"]),
    "mnist": dict(groups=3, lr=0.03, mu=1.0, data=["partition=classes_power_law", "partition.k=2",
                                                   "partition.test_fraction=0.2"]),
}
COMMON = ["model=mclr", "clients_per_round=20", "local.epochs=20", "local.batch_size=10", "local.momentum=0",
          "local.weight_decay=0", "eval_every=1", "checkpoint_every=0", "--quiet"]


def variants(m: int, mu: float) -> dict[str, list[str]]:
    fg = [f"fedgroup.groups={m}", "fedgroup.alpha=20"]
    return {
        "FedAvg": ["algorithm=fedavg"],
        "FedProx": ["algorithm=fedprox", f"fedprox.mu={mu}"],
        "IFCA": ["algorithm=ifca", f"ifca.groups={m}"],
        "FeSEM": ["algorithm=fesem", f"fesem.groups={m}"],
        "FG-RCC-EDC": ["algorithm=fedgroup", *fg, "fedgroup.centres=random"],
        "FG-RAC-EDC": ["algorithm=fedgroup", *fg, "fedgroup.cold_clients=random"],
        "FG-EDC": ["algorithm=fedgroup", *fg],
        "FGP-EDC": ["algorithm=fedgrouprox", *fg, f"fedgroup.mu={mu}"],
        "FG-MADC": ["algorithm=fedgroup", *fg, "fedgroup.measure=madc"],
        "FGP-MADC": ["algorithm=fedgrouprox", *fg, "fedgroup.measure=madc", f"fedgroup.mu={mu}"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", choices=sorted(SETUPS), default="synthetic")
    p.add_argument("--mnist-dir", type=Path, default=HERE.parent.parent / "shared" / "data" / "mnist-t10k")
    p.add_argument("--clients", type=int, default=200, help="mnist: number of clients")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--algorithms", nargs="+", default=None, help="labels of the variants to run (default: all)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    args = p.parse_args()
    from raysim.run import main as run

    setup = SETUPS[args.setup]
    table = variants(setup["groups"], setup["mu"])
    labels = args.algorithms or list(table)
    ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        data = list(setup["data"])
        if args.setup == "mnist":
            from accuracy_mnist import write_split

            write_split(args.mnist_dir, Path(tmp) / "data")
            data += ["dataset=mnist", f"data_dir={tmp}/data", "download=false", f"num_clients={args.clients}"]
        print(f"{args.setup}: {' '.join(data[:5] if args.setup == 'synthetic' else data[:3])}, MCLR, "
              f"m={setup['groups']}, lr {setup['lr']}, mu {setup['mu']}, {args.rounds} rounds, seeds {args.seeds}, "
              f"{' '.join(args.set)}")
        print("max over rounds of the weighted accuracy on the clients' own test data (%), mean +- std over seeds; "
              "final round's; paper (Table III)")
        print(f"{'variant':<12}{'max weighted acc':>20}{'final':>16}{'paper':>8}{'s/run':>8}")
        for label in labels:
            best, final, secs = [], [], []
            for seed in args.seeds:
                name = f"{label}-{seed}"
                out = io.StringIO()
                t0 = time.time()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    code = run([*data, *COMMON, f"local.lr={setup['lr']}", f"seed={seed}", f"rounds={args.rounds}",
                                f"output_dir={tmp}/runs", f"run_name={name}", *table[label], *args.set])
                secs.append(time.time() - t0)
                if code != 0:
                    raise SystemExit(f"{name} failed with exit code {code}:\n{out.getvalue()[-2000:]}")
                rows = pq.read_table(Path(tmp) / "runs" / name / "metrics.parquet").to_pylist()
                acc = [r["local_accuracy"] for r in rows if r.get("local_accuracy") is not None]
                best.append(100 * max(acc))
                final.append(100 * acc[-1])
            sd = statistics.pstdev
            print(f"{label:<12}{statistics.mean(best):>12.1f} +- {sd(best):>4.1f}"
                  f"{statistics.mean(final):>9.1f} +- {sd(final):>4.1f}"
                  f"{PAPER[args.setup].get(label, float('nan')):>8.1f}{statistics.mean(secs):>8.0f}", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
