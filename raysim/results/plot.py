"""`python -m raysim.results.plot PATH...`: curves of a per-round metric for several runs, one
figure per x axis.

PATH: run directories or folders holding them (a sweep directory). Runs that differ only
in their seed form one line, the mean over seeds with a band of +- one standard
deviation; the legend names the config keys that differ between the lines. `--metric`:
any column of metrics.parquet (`accuracy`, default; `loss`, `train_loss`,
`local_accuracy`, ...). `--x`: `round`, `bytes` (MiB communicated, down + up) and / or
`seconds` (wall time since the first round started) and / or `sim` (simulated seconds, with a
`system.profile`: time to accuracy); several give several files.
Writes OUT_round.png etc. (`--out`, default ./plot; `--format png` or `svg`).

    python -m raysim.results.plot runs/sweeps/fedavg-vs-fedprox --x round bytes seconds
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from raysim.errors import ConfigError
from raysim.results.runs import differing_keys, find_runs, label

X_AXES = {"round": "round", "bytes": "MiB communicated (down + up)", "seconds": "wall seconds",
          "sim": "simulated seconds"}


def _x(rows: list[dict], axis: str) -> np.ndarray:
    if axis == "round":
        return np.array([r["round"] for r in rows], dtype=float)
    if axis == "bytes":
        return np.array([(r["bytes_down"] + r["bytes_up"]) / 2**20 for r in rows])
    if axis == "sim":
        if any(r.get("sim_end") is None for r in rows):
            raise ConfigError("--x sim: a run has no simulated time (run it with a system.profile)")
        return np.array([r["sim_end"] for r in rows], dtype=float)
    return np.array([r["elapsed"] for r in rows], dtype=float)


def series(paths: list, metric: str, axis: str) -> list[dict]:
    """One entry per line: runs grouped by every differing key but the seed."""
    runs = find_runs(paths)
    keys = differing_keys(runs)
    lines: dict[str, list] = {}
    for r in runs:
        rows = [row for row in r.rows if row.get(metric) is not None]
        if rows:
            lines.setdefault(label(r, keys), []).append((_x(rows, axis), np.array([row[metric] for row in rows])))
    if not lines:
        cols = sorted(runs[0].rows[0]) if runs[0].rows else []
        raise ConfigError(f"--metric {metric}: no run has it per round; metrics.parquet's columns: {', '.join(cols)}")
    out = []
    for name, curves in lines.items():
        n = min(len(c[1]) for c in curves)  # seeds cut to the shortest run
        x = np.mean([c[0][:n] for c in curves], axis=0)
        ys = np.stack([c[1][:n] for c in curves])
        mean, std = ys.mean(0), ys.std(0)
        entry = {"label": f"{name} ({len(curves)} seed{'s' if len(curves) > 1 else ''})", "x": x, "mean": mean}
        if len(curves) > 1:
            entry.update(low=mean - std, high=mean + std)
        out.append(entry)
    return out


def main(argv=None) -> int:
    from raysim.results.figures import curves_figure

    p = argparse.ArgumentParser(prog="python -m raysim.results.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="run directories or folders holding them")
    p.add_argument("--metric", default="accuracy")
    p.add_argument("--x", nargs="+", choices=list(X_AXES), default=["round"])
    p.add_argument("--out", type=Path, default=Path("plot"), help="file name stem (default: ./plot)")
    p.add_argument("--format", choices=["png", "svg"], default="png")
    args = p.parse_args(argv)
    try:
        if not args.out.parent.exists():
            raise ConfigError(f"--out {args.out}: folder {args.out.parent} does not exist")
        for axis in args.x:
            path = args.out.with_name(f"{args.out.name}_{axis}.{args.format}")
            curves_figure(series(args.paths, args.metric, axis), X_AXES[axis], args.metric, path)
            print(f"written: {path}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
