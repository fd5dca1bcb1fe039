"""Partial sums inside the actors (`server.partial_sums`): the server actor's memory and
time per round, with and without, side by side in one Ray session.

Each case runs FedAvg rounds in which every client takes one SGD step (so the round is
mostly moving and folding updates), once per-client (every model to the server) and once
with partial sums (one weighted sum per block of clients). Printed per case: seconds per
round (median of rounds 2-4), the server's waiting-for-results and aggregate seconds, MiB
received per round, and the server actor's peak RSS.

    python benchmarks/accuracy_mnist.py --write-split runs/data/mnist-split   # once
    python benchmarks/partial_sums.py                                         # ~10 min on 2 cores
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "runs" / "data" / "mnist-split"
BASE = {"dataset": "mnist", "data_dir": str(DATA), "download": False, "input_scale": "unit", "partition": "iid",
        "partition.min_size": 5, "participation": 1.0, "rounds": 4, "local.steps": 1, "local.batch_size": 8,
        "checkpoint_every": 0, "eval_every": 4, "seed": 0}
CASES = [  # (name, overrides, block)
    ("cnn, 1000 clients per round", {"model": "cnn", "num_clients": 1000}, 50),
    ("MLP 784-3000-2500-10 (9.9 M parameters), 100 clients per round",
     {"model": "mlp", "model_options.hidden": [3000, 2500], "num_clients": 100}, 25),
]


def server_rss_sampler(peak: list, done: threading.Event) -> None:
    """The peak RSS of the process running the server actor (`ray::ServerActor...`)."""
    while not done.is_set():
        for p in psutil.process_iter(["cmdline"]):
            try:
                if p.info["cmdline"] and p.info["cmdline"][0].startswith("ray::ServerActor"):
                    peak[0] = max(peak[0], p.memory_info().rss)
            except psutil.Error:
                pass
        time.sleep(0.2)


def measure(overrides: dict, out: str) -> dict:
    import raysim

    peak, done = [0], threading.Event()
    sampler = threading.Thread(target=server_rss_sampler, args=(peak, done), daemon=True)
    sampler.start()
    try:
        res = raysim.simulate(overrides={**BASE, **overrides, "output_dir": out}, progress=False)
    finally:
        done.set()
        sampler.join()
    m = res.metrics[res.metrics["round"] >= 2]
    return {"seconds": statistics.median(m["seconds"]), "train": statistics.median(m["train_seconds"]),
            "aggregate": statistics.median(m["aggregate_seconds"]),
            "mib_up": statistics.median(m["round_bytes_up"]) / 2**20, "rss": peak[0] / 2**20,
            "accuracy": float(res.summary["final_accuracy"])}


def main() -> int:
    if not (DATA / "MNIST").exists() and not any(DATA.glob("*")):
        print(f"no MNIST split in {DATA}: python benchmarks/accuracy_mnist.py --write-split {DATA}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as out:
        for name, overrides, block in CASES:
            print(f"\n{name}")
            print(f"  {'':<22}{'s/round':>9}{'waiting':>9}{'aggregate':>10}{'MiB up':>9}{'server RSS MiB':>16}{'acc':>7}")
            rows = {}
            for label, extra in (("per client", {}), (f"partial sums ({block})", {"server.partial_sums": block})):
                r = rows[label] = measure({**overrides, **extra}, out)
                print(f"  {label:<22}{r['seconds']:>9.2f}{r['train']:>9.2f}{r['aggregate']:>10.3f}{r['mib_up']:>9.1f}"
                      f"{r['rss']:>16.0f}{r['accuracy']:>7.3f}", flush=True)
            a, b = rows.values()
            print(f"  ratio (per client / partial sums): s/round {a['seconds'] / b['seconds']:.2f}x, "
                  f"aggregate {a['aggregate'] / max(b['aggregate'], 1e-9):.1f}x, MiB up {a['mib_up'] / b['mib_up']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
