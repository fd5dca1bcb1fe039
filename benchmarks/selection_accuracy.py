"""FedEntOpt against random selection on a #C=1 label skew of real offline data.

    python benchmarks/selection_accuracy.py [--seeds 0 1 2] [--rounds 60]

scikit-learn's digits (real 8x8 scans, shipped with the install), 100 clients holding one
label each (#C=1), 10% of them per round, MLP, FedAvg for local training. For each
selection strategy and seed it runs `python -m raysim.run` and reads the run directory:
the mean over rounds of the selected cohort's label entropy (from its true label counts)
and labels covered, and the mean accuracy of the last 10 rounds. Prints mean +- std over
the seeds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["dataset=digits", "model=mlp", "partition=classes", "partition.k=1", "num_clients=100",
          "participation=0.1", "local.epochs=2", "local.batch_size=32", "local.lr=0.05", "--quiet"]


def run(selection: str, seed: int, rounds: int, out: str) -> dict:
    name = f"{selection}-{seed}"
    cmd = [sys.executable, "-m", "raysim.run", *COMMON, f"selection={selection}", f"seed={seed}",
           f"rounds={rounds}", f"output_dir={out}", f"run_name={name}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    d = Path(out) / name
    rows = pq.read_table(d / "metrics.parquet").to_pylist()
    s = json.loads((d / "summary.json").read_text())
    return {"entropy": statistics.mean(x["cohort_entropy"] for x in rows),
            "labels": statistics.mean(x["cohort_labels"] for x in rows),
            "last10": s["last10_mean_accuracy"]}


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} +- {statistics.pstdev(values):.4f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--selections", nargs="+", default=["random", "fedentopt", "kl"])
    args = p.parse_args()
    print(f"digits, 100 clients, #C=1, 10 per round, {args.rounds} rounds, seeds {args.seeds}")
    print(f"{'selection':<11}{'cohort entropy (nats)':>24}{'labels per cohort':>20}{'last-10 accuracy':>22}")
    with tempfile.TemporaryDirectory() as out:
        for sel in args.selections:
            res = [run(sel, seed, args.rounds, out) for seed in args.seeds]
            print(f"{sel:<11}{mean_std([r['entropy'] for r in res]):>24}"
                  f"{statistics.mean(r['labels'] for r in res):>20.2f}{mean_std([r['last10'] for r in res]):>22}",
                  flush=True)
    print("(max entropy with 10 labels: ln 10 = 2.3026)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
