"""The compression sweep's table: accuracy against rounds, bytes sent and simulated seconds.

    python benchmarks/compression_table.py runs/sweeps/compression_mnist [--target 0.6]

One row per codec (the sweep's `codec` axis), each cell the mean over the seeds (± their
standard deviation where it matters): the test accuracy after rounds 10, 20 and 30; the
megabytes the clients sent in all (the counted, encoded bytes: metrics' `round_bytes_up`);
the megabytes sent and the simulated minutes (`system.profile`'s clock) until the accuracy
first reached `--target` (mean over the seeds that reached it; "k/n" says how many did);
and the run's simulated minutes.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pyarrow.parquet as pq


def point(folder: Path, target: float) -> dict:
    rows = pq.read_table(folder / "metrics.parquet").to_pylist()
    summary = json.loads((folder / "summary.json").read_text())
    sent, reached = 0, None
    acc = {}
    for r in rows:
        sent += r["round_bytes_up"]
        if r.get("accuracy") is not None:
            acc[r["round"]] = r["accuracy"]
            if reached is None and r["accuracy"] >= target:
                reached = (sent, r["sim_end"])
    return {"acc": acc, "mb": sent / 2**20, "reached": reached, "sim_min": summary["sim_seconds"] / 60,
            "status": summary["status"]}


def mean_sd(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", type=Path)
    p.add_argument("--target", type=float, default=0.6, help="the accuracy for 'to target' columns")
    args = p.parse_args()
    by_codec: dict[str, list[dict]] = {}
    for folder in sorted(args.sweep.iterdir()):
        if not (folder / "summary.json").exists():
            continue
        keys = dict(part.split("=", 1) for part in folder.name.split(","))
        by_codec.setdefault(keys["codec"], []).append(point(folder, args.target))
    t = f"{args.target:.0%}"
    head = (f"{'codec':<18}{'seeds':>6}{'acc @10':>16}{'acc @20':>16}{'acc @30':>16}{'MB up':>10}"
            f"{'MB to ' + t:>16}{'sim min to ' + t:>17}{'sim min':>9}")
    print(head)
    for codec, points in by_codec.items():
        done = [q for q in points if q["status"] == "finished"]
        reached = [q["reached"] for q in done if q["reached"] is not None]
        cells = [mean_sd([q["acc"][r] for q in done if r in q["acc"]], ".3f") for r in (10, 20, 30)]
        print(f"{codec:<18}{len(done):>6}{cells[0]:>16}{cells[1]:>16}{cells[2]:>16}"
              f"{statistics.mean(q['mb'] for q in done) if done else float('nan'):>10.2f}"
              f"{(format(statistics.mean(r[0] for r in reached) / 2**20, '.2f') if reached else '-') + f' {len(reached)}/{len(done)}':>16}"
              f"{(format(statistics.mean(r[1] for r in reached) / 60, '.2f') if reached else '-') + f' {len(reached)}/{len(done)}':>17}"
              f"{statistics.mean(q['sim_min'] for q in done) if done else float('nan'):>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
