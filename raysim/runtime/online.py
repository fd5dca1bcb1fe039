"""When clients are online, in simulated time (`system.availability`, issue 43): a client can
be selected only while online, and one that goes offline before its update is back is a
dropout at that simulated time (`reason=offline`). Needs the virtual clock (runtime/clock.py).

- `always`: every client, all the time (the default).
- `diurnal`: each client is online `system.online_hours` hours of every simulated day, from
  a start drawn once per client from the seed (phones that train while charging at night,
  spread over time zones).
- `trace`: online intervals read from `system.availability_trace`, a CSV with the header
  `client,start_s,end_s` (one row per interval, seconds of simulated time; a client's
  intervals need not be sorted but must not overlap). Client c follows the trace's client
  c mod (number of clients in the trace), and the trace repeats with the period of its
  last interval's end, as FedScale's behaviour traces (`client_behave_trace`) are replayed.
  FedScale ships its traces as pickles of per-client active / inactive times; write them
  out as these rows to use them. `examples/availability_trace.csv` is a small generated one.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import numpy as np

from raysim.errors import ConfigError

DAY = 24 * 3600.0


def trace_rows(key: str, path: str, header: tuple) -> list[tuple[int, list[str]]]:
    """(row number, cells) of a trace CSV after its header, blank rows skipped; a file that
    cannot be read or has another header is a ConfigError naming `key` and the file."""
    try:
        with open(Path(path).expanduser(), newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise ConfigError(f"{key}={path}: cannot read it ({e.strerror})") from None
    if not rows or [c.strip() for c in rows[0]] != list(header):
        raise ConfigError(f"{key}={path}: the first row must be the header {','.join(header)}")
    return [(i, row) for i, row in enumerate(rows[1:], start=2) if row and "".join(row).strip()]


def read_intervals(path: str) -> dict[int, np.ndarray]:
    """{trace client: (k, 2) array of [start, end) seconds, sorted}, or a ConfigError naming
    the file and the row."""
    found: dict[int, list] = {}
    for i, row in trace_rows("system.availability_trace", path, ("client", "start_s", "end_s")):
        try:
            client, start, end = int(row[0]), float(row[1]), float(row[2])
            ok = len(row) == 3 and client >= 0 and 0 <= start < end and np.isfinite(end)
        except (ValueError, IndexError):
            ok = False
        if not ok:
            raise ConfigError(f"system.availability_trace={path}, row {i}: {','.join(row)[:80]!r} is not "
                              "client,start_s,end_s (a client id >= 0, then 0 <= start < end seconds)")
        found.setdefault(client, []).append((start, end))
    if not found:
        raise ConfigError(f"system.availability_trace={path}: no intervals after the header")
    out = {}
    for client, spans in found.items():
        a = np.array(sorted(spans))
        if (a[1:, 0] < a[:-1, 1]).any():
            raise ConfigError(f"system.availability_trace={path}: client {client}'s intervals overlap")
        out[client] = a
    return out


class Online:
    """Who is online when (module docstring)."""

    def __init__(self, cfg, num_clients: int):
        s = cfg.system
        self.mode = s.availability
        if self.mode == "diurnal":
            hours = float(s.online_hours)
            starts = np.random.default_rng([int(cfg.seed), 9]).uniform(0, DAY, num_clients)
            self.spans = [np.array([[a, a + hours * 3600.0]]) for a in starts]
            self.period = DAY
        elif self.mode == "trace":
            table = read_intervals(s.availability_trace)
            keys = sorted(table)
            self.spans = [table[keys[c % len(keys)]] for c in range(num_clients)]
            self.period = max(float(v[-1, 1]) for v in table.values())

    def until(self, cid: int, t: float) -> Optional[float]:
        """The end of client `cid`'s online interval around time `t`; None if offline at `t`."""
        if self.mode == "always":
            return float("inf")
        base = np.floor(t / self.period) * self.period
        for shift in (base - self.period, base):  # an interval may wrap past the period's end (diurnal)
            for start, end in self.spans[cid]:
                if shift + start <= t < shift + end:
                    return float(shift + end)
        return None

    def online(self, cids: list[int], t: float) -> list[int]:
        return cids if self.mode == "always" else [c for c in cids if self.until(c, t) is not None]

    def next_start(self, cids: list[int], t: float) -> float:
        """The earliest time after `t` at which one of `cids` comes online."""
        base = np.floor(t / self.period) * self.period
        times = [shift + start for c in cids for start, _ in self.spans[c]
                 for shift in (base, base + self.period) if shift + start > t]
        return float(min(times))
