"""Partitioning and data generation at scale: seconds per partitioner for N clients of S
samples each (random labels, 10 classes), and FedProx Synthetic generation for N users.

    python benchmarks/partition_scale.py --clients 100000 --per-client 20
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from raysim.config import ConfigError, load_config
from raysim.data.datasets import load_dataset
from raysim.data.partition import make_partition


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=100_000)
    p.add_argument("--per-client", type=int, default=20)
    args = p.parse_args()
    n, per = args.clients, args.per_client
    y = np.random.default_rng(0).integers(0, 10, n * per)
    print(f"{n} clients x {per} samples ({len(y):,} labels)")
    print(f"{'partition':<12}{'seconds':>9}{'smallest':>10}")
    for name in ("iid", "dirichlet", "quantity", "classes", "shards", "power_law"):
        cfg = load_config(overrides=[f"partition={name}", f"num_clients={n}"])
        t0 = time.perf_counter()
        try:
            sizes = make_partition(y, cfg, 10).sizes()
            print(f"{name:<12}{time.perf_counter() - t0:>9.2f}{sizes.min():>10}")
        except ConfigError as e:
            print(f"{name:<12}{time.perf_counter() - t0:>9.2f}  refused: {e}")
    cfg = load_config(overrides=["dataset=synthetic", f"num_clients={n}", f"synthetic.samples_per_client={per}"])
    t0 = time.perf_counter()
    data = load_dataset(cfg)
    print(f"synthetic generation, {n} users x {per}: {time.perf_counter() - t0:.2f} s, "
          f"{data.x_train.nbytes / 2**20:.0f} MB of training features")


if __name__ == "__main__":
    main()
