"""A small sweep's seconds, both ways a sweep runs its points, side by side in one run.

    python benchmarks/sweep_startup.py              # 3 points (2-round digits / synthetic), 2 repeats
    python benchmarks/sweep_startup.py --repeats 3

`python -m raysim.sweep` runs points that ask for no Ray one after another in its own
process (`sweep.run_here`: a small point trains its clients there, with no Ray), and points
that ask for Ray as Ray Tune trials (`sweep.run_on_tune`). The same sweep file is run both
ways, each a fresh command into a fresh folder: as it is, and with
`resources.ray_start_s=0` (a key that asks for Ray and changes no result: `resources` is not
in a run's config hash). Printed: each command's wall seconds, the ratio of the medians, and
whether every point's model_sha256 is the same both ways (it must be). Beside it, the plain
work: the same three runs as `python -m raysim.run` commands, one after another. The
machine should be idle.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SWEEP = """name: t
fixed: {rounds: 2, num_clients: 6, participation: 0.5, system: {profile: uniform}, partition: {test_fraction: 0.2}}
grid:
  seed: [0]
  setting:
    - {label: digits, dataset: digits, model: mlp, model_options: {hidden: [16]}}
    - {label: syn, dataset: synthetic, model: mclr, num_clients: 5}
  algorithm: [fedavg, fedper]
skip:
  - {setting: syn, algorithm: fedper}
"""


def timed(cmd: list, cwd: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return time.perf_counter() - t0


def hashes(folder: Path) -> dict:
    return {d.name: json.loads((d / "summary.json").read_text())["model_sha256"]
            for d in sorted(folder.iterdir()) if (d / "summary.json").is_file()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sweep-startup-"))
    (work / "s.yaml").write_text(SWEEP)
    ways = {"in its own process": [], "on Ray Tune": []}
    models = {}
    for i in range(args.repeats):
        for way, extra in (("in its own process", []), ("on Ray Tune", ["resources.ray_start_s=0"])):
            out = work / f"{i}-{'here' if not extra else 'tune'}"
            ways[way].append(timed([sys.executable, "-m", "raysim.sweep", "--file", "s.yaml", "--output-dir",
                                    str(out), *extra], work))
            models.setdefault(way, hashes(out / "t"))
    plain = []
    for i in range(args.repeats):
        t = 0.0
        for name, over in (("digits-fedavg", ["dataset=digits", "model=mlp", "model_options.hidden=[16]",
                                              "algorithm=fedavg"]),
                           ("digits-fedper", ["dataset=digits", "model=mlp", "model_options.hidden=[16]",
                                              "algorithm=fedper"]),
                           ("syn-fedavg", ["dataset=synthetic", "model=mclr", "num_clients=5", "algorithm=fedavg"])):
            t += timed([sys.executable, "-m", "raysim.run", "rounds=2", "num_clients=6", "participation=0.5",
                        "system.profile=uniform", "partition.test_fraction=0.2", *over, "seed=0",
                        f"output_dir={work / f'plain{i}'}", f"run_name={name}", "--quiet"], work)
        plain.append(t)
    here, tune = statistics.median(ways["in its own process"]), statistics.median(ways["on Ray Tune"])
    print(f"a 3-point sweep (2-round digits mlp x fedavg/fedper, synthetic mclr), {args.repeats} repeats, medians:")
    for way, secs in ways.items():
        print(f"  {way:20s} {statistics.median(secs):6.1f} s  ({', '.join(f'{s:.1f}' for s in secs)})")
    print(f"  {'3 raysim.run commands':20s} {statistics.median(plain):6.1f} s  ({', '.join(f'{s:.1f}' for s in plain)})")
    print(f"on Ray Tune / in its own process: {tune / here:.1f}x")
    same = models["in its own process"] == models["on Ray Tune"] and len(models["on Ray Tune"]) == 3
    print(f"the same 3 models both ways: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
