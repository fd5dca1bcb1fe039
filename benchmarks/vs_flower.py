"""raysim against Flower's simulation and a plain torch loop, on the same FedAvg work, in one run.

    python -m venv --system-site-packages .bench-flower            # once: Flower pins its own Ray,
    .bench-flower/bin/pip install "flwr[simulation]>=1.41"         # so it lives in its own venv
    python benchmarks/vs_flower.py                                 # mclr and cnn
    python benchmarks/vs_flower.py --workloads cnn-1000 --flower-python .bench-flower/bin/python

The workloads are `benchmarks/throughput.py`'s (same data from raysim's loaders, same
model, same local SGD recipe, one torch thread per process, 2 workers on 2 cores):
- raysim: `python -m raysim.run ...` (its per-round seconds from metrics.parquet);
- plain loop: throughput.py's sequential FedAvg in one process;
- Flower: a `ServerApp` with Flower's `FedAvg` strategy and a `ClientApp` whose client trains
  with the same SGD loop, run by `flwr.simulation.run_simulation` on Flower's Ray backend
  (one CPU per client app, the clients' data loaded once per Flower worker process). Its
  round time is taken between successive `aggregate_fit` calls.
Each side is a fresh process; while it runs, this script samples the summed RSS of it and
all its descendants. Printed: median s/round after the first, end of round 1 after the
process started, peak summed RSS, and the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

WORKLOADS = ("mclr", "cnn", "cnn-1000", "cnn-1000-f32")


def overrides(name: str, side: str = "raysim", store_dir: str = "<a fresh folder>") -> list[str]:
    """The workload's config. cnn-1000-f32 (issue 42): 1,000 clients x 500 float32 3x32x32
    samples, 5.7 GB; raysim keeps them in files (written by its run into a
    fresh folder, by `data_store=auto`: 5.7 GB would crowd Ray's default store), Flower's workers
    each make them in memory as raysim's loaders give them."""
    import throughput

    if name == "cnn-1000":  # 1,000 clients x 500 images: 1.5 GB of uint8 pixels
        return [o if not o.startswith("num_clients=") else "num_clients=1000" for o in throughput.overrides("cnn")]
    if name == "cnn-1000-f32":  # raysim's data_store=auto puts them in files: they would crowd the object store
        files = [f"data_store_dir={store_dir}"] if side == "raysim" else []
        return [*overrides("cnn-1000"), "bench_images.dtype=float32", *files]
    return throughput.overrides(name)


# --------------------------------------------------------------------------- Flower side
def flower(name: str) -> dict:
    """The workload through Flower's simulation, in this process (run by the Flower venv's python)."""
    from raysim.run import process_start

    t_start = process_start()  # psutil.Process().create_time() is up to 1 s early on Linux
    import flwr
    from flwr.client import ClientApp
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    from raysim.config import clients_per_round, load_config

    cfg = load_config(overrides=overrides(name, "flower"))
    n, k, rounds = int(cfg.num_clients), clients_per_round(cfg), int(cfg.rounds)
    marks: list[float] = []

    class TimedFedAvg(FedAvg):
        def aggregate_fit(self, server_round, results, failures):
            out = super().aggregate_fit(server_round, results, failures)
            marks.append(time.time())
            return out

    def initial():
        import torch

        from raysim.experiment import prepare
        from raysim.models import build_model

        data, _, classes = prepare(cfg)
        torch.manual_seed(0)
        return [v.numpy() for v in build_model(cfg.model, data.input_shape, classes).state_dict().values()]

    def server_fn(context: Context) -> ServerAppComponents:
        strategy = TimedFedAvg(fraction_fit=k / n, min_fit_clients=k, min_available_clients=n, fraction_evaluate=0.0,
                               min_evaluate_clients=0, initial_parameters=ndarrays_to_parameters(initial()))
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    def client_fn(context: Context):
        return BenchClient(int(context.node_config["partition-id"])).to_client()

    run_simulation(ServerApp(server_fn=server_fn), ClientApp(client_fn=client_fn), num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": os.cpu_count(), "include_dashboard": False,
                                                 "logging_level": "error", "log_to_driver": False}})
    times = [b - a for a, b in zip(marks, marks[1:])]
    return {"round_seconds": [marks[0] - t_start] + times, "seconds_to_end_of_round_1": marks[0] - t_start,
            "clients_per_round": k, "flower": flwr.__version__}


_CACHE: dict = {}


try:  # the Flower venv has it; the main environment need not
    from flwr.client import NumPyClient
except ImportError:
    NumPyClient = object


class BenchClient(NumPyClient):
    """Local SGD on one client's shard: throughput.py's recipe (raysim's SGD, one epoch)."""

    def __init__(self, cid: int):
        self.cid = cid

    def get_parameters(self, config):
        return [v.numpy() for v in self.model().state_dict().values()]

    def model(self):
        return self.data()["model"]

    @staticmethod
    def data() -> dict:
        if not _CACHE:  # once per Flower worker process
            import torch

            from raysim.config import load_config
            from raysim.experiment import prepare
            from raysim.models import build_model

            torch.set_num_threads(1)
            cfg = load_config(overrides=overrides(os.environ["BENCH_WORKLOAD"], "flower"))
            data, part, classes = prepare(cfg)
            _CACHE.update(cfg=cfg, x=torch.from_numpy(data.x_train), y=torch.from_numpy(data.y_train), data=data,
                          shards=[torch.from_numpy(ix) for ix in part.train],
                          model=build_model(cfg.model, data.input_shape, classes))
        return _CACHE

    def fit(self, parameters, config):
        import torch
        from throughput import train_plain

        d = self.data()
        model, loc = d["model"], d["cfg"].local
        model.load_state_dict({k: torch.from_numpy(v) for k, v in zip(model.state_dict(), parameters)})
        idx = d["shards"][self.cid]
        x, y = d["data"].inputs(d["x"][idx]), d["y"][idx]
        train_plain(model, x, y, loc, torch.Generator().manual_seed(self.cid))
        return [v.detach().numpy() for v in model.state_dict().values()], len(y), {}


# --------------------------------------------------------------------------- the three sides
def measure(name: str, flower_python: str) -> dict:
    import throughput

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", BENCH_WORKLOAD=name)
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.sync()  # each side starts with no other side's writes still going to disk
        r, peak = throughput.run_measured([sys.executable, "-m", "raysim.run", "--quiet",
                                           *overrides(name, store_dir=str(Path(tmp) / "arrays")),
                                           f"output_dir={tmp}", "run_name=r"], env)
        if r.returncode != 0:
            raise SystemExit(f"raysim failed:\n{r.stderr[-3000:]}")
        import pyarrow.parquet as pq

        rows = pq.read_table(Path(tmp) / "r" / "metrics.parquet").to_pylist()
        summary = json.loads((Path(tmp) / "r" / "summary.json").read_text())
        res["raysim"] = {"round_seconds": [row["seconds"] for row in rows], "peak_rss": peak[0], "peak_used": peak[2],
                         "seconds_to_end_of_round_1": summary["seconds_to_end_of_round_1"]}
    # the plain loop at 1,000 clients does the same work as at 100
    seq = {"mclr": "mclr", "cnn-1000-f32": "cnn-f32"}.get(name, "cnn")
    os.sync()
    r, peak = throughput.run_measured([sys.executable, str(HERE / "throughput.py"), "--sequential", seq], env)
    if r.returncode != 0:
        raise SystemExit(f"plain loop failed:\n{r.stderr[-3000:]}")
    res["plain loop"] = dict(json.loads(r.stdout.strip().splitlines()[-1]), peak_rss=peak[0], peak_used=peak[2])
    os.sync()
    r, peak = throughput.run_measured([flower_python, str(Path(__file__).resolve()), "--flower", name], env)
    if r.returncode != 0:
        raise SystemExit(f"Flower failed:\n{r.stderr[-3000:]}")
    res["Flower"] = dict(json.loads(r.stdout.strip().splitlines()[-1]), peak_rss=peak[0], peak_used=peak[2])
    for side in res.values():
        side["median_round_seconds"] = statistics.median(side["round_seconds"][1:] or side["round_seconds"])
    return res


def report(name: str, res: dict) -> str:
    sides = ["plain loop", "Flower", "raysim"]
    lines = [f"== {name}: {' '.join(overrides(name))}" + (f"  (Flower {res['Flower'].get('flower')})"),
             f"{'':<34}" + "".join(f"{s:>14}" for s in sides) + f"{'raysim/Flower':>16}"]
    rows = [("median s/round after the first", "median_round_seconds", ".4f", lambda a, b: b / a),
            ("s from start to end of round 1", "seconds_to_end_of_round_1", ".2f", lambda a, b: b / a),
            ("peak summed RSS (MB)", "peak_rss", ".0f", lambda a, b: b / a),
            ("peak system memory used (MB)", "peak_used", ".0f", lambda a, b: b / a)]
    for label, key, fmt, ratio in rows:
        vals = [res[s][key] / (2**20 if key.startswith("peak_") else 1) for s in sides]
        lines.append(f"{label:<34}" + "".join(f"{format(v, fmt):>14}" for v in vals)
                     + f"{ratio(vals[2], vals[1]):>15.2f}x")
    loop = res["plain loop"]["median_round_seconds"]
    lines.append(f"{'speed vs the plain loop':<34}{'1.00x':>14}{loop / res['Flower']['median_round_seconds']:>13.2f}x"
                 f"{loop / res['raysim']['median_round_seconds']:>13.2f}x")
    lines.append("(raysim/Flower: > 1 means raysim is faster / starts sooner / uses less memory)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["mclr", "cnn"], choices=WORKLOADS)
    p.add_argument("--flower-python", default=str(ROOT / ".bench-flower" / "bin" / "python"),
                   help="a python with flwr[simulation] installed (default: .bench-flower/bin/python)")
    p.add_argument("--flower", metavar="WORKLOAD", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.flower:  # imported by name, so Flower's workers import the client class instead of unpickling __main__
        import vs_flower

        os.environ["BENCH_WORKLOAD"] = args.flower
        print(json.dumps(vs_flower.flower(args.flower)))
        return 0
    if not Path(args.flower_python).exists():
        print(f"error: {args.flower_python} not found; create it as this file's docstring says", file=sys.stderr)
        return 2
    print(f"host: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, python {sys.version.split()[0]}")
    for name in args.workloads:
        print(report(name, measure(name, args.flower_python)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
