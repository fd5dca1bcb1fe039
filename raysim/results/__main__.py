"""`python -m raysim.results RUN_DIR [RUN_DIR ...]`: print each run's summary and draw
accuracy against rounds (and against bytes communicated) into RUN_DIR/accuracy.png."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq


def report(run_dir: Path) -> str:
    summary_file = run_dir / "summary.json"
    metrics_file = run_dir / "metrics.parquet"
    if not summary_file.is_file() or not metrics_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a finished run directory (no summary.json / metrics.parquet)")
    s = json.loads(summary_file.read_text())
    lines = [f"run {run_dir}"]
    for key in ("final_accuracy", "best_accuracy", "last10_mean_accuracy", "last10_std_accuracy", "rounds",
                "wall_seconds", "seconds_to_end_of_round_1", "client_updates_per_second"):
        v = s.get(key)
        lines.append(f"  {key:<28} {v:.4f}" if isinstance(v, float) else f"  {key:<28} {v}")
    return "\n".join(lines)


def plot(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in pq.read_table(run_dir / "metrics.parquet").to_pylist() if r.get("accuracy") is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["round"] for r in rows], [r["accuracy"] for r in rows])
    ax1.set_xlabel("round")
    ax1.set_ylabel("test accuracy")
    ax2.plot([(r["bytes_down"] + r["bytes_up"]) / 2**20 for r in rows], [r["accuracy"] for r in rows])
    ax2.set_xlabel("MiB communicated (down + up)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "accuracy.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raysim.results", description=__doc__)
    p.add_argument("run_dirs", nargs="+", type=Path)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    for d in args.run_dirs:
        try:
            print(report(d))
            if not args.no_plot:
                print(f"  plot                         {plot(d)}")
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
