"""The run directory: resolved config, per-round metrics (parquet + readable log),
per-client records, the final model and `summary.json`."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch


def summarize(rows: list[dict], wall_seconds: float, client_updates: int, first_round_seconds: float) -> dict:
    """final / best accuracy, mean +- std over the last 10 evaluations, and throughput."""
    acc = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
    last = acc[-10:]
    mean = sum(last) / len(last) if last else float("nan")
    std = math.sqrt(sum((a - mean) ** 2 for a in last) / len(last)) if last else float("nan")
    local = [r["local_accuracy"] for r in rows if r.get("local_accuracy") is not None]  # runtime/local_eval.py
    extra = {"final_local_accuracy": local[-1], "best_local_accuracy": max(local)} if local else {}
    for group in ("many", "medium", "few"):  # long-tailed data: the classes by training samples
        got = [r[f"{group}_accuracy"] for r in rows if r.get(f"{group}_accuracy") is not None]
        if got:
            extra[f"final_{group}_accuracy"] = got[-1]
    return {
        **extra,
        "final_accuracy": acc[-1] if acc else None,
        "best_accuracy": max(acc) if acc else None,
        "last10_mean_accuracy": mean if last else None,
        "last10_std_accuracy": std if last else None,
        "rounds": max((r["round"] for r in rows), default=0),
        "wall_seconds": wall_seconds,
        "seconds_to_end_of_round_1": first_round_seconds,
        "client_updates": client_updates,
        "client_updates_per_second": client_updates / wall_seconds if wall_seconds > 0 else None,
    }


class RunWriter:
    """Writes one run directory. `resume_round`: reopen an existing one, keeping its
    metrics up to that round (the checkpoint's) and dropping any later ones."""

    def __init__(self, run_dir: Path, config_yaml: str, resume_round: int | None = None, tensorboard: bool = False):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=resume_round is not None)
        (self.dir / "config.yaml").write_text(config_yaml)
        self.log_file = open(self.dir / "log.txt", "a", buffering=1)
        self.rows: list[dict] = []
        self.client_rows: list[dict] = []
        if resume_round is not None:
            for rows, name in ((self.rows, "metrics.parquet"), (self.client_rows, "clients.parquet")):
                if (self.dir / name).is_file():
                    rows.extend(r for r in pq.read_table(self.dir / name).to_pylist() if r["round"] <= resume_round)
            self.log(f"resumed after round {resume_round}")
        self.tb = None
        if tensorboard:  # `tensorboard --logdir <output_dir>` shows every run's curves live
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))

    def log(self, line: str) -> None:
        self.log_file.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    def round(self, row: dict, clients: list[dict]) -> None:
        self.rows.append(row)
        self.client_rows.extend(clients)
        parts = [f"round {row['round']}"]
        for key in ("accuracy", "loss", "train_loss"):
            if row.get(key) is not None:
                parts.append(f"{key}={row[key]:.4f}")
        parts.append(f"clients={row['clients']} dropped={row['dropped']} seconds={row['seconds']:.2f}")
        self.log(" ".join(parts))
        if self.tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "round":
                    self.tb.add_scalar(key, value, row["round"])
            self.tb.flush()

    def flush_tables(self) -> None:
        for rows, name in ((self.rows, "metrics.parquet"), (self.client_rows, "clients.parquet")):
            if rows:
                keys = list(dict.fromkeys(k for r in rows for k in r))  # rows may differ in keys
                tmp = self.dir / (name + ".tmp")  # replaced atomically: a kill mid-write keeps the old file
                pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), tmp)
                os.replace(tmp, self.dir / name)

    def finish(self, summary: dict, model_state: dict | None) -> None:
        """Tables, the final model (None: no model worth keeping, e.g. a diverged one) and summary.json."""
        self.flush_tables()
        if model_state is not None:
            torch.save(model_state, self.dir / "model.pt")
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.log("summary " + json.dumps(summary))
        self.log_file.close()
        if self.tb is not None:
            self.tb.close()
