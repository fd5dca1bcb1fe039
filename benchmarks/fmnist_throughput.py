"""Fashion-MNIST in NIID-Bench's set-up (issue 83, item 2): the simple CNN's training samples
per second, raysim against a plain torch loop doing the same work, side by side in one run.

    python benchmarks/fmnist_throughput.py                 # about 4 minutes on 2 cores
    python benchmarks/fmnist_throughput.py --rounds 4 --sides plain-1,actors-2

The work is one round of NIID-Bench's FMNIST #C=2 run with one local epoch: 10 clients, all
in the round, the simple CNN, batch 64, SGD lr 0.01 momentum 0.9 weight decay 1e-5, [0, 1]
pixels, on the full 60,000 training images (Debian's dataset-fashion-mnist, or torchvision's
copy under data/). A real run is 50 rounds x 10 epochs of it: ~30 million sample passes, so
its training time is 30e6 / (samples per second), printed as minutes beside each side.

Sides, each measured in its own process:
- `plain-1`, `plain-2`: the clients one after another in one process, with 1 / 2 torch
  threads (benchmarks/throughput.py's `train_plain`: raysim's SGD, the same arithmetic as
  torch.optim.SGD), from the data and partition raysim's loaders prepare;
- `actors-2`: `python -m raysim.run` with two client actors (one CPU each);
- `vectorised-2`: the same with `local.vectorize=true` (each actor's 5 clients as one group);
- `here`: raysim in the command's own process (no Ray; `resources.ray_start_s` large).
raysim's figure is the median of its rounds' `seconds` after the first (training and
aggregation, not evaluation); the plain loop's, the median of its rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETUP = ["dataset=fmnist", "model=cnn", "partition=classes", "partition.k=2", "num_clients=10", "participation=1.0",
         "local.epochs=1", "local.batch_size=64", "local.lr=0.01", "local.momentum=0.9", "local.weight_decay=1e-5",
         "input_scale=unit", "seed=0", "checkpoint_every=0"]
RUN_SAMPLES = 50 * 10 * 60_000  # NIID-Bench: 50 rounds x 10 local epochs over the 60,000 training images
RAYSIM = {"actors-2": ["resources.num_actors=2"],
          "vectorised-2": ["resources.num_actors=2", "local.vectorize=true", "local.vectorize_group=5"],
          "here": ["resources.ray_start_s=100000"]}


def plain(threads: int, rounds: int) -> dict:
    """The round as a plain loop in this process: every client's epoch, one after another."""
    import numpy as np
    import torch

    sys.path.insert(0, str(HERE))
    from throughput import train_plain

    from raysim.config import load_config
    from raysim.experiment import prepare
    from raysim.models import build_model

    torch.set_num_threads(threads)
    cfg = load_config(overrides=SETUP)
    data, part, n_classes = prepare(cfg)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    torch.manual_seed(0)
    model = build_model(cfg.model, data.input_shape, n_classes)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    times, samples = [], 0
    for rnd in range(rounds):
        t0 = time.perf_counter()
        samples = 0
        for cid, rows in enumerate(part.train):
            model.load_state_dict(start)
            rows = torch.from_numpy(np.asarray(rows))
            train_plain(model, data.inputs(x[rows]), y[rows], cfg.local, torch.Generator().manual_seed(rnd * 1000 + cid))
            samples += len(rows)
        times.append(time.perf_counter() - t0)
    return {"round_seconds": times, "samples": samples}


def raysim_side(extra: list[str], rounds: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="fmnist-tp-"))
    r = subprocess.run([sys.executable, "-m", "raysim.run", *SETUP, *extra, f"rounds={rounds}", f"eval_every={rounds}",
                        f"output_dir={out}", "run_name=r", "--quiet"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    import pyarrow.parquet as pq

    rows = pq.read_table(out / "r" / "metrics.parquet").to_pylist()
    samples = sum(r["num_samples"] for r in pq.read_table(out / "r" / "clients.parquet").to_pylist()
                  if r["round"] == 1 and r["method"] == "client_update")
    return {"round_seconds": [r["seconds"] for r in rows], "samples": samples}


def processor() -> str:
    for line in open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sides", default="plain-1,plain-2,actors-2,vectorised-2,here")
    p.add_argument("--side", help=argparse.SUPPRESS)  # one side, in a child process
    a = p.parse_args()
    if a.side:
        kind, _, n = a.side.partition("-")
        res = plain(int(n), a.rounds) if kind == "plain" else raysim_side(RAYSIM[a.side], a.rounds)
        print(json.dumps(res))
        return
    import torch

    print(f"processor: {processor()} ({os.cpu_count()} CPUs); torch {torch.__version__}; {a.rounds} rounds a side; "
          f"one round = 10 clients x 1 epoch, batch 64")
    results = {}
    for side in a.sides.split(","):
        r = subprocess.run([sys.executable, __file__, "--side", side, "--rounds", str(a.rounds)], capture_output=True,
                           text=True)
        if r.returncode:
            print(f"{side}: failed\n{r.stderr[-1500:]}")
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        later = res["round_seconds"][1:] or res["round_seconds"]
        res["per_second"] = res["samples"] / statistics.median(later)
        results[side] = res
        print(f"{side:<13} {statistics.median(later):6.2f} s a round ({', '.join(f'{s:.2f}' for s in res['round_seconds'])})"
              f"  {res['per_second']:8,.0f} samples/s  a NIID-Bench run's training: "
              f"{RUN_SAMPLES / res['per_second'] / 60:5.1f} min", flush=True)
    if "plain-1" in results:
        base = results["plain-1"]["per_second"]
        print("against plain-1: " + ", ".join(f"{s} {r['per_second'] / base:.2f}x" for s, r in results.items()))


if __name__ == "__main__":
    main()
