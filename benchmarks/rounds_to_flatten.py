"""How many rounds tuned FedAvg needs to flatten, per setting (issue 72, item 2): reads a sweep
run with `algorithm=fedavg seed=0 rounds=R` (its tuning runs, judged on held-out training
samples, and its seed-0 run at the chosen lr) and prints, per setting, the round after which
the chosen run's accuracy stays within `--within` of its final level (the mean of its last 3
evaluations), for the judged column (per client, or global where the sweep judges global).

    python -m raysim.sweep --file configs/sweeps/results_table.yaml algorithm=fedavg seed=0 rounds=150 \\
        --name rounds-probe
    python benchmarks/rounds_to_flatten.py runs/sweeps/rounds-probe
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import pyarrow.parquet as pq


def flat_from(curve: list[tuple[int, float]], within: float) -> int | None:
    """The first evaluated round from which every later evaluation is within `within` of the
    final level (mean of the last 3); None for no curve."""
    if not curve:
        return None
    level = sum(v for _, v in curve[-3:]) / len(curve[-3:])
    first = curve[-1][0]
    for r, v in reversed(curve):
        if abs(v - level) > within:
            break
        first = r
    return first


def curve_of(run_dir: Path, judge: str) -> list[tuple[int, float]]:
    t = pq.read_table(run_dir / "metrics.parquet").to_pydict()
    key = "accuracy" if judge == "global" else next(k for k in ("personal_accuracy", "local_accuracy", "accuracy")
                                                     if k in t)
    return [(r, a) for r, a in zip(t["round"], t[key]) if a is not None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--within", type=float, default=0.01, help="how close to the final level (default 1 point)")
    ap.add_argument("--global-settings", default="mnist_lt", help="settings judged by the global model")
    a = ap.parse_args(argv)
    chosen = {r["setting"]: r["point"] for r in csv.DictReader((a.sweep_dir / "tuning.csv").open()) if r["chosen"] == "1"}
    print(f"{'setting':<12} {'lr':<9} {'flat from (validation)':>22} {'flat from (seed 0, test)':>25} {'final':>6}")
    for setting, point in sorted(chosen.items()):
        judge = "global" if setting in a.global_settings.split(",") else "own"
        tune = curve_of(a.sweep_dir / "tuning" / f"seed=0,setting={setting},algorithm=fedavg,{point}", judge)
        final_dir = a.sweep_dir / f"seed=0,setting={setting},algorithm=fedavg"
        test = curve_of(final_dir, judge) if (final_dir / "metrics.parquet").is_file() else []
        level = sum(v for _, v in test[-3:]) / len(test[-3:]) if test else float("nan")
        print(f"{setting:<12} {point:<9} {flat_from(tune, a.within)!s:>22} {flat_from(test, a.within)!s:>25} "
              f"{100 * level:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
