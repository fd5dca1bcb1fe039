"""Run a sweep file's points as plain `python -m raysim.run` processes, N at a time.

    python benchmarks/sweep_processes.py --file configs/sweeps/fed2_speed_mnist.yaml --parallel 4 \
        [--output-dir DIR] [--python python3] [--only REGEX ...] [KEY=VALUE ...]

For a machine where `raysim.sweep` cannot run its points on Ray Tune (the lent GPU machine
has Ray without Tune's dependencies), and for GPU points: each process starts its own local
Ray, so each point sees the whole device (`resources.num_gpus_per_actor` shares it within the
point). KEY=VALUE overrides go to every point (resources, ray.dashboard=false); they must not
change what a point computes. The points land where `raysim.sweep` puts them
(<output-dir>/<sweep name>/<point>, named by their grid values, in grid order), so
`python -m raysim.results.table` reads them and a later `raysim.sweep` counts the finished ones
as done; points with a summary.json are skipped. Each point's output goes to <point>.out
beside its folder; the script prints one line per point as it ends. On the lent GPU machine,
give an --output-dir outside $OUT and tar it into $OUT at the end: point names hold '=' and
',', which the machine does not send back.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from raysim.sweep import parse, plan

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--file", type=Path, required=True)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--output-dir", type=Path, default=Path("runs/sweeps"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--only", action="append", default=[], metavar="REGEX",
                   help="run only the points whose name matches one of these (re.search), in grid order")
    args = p.parse_args(argv)
    name, files, fixed, grid = parse([], args.file)
    sweep_dir = (args.output_dir / name).resolve()
    points = [q for q in plan(files, fixed, grid, sweep_dir) if q["state"] != "done"
              and (not args.only or any(re.search(r, q["name"]) for r in args.only))]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    print(f"{sweep_dir}: {len(points)} point(s) to run, {args.parallel} at a time", flush=True)
    config = [f"--config={f}" for f in files]

    def run(point: dict) -> None:
        t0 = time.time()
        resume = [f"resume={point['run_dir']}"] if point["state"] == "partial" else []
        cmd = [args.python, "-m", "raysim.run", *config, *point["overrides"], *args.overrides, *resume, "--quiet"]
        with open(sweep_dir / f"{point['name']}.out", "w") as out:
            rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        print(f"{point['name']}: exit {rc}, {time.time() - t0:.0f} s", flush=True)

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(run, points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
