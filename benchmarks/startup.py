"""Where the seconds before round 1 go: `python -m raysim.run` from the command to the end
of round 1, phase by phase, next to a plain torch loop's start on the same work.

    python benchmarks/startup.py               # the default run and the mclr workload, 3 times each
    python benchmarks/startup.py --repeats 5 --workloads default

Each run is a fresh process. The CLI stamps every start-up line with the seconds since the
process started; the phases are the gaps between them (a command whose clients train in its
own process, runtime/here.py, starts no Ray: its phases are imports + check, data + one
client's epoch timed, the run directory):
  imports            process start -> "starting a local Ray" (Python, raysim's CLI, the YAML read)
  Ray start + check  -> "the server runs in this process" (ray.init of a local Ray; meanwhile
                        a thread imports torch, the registry and the server's code and checks
                        the config: its end is shown as "(check ended at)", since the two overlap)
  data               -> "data ready" (the server, in the command's process, starts the client
                        actors, then loads and partitions the data while they import torch)
  client actors      -> "run directory" (the client actors are placed and have imported torch)
  round 1            -> summary.json's seconds_to_end_of_round_1
  command wall       -> the command's exit (the rest of the rounds, the files, Ray stopped)
A plain loop (this file with --plain) pays only its imports and data before its round 1.
Then the same workload through `raysim.simulate` in one Python process, call after call: the
first call starts Ray and the workers, the later ones reuse them (`ray.reuse_workers`), which
is what a notebook or a sweep sees. Last, the same command on the warm local service
(`python -m raysim.up`, started here in a folder of its own): its phases are the command's
imports, joining the service's Ray and checking the config in its server, the data, the
client actors (reused after the first command) and round 1. Medians over the repeats; the
machine should be idle.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYNTH = ["dataset=synthetic", "synthetic.samples_per_client=250", "synthetic.test_fraction=0.2", "partition=natural",
         "model=mclr", "num_clients=100", "clients_per_round=20", "local.epochs=1", "local.batch_size=10",
         "local.lr=0.01", "local.momentum=0", "rounds=2"]
# the README's default command itself (30 rounds: its wall time is issue 58's target), the same
# with Ray and client actors (resources.ray_start_s=0: always Ray), and a 100-client workload
WORKLOADS = {"default": [], "default-ray": ["resources.ray_start_s=0"], "mclr": SYNTH}
MARKS = [("imports", "starting a local Ray"), ("Ray start + check", "the server runs in this process"),
         ("data", "data ready"), ("client actors", "run directory")]
# a command whose clients train in its own process (runtime/here.py): no Ray, no actors
HERE_MARKS = [("imports + check", "the server runs in this process"),
              ("data + one epoch timed", "data ready"), ("run directory", "run directory")]
AT = {"(check ended at)": "config:"}  # moments shown as they are, not as a phase
STAMP = re.compile(r"raysim \[\s*([\d.]+) s\] (.*)")


# on the warm service (python -m raysim.up): the command joins its Ray, its server checks the config
SERVICE_MARKS = [("imports", "using the raysim service"), ("join + check", "config:"),
                 ("server + data", "data ready"), ("client actors", "run directory")]


def one_run(args: list[str], out: str, name: str, marks=MARKS, env=None, at_marks=AT) -> dict:
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "raysim.run", *args, f"output_dir={out}", f"run_name={name}"],
                       capture_output=True, text=True, check=True, env=env)
    stamps = [(float(m.group(1)), m.group(2)) for m in map(STAMP.match, r.stderr.splitlines()) if m]
    if marks is MARKS and not any(line.startswith("starting a local Ray") for _, line in stamps):
        marks, at_marks = HERE_MARKS, {}
    at = {}
    for label, prefix in marks:
        at[label] = next(t for t, line in stamps if line.startswith(prefix))
    summary = json.loads((Path(out) / name / "summary.json").read_text())
    at["round 1"] = summary["seconds_to_end_of_round_1"]
    phases, before = {}, 0.0
    for label in [m for m, _ in marks] + ["round 1"]:
        phases[label] = at[label] - before
        before = at[label]
    phases["end of round 1"] = at["round 1"]
    for label, prefix in at_marks.items():
        phases[label] = next(t for t, line in stamps if line.startswith(prefix))
    phases["command wall"] = time.time() - t0
    return phases


def plain_start(args: list[str]) -> float:
    """Seconds from a fresh process's start to the end of its round 1, a plain loop."""
    code = ("import time; from raysim.run import process_start; t0 = process_start(); import torch; "
            "from raysim.config import load_config; from raysim.experiment import prepare; "
            "from raysim.models import build_model; from raysim.training import local_sgd; "
            f"cfg = load_config(overrides={args!r}); data, part, n = prepare(cfg); "
            "torch.set_num_threads(1); torch.manual_seed(0); "
            "print(time.time() - t0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(r.stdout.strip().splitlines()[-1])


def in_one_session(args: list[str], out: str, name: str, calls: int) -> list[float]:
    """Seconds from each `raysim.simulate` call to the end of its round 1, `calls` calls in
    one fresh Python process (the first starts Ray and the workers)."""
    code = ("import json, sys, raysim; out = []\n"
            f"for i in range({calls}):\n"
            f"    r = raysim.simulate({args!r} + ['output_dir={out}', f'run_name={name}-session-{{i}}'], progress=False)\n"
            "    out.append(r.summary['seconds_to_end_of_round_1'])\n"
            "raysim.shutdown(); print(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def on_service(args: list[str], out: str, name: str, repeats: int) -> tuple[dict, list[dict]]:
    """The command on a warm service started for the purpose: (its first run, which starts
    the workload's client actors, and the `repeats` after it)."""
    import os

    with tempfile.TemporaryDirectory(prefix="rs-") as folder:
        env = dict(os.environ, RAYSIM_SERVICE_DIR=folder)
        subprocess.run([sys.executable, "-m", "raysim.up"], check=True, env=env, capture_output=True)
        try:
            runs = [one_run(args, out, f"{name}-service-{i}", SERVICE_MARKS, env, {}) for i in range(1 + repeats)]
        finally:
            subprocess.run([sys.executable, "-m", "raysim.down"], env=env, capture_output=True)
    return runs[0], runs[1:]


def show(runs: list[dict]) -> None:
    for label in runs[0]:
        vals = [r[label] for r in runs]
        print(f"  {label:<18} {statistics.median(vals):6.2f}   ({', '.join(f'{v:.2f}' for v in vals)})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(f"python {sys.version.split()[0]}, {__import__('os').cpu_count()} CPUs; medians of {a.repeats} fresh "
          "processes; seconds")
    with tempfile.TemporaryDirectory() as out:
        for w in a.workloads:
            runs = [one_run(WORKLOADS[w], out, f"{w}-{i}") for i in range(a.repeats)]
            plain = statistics.median(plain_start(WORKLOADS[w]) for _ in range(a.repeats))
            print(f"\n{w}: {' '.join(WORKLOADS[w])}")
            show(runs)
            print(f"  {'plain: imports + data':<18} {plain:6.2f}   (a process that imports torch and raysim's "
                  "data code and loads the same data, no training)")
            session = in_one_session(WORKLOADS[w], out, w, 1 + a.repeats)
            print(f"  raysim.simulate in one process, call to end of round 1: first {session[0]:.2f}, then "
                  f"{statistics.median(session[1:]):.2f} (median; {', '.join(f'{v:.2f}' for v in session[1:])}: "
                  "workers reused)")
            first, warm = on_service(WORKLOADS[w], out, w, a.repeats)
            print(f"  on the warm service (python -m raysim.up); its first command of this workload ended round 1 "
                  f"at {first['end of round 1']:.2f} s (it starts the client actors), then:")
            show(warm)


if __name__ == "__main__":
    main()
