"""Throughput of raysim against a plain sequential torch loop doing the same FedAvg work.

    python benchmarks/throughput.py                      # cnn, mclr, mclr-1000, mclr-10000
    python benchmarks/throughput.py --workloads cnn mclr

Each side runs as its own fresh process (`python -m raysim.run ...` and this file with
`--sequential`), so both pay their own interpreter start, imports, data preparation (and,
for raysim, Ray start-up). While each runs, this script samples the summed RSS of that
process and all its descendants (Ray's raylet, GCS, dashboard and workers included) every
0.1 s. Printed for both: median seconds per round after the first, client updates per
second (clients per round / that median), seconds from process start to the end of
round 1, and peak summed RSS; then the ratios raysim / sequential. Seeds are fixed and
every worker uses one torch thread. Both sides evaluate once, after the last round.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

COMMON = ["plugins=[bench_plugin]", "seed=0", "local.epochs=1", "local.weight_decay=0", "selection=random"]
SYNTH = ["dataset=synthetic", "synthetic.samples_per_client=250", "synthetic.test_fraction=0.2", "partition=natural",
         "model=mclr", "clients_per_round=20", "local.batch_size=10", "local.lr=0.01", "local.momentum=0"]
WORKLOADS = {
    # compute-bound: 100 clients x 500 random 3x32x32 images, simple CNN
    "cnn": ["dataset=bench_images", "bench_images.samples_per_client=500", "partition=iid", "model=cnn",
            "num_clients=100", "clients_per_round=10", "rounds=5", "local.batch_size=64", "local.lr=0.01",
            "local.momentum=0.9"],
    # overhead-bound: 100 clients x 200 FedProx Synthetic samples, logistic regression
    "mclr": [*SYNTH, "num_clients=100", "rounds=10"],
    # the same with a 2-layer MLP (200, 200): more arithmetic per step
    "mlp": [*SYNTH, "model=mlp", "num_clients=100", "rounds=10"],
    # the same, each actor training its clients as vectorised groups (raysim/vectorized.py)
    "mlp-vec": [*SYNTH, "model=mlp", "num_clients=100", "rounds=10", "local.vectorize=true", "local.vectorize_group=10"],
    "mclr-vec": [*SYNTH, "num_clients=100", "rounds=10", "local.vectorize=true", "local.vectorize_group=10"],
    # simulated time (issue 43): mclr with devices from a trace and a diurnal availability (24 h online:
    # the same clients as mclr, every check made), and FedBuff keeping 20 in flight, 20 arrivals a round
    "mclr-clock": [*SYNTH, "num_clients=100", "rounds=10", "system.profile=trace",
                   f"system.trace={ROOT / 'examples' / 'device_trace.csv'}", "system.availability=diurnal",
                   "system.online_hours=24"],
    "mclr-fedbuff": [*SYNTH, "num_clients=100", "rounds=10", "algorithm=fedbuff", "fedbuff.concurrency=20",
                     "fedbuff.buffer=20", "system.profile=trace", f"system.trace={ROOT / 'examples' / 'device_trace.csv'}"],
    "cnn-vec": ["dataset=bench_images", "bench_images.samples_per_client=500", "partition=iid", "model=cnn",
                "num_clients=100", "clients_per_round=10", "rounds=5", "local.batch_size=64", "local.lr=0.01",
                "local.momentum=0.9", "local.vectorize=true", "local.vectorize_group=5"],
    # big data (issue 42): 1,000 clients x 500 random 3x32x32 uint8 images (1.5 GB), in Ray's object
    # store or in memory-mapped files (data_store=files)
    "cnn-1000x500": ["dataset=bench_images", "bench_images.samples_per_client=500", "partition=iid", "model=cnn",
                     "num_clients=1000", "clients_per_round=10", "rounds=6", "local.batch_size=64", "local.lr=0.01",
                     "local.momentum=0.9"],
    "cnn-1000x500-files": ["dataset=bench_images", "bench_images.samples_per_client=500", "partition=iid",
                           "model=cnn", "num_clients=1000", "clients_per_round=10", "rounds=6", "local.batch_size=64",
                           "local.lr=0.01", "local.momentum=0.9", "data_store=files"],
    # the same cohort's work as cnn with float32 features (the plain loop's side of vs_flower.py's cnn-1000-f32)
    "cnn-f32": ["dataset=bench_images", "bench_images.samples_per_client=500", "bench_images.dtype=float32",
                "partition=iid", "model=cnn", "num_clients=100", "clients_per_round=10", "rounds=5",
                "local.batch_size=64", "local.lr=0.01", "local.momentum=0.9"],
    # start-up time and memory at scale
    "mclr-1000": [*SYNTH, "num_clients=1000", "rounds=3"],
    "mclr-10000": [*SYNTH, "num_clients=10000", "rounds=3"],
}


ROUNDS = 0  # --rounds: every workload's rounds (0: each its own)


def overrides(name: str) -> list[str]:
    ov = COMMON + WORKLOADS[name]
    if ROUNDS:
        ov = [o for o in ov if not o.startswith("rounds=")] + [f"rounds={ROUNDS}"]
    rounds = next(int(o.split("=")[1]) for o in ov if o.startswith("rounds="))
    return ov + [f"eval_every={rounds}"]


# --------------------------------------------------------------------------- sequential side
def sequential(name: str) -> dict:
    """The same FedAvg rounds as a plain loop in this one process: same data and partition
    (prepared by raysim's loaders), same client sampling, same local SGD recipe."""
    from raysim.run import process_start

    t_start = process_start()  # psutil.Process().create_time() is up to 1 s early on Linux
    sys.path.insert(0, str(HERE))
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from raysim.config import clients_per_round, load_config
    from raysim.models import build_model
    from raysim.experiment import prepare

    cfg = load_config(overrides=overrides(name))
    data, part, n_classes = prepare(cfg)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    shards = [torch.from_numpy(ix) for ix in part.train]
    torch.manual_seed(0)
    model = build_model(cfg.model, data.input_shape, n_classes)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    loc, k = cfg.local, clients_per_round(cfg)
    times, t_round1 = [], None
    for rnd in range(1, int(cfg.rounds) + 1):
        t0 = time.time()
        chosen = sorted(np.random.default_rng([0, rnd, 1]).choice(int(cfg.num_clients), k, replace=False).tolist())
        acc, total = None, 0
        for cid in chosen:
            model.load_state_dict(glob)
            xc, yc = data.inputs(x[shards[cid]]), y[shards[cid]]  # images decoded per client, as raysim's actors do
            train_plain(model, xc, yc, loc, torch.Generator().manual_seed(rnd * 100003 + cid))
            n = len(yc)
            sd = model.state_dict()
            acc = {kk: v.double() * n for kk, v in sd.items()} if acc is None else {kk: acc[kk] + sd[kk].double() * n for kk in acc}
            total += n
        glob = {kk: (v / total).to(glob[kk].dtype) for kk, v in acc.items()}
        times.append(time.time() - t0)  # training only; raysim's "seconds" leaves out evaluation too
        if rnd == int(cfg.rounds):
            model.load_state_dict(glob)
            model.eval()
            with torch.no_grad():
                accuracy = float((model(data.inputs(data.x_test)).argmax(1) == torch.from_numpy(data.y_test)).float().mean())
        if t_round1 is None:
            t_round1 = time.time() - t_start
    return {"round_seconds": times, "seconds_to_end_of_round_1": t_round1, "clients_per_round": k, "accuracy": accuracy}


def train_plain(model, x, y, loc, generator) -> None:
    """One client's local SGD as a plain torch loop: `local.epochs` passes of shuffled
    minibatches, raysim's SGD (the same arithmetic as torch.optim.SGD)."""
    import torch
    import torch.nn.functional as F

    from raysim.training import SGD

    opt = SGD(model.parameters(), lr=loc.lr, momentum=loc.momentum, weight_decay=loc.weight_decay)
    model.train()
    for _ in range(int(loc.epochs)):
        perm = torch.randperm(len(y), generator=generator)
        for s in range(0, len(y), int(loc.batch_size)):
            idx = perm[s:s + int(loc.batch_size)]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()


# --------------------------------------------------------------------------- measurement
PSS = False  # --pss: also sample PSS (reading /proc/*/smaps takes ~40 ms a sample and perturbs timings)


ROLES = ("command", "server", "client actors", "Ray")


def _role(q, top) -> str:
    """A process's part in a raysim run: the command, the server actor, a client actor, or
    Ray's own (Ray names its workers' processes after the actor they run)."""
    if q.pid == top.pid:
        return "command"
    line = " ".join(q.cmdline())
    return "server" if "ServerActor" in line else "client actors" if "ClientActor" in line else "Ray"


def run_measured(cmd: list[str], env: dict, by_role: dict | None = None) -> tuple[subprocess.CompletedProcess, list]:
    """Run `cmd`, sampling the summed RSS (and with --pss the PSS) of it and its
    descendants every 0.1 s; returns (result, [peak RSS, peak PSS, peak system memory
    used over what was used when it started]). RSS counts shared pages (torch's libraries,
    the object store) once per process that maps them; PSS splits them among those
    processes; the system's used memory (psutil's `used`, as `free` shows it) counts each
    page once but not the page cache, nor shared memory (Ray's object store in /dev/shm). `by_role`, when given, is filled with the peak
    summed RSS of each of `ROLES`."""
    idle = psutil.virtual_memory().used
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0, 0, 0]
    if by_role is not None:
        by_role.update(dict.fromkeys(ROLES, 0))
    done = threading.Event()

    def sample():
        try:
            p = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        tick = 0
        while not done.is_set():
            with_pss = PSS and tick % 10 == 0  # once a second: smaps is costly
            rss = pss = 0
            roles = dict.fromkeys(ROLES, 0)
            try:
                for q in [p, *p.children(recursive=True)]:
                    try:
                        m = q.memory_full_info() if with_pss else q.memory_info()
                        rss += m.rss
                        pss += m.pss if with_pss else 0
                        if by_role is not None:
                            roles[_role(q, p)] += m.rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            peak[0] = max(peak[0], rss)
            peak[1] = max(peak[1], pss)
            peak[2] = max(peak[2], psutil.virtual_memory().used - idle)
            if by_role is not None:
                for k, v in roles.items():
                    by_role[k] = max(by_role[k], v)
            tick += 1
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    done.set()
    th.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), peak


def measure(name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "raysim.run", "--quiet", *overrides(name), f"output_dir={tmp}", "run_name=r"]
        r, peak = run_measured(cmd, env)
        if r.returncode != 0:
            raise SystemExit(f"raysim run failed:\n{r.stderr[-3000:]}")
        import pyarrow.parquet as pq

        rows = pq.read_table(Path(tmp) / "r" / "metrics.parquet").to_pylist()
        summary = json.loads((Path(tmp) / "r" / "summary.json").read_text())
        secs = [row["seconds"] for row in rows]
        res["raysim"] = {"round_seconds": secs, "seconds_to_end_of_round_1": summary["seconds_to_end_of_round_1"],
                         "clients_per_round": rows[0]["clients"], "accuracy": summary["final_accuracy"],
                         "peak_rss": peak[0], "peak_pss": peak[1]}
    r, peak = run_measured([sys.executable, str(Path(__file__).resolve()), "--sequential", name, f"--rounds={ROUNDS}"], env)
    if r.returncode != 0:
        raise SystemExit(f"sequential run failed:\n{r.stderr[-3000:]}")
    res["sequential"] = dict(json.loads(r.stdout.strip().splitlines()[-1]), peak_rss=peak[0], peak_pss=peak[1])
    if not name.startswith("mclr-"):
        # Control: two sequential loops at once. How much they slow each other (shared
        # caches, memory bandwidth, clocks) bounds what any 2-worker runtime can reach.
        seq_cmd = [sys.executable, str(Path(__file__).resolve()), "--sequential", name, f"--rounds={ROUNDS}"]
        procs = [subprocess.Popen(seq_cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        pair = [statistics.median(json.loads(p.communicate()[0].strip().splitlines()[-1])["round_seconds"][1:]) for p in procs]
        res["ceiling"] = 2 * statistics.median(res["sequential"]["round_seconds"][1:]) / statistics.mean(pair)
    for side in (res["raysim"], res["sequential"]):
        after_first = side["round_seconds"][1:] or side["round_seconds"]
        side["median_round_seconds"] = statistics.median(after_first)
        side["client_updates_per_second"] = side["clients_per_round"] / side["median_round_seconds"]
    return res


def speed_ratio(res: dict) -> float:
    return res["sequential"]["median_round_seconds"] / res["raysim"]["median_round_seconds"]


def report(name: str, res: dict) -> str:
    r, s = res["raysim"], res["sequential"]
    lines = [f"== {name}: {' '.join(WORKLOADS[name])}{f' (--rounds {ROUNDS})' if ROUNDS else ''}",
             f"{'':<34}{'raysim':>12}{'sequential':>12}{'ratio':>10}"]

    def row(label, key, fmt, ratio):
        lines.append(f"{label:<34}{format(r[key], fmt):>12}{format(s[key], fmt):>12}{ratio(r[key], s[key]):>9.2f}x")

    row("median s/round after the first", "median_round_seconds", ".4f", lambda a, b: b / a)
    row("client updates per second", "client_updates_per_second", ".1f", lambda a, b: a / b)
    row("s from start to end of round 1", "seconds_to_end_of_round_1", ".2f", lambda a, b: a / b)
    for key in ("rss", "pss") if PSS else ("rss",):
        a, b = r[f"peak_{key}"], s[f"peak_{key}"]
        lines.append(f"{f'peak summed {key.upper()} (MB)':<34}{a / 2**20:>12.0f}{b / 2**20:>12.0f}{a / b:>9.2f}x")
    lines.append(f"{'final accuracy':<34}{r['accuracy']:>12.4f}{s['accuracy']:>12.4f}")
    if "ceiling" in res:
        lines.append(f"{'2-worker ceiling (2 loops at once)':<34}{'':>24}{res['ceiling']:>9.2f}x")
    lines.append("(speed ratios: >1 means raysim is faster; start and memory ratios: raysim / sequential)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--sequential", metavar="WORKLOAD", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="also write the raw measurements here")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each workload N times, the workloads in turn (a slow spell of the machine hits "
                        "all of them); the table shows the run with the median speed ratio")
    p.add_argument("--rounds", type=int, default=0, help="rounds for every workload (default: each its own); "
                   "more rounds steady a median on a noisy machine")
    p.add_argument("--pss", action="store_true", help="also report peak summed PSS (perturbs the timings)")
    args = p.parse_args()
    global PSS, ROUNDS
    PSS, ROUNDS = args.pss, args.rounds
    if args.sequential:  # the child inherits --rounds
        print(json.dumps(sequential(args.sequential)))
        return 0
    print(f"host: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, python {sys.version.split()[0]}")
    all_res, measured = {}, {name: [] for name in args.workloads}
    for _ in range(max(1, args.repeat) - 1):
        for name in args.workloads:
            measured[name].append(measure(name))
    for name in args.workloads:
        measured[name].append(measure(name))
        runs = sorted(measured[name], key=speed_ratio)
        all_res[name] = dict(runs[len(runs) // 2], speed_ratios=[speed_ratio(r) for r in runs])
        print(report(name, all_res[name]), flush=True)
        if len(runs) > 1:
            print(f"speed ratio over {len(runs)} repeats: " + ", ".join(f"{r:.2f}x" for r in all_res[name]["speed_ratios"]))
    if {"mclr-1000", "mclr-10000"} <= set(all_res):
        a, b = all_res["mclr-1000"]["raysim"], all_res["mclr-10000"]["raysim"]
        data_per_client = 250 * (60 * 4 + 8)  # float32 features + int64 label, train + test
        per_client = (b["peak_rss"] - a["peak_rss"]) / 9000
        print(f"raysim memory per extra simulated client (1,000 -> 10,000): {per_client / 1024:.1f} KiB "
              f"(its data: about {data_per_client / 1024:.1f} KiB per copy)")
    for name in ("mclr-clock", "mclr-fedbuff"):  # issue 43's targets: the same cohort, in turn
        if name in measured and "mclr" in measured:
            pairs = sorted(r["raysim"]["median_round_seconds"] / base["raysim"]["median_round_seconds"]
                           for r, base in zip(measured[name], measured["mclr"]))
            print(f"{name} / mclr, raysim's s/round, repeat by repeat: " + ", ".join(f"{p:.2f}" for p in pairs)
                  + f" (median {statistics.median(pairs):.2f}; client updates per second: the inverse)")
    if args.json:
        args.json.write_text(json.dumps(all_res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
