"""FedConcat and FedConcat-ID against FedAvg at equal communication, on an extreme label
skew (#C=2: every client holds two labels) of real offline data.

    python benchmarks/fedconcat_accuracy.py [--seeds 0 1 2]       # digits, MLP
    python benchmarks/fedconcat_accuracy.py --dataset mnist       # MNIST test set split 80/20, simple CNN

40 clients with #C=2, all of them every round (the paper's Table 1 set-up: 10 local
epochs, batch 64, SGD lr 0.01 momentum 0.9, K = 5 clusters, 31 encoder rounds + 200
classifier rounds of 3 local steps) on scikit-learn's digits (real 8x8 scans; MLP: too
small for the paper's CNN) or on the 10,000 MNIST test images of ../shared/data split
8,000 / 2,000 (the paper's simple CNN). FedAvg runs long enough; its accuracy is read at the last
round whose cumulative bytes (down + up, the runtime's count) do not exceed the FedConcat
variant's total: equal communication. Printed per seed and as mean +- std: final accuracy
and the mean of the last 10 evaluations (FedAvg: the 10 up to the equal-bytes round).
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
COMMON = ["partition=classes", "partition.k=2", "num_clients=40", "participation=1.0",
          "local.epochs=10", "local.batch_size=64", "local.lr=0.01", "local.momentum=0.9", "eval_every=1",
          "checkpoint_every=0", "--quiet"]
DATA = ["dataset=digits", "model=mlp"]
CONCAT = ["rounds=231", "fedconcat.encoder_rounds=31", "fedconcat.clusters=5", "fedconcat.classifier_steps=3"]


def run(args: list[str], out: str, name: str) -> list[dict]:
    from raysim.run import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = main([*DATA, *COMMON, *args, f"output_dir={out}", f"run_name={name}"])
    if code != 0:
        raise SystemExit(f"{name} failed:\n{buf.getvalue()[-2000:]}")
    return pq.read_table(Path(out) / name / "metrics.parquet").to_pylist()


def total_bytes(row: dict) -> int:
    return row["bytes_down"] + row["bytes_up"]


def ms(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} +- {statistics.pstdev(values):.4f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--mnist-dir", type=Path, default=HERE.parent.parent / "shared" / "data" / "mnist-t10k")
    args = p.parse_args()
    global DATA
    data_tmp = tempfile.TemporaryDirectory()
    if args.dataset == "mnist":
        sys.path.insert(0, str(HERE))
        from accuracy_mnist import write_split

        write_split(args.mnist_dir, Path(data_tmp.name) / "data")
        DATA = ["dataset=mnist", f"data_dir={data_tmp.name}/data", "download=false", "model=cnn"]
    fedavg_rounds = 120 if args.dataset == "digits" else 70
    ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    res: dict = {k: {"final": [], "last10": []} for k in ("fedconcat", "fedconcat_id", "fedavg@fedconcat",
                                                          "fedavg@fedconcat_id")}
    print(f"{args.dataset}, 40 clients, #C=2, all per round, 10 local epochs; FedConcat: K=5, 31 encoder + 200 classifier "
          "rounds; FedAvg read at the same total bytes")
    print(f"{'seed':<6}{'variant':<14}{'MB':>8}{'final':>8}{'last10':>8}   {'FedAvg round':>12}{'final':>8}{'last10':>8}")
    with tempfile.TemporaryDirectory() as out:
        for seed in args.seeds:
            avg = run(["algorithm=fedavg", f"rounds={fedavg_rounds}", f"seed={seed}"], out, f"fedavg-{seed}")
            for a in ("fedconcat", "fedconcat_id"):
                m = run([f"algorithm={a}", f"seed={seed}", *CONCAT], out, f"{a}-{seed}")
                budget = total_bytes(m[-1])
                within = [r for r in avg if total_bytes(r) <= budget]
                if len(within) == len(avg):
                    raise SystemExit("FedAvg ran out of rounds before reaching FedConcat's bytes: raise its rounds")
                acc = [r["accuracy"] for r in m]
                acc_avg = [r["accuracy"] for r in within]
                res[a]["final"].append(acc[-1])
                res[a]["last10"].append(statistics.mean(acc[-10:]))
                res[f"fedavg@{a}"]["final"].append(acc_avg[-1])
                res[f"fedavg@{a}"]["last10"].append(statistics.mean(acc_avg[-10:]))
                print(f"{seed:<6}{a:<14}{budget / 2**20:>8.1f}{acc[-1]:>8.4f}{statistics.mean(acc[-10:]):>8.4f}   "
                      f"{within[-1]['round']:>12}{acc_avg[-1]:>8.4f}{statistics.mean(acc_avg[-10:]):>8.4f}", flush=True)
    print()
    for a in ("fedconcat", "fedconcat_id"):
        print(f"{a:<14} final {ms(res[a]['final'])}  last10 {ms(res[a]['last10'])}")
        print(f"{'FedAvg, same bytes':<14} final {ms(res['fedavg@' + a]['final'])}  "
              f"last10 {ms(res['fedavg@' + a]['last10'])}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
