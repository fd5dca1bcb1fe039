"""The server's torch threads when sweep points run side by side (issue 72's cost).

A sweep runs as many points at once as the CPUs hold client actors; each point's server did
its own torch work (evaluation, CReFF's and CCVR's classifier re-training) with every CPU's
threads. This measures CReFF's per-round re-training (raysim.training.train_linear: 300
epochs over 1,000 federated features in batches of 32, 9,600 steps of a 32-to-10 linear
layer, the sweep's synthetic setting) in `--procs` processes at once, each with 1 torch
thread and each with every CPU's, side by side in one run, and prints the ratio:

    python benchmarks/server_threads.py [--procs 2] [--steps 9600] [--dim 32]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def work(threads: int, steps: int, dim: int, out) -> None:
    import torch

    from raysim.training import train_linear

    torch.set_num_threads(threads)
    x = torch.randn(1000, dim, generator=torch.Generator().manual_seed(0))
    y = torch.arange(10).repeat_interleave(100)
    head = torch.nn.Linear(dim, 10)
    t = time.perf_counter()
    train_linear(head, x, y, steps, 0.01, 32, torch.Generator().manual_seed(1))
    out.put(time.perf_counter() - t)


def side_by_side(procs: int, threads: int, steps: int, dim: int) -> float:
    """Seconds of the slowest of `procs` processes running `work` at once."""
    q = mp.get_context("spawn").Queue()
    ps = [mp.get_context("spawn").Process(target=work, args=(threads, steps, dim, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    times = [q.get() for _ in ps]
    for p in ps:
        p.join()
    return max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2, help="processes at once (the sweep's points at a time)")
    ap.add_argument("--steps", type=int, default=9600)
    ap.add_argument("--dim", type=int, default=32)
    a = ap.parse_args()
    cpus = os.cpu_count() or 1
    one = side_by_side(a.procs, 1, a.steps, a.dim)
    every = side_by_side(a.procs, cpus, a.steps, a.dim)
    print(f"{a.procs} processes at once on {cpus} CPUs, {a.steps} steps each: 1 thread {one:.2f} s, "
          f"{cpus} threads {every:.2f} s; {every / one:.1f}x")


if __name__ == "__main__":
    main()
