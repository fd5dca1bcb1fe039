"""Fed2's convergence speed against FedAvg + GN (issue 45): for each (local epochs E, #C)
cell of a finished `configs/sweeps/fed2_speed_mnist.yaml`, FedAvg + GN's final accuracy A
and, for every variant, the first round whose test accuracy reaches 0.8 A and 0.9 A
("never" if it does not in the run), its final and best accuracy, and the mean accuracy over
the first 5 rounds (the early curve).

    python benchmarks/fed2_speed.py runs/sweeps/fed2_speed_mnist [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def variant(run) -> str:
    c = run.config
    if c["algorithm"] != "fed2":
        return f"{c['algorithm']}+{'GN' if c.get('model_options.norm') == 'group' else c.get('model_options.norm')}"
    extra = [f"{k}={c[f'fed2.{k}']}" for k, d in (("layers", 6), ("groups", 10)) if c.get(f"fed2.{k}") != d]
    return "fed2" + (f" ({', '.join(extra)})" if extra else "")


def first_round(acc: list, target: float):
    return next((i + 1 for i, a in enumerate(acc) if a >= target), None)


def main(argv=None) -> int:
    from raysim.results.runs import find_runs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    runs = [r for r in find_runs([args.sweep]) if (r.path / "metrics.parquet").is_file()]
    cells: dict = {}
    for r in runs:
        key = (int(r.config["local.epochs"]), int(r.config["partition.k"]), int(r.config["seed"]))
        cells.setdefault(key, []).append(r)
    lines = ["| E | #C | seed | variant | rounds | to 80 % of FedAvg+GN's final | to 90 % | mean acc rounds 1-5 | final | best |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (e, k, seed), group in sorted(cells.items()):
        base = [r for r in group if variant(r) == "fedavg+GN"]
        final = base[0].rows[-1]["accuracy"] if base else None
        for r in sorted(group, key=lambda r: (variant(r) != "fedavg+GN", variant(r))):
            acc = [row["accuracy"] for row in r.rows if row.get("accuracy") is not None]
            reach = ["-" if final is None else str(first_round(acc, f * final) or "never") for f in (0.8, 0.9)]
            early = sum(acc[:5]) / len(acc[:5])
            lines.append(f"| {e} | {k} | {seed} | {variant(r)} | {len(acc)} | {reach[0]} | {reach[1]} | "
                         f"{100 * early:.1f} | {100 * acc[-1]:.1f} | {100 * max(acc):.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
