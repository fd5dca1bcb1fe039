"""When clients are online, in simulated time (`system.availability`, issue 43): a client can
be selected only while online, and one that goes offline before its update is back is a
dropout at that simulated time (`reason=offline`). Needs the virtual clock (world/clock.py).

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

from typing import Optional

import numpy as np

from raysim.world.traces import Intervals, read_intervals

DAY = 24 * 3600.0


class Online:
    """Who is online when (module docstring)."""

    def __init__(self, cfg, num_clients: int):
        s = cfg.system
        self.mode = s.availability
        if self.mode == "diurnal":
            hours = float(s.online_hours)
            starts = np.random.default_rng([int(cfg.seed), 9]).uniform(0, DAY, num_clients)
            self.spans = Intervals.one_each(starts, starts + hours * 3600.0)
            self.row = np.arange(num_clients)  # client c's row of spans
            self.period = DAY
        elif self.mode == "trace":
            self.spans = read_intervals(s.availability_trace)
            self.row = np.arange(num_clients) % len(self.spans)  # client c follows the trace's client c mod its clients
            self.period = self.spans.period

    def until(self, cid: int, t: float) -> Optional[float]:
        """The end of client `cid`'s online interval around time `t`; None if offline at `t`."""
        if self.mode == "always":
            return float("inf")
        base = np.floor(t / self.period) * self.period
        k = int(self.row[cid])
        for shift in (base - self.period, base):  # an interval may wrap past the period's end (diurnal)
            end = self.spans.around(k, t, shift)
            if end is not None:
                return end
        return None

    def online(self, cids: list[int], t: float) -> list[int]:
        return cids if self.mode == "always" else [c for c in cids if self.until(c, t) is not None]

    def next_start(self, cids: list[int], t: float) -> float:
        """The earliest time after `t` at which one of `cids` comes online."""
        base = np.floor(t / self.period) * self.period
        times = [start for c in cids for shift in (base, base + self.period)
                 if (start := self.spans.first_start_after(int(self.row[c]), t, shift)) is not None]
        return float(min(times))
