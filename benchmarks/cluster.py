"""What a cluster costs (issue 53): the same runs on 1 host and on 3 hosts, all on this
machine (tests/support/hosts.py: network namespaces on a bridge, links shaped to 1 Gbit/s),
so it measures cost, not speed-up: every host shares the machine's cores.

    sudo python benchmarks/cluster.py [--out benchmarks/results-cluster-cpu-2core.txt]

Workloads: the 1,000-client vectorised logistic regression (FedProx Synthetic, mclr, all
1,000 clients each round: benchmarks/scale.py's cohort) and the 100-client CNN on MNIST
(shared/data's test set split 8,000 / 2,000, 10 clients a round). Each on one host (a Ray
head with 6 logical CPUs) and on three (2 each), three client actors of 2 CPUs in both, and
on three hosts where host 2's processes all die after round 2 (its calls are made again on
the others). Per run: seconds to the end of round 1 (from the command, summary.json),
median seconds per round after round 1, bytes each host's link carried per round after
round 1 (its eth0 counters, sampled every 0.1 s and read at the ends of rounds 1 and R),
and whether model.pt is the one-host run's, bit for bit. Six rounds measure cost; the
models are far from trained (the accuracy column is there to compare runs). Needs root (as
the tests)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from accuracy_mnist import write_split  # noqa: E402
from hosts import Hosts, missing  # noqa: E402

LR = ["dataset=synthetic", "synthetic.samples_per_client=20", "synthetic.max_samples_per_client=200",
      "synthetic.test_fraction=0.2", "partition=natural", "model=mclr", "num_clients=1000", "clients_per_round=1000",
      "local.batch_size=10", "local.lr=0.01", "local.momentum=0", "local.vectorize=true", "rounds=6"]
CNN = ["dataset=mnist", "model=cnn", "num_clients=100", "clients_per_round=10", "local.epochs=2",
       "local.batch_size=16", "local.lr=0.01", "rounds=6"]
COMMON = ["resources.num_actors=3", "resources.num_cpus_per_actor=2", "--quiet"]


class Counters(threading.Thread):
    """Each host's eth0 (rx + tx bytes), sampled every 0.1 s with the time."""

    def __init__(self, hosts):
        super().__init__(daemon=True)
        self.hosts, self.samples, self.stop = hosts, [], False

    def read(self) -> list[int]:
        out = []
        for h in self.hosts:
            r = subprocess.run(["ip", "netns", "exec", h.ns, "cat", "/sys/class/net/eth0/statistics/rx_bytes",
                                "/sys/class/net/eth0/statistics/tx_bytes"], capture_output=True, text=True)
            rx, tx = (int(x) for x in r.stdout.split())
            out.append(rx + tx)
        return out

    def run(self) -> None:
        while not self.stop:
            self.samples.append((time.time(), self.read()))
            time.sleep(0.1)

    def at(self, t: float) -> list[int]:
        """The last sample taken at or before `t`."""
        best = self.samples[0][1]
        for when, values in self.samples:
            if when > t:
                break
            best = values
        return best


def start_ray(hosts, n: int, env: dict) -> None:
    for i in range(3):
        hosts.run(i, "ray stop --force >/dev/null 2>&1; true", env=env)
    head = hosts.hosts[0].address
    hosts.run(0, f"ray start --head --port=6379 --node-ip-address={head} --num-cpus={6 if n == 1 else 2} "
                 "--include-dashboard=false --disable-usage-stats", env=env)
    for i in range(1, n):
        hosts.run(i, f"ray start --address={head}:6379 --node-ip-address={hosts.hosts[i].address} --num-cpus=2 "
                     "--disable-usage-stats", env=env)


def kill_ray_on(host) -> None:
    """Every process of `host` but its sshd (the host is lost; Ray can be started there again)."""
    for pid in host.pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"sshd" not in cmd:
                os.kill(pid, 9)
        except (OSError, ProcessLookupError):
            pass


def one_run(hosts, env: dict, name: str, workload: list, data_dir: str, lose: bool = False) -> dict:
    counters = Counters(hosts.hosts)
    counters.start()
    log = hosts.hosts[0].folder / "home" / "bench" / name / "log.txt"
    killer = None
    if lose:
        def kill_after_round_2() -> None:
            while not (log.exists() and " round 2 " in log.read_text()):
                time.sleep(0.05)
            kill_ray_on(hosts.hosts[2])
        killer = threading.Thread(target=kill_after_round_2, daemon=True)
        killer.start()
    time.sleep(0.3)
    t0 = time.time()
    r = hosts.run(0, f"cd {ROOT} && python -m raysim.run ray.address=auto {' '.join(workload + COMMON)} "
                     f"data_dir={data_dir} output_dir=/root/bench run_name={name}", env=env, timeout=1800, check=False)
    counters.stop = True
    counters.join()
    if r.returncode != 0:
        raise RuntimeError(f"{name}: exit {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
    run = hosts.hosts[0].folder / "home" / "bench" / name
    rows = pq.read_table(run / "metrics.parquet").to_pylist()
    summary = json.loads((run / "summary.json").read_text())
    first, last = counters.at(t0 + rows[0]["elapsed"]), counters.at(t0 + rows[-1]["elapsed"])
    model = torch.load(run / "model.pt", weights_only=True)["global"]
    digest = hashlib.sha256(b"".join(model[k].numpy().tobytes() for k in sorted(model))).hexdigest()[:16]
    redone = [re.sub(r"clients \[([^\]]*)\]", lambda m: f"{len(m.group(1).split(','))} clients", line.split(" ", 1)[1])
              for line in (run / "log.txt").read_text().splitlines() if "redone on" in line]
    return {"round1": summary["seconds_to_end_of_round_1"], "per_round": statistics.median(r["seconds"] for r in rows[1:]),
            "max_round": max(r["seconds"] for r in rows[1:]), "accuracy": rows[-1]["accuracy"],
            "bytes": [(b - a) / (len(rows) - 1) for a, b in zip(first, last)], "model": digest,
            "nodes": len(summary["client_actor_nodes"]), "redone": redone}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results-cluster-cpu-2core.txt")
    p.add_argument("--mnist-dir", type=Path, default=ROOT.parent / "shared" / "data" / "mnist-t10k")
    args = p.parse_args()
    if missing():
        print(f"cluster.py: {missing()}", file=sys.stderr)
        return 2
    data = Path(tempfile.mkdtemp(prefix="rsbench-", dir="/var/tmp"))  # every host sees /var/tmp (not /tmp)
    write_split(args.mnist_dir, data)
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAYSIM_CACHE_DIR": "/root/.cache/raysim"}
    lines = [f"# sudo python benchmarks/cluster.py   ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
             f"after {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()})",
             "hosts: network namespaces on one machine, links shaped to 1 Gbit/s; 3 client actors of 2 CPUs in every run",
             "", f"{'workload':<10} {'hosts':<16} {'round 1 s':>9} {'s/round':>8} {'max s':>6} {'KB/round per host (rx+tx)':<30} "
             f"{'accuracy':>8}  model"]
    with Hosts(3) as hosts:
        for label, workload in (("lr-1000", LR), ("cnn-100", CNN)):
            base = None
            for n, lose in ((1, False), (3, False), (3, True)):
                start_ray(hosts, n, env)
                name = f"{label}-{n}{'-lost' if lose else ''}"
                got = one_run(hosts, env, name, workload, str(data), lose)
                base = base or got["model"]
                kb = ", ".join(f"{b / 1024:.0f}" for b in got["bytes"][:n])
                what = f"{n} host{'s' if n > 1 else ''}" + (", 1 lost" if lose else "")
                lines.append(f"{label:<10} {what:<16} {got['round1']:9.1f} {got['per_round']:8.2f} {got['max_round']:6.2f} "
                             f"{kb:<30} {got['accuracy']:8.4f}  {got['model']}"
                             f"{' (= 1 host)' if got['model'] == base else ' (DIFFERS from 1 host)'}")
                for line in got["redone"]:
                    lines.append(f"    {line}")
                print(lines[-1 - len(got["redone"])], flush=True)
        for i in range(3):
            hosts.run(i, "ray stop --force >/dev/null 2>&1; true", env=env, check=False)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
