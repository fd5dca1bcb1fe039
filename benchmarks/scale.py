"""Scale: start-up time, per-round overhead and memory from 100 to 100,000 simulated
clients, and throughput with 1, 2 and 4 client actors, each next to the plain sequential
torch loop of throughput.py doing the same work in one process.

    python benchmarks/scale.py                              # all of it (~5 min on 2 cores)
    python benchmarks/scale.py --clients 100 1000 --actors 1 2
    python benchmarks/scale.py --clients --actors --cohort-clients --state-clients --population-clients  # FedBuff alone
    python benchmarks/scale.py --clients --actors --cohort-clients --state-clients --async-clients  # made when picked

Every configuration runs as fresh processes (`python -m raysim.run ...` with its own local
Ray, and the sequential loop), with the summed RSS of each process tree sampled every
0.1 s (throughput.py's `run_measured`). Small model on purpose (logistic regression on
FedProx Synthetic data, 25 samples per client): what grows with the number of clients is
the platform's own cost, not training.

- start-up: seconds from process start to the start of round 1 (imports, Ray, data
  generation and partitioning, client actors);
- s/round: median over rounds 2.. of the round's time without evaluation; 100 clients
  selected per round;
- overhead/client: (round time - clients' own training time / actors) / clients per round,
  what the runtime adds to each client update;
- memory: peak summed RSS (Ray's processes included); per extra client between scales.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import throughput as tp  # noqa: E402  (the sequential loop and the RSS sampler)

SMALL = ["dataset=synthetic", "synthetic.samples_per_client=25", "synthetic.test_fraction=0.2", "partition=natural",
         "model=mclr", "clients_per_round=100", "local.batch_size=10", "local.lr=0.01", "local.momentum=0"]
# the actors sweep: more work per client (250 samples), so that workers have something to share
WORK = ["dataset=synthetic", "synthetic.samples_per_client=250", "synthetic.test_fraction=0.2", "partition=natural",
        "model=mclr", "num_clients=1000", "clients_per_round=100", "local.batch_size=10", "local.lr=0.01",
        "local.momentum=0", "rounds=8"]


def _register(clients: list[int]) -> None:
    """Add this script's workloads to throughput.py's table (its sequential loop reads them)."""
    for n in clients:
        tp.WORKLOADS[f"scale-{n}"] = [*SMALL, f"num_clients={n}", "rounds=6"]
    tp.WORKLOADS["actors"] = WORK


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(tp.ROOT), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")


def run_raysim(name: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "raysim.run", "--quiet", "resources.ray_start_s=0", *tp.overrides(name), *extra, f"output_dir={tmp}",
               "run_name=r"]
        r, peak = tp.run_measured(cmd, _env())
        if r.returncode != 0:
            raise SystemExit(f"raysim run failed:\n{r.stderr[-3000:]}")
        d = Path(tmp) / "r"
        rows = pq.read_table(d / "metrics.parquet").to_pylist()
        clients = pq.read_table(d / "clients.parquet").to_pylist()
        actors = int((d / "log.txt").read_text().split(" client actors")[0].split()[-1])
    first = rows[0]
    later = rows[1:]
    work = {r["round"]: 0.0 for r in rows}
    for c in clients:
        work[c["round"]] += c["seconds"] or 0.0
    overhead = [(r["seconds"] - work[r["round"]] / actors) / r["clients"] for r in later]
    return {
        "actors": actors,
        "startup_seconds": first["elapsed"] - first["seconds"] - first["eval_seconds"],
        "round_seconds": statistics.median(r["seconds"] for r in later),
        "overhead_per_client": statistics.median(overhead),
        "breakdown": {k: statistics.median(r[f"{k}_seconds"] for r in later)
                      for k in ("select", "broadcast", "train", "aggregate")},
        "clients_per_round": first["clients"],
        "peak_rss": peak[0],
    }


# issue 30's scale: 1,000 clients per round, vectorised, 20-200 samples per client, N from 1,000 to 100,000
COHORT = ["dataset=synthetic", "synthetic.samples_per_client=20", "synthetic.max_samples_per_client=200",
          "synthetic.test_fraction=0.2", "partition=natural", "model=mclr", "clients_per_round=1000",
          "local.batch_size=10", "local.lr=0.01", "local.momentum=0", "local.vectorize=true", "rounds=6"]


def run_cohort(n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "raysim.run", "--quiet", "resources.ray_start_s=0", *COHORT, f"num_clients={n}", "eval_every=6",
               f"output_dir={tmp}", "run_name=r"]
        peak: dict = {}
        r, _ = tp.run_measured(cmd, _env(), by_role=peak)
        if r.returncode != 0:
            raise SystemExit(f"raysim run failed:\n{r.stderr[-3000:]}")
        peak["server"] = peak["server"] or peak["command"]  # since issue 58 the command hosts its server
        d = Path(tmp) / "r"
        rows = pq.read_table(d / "metrics.parquet").to_pylist()
        summary = json.loads((d / "summary.json").read_text())
    first, later = rows[0], rows[1:]
    return {"setup_seconds": first["elapsed"] - first["seconds"] - first["eval_seconds"],
            "round_seconds": statistics.median(r["seconds"] for r in later),
            "breakdown": {k: statistics.median(r[f"{k}_seconds"] for r in later)
                          for k in ("select", "broadcast", "train", "aggregate")},
            "samples": summary.get("train_samples"), "peak": peak}


# issue 58: asynchronous rounds at scale: FedBuff keeping 1,000 clients in flight, a buffer of 100
ASYNC = [*SMALL[:-4], "algorithm=fedbuff", "fedbuff.concurrency=1000", "fedbuff.buffer=100", "local.batch_size=10",
         "local.lr=0.01", "local.momentum=0", "rounds=30"]


def run_async(n: int) -> dict:
    """One FedBuff run with `n` clients: the median round (a buffer of 100 arrivals) after
    the first, per update, and the server's own CPU per update (`server_cpu_seconds`: pick,
    send, fold, record; the waits for the clients left out). Evaluated only after the last
    round (the test set grows with the clients)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "raysim.run", "--quiet", *ASYNC, f"num_clients={n}", "eval_every=1000",
               f"output_dir={tmp}", "run_name=r"]
        r, peak = tp.run_measured(cmd, _env())
        if r.returncode != 0:
            raise SystemExit(f"raysim run failed:\n{r.stderr[-3000:]}")
        d = Path(tmp) / "r"
        rows = pq.read_table(d / "metrics.parquet").to_pylist()
        actors = int((d / "log.txt").read_text().split(" client actors")[0].split()[-1])
    later = rows[1:]
    per_update = [row["seconds"] / row["clients"] for row in later]
    server = [row["server_cpu_seconds"] / row["clients"] for row in later]
    return {"round_seconds": statistics.median(row["seconds"] for row in later), "actors": actors,
            "per_update": statistics.median(per_update), "server_cpu_per_update": statistics.median(server),
            "updates_per_round": later[0]["clients"], "peak_rss": peak[0]}


# issue 73: populations made when picked (synthetic.generate=lazy), 1,000 clients a round, N up to 15 million
POPULATION = ["dataset=synthetic", "synthetic.samples_per_client=20", "synthetic.generate=lazy",
              "synthetic.test_users=1000", "partition=natural", "model=mclr", "clients_per_round=1000",
              "eval.local_clients=100", "local.batch_size=10", "local.lr=0.01", "local.momentum=0", "rounds=6",
              "eval_every=3"]
POPULATION_RUNS = {"fedavg": [], "scaffold": ["algorithm=scaffold"],
                   "fedbuff": ["algorithm=fedbuff", "fedbuff.concurrency=1000", "fedbuff.buffer=1000"]}


def run_population(n: int, algorithm: str) -> dict:
    """One run of `n` users made when picked, with 2 client actors: start-up (process start
    to round 1), the median round after the first (evaluations excluded), the peak summed
    RSS of the command, Ray and the actors, the system's used memory over its start, and the
    clients' state the server kept (SCAFFOLD's: the clients ever picked)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "raysim.run", "--quiet", "resources.ray_start_s=0", *POPULATION,
               *POPULATION_RUNS[algorithm], f"num_clients={n}", f"output_dir={tmp}", "run_name=r"]
        r, peak = tp.run_measured(cmd, _env())
        if r.returncode != 0:
            raise SystemExit(f"raysim run failed:\n{r.stderr[-3000:]}")
        d = Path(tmp) / "r"
        rows = pq.read_table(d / "metrics.parquet").to_pylist()
        summary = json.loads((d / "summary.json").read_text())
    first, later = rows[0], rows[1:]
    return {"startup_seconds": first["elapsed"] - first["seconds"] - (first.get("eval_seconds") or 0.0),
            "round_seconds": statistics.median(r["seconds"] for r in later), "clients": later[0]["clients"],
            "peak_rss": peak[0], "system_used": peak[2], "state_gb": summary.get("client_state_gb", 0.0),
            "states": summary.get("client_states", 0), "accuracy": summary["final_accuracy"]}


TEST_DATA = ("x_test", "y_test", "local_tests")  # the evaluation data (global and the clients' own): data


def state_of(ns: list[int]) -> dict:
    """{N: {part: bytes}} of the server's state after a 2-round cohort run with N clients
    (`FederatedServer.state_bytes`), the runs in one `raysim.simulate` session."""
    code = ("import json, sys, tempfile, ray, raysim\n"
            "from raysim.runtime import pool\n"
            "sys.path.insert(0, %r)\n"
            "from scale import COHORT\n"
            "out = {}\n"
            "with tempfile.TemporaryDirectory() as tmp:\n"
            "    for n in %r:\n"
            "        raysim.simulate(COHORT + [f'num_clients={n}', 'rounds=2', 'eval_every=2', f'output_dir={tmp}',\n"
            "                        f'run_name=s{n}'], progress=False)\n"
            "        server = pool.warm_server()\n"
            "        out[n] = ray.get(server.state_bytes.remote())\n"
            "        pool.keep_server(server, [])\n"
            "raysim.shutdown()\n"
            "print(json.dumps(out))\n") % (str(HERE), list(ns))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    if r.returncode != 0:
        raise SystemExit(f"state measurement failed:\n{r.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def run_sequential(name: str) -> dict:
    r, peak = tp.run_measured([sys.executable, str(Path(__file__).resolve()), "--sequential", name], _env())
    if r.returncode != 0:
        raise SystemExit(f"sequential run failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    first = out["round_seconds"][0]
    return {"startup_seconds": out["seconds_to_end_of_round_1"] - first,
            "round_seconds": statistics.median(out["round_seconds"][1:]), "peak_rss": peak[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", nargs="*", type=int, default=[100, 1000, 10000, 100000])
    p.add_argument("--actors", nargs="*", type=int, default=[1, 2, 4])
    p.add_argument("--cohort-clients", nargs="*", type=int, default=[1000, 10000, 100000],
                   help="N for the 1,000-per-round vectorised scale table (issue 30)")
    p.add_argument("--state-clients", nargs="*", type=int, default=[1000, 10000, 100000],
                   help="N for the server's state by part (bytes per idle client; issue 30)")
    p.add_argument("--async-clients", nargs="*", type=int, default=[1000, 10000, 100000],
                   help="N for FedBuff with 1,000 clients in flight (per-update cost; issue 58)")
    p.add_argument("--population-clients", nargs="*", type=int, default=[1000, 100000, 1000000, 15000000],
                   help="N for users made when picked, 1,000 a round (issue 73)")
    p.add_argument("--population-algorithms", nargs="*", default=list(POPULATION_RUNS), choices=list(POPULATION_RUNS))
    p.add_argument("--sequential", metavar="WORKLOAD", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="also write the raw measurements here")
    args = p.parse_args()
    _register(args.clients)
    if args.sequential:
        _register([int(args.sequential.split("-")[1])] if args.sequential.startswith("scale-") else [])
        print(json.dumps(tp.sequential(args.sequential)))
        return 0
    print(f"host: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, python {sys.version.split()[0]}")
    results: dict = {"clients": {}, "actors": {}}

    if args.clients:
        print("\n== scale: FedAvg, mclr on FedProx Synthetic (25 samples/client), 100 clients per round, 6 rounds, "
              "2 client actors")
        print(f"{'clients':>8} {'start-up s':>11} {'(seq)':>7} {'s/round':>8} {'(seq)':>7} {'speed':>6} "
              f"{'overhead':>12} {'peak RSS MB':>12} {'(seq)':>7} {'per extra client':>17}")
        prev = None
        for n in args.clients:
            r, s = run_raysim(f"scale-{n}", []), run_sequential(f"scale-{n}")
            results["clients"][n] = {"raysim": r, "sequential": s}
            extra = f"{(r['peak_rss'] - prev[1]) / (n - prev[0]) / 1024:>13.1f} KiB" if prev else f"{'':>17}"
            print(f"{n:>8} {r['startup_seconds']:>11.2f} {s['startup_seconds']:>7.2f} {r['round_seconds']:>8.4f} "
                  f"{s['round_seconds']:>7.4f} {s['round_seconds'] / r['round_seconds']:>5.2f}x "
                  f"{r['overhead_per_client'] * 1e3:>7.3f} ms/cl {r['peak_rss'] / 2**20:>12.0f} "
                  f"{s['peak_rss'] / 2**20:>7.0f} {extra}", flush=True)
            prev = (n, r["peak_rss"])
        print("(speed: sequential s/round / raysim s/round; overhead: what raysim adds per client update)")
        last = results["clients"][args.clients[-1]]["raysim"]["breakdown"]
        print(f"round breakdown at {args.clients[-1]} clients (median s): "
              + ", ".join(f"{k} {v:.4f}" for k, v in last.items()))

    if args.actors:
        print("\n== actors: FedAvg, mclr on FedProx Synthetic (250 samples/client), 1,000 clients, 100 per round, "
              "8 rounds; 0.5 CPU per actor")
        s = run_sequential("actors")
        results["actors"]["sequential"] = s
        print(f"{'actors':>8} {'s/round':>8} {'updates/s':>10} {'vs sequential':>14} {'vs 1 actor':>11}")
        print(f"{'seq':>8} {s['round_seconds']:>8.4f} {100 / s['round_seconds']:>10.1f}")
        base = None
        for k in args.actors:
            r = run_raysim("actors", [f"resources.num_actors={k}", "resources.num_cpus_per_actor=0.5"])
            results["actors"][k] = r
            base = base or r["round_seconds"]
            print(f"{k:>8} {r['round_seconds']:>8.4f} {100 / r['round_seconds']:>10.1f} "
                  f"{s['round_seconds'] / r['round_seconds']:>13.2f}x {base / r['round_seconds']:>10.2f}x", flush=True)
    if args.cohort_clients:
        print("\n== cohort scale: FedAvg, mclr on FedProx Synthetic (20-200 samples/client), 1,000 clients per round, "
              "local.vectorize, 6 rounds; peak RSS by process, MB")
        print(f"{'clients':>8} {'set-up s':>9} {'s/round':>8} {'aggregate':>10} {'command':>8} {'server':>7} "
              f"{'actors':>7} {'Ray':>6} {'server per extra client':>24}")
        results["cohort"] = {}
        prev = None
        for n in args.cohort_clients:
            r = run_cohort(n)
            results["cohort"][n] = r
            pk = r["peak"]
            extra = f"{(pk['server'] - prev[1]) / (n - prev[0]):>18.0f} bytes" if prev else f"{'':>24}"
            print(f"{n:>8} {r['setup_seconds']:>9.2f} {r['round_seconds']:>8.3f} {r['breakdown']['aggregate']:>10.4f} "
                  f"{pk['command'] / 2**20:>8.0f} {pk['server'] / 2**20:>7.0f} {pk['client actors'] / 2**20:>7.0f} "
                  f"{pk['Ray'] / 2**20:>6.0f} {extra}", flush=True)
            prev = (n, pk["server"])
        last = results["cohort"][args.cohort_clients[-1]]["breakdown"]
        print(f"round breakdown at {args.cohort_clients[-1]} clients (median s): "
              + ", ".join(f"{k} {v:.4f}" for k, v in last.items()))
    if args.async_clients:
        print("\n== asynchronous scale: FedBuff, mclr on FedProx Synthetic (25 samples/client), 1,000 clients in "
              "flight, a round = a buffer of 100 arrivals, 30 rounds")
        print(f"{'clients':>8} {'s/round':>8} {'ms/update':>10} {'vs first':>9} {'server CPU ms/update':>21} "
              f"{'vs first':>9} {'peak RSS MB':>12}")
        results["async"] = {}
        first = None
        for n in args.async_clients:
            r = run_async(n)
            results["async"][n] = r
            first = first or r
            print(f"{n:>8} {r['round_seconds']:>8.3f} {r['per_update'] * 1e3:>10.3f} "
                  f"{r['per_update'] / first['per_update']:>8.2f}x {r['server_cpu_per_update'] * 1e3:>21.3f} "
                  f"{r['server_cpu_per_update'] / first['server_cpu_per_update']:>8.2f}x "
                  f"{r['peak_rss'] / 2**20:>12.0f}", flush=True)
        print("(ms/update: a round's time over its 100 updates, rounds 2-30, median; server CPU: the server thread's "
              "CPU time in the round, metrics' server_cpu_seconds, over its updates)")
    if args.population_clients:
        print("\n== populations made when picked (issue 73): mclr on FedProx Synthetic, synthetic.generate=lazy, 20 "
              "samples a user, 1,000 a round (FedBuff: 1,000 in flight, a server step per 1,000 arrivals), 6 rounds, "
              "2 client actors; the global test set 1,000 users' splits, 100 users' own splits a round")
        print(f"{'algorithm':>9} {'clients':>11} {'start-up s':>11} {'s/round':>8} {'vs first':>9} {'peak RSS MB':>12} "
              f"{'used MB':>8} {'state GB':>9} {'states':>8}")
        results["population"] = {}
        for algorithm in args.population_algorithms:
            first = None
            for n in args.population_clients:
                r = run_population(n, algorithm)
                results["population"][f"{algorithm}-{n}"] = r
                first = first or r
                print(f"{algorithm:>9} {n:>11,} {r['startup_seconds']:>11.1f} {r['round_seconds']:>8.3f} "
                      f"{r['round_seconds'] / first['round_seconds']:>8.2f}x {r['peak_rss'] / 2**20:>12.0f} "
                      f"{r['system_used'] / 2**20:>8.0f} {r['state_gb']:>9.3f} {r['states']:>8,}", flush=True)
        print("(start-up: process start to round 1; s/round: median of rounds 2-6 without evaluation; vs first: "
              "against the smallest N; used: the system's used memory over its level at the start, Ray included "
              "but not the object store's shared memory; state: what the server keeps of its clients, the ones "
              "ever picked)")
    if args.state_clients:
        ns = args.state_clients
        print("\n== the server's state by part after a 2-round cohort run (as above), bytes "
              "(FederatedServer.state_bytes: deep sizes, each object once)")
        state = state_of(ns)
        results["state"] = state
        parts = sorted({k for v in state.values() for k in v}, key=lambda k: -state[ns[-1]].get(k, 0))
        print(f"{'part':<28}" + "".join(f"{n:>14,}" for n in ns) + f"{'per extra client':>18}")
        for part in parts:
            vals = [state[n].get(part, 0) for n in ns]
            grow = (vals[-1] - vals[0]) / (ns[-1] - ns[0]) if len(ns) > 1 else 0.0
            if max(vals) >= 1024 or abs(grow) >= 1:
                print(f"{part:<28}" + "".join(f"{v:>14,}" for v in vals) + f"{grow:>16.1f} B")
        idle = [sum(v for k, v in state[n].items() if k not in TEST_DATA) for n in ns]
        grow = (idle[-1] - idle[0]) / (ns[-1] - ns[0]) if len(ns) > 1 else 0.0
        print(f"{'all but the test data':<28}" + "".join(f"{v:>14,}" for v in idle) + f"{grow:>16.1f} B")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
