"""Finished run directories read back for tables and plots: each run's flattened config,
summary and per-round metrics; how runs differ; metric values by name."""
from __future__ import annotations

import difflib
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from raysim.config import ConfigError

_FORM = re.compile(r"(?P<name>\w+)@(?P<at>\d+)|(?P<fn>mean|max|last10|round)\((?P<fname>\w+)(?:>=(?P<x>[-\d.e]+))?\)")

# keys that differ between runs without making them different experiments
INCIDENTAL = ("seed", "run_name", "output_dir", "resume", "data_dir", "download", "checkpoint_every", "ray.",
              "resources.", "log.")


@dataclass
class Run:
    path: Path
    config: dict  # flattened: {"partition.beta": 0.5, ...}
    summary: dict
    _rows: Optional[list] = field(default=None, repr=False)

    @property
    def rows(self) -> list[dict]:
        """metrics.parquet, one dict per round (read on first use)."""
        if self._rows is None:
            import pyarrow.parquet as pq

            self._rows = pq.read_table(self.path / "metrics.parquet").to_pylist()
        return self._rows

    def value(self, metric: str) -> Optional[float]:
        """A summary field (`final_accuracy`, `best_accuracy`, `last10_mean_accuracy`, ...),
        or from the per-round metric NAME: `NAME@R` (at round R), `mean(NAME)`, `max(NAME)`,
        `last10(NAME)` (mean of the last 10 values), `round(NAME>=X)` (the first round at
        which NAME reaches X; None if it never does)."""
        m = _FORM.fullmatch(metric)
        if m is None:
            return self.summary.get(metric)
        if m["at"] is not None:
            row = next((r for r in self.rows if r["round"] == int(m["at"])), None)
            return None if row is None else row.get(m["name"])
        name = m["fname"]
        got = [(r["round"], r[name]) for r in self.rows if r.get(name) is not None]
        if not got:
            return None
        values = [v for _, v in got]
        if m["fn"] == "round":
            return next((float(rnd) for rnd, v in got if v >= float(m["x"])), None)
        return {"mean": statistics.mean, "max": max, "last10": lambda v: statistics.mean(v[-10:])}[m["fn"]](values)


def flatten(node: Any, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: json.dumps(node) if isinstance(node, (list, dict)) else node}


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every finished run (a folder with summary.json) at or below the given paths, sorted."""
    from omegaconf import OmegaConf

    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError(f"{p} does not exist")
        found += [p] if (p / "summary.json").is_file() else sorted(q.parent for q in p.rglob("summary.json"))
    if not found:
        raise ConfigError(f"no finished run (a folder with summary.json) under {', '.join(map(str, paths))}")
    runs = []
    for d in sorted(set(found)):
        cfg = OmegaConf.to_container(OmegaConf.load(d / "config.yaml")) if (d / "config.yaml").is_file() else {}
        runs.append(Run(d, flatten(cfg), json.loads((d / "summary.json").read_text())))
    return runs


def differing_keys(runs: list[Run]) -> list[str]:
    """Config keys whose values differ between the runs, incidental ones (seed, paths) left out."""
    keys = sorted({k for r in runs for k in r.config})
    return [k for k in keys if not k.startswith(INCIDENTAL) and len({json.dumps(r.config.get(k)) for r in runs}) > 1]


def check_keys(runs: list[Run], keys: list[str]) -> None:
    known = {k for r in runs for k in r.config}
    for k in keys:
        if k not in known:
            near = difflib.get_close_matches(k, sorted(known), n=3)
            raise ConfigError(f"{k!r} is not a config key of these runs" + (f"; did you mean {', '.join(near)}?" if near else ""))


def label(run: Run, keys: list[str]) -> str:
    return ", ".join(f"{k}={run.config.get(k)}" for k in keys) or run.path.name


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)
