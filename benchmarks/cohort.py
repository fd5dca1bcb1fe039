"""1,000 clients a round, vectorised (`local.vectorize`): raysim's round against the stacked
arithmetic alone and against a plain per-client torch loop, side by side in one run.

    python benchmarks/cohort.py                       # both workloads (about 2 minutes on 2 cores)
    python benchmarks/cohort.py --workloads mclr --rounds 8
    python benchmarks/cohort.py --workloads mclr --repeat 5      # five measurements and their median ratio
    python benchmarks/cohort.py --workloads mclr-10k --rounds 6 --group 5000   # 10,000 clients a round

Workloads (issue 41's 2-core targets):
- `mclr`: logistic regression, 2,000 clients of 200 FedProx Synthetic(1,1) training samples,
  1,000 a round, batch 10, one epoch, lr 0.01: raysim's round >= 25x the plain loop;
- `cnn`: the simple CNN on 1,000 clients x 8 random 1x28x28 images, all 1,000 a round, E=1,
  B=8: raysim's round within 1.3x of the stacked arithmetic alone.

Three measurements per workload, each with one torch thread per process:
- raysim: `python -m raysim.run` as its own process (2 client actors, groups of `--group`);
  the median of the rounds' `seconds` (the round without evaluation) after the first, and
  the median wall-clock time between rounds (everything, writing the tables included);
- arithmetic alone: in this process, `vectorized.stacked_sgd` (the steps of `cohort_sgd`:
  forward, backward, the optimizer) on data already stacked, for the groups of the actor
  with the most work (the two actors run at once, one core each, so a round cannot be
  faster than that actor's arithmetic); the median of 3;
- plain loop: the same clients one after another in this process (local SGD as
  throughput.py's `train_plain`, weights folded into a float64 mean); the median of 3 rounds.
The arithmetic and the plain loop are measured just before and just after raysim's run (the
mean of the two medians is used, both are printed): this VM's speed drifts within minutes.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

WORKLOADS = {
    "mclr": ["dataset=synthetic", "synthetic.samples_per_client=250", "synthetic.test_fraction=0.2",
             "partition=natural", "model=mclr", "num_clients=2000", "clients_per_round=1000", "local.batch_size=10",
             "local.lr=0.01", "local.momentum=0"],
    # the same at 10,000 clients a round (issue 73: the ratio held at 10x the cohort)
    "mclr-10k": ["dataset=synthetic", "synthetic.samples_per_client=250", "synthetic.test_fraction=0.2",
                 "partition=natural", "model=mclr", "num_clients=20000", "clients_per_round=10000",
                 "local.batch_size=10", "local.lr=0.01", "local.momentum=0"],
    "cnn": ["plugins=[bench_plugin]", "dataset=bench_images", "bench_images.samples_per_client=8",
            "bench_images.channels=1", "bench_images.size=28", "partition=iid", "partition.min_size=1", "model=cnn",
            "num_clients=1000", "clients_per_round=1000", "local.batch_size=8", "local.lr=0.01", "local.momentum=0.9"],
}
COMMON = ["resources.ray_start_s=0", "seed=0", "local.epochs=1", "local.weight_decay=0", "selection=random", "local.vectorize=true",
          "resources.num_actors=2", "checkpoint_every=0"]


def overrides(name: str, group: int, rounds: int) -> list[str]:
    return [*WORKLOADS[name], *COMMON, f"local.vectorize_group={group}", f"rounds={rounds}", f"eval_every={rounds}"]


def raysim_round(ov: list[str]) -> dict:
    """Run raysim as its own process; per-round medians from its metrics.parquet."""
    import numpy as np
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as out:
        env = {"PYTHONPATH": f"{HERE}:{ROOT}"}
        import os

        r = subprocess.run([sys.executable, "-m", "raysim.run", *ov, f"output_dir={out}", "run_name=bench", "--quiet"],
                           cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"raysim failed:\n{r.stdout}\n{r.stderr}")
        rows = pq.read_table(Path(out) / "bench" / "metrics.parquet").to_pylist()
    steady = rows[1:-1]  # after the first; the last one evaluates
    between = np.diff([r["elapsed"] for r in rows])[1:-1]
    return {"seconds": statistics.median(r["seconds"] for r in steady),
            "between": float(np.median(between)),
            "aggregate": statistics.median(r["aggregate_seconds"] for r in steady)}


def setup(ov: list[str]):
    import torch

    torch.set_num_threads(1)
    import bench_plugin  # noqa: F401  (registers bench_images)
    from raysim.config import load_config
    from raysim.experiment import prepare

    cfg = load_config(overrides=ov)
    data, part, n_classes = prepare(cfg)
    return cfg, data, part, n_classes


def arithmetic(cfg, data, part, n_classes, repeats: int = 3) -> float:
    """Seconds of `stacked_sgd` alone for the busiest actor's groups of round 1's cohort."""
    import numpy as np
    import torch

    from raysim.config import clients_per_round
    from raysim.data.datasets import model_inputs
    from raysim.models import build_model
    from raysim.runtime import placement
    from raysim.training import base_sample_loss, new_client, round_lr
    from raysim.vectorized import Cohort, stack_batches, stacked_sgd

    cohort = sorted(np.random.default_rng([0, 1, 1]).choice(int(cfg.num_clients), clients_per_round(cfg),
                                                            replace=False).tolist())
    work = {c: len(part.train[c]) for c in cohort}
    plan = placement.plan(cohort, work, 2, False, int(cfg.local.vectorize_group))
    _, chunk, blocks = max(plan, key=lambda p: sum(work[c] for c in p[1]))
    torch.manual_seed(0)
    model = build_model(cfg.model, data.input_shape, n_classes)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x_all, y_all = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    groups, at = [], 0
    for size in blocks:  # stacked once, before the clock starts
        cids = chunk[at:at + size]
        at += size
        rows = torch.from_numpy(np.concatenate([part.train[c] for c in cids]))
        x, y = model_inputs(x_all[rows], data.pixel_max, data.norm), y_all[rows]
        clients, o = [], 0
        for c in cids:
            n = len(part.train[c])
            clients.append(new_client(cfg, 1, c, x[o:o + n], y[o:o + n], n_classes, {}, model, 1, None, 0))
            o += n
        index, weight, _ = stack_batches(Cohort(clients, x, y), int(cfg.local.batch_size), int(cfg.local.steps))
        groups.append((x, y, index, weight))
    loss, lr, loc = base_sample_loss(cfg.local), round_lr(cfg.local, 1), cfg.local
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x, y, index, weight in groups:
            g = index.shape[1]
            params = {n: start[n].expand(g, *start[n].shape).clone().requires_grad_()
                      for n, p in model.named_parameters()}
            stacked_sgd(model, params, x, y, index, weight, loss, lr, float(loc.momentum), float(loc.weight_decay))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_round(cfg, data, part, n_classes, repeats: int = 3) -> float:
    """A round of the same cohort as a plain per-client loop, in this process (the median of
    `repeats` rounds)."""
    import numpy as np
    import torch

    from raysim.config import clients_per_round
    from raysim.models import build_model
    from throughput import train_plain

    cohort = sorted(np.random.default_rng([0, 1, 1]).choice(int(cfg.num_clients), clients_per_round(cfg),
                                                            replace=False).tolist())
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    torch.manual_seed(0)
    model = build_model(cfg.model, data.input_shape, n_classes)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    times = []
    for _ in range(repeats):  # the median of a few rounds: one round's time varies by 20 % on this machine
        t0 = time.perf_counter()
        acc, total = None, 0
        for cid in cohort:
            model.load_state_dict(glob)
            idx = torch.from_numpy(part.train[cid])
            xc, yc = data.inputs(x[idx]), y[idx]
            train_plain(model, xc, yc, cfg.local, torch.Generator().manual_seed(cid))
            n = len(yc)
            sd = model.state_dict()
            acc = {k: v.double() * n for k, v in sd.items()} if acc is None else {k: acc[k] + sd[k].double() * n for k in acc}
            total += n
        glob = {k: (v / total).to(glob[k].dtype) for k, v in acc.items()}
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["mclr", "cnn"], choices=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--group", type=int, default=500, help="local.vectorize_group (500: one group per actor)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each workload this many times in a row and print the median ratio too "
                        "(this VM's speed varies: one measurement is a sample)")
    args = p.parse_args()
    import os

    from raysim.runtime.determinism import processor

    # the ratio depends on the processor: the plain loop is Python-bound, the round arithmetic-bound
    print(f"# python benchmarks/cohort.py {' '.join(sys.argv[1:])}   ({time.strftime('%Y-%m-%d')}, "
          f"{os.cpu_count()} CPUs, {processor('cpu')})")
    for name in args.workloads:
        ov = overrides(name, args.group, args.rounds)
        cfg, data, part, n_classes = setup(ov)
        print(f"== {name}: {' '.join(ov)}")
        ratios = []
        for _ in range(args.repeat):
            # this VM's speed drifts by up to a third within minutes: the plain loop and the
            # arithmetic are measured just before and just after raysim's run, and their medians used
            before = plain_round(cfg, data, part, n_classes), arithmetic(cfg, data, part, n_classes)
            run = raysim_round(ov)
            after = plain_round(cfg, data, part, n_classes), arithmetic(cfg, data, part, n_classes)
            plain, arith = statistics.median([before[0], after[0]]), statistics.median([before[1], after[1]])
            ratios.append(plain / run["seconds"])
            print(f"   raysim s/round (median 'seconds' after round 1) {run['seconds']:.4f}   "
                  f"(wall between rounds {run['between']:.4f}; aggregate {run['aggregate']:.4f})")
            print(f"   stacked arithmetic alone, busiest actor          {arith:.4f}   raysim / arithmetic = "
                  f"{run['seconds'] / arith:.2f}x")
            print(f"   plain per-client loop, one process               {plain:.4f}   plain / raysim = "
                  f"{plain / run['seconds']:.1f}x   (before / after raysim: {before[0]:.4f} / {after[0]:.4f}; "
                  f"arithmetic {before[1]:.4f} / {after[1]:.4f})", flush=True)
        if args.repeat > 1:
            print(f"   plain / raysim over {args.repeat} measurements: median {statistics.median(ratios):.1f}x "
                  f"(range {min(ratios):.1f}-{max(ratios):.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
