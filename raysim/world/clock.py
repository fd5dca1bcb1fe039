"""Simulated time (`system.profile`, issue 43): a virtual clock that says how long each
client update and each round would take on real devices, for any algorithm.

Each client has a device: compute speed (FLOP/s), download and upload bandwidth (bytes/s)
and a latency (s), drawn once from a named profile (seeded, `PROFILES`) or read from a
trace file (`system.trace`, CSV: `gflops,down_mbps,up_mbps,latency_s` per row; client c
takes row c mod rows, as FedScale maps its device traces onto clients). A training call's
client c takes

    2 x latency + bytes_down / down + samples x epochs x flops_per_sample / speed + bytes_up / up

simulated seconds: `bytes_down` is what the server sends it (counted as `bytes_down` is),
`bytes_up` the same size (an update is the model's size; what clients really send is in
`bytes_up`) or, with `compress.up`, the encoded update's size, `flops_per_sample` the model's forward and backward FLOPs on one sample,
counted once by torch's `FlopCounterMode` (counted, not timed: the same on every machine
and every run). With `local.steps`, samples x epochs is steps x batch size.

The server's clock: a training call starts when the previous one ended and ends when its
slowest client is back; with `system.deadline` a client that would be later is dropped
before it trains (`reason=deadline` in the clients table) and the call ends at the
deadline: a fixed round deadline. (This is not FedScale's over-commitment, which selects
more clients than it needs and keeps the first K to finish, so that a round ends at the
K-th arrival, not at a fixed time; raysim has no over-commitment yet.) With `system.availability`
(world/online.py) only clients online at a round's start are offered to the selection,
and one whose online time ends before its update is back is dropped (`reason=offline`). Clients that drop out
(`system.dropout`) hold nothing up. Rounds record `sim_start` and `sim_end`, clients
`sim_seconds`; the summary `sim_seconds` and, with `system.target_accuracy`, the simulated
time at which the test accuracy first reached it (time to accuracy).

References: FedScale's client device traces and virtual clock (SymbioticLab/FedScale,
`fedscale/cloud/execution` and its `client_device_capacity` traces); FLGo's system
simulator (latency, availability). Both time a round by its slowest kept client, as here.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from raysim.world.online import Online
from raysim.world.traces import MBIT, read_devices

# name: (median, spread) of each quantity; spread = sigma of its log-normal (0: every client
# the same). mobile: speeds 10x apart between the 5th and 95th percentiles (sigma 0.7), links
# 1-20 Mbit/s down (sigma 0.9), as the FedScale traces' phones spread.
PROFILES = {
    "uniform": {"speed": (2e9, 0.0), "down": (20 * MBIT, 0.0), "up": (5 * MBIT, 0.0), "latency": (0.05, 0.0)},
    "mobile": {"speed": (2e9, 0.7), "down": (5 * MBIT, 0.9), "up": (1.5 * MBIT, 0.9), "latency": (0.1, 0.5)},
}


def flops_per_sample(model, sample) -> float:
    """Forward and backward FLOPs of `model` on one input (`sample`: a batch of one), counted
    on the input twice and halved: BatchNorm after a linear layer cannot train on a batch of
    one (the counted ops are linear in the batch, so the count is the same)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model = model.train()
    with FlopCounterMode(display=False) as counter:
        out = model(torch.cat([sample, sample]))
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        params = sum(p.numel() for p in model.parameters())
    return float(max(counter.get_total_flops() / 2, 2 * params))  # ops FlopCounterMode does not count: a floor


class Clock:
    """The virtual clock (module docstring): devices per client, and the server's time."""

    def __init__(self, cfg, num_clients: int, sizes, flops: float, profile: Optional[str] = None):
        s = cfg.system
        profile = profile or s.profile
        if profile == "trace":
            table = read_devices(s.trace)
            rows = np.arange(num_clients) % len(table["speed"])
            self.devices = {k: v[rows] for k, v in table.items()}
        else:
            rng = np.random.default_rng([int(cfg.seed), 8])
            # a device type every client shares is one value seen N times (a read-only view): 15 million
            # clients under `uniform` hold no 480 MB of copies of four numbers
            self.devices = {k: median * np.exp(spread * rng.standard_normal(num_clients)) if spread else
                            np.broadcast_to(np.float64(median), (num_clients,))
                            for k, (median, spread) in PROFILES[profile].items()}
        self.sizes = np.asarray(sizes)
        self.flops = flops
        self.deadline = float(s.deadline) if s.deadline else None
        self.cfg, self.num_clients = cfg, num_clients
        loc = cfg.local
        self.steps = int(loc.steps) * int(loc.batch_size) if loc.get("steps") else None  # samples a client sees, per epoch
        self.now = 0.0

    @functools.cached_property
    def online(self) -> Online:
        """Who is online when (world/online.py), built when first asked (its trace read then)."""
        return Online(self.cfg, self.num_clients)

    @staticmethod
    def from_config(cfg, num_clients: int, sizes, model, sample, asynchronous: bool = False) -> Optional["Clock"]:
        """The run's clock: with a `system.profile`, or `uniform` for an asynchronous
        algorithm (its clients arrive in simulated time); else None."""
        if cfg.system.profile == "none" and not asynchronous:
            return None
        return Clock(cfg, num_clients, sizes, flops_per_sample(model, sample),
                     "uniform" if cfg.system.profile == "none" else None)

    def seconds(self, cid: int, epochs: int, bytes_down: int, bytes_up: int) -> float:
        """Client `cid`'s simulated seconds for one training call."""
        samples = self.steps if self.steps is not None else int(self.sizes[cid]) * epochs
        return float(self._took(cid, samples, bytes_down, bytes_up))

    def _took(self, cid, samples, bytes_down: int, bytes_up: int):
        """The module docstring's formula, for a client (`cid` an int) or all (a slice)."""
        d = self.devices
        return (2 * d["latency"][cid] + bytes_down / d["down"][cid] + samples * self.flops / d["speed"][cid]
                + bytes_up / d["up"][cid])

    def fastest(self, epochs: int, payload_bytes: int) -> tuple[int, float]:
        """The client whose training call of `epochs` epochs and a payload of `payload_bytes`
        takes the fewest simulated seconds, and those seconds."""
        samples = self.steps if self.steps is not None else self.sizes * epochs
        took = self._took(slice(None), samples, payload_bytes, payload_bytes)
        c = int(np.argmin(took))
        return c, float(took[c])

    def call(self, cids: list[int], epochs: dict, payload_bytes: int,
             upload_bytes: Optional[int] = None) -> tuple[list[int], dict, dict]:
        """A training call of `cids` starting now: (those whose update is back in time, {the
        others: why, `deadline` or `offline`}, every client's seconds). The call ends when its
        last kept client is back, when its last client goes offline, or at the deadline when
        a client would be later; the clock moves there. `upload_bytes`: what each client
        sends back (`compress.up`'s message), else the payload's size."""
        up = payload_bytes if upload_bytes is None else upload_bytes
        took = {c: self.seconds(c, epochs[c], payload_bytes, up) for c in cids}
        kept, lost, ends = [], {}, [0.0]
        for c in cids:
            gone = self.online.until(c, self.now)  # None: not online now (a strategy chose it anyway)
            if self.deadline is not None and took[c] > self.deadline:
                lost[c] = "deadline"
                ends.append(self.deadline)
            elif gone is None or gone < self.now + took[c]:
                lost[c] = "offline"
                ends.append(max(0.0, (gone or self.now) - self.now))
            else:
                kept.append(c)
                ends.append(took[c])
        self.now += max(ends)
        return kept, lost, took

    def available(self, there: list[int]) -> list[int]:
        """Of the clients `there`, those online now; when none is, the clock first waits
        until one comes online."""
        online = self.online.online(there, self.now)
        if there and not online:
            self.now = self.online.next_start(there, self.now)
            online = self.online.online(there, self.now)
        return online

    def summary(self, rows: list[dict], target: Optional[float]) -> dict:
        """summary.json's simulated time: the run's, and the time to `target` accuracy (None if
        never reached; the first evaluation at or above it, at its round's end)."""
        out = {"sim_seconds": self.now}
        if target is not None:
            out["target_accuracy"] = float(target)
            out["sim_seconds_to_target"] = next((r["sim_end"] for r in rows if r.get("accuracy") is not None
                                                 and r["accuracy"] >= target), None)
        return out
