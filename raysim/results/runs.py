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

from raysim.errors import ConfigError

_FORM = re.compile(r"(?:(?P<fn>mean|max|min|last(?P<k>\d+)|round|time)\()?(?P<name>\w+)"
                   r"(?:@(?P<at>\d+(?:\.\d*)?)(?P<mib>MiB)?)?(?:>=(?P<x>[-+\d.e]+))?(?(fn)\))")
METRICS_HELP = ("a summary field (final_accuracy, best_accuracy, last10_mean_accuracy, wall_seconds, ...) or a "
                "per-round metric NAME (accuracy, loss, mib, ...) as NAME@R (at round R), NAME@XMiB (at the last "
                "round within X MiB communicated), mean(NAME), max(NAME), min(NAME), lastK(NAME) (mean of the last "
                "K values), round(NAME>=X) (first round reaching X), time(NAME>=X) (the simulated seconds at the "
                "end of that round: time to accuracy, with a system.profile); a function's NAME may carry @R or @XMiB")


def parse_metric(metric: str) -> Optional[re.Match]:
    """None for a summary field; the parts of a per-round form; ConfigError if malformed."""
    m = _FORM.fullmatch(metric)
    if m is None:
        if not re.fullmatch(r"\w+", metric):
            raise ConfigError(f"--metric {metric!r} is not understood; it is {METRICS_HELP}")
        return None
    if (m["fn"] in ("round", "time")) != (m["x"] is not None):
        raise ConfigError(f"--metric {metric!r}: '>=X' goes with round(NAME>=X) and time(NAME>=X) only")
    return None if m["fn"] is None and m["at"] is None else m


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
        """metrics.parquet, one dict per round (read on first use), plus `mib`."""
        if self._rows is None:
            import pyarrow.parquet as pq

            self._rows = pq.read_table(self.path / "metrics.parquet").to_pylist()
            for r in self._rows:  # cumulative traffic, down + up, in MiB
                r["mib"] = (r.get("bytes_down", 0) + r.get("bytes_up", 0)) / 2**20
        return self._rows

    def value(self, metric: str) -> Optional[float]:
        """The number `metric` names for this run (see METRICS_HELP); None if the run has none."""
        m = parse_metric(metric)
        if m is None:
            return self.summary.get(metric)
        rows = self.rows
        if m["at"] is not None and not m["mib"] and rows and rows[-1]["round"] < float(m["at"]):
            return None  # the run ended (diverged) before round R
        if m["at"] is not None:  # the curve up to a round, or up to a communication budget
            limit = float(m["at"])
            rows = [r for r in rows if (r["mib"] if m["mib"] else r["round"]) <= limit]
        got = [(r["round"], r[m["name"]]) for r in rows if r.get(m["name"]) is not None]
        if not got:
            return None
        values = [v for _, v in got]
        fn = m["fn"]
        if fn is None:
            return values[-1]
        if fn == "round":
            return next((float(rnd) for rnd, v in got if v >= float(m["x"])), None)
        if fn == "time":  # simulated time (world/clock.py): the end of the first round reaching X
            ends = {r["round"]: r.get("sim_end") for r in rows}
            return next((ends[rnd] for rnd, v in got if v >= float(m["x"])), None)
        if fn.startswith("last"):
            return statistics.mean(values[-int(m["k"]):])
        return {"mean": statistics.mean, "max": max, "min": min}[fn](values)

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
        runs.append(Run(d, flatten(read_sections(cfg)), json.loads((d / "summary.json").read_text())))
    return runs


def read_sections(cfg: dict) -> dict:
    """The config without the plugin sections the run does not read (a FedAvg run's config
    carries fed2.* defaults; a table row should not say it used them)."""
    from raysim.config import plugin_sections, used_sections

    try:
        unused = set(plugin_sections()) - used_sections(cfg)
    except Exception:  # a plugin of the run that is not importable here: keep everything
        return cfg
    return {k: v for k, v in cfg.items() if k not in unused}


def differing_keys(runs: list[Run]) -> list[str]:
    """Config keys whose values differ between the runs that have them (a section only some
    runs read counts by its values there), incidental ones (seed, paths) left out."""
    keys = sorted({k for r in runs for k in r.config})
    return [k for k in keys if not k.startswith(INCIDENTAL)
            and len({json.dumps(r.config[k]) for r in runs if k in r.config}) > 1]


def check_keys(runs: list[Run], keys: list[str]) -> None:
    known = {k for r in runs for k in r.config}
    for k in keys:
        if k not in known:
            near = difflib.get_close_matches(k, sorted(known), n=3)
            raise ConfigError(f"{k!r} is not a config key of these runs" + (f"; did you mean {', '.join(near)}?" if near else ""))


def label(run: Run, keys: list[str]) -> str:
    return ", ".join(f"{k}={run.config[k]}" for k in keys if k in run.config) or run.path.name


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)
