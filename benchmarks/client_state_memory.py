"""Memory per client of the stateful algorithms at 1,000 clients: SCAFFOLD keeps a control
variate c_i per client, MOON the client's previous model, FedPer / FedRep a head, Ditto a
whole model; FedAvg keeps nothing.

    python benchmarks/client_state_memory.py [--clients 1000]
    python benchmarks/client_state_memory.py --clients 10000 --algorithms fedavg fedper   # issue 44

Each algorithm runs as a fresh `python -m raysim.run` (its own local Ray, 2 client actors):
FedProx Synthetic data, 25 samples per client, the MLP (60-200-200-10), every client
selected in each of 3 rounds, so that after round 1 all of them hold state; a checkpoint
after the last round. The summed PSS of the process tree (shared pages such as Ray's
object store split among the processes that map them, so nothing is counted twice) is
sampled every 0.1 s. Printed: each algorithm's state size per client (from the model),
the peak PSS, the extra PSS over FedAvg per client, and the checkpoint's size per client
(`--checkpoint-every 0`: no checkpoint, the rounds alone).
Client state is kept by the server (runtime/state_store.py; before issue 58, one Ray object
per client). `--set KEY=VALUE ...` adds overrides to every run (e.g. ray.object_store_gb=0.3).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import throughput as tp  # noqa: E402  (the process-tree memory sampler)

COMMON = ["resources.ray_start_s=0",  # client actors, always (a short run would train in the command: runtime/here.py)
          "dataset=synthetic", "synthetic.samples_per_client=25", "partition=natural", "model=mlp",
          "participation=1.0", "rounds=3", "eval_every=3", "local.epochs=1",
          "local.batch_size=25", "local.lr=0.01", "--quiet"]


def state_bytes(algorithm: str) -> int:
    """Bytes of one client's state, from the model the run uses."""
    from raysim.config import load_config
    from raysim.models import build_model

    cfg = load_config(overrides=["model=mlp", f"algorithm={algorithm}"])
    model = build_model("mlp", (60,), 10)
    if algorithm == "moon":
        from raysim.algorithms.moon import with_projection

        model = with_projection(model, int(cfg.moon.out_dim), 10)
        return sum(v.numel() * v.element_size() for v in model.state_dict().values())  # the whole previous model
    if algorithm == "scaffold":
        return sum(p.numel() * p.element_size() for p in model.parameters())  # c_i
    if algorithm in ("fedper", "fedrep"):
        return sum(v.numel() * v.element_size() for v in model.head.state_dict().values())  # its head
    if algorithm in ("ditto", "apfl"):
        return sum(v.numel() * v.element_size() for v in model.state_dict().values())  # v
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--algorithms", nargs="+", default=["fedavg", "scaffold", "moon"])
    p.add_argument("--checkpoint-every", type=int, default=3, help="0: no checkpoint (the rounds alone)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more overrides for every run, e.g. ray.object_store_gb=0.3 (issue 58's Ditto case)")
    args = p.parse_args()
    tp.PSS = True
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"host: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"{args.clients} clients, all selected each of 3 rounds, MLP on Synthetic, "
          f"checkpoint_every={args.checkpoint_every}{' ' + ' '.join(args.set) if args.set else ''}")
    print(f"{'algorithm':<10}{'state/client':>14}{'peak PSS MB':>13}{'peak RSS MB':>13}{'extra PSS/client':>18}"
          f"{'checkpoint/client':>19}{'s/round':>9}")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algorithms:
            cmd = [sys.executable, "-m", "raysim.run", *COMMON, f"num_clients={args.clients}", f"algorithm={algo}",
                   f"checkpoint_every={args.checkpoint_every}", *args.set,
                   f"output_dir={tmp}", f"run_name={algo}"]
            r, peak = tp.run_measured(cmd, env)
            if r.returncode != 0:
                raise SystemExit(r.stderr[-3000:])
            f = Path(tmp) / algo / "checkpoint.pt"
            ckpt = f.stat().st_size if f.exists() else 0
            base = base if base is not None else (peak[1], ckpt)
            extra = (peak[1] - base[0]) / args.clients
            import pyarrow.parquet as pq

            secs = sorted(pq.read_table(Path(tmp) / algo / "metrics.parquet", columns=["seconds"])["seconds"].to_pylist())
            print(f"{algo:<10}{state_bytes(algo) / 1024:>11.1f} KiB{peak[1] / 2**20:>13.0f}{peak[0] / 2**20:>13.0f}"
                  f"{extra / 1024:>14.1f} KiB{(ckpt - base[1]) / args.clients / 1024:>15.1f} KiB"
                  f"{secs[len(secs) // 2]:>9.2f}", flush=True)
    print("(extra PSS and checkpoint per client: over the first algorithm, FedAvg)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
