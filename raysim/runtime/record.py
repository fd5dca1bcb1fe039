"""The run record: what a run leaves behind, kept as it goes.

It owns the run directory's writer (runtime/writer.py: config.yaml, log.txt, the metrics
and clients tables, model.pt, summary.json), the rows of the clients table for the round
in progress (one per call to a client, join, dropout or per-client evaluation), the run's
counters, Ray's metrics (observe.py) and the checkpoints (checkpoint.py).
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf, open_dict

from raysim.contract import ClientResult
from raysim.config import to_yaml
from raysim.config.sections import foreign_sections
from raysim.runtime.writer import RunWriter, summarize
from raysim import checkpoint
from raysim.runtime import observe


class RunRecord:
    def __init__(self, cfg, run_dir: Path, t_start: float, resume: Optional[dict], sizes, stragglers: set,
                 attacking=lambda cid, rnd, method: False):
        """Create (or, resuming from checkpoint `resume`, reopen) the run directory."""
        saved = cfg.copy()
        saved.resume = None  # config.yaml describes the run, wherever it was resumed from
        with open_dict(saved):
            for section in foreign_sections(cfg):  # another run's plugin: not this run's, nor readable without it
                del saved[section]
        self.writer = RunWriter(run_dir, to_yaml(saved), resume_round=resume["round"] if resume else None,
                                trackers=OmegaConf.to_container(saved, resolve=True))
        self.dir = self.writer.dir
        self.t_start = t_start
        self.sizes, self.stragglers, self.attacking = sizes, stragglers, attacking
        self.metrics = observe.for_run(Path(run_dir).name)
        self.rows: list[dict] = []  # the clients table's rows of the round in progress
        self.sim_seconds: dict[int, float] = {}
        self.label_counts: dict = {}  # cid: training-label counts a client reported with its update this round
        self.client_updates = 0
        self.first_round_seconds: Optional[float] = None
        self.last_checkpoint: Optional[int] = resume["round"] if resume else None  # the round a resume starts after

    def log(self, line: str) -> None:
        self.writer.log(line)

    def client(self, rnd: int, cid: int, method: str, status: str, reason: Optional[str] = None,
               result: Optional[ClientResult] = None, epochs: Optional[int] = None,
               accuracy: Optional[float] = None, num_samples: Optional[int] = None, redone: bool = False) -> None:
        """One row of the clients table: a call to a client (training, or another method),
        a join, or (method `evaluate`) its accuracy on its local test data. A training call's
        simulated seconds (`sim_seconds`, world/clock.py) come from the round's clock.
        `redone`: the call was made again on another actor after its actor was lost."""
        m = result.metrics if result is not None else {}
        if result is not None:
            self.client_updates += 1
            if "label_counts" in m:  # a population made when picked (runtime/client_actor.py)
                self.label_counts[cid] = m["label_counts"]
        if num_samples is None:
            num_samples = int(result.num_samples if result is not None else self.sizes[cid])
        self.rows.append({
            "round": rnd, "cid": cid, "method": method, "status": status, "reason": reason,
            "num_samples": num_samples, "epochs": epochs, "straggler": cid in self.stragglers,
            "loss": m.get("loss"), "seconds": m.get("seconds"), "accuracy": accuracy,
            "attacker": self.attacking(cid, rnd, method), "redone": redone,
            **({"bytes_up": m["bytes_up"]} if "bytes_up" in m else {}),  # compress.up: its message's bytes
            **({"sim_seconds": self.sim_seconds.get(cid)} if self.sim_seconds and method == "client_update" else {})})

    def new_round(self) -> None:
        self.rows = []
        self.sim_seconds = {}  # cid: this round's simulated seconds of its training call (world/clock.py)
        self.label_counts = {}

    def round(self, row: dict) -> None:
        """The round's metrics row and its clients' rows."""
        row["elapsed"] = time.time() - self.t_start
        if self.first_round_seconds is None:
            self.first_round_seconds = time.time() - self.t_start
        self.writer.round(row, self.rows)
        self.rows = []  # written: not held until the next round (all N clients' rows after a local evaluation)
        self.metrics.record(row)

    def clients_only(self) -> None:
        """The clients' rows of calls made outside a round (`Algorithm.after_training`)."""
        self.writer.clients(self.rows)
        self.rows = []

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, rnd: int, state: dict) -> None:
        """Metrics so far, then `state` (everything else a resumed run needs) with the
        record's counters (see checkpoint.py)."""
        t0 = time.time()
        self.writer.flush_tables()
        checkpoint.save(self.dir, {
            "round": rnd, **state,
            "client_updates": self.client_updates,
            "elapsed": time.time() - self.t_start,
            "first_round_seconds": self.first_round_seconds,
        }, last_good=self.last_checkpoint)
        self.last_checkpoint = rnd
        self.log(f"checkpoint after round {rnd} ({len(state.get('client_states', {}))} client states, "
                 f"{time.time() - t0:.2f} s)")

    def restore(self, ckpt: dict) -> None:
        """The counters of a checkpoint; elapsed time goes on from where it stopped."""
        self.client_updates = int(ckpt["client_updates"])
        self.t_start -= float(ckpt["elapsed"])
        self.first_round_seconds = ckpt["first_round_seconds"]

    # ------------------------------------------------------------------ the end
    def summary(self) -> dict:
        return {**summarize(self.writer.rows, time.time() - self.t_start, self.client_updates,
                            self.first_round_seconds or 0.0), "run_dir": str(self.dir)}

    def finish(self, summary: dict, model_state: Optional[dict]) -> None:
        self.writer.finish(summary, model_state)

    def open(self) -> bool:
        return not self.writer.log_file.closed

    def flush(self) -> None:
        """Write the metrics of the rounds so far (the run is being stopped early)."""
        if self.open():
            self.writer.flush_tables()
            self.log("run stopped before its last round")

    def log_failure(self, rnd: int, text: str) -> None:
        """An exception stopped round `rnd`: its full traceback goes into log.txt."""
        if self.open():
            plain = re.sub(r"\x1b\[[0-9;]*m", "", text.rstrip())  # Ray colours its actor names
            self.log(f"round {rnd} failed:\n{plain}")
