"""Personalised accuracy against how often a client trained (issue 44): a client's own model
(Ditto's v, LG-FedAvg's encoder, FedPer's head, ...) learns only in the rounds the client is
selected, so with 10 of 100 clients a round it has had about 5 rounds in 50. This reads a
personalised sweep (configs/sweeps/personal_mnist.yaml) and splits each run's final personal
accuracy (total correct / total local test samples) by the number of rounds each client
trained: methods whose personal part starts from scratch should gain most with more rounds.

    python benchmarks/personal_participation.py runs/sweeps/personal_mnist
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

BINS = ((0, 3), (4, 5), (6, 7), (8, 99))


def run_rows(run: Path) -> list[tuple[int, float, int]]:
    """(rounds trained, personal accuracy, test samples) per client at the last evaluation."""
    t = pq.read_table(run / "clients.parquet", columns=["round", "cid", "method", "status", "accuracy",
                                                        "num_samples"]).to_pandas()
    trained = t[(t.method == "client_update") & (t.status == "ok")].groupby("cid").size()
    ev = t[t.method == "evaluate_personal"]
    if ev.empty:
        return []
    ev = ev[ev["round"] == ev["round"].max()]
    return [(int(trained.get(c, 0)), float(a), int(n)) for c, a, n in zip(ev.cid, ev.accuracy, ev.num_samples)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", type=Path)
    args = p.parse_args()
    pooled: dict[tuple, list] = defaultdict(list)  # (split, method) -> rows of every seed
    for run in sorted(d for d in args.sweep.iterdir() if (d / "clients.parquet").exists()):
        point = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
        if point is None:
            continue
        pooled[group(run)].extend(run_rows(run))
    head = "".join(f"{f'{lo}-{hi}' if hi < 99 else f'{lo}+':>16}" for lo, hi in BINS)
    print(f"{'split':<20}{'method':<26}{head}{'corr':>8}")
    print(f"{'':<46}" + "".join(f"{'acc (clients)':>16}" for _ in BINS) + "   (rounds trained -> personal accuracy)")
    for (split, method), rows in sorted(pooled.items()):
        if not rows:
            continue
        k, a, n = (np.array(x) for x in zip(*rows))
        cells = []
        for lo, hi in BINS:
            m = (k >= lo) & (k <= hi)
            cells.append(f"{(a[m] * n[m]).sum() / n[m].sum():.3f} ({int(m.sum()):>3})" if m.any() else "-")
        corr = np.corrcoef(k, a)[0, 1] if k.std() > 0 and a.std() > 0 else float("nan")
        print(f"{split:<20}{method:<26}" + "".join(f"{c:>16}" for c in cells) + f"{corr:>8.2f}")
    print("(each cell: accuracy weighted by test samples over the clients, all seeds pooled, that trained that "
          "many rounds; corr: Pearson's r between rounds trained and accuracy)")
    alphas = apfl_alphas(args.sweep)
    for (split, method), a in sorted(alphas.items()):
        print(f"APFL's alpha after the last round, {split} {method}: percentiles 0/10/50/90/100 = "
              + " / ".join(f"{v:.3f}" for v in np.percentile(a, [0, 10, 50, 90, 100])) + f" ({len(a)} clients)")
    return 0


def apfl_alphas(sweep: Path) -> dict[tuple, list]:
    """Each APFL client's alpha, from the runs' last checkpoints (client states), all seeds."""
    import torch

    out: dict[tuple, list] = defaultdict(list)
    for run in sorted(sweep.iterdir()):
        ckpt = run / "checkpoint.pt"
        if not ckpt.exists() or "algorithm: apfl" not in (run / "config.yaml").read_text():
            continue
        states = torch.load(ckpt, weights_only=False)["client_states"]
        out[group(run)].extend(s["alpha"] for s in states.values() if "alpha" in s)
    return out


def group(run: Path) -> tuple[str, str]:
    """(split, method) of a sweep point from its folder name: the `split` and `method` axes of
    configs/sweeps/personal_mnist.yaml, else `partition` and the other axes but the seed."""
    key = dict(part.split("=", 1) for part in run.name.split(","))
    key.pop("seed", None)
    split = key.pop("split", None) or key.pop("partition", "")
    return split, key.pop("method", None) or ",".join(f"{k}={v}" for k, v in key.items())


if __name__ == "__main__":
    raise SystemExit(main())
