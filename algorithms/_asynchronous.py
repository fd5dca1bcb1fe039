"""What FedBuff and FedAsync share (issue 43): clients train from the model version they
downloaded while the server updates its model; their updates arrive in simulated-time order
(runtime/asynchronous.py on the virtual clock, world/clock.py; without a `system.profile`
the run takes the `uniform` one). A round is a fixed number of arrivals (FedBuff: one buffer; FedAsync:
`fedasync.updates_per_round`), so rounds, evaluation and checkpoints work as for any
algorithm. Staleness tau = the server's version now - the version the client trained from.

`staleness_weight` is each paper's s(tau):
- FedBuff (Nguyen et al. 2022, AISTATS; "Federated Learning with Buffered Asynchronous
  Aggregation", Sec. 4): 1 / sqrt(1 + tau).
- FedAsync (Xie, Koyejo, Gupta 2019, "Asynchronous Federated Optimization", Sec. 5.2):
  constant 1; polynomial (tau + 1)^-a; hinge 1 if tau <= b else 1 / (a (tau - b) + 1).
raysim follows the papers. The reference implementations read differ from them, each way
an option: FedScale's async FedBuff aggregator (SymbioticLab/FedScale,
fedscale/cloud/aggregation/async_aggregator.py) averages whole models weighted by
1/(1 + tau) and drops arrivals staler than `max_staleness` (`fedbuff.reading=fedscale`);
FLGo (WwZzz/easyFL, flgo/algorithm/fedbuff.py) applies the plain mean update
(`fedbuff.staleness=none`), and its fedasync.py a FedProx client (mu 0.005: `fedasync.rho`)
with hinge constants 10 and 6 and no +1 in the hinge (`fedasync.b=6`). Both papers' servers
wait for their count of updates: a client that went offline brings none and is not counted
(`updates`).
"""
from __future__ import annotations

import math
from typing import Iterator

from raysim.contract import Server
from raysim.errors import ConfigError, RunStalled
from raysim.training import cpu_state

from raysim.algorithms.fedavg import FedAvg


def staleness_weight(kind: str, tau: int, a: float = 0.5, b: float = 4.0) -> float:
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + tau)
    if kind == "poly":
        return (tau + 1.0) ** (-a)
    if kind == "hinge":
        return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
    if kind in ("constant", "none"):
        return 1.0
    raise ValueError(kind)


def needs_clock(cfg, section: str) -> None:
    """What an asynchronous run refuses: a deadline (for synchronous rounds), and vectorised
    groups or partial sums, whose grouping would follow the batches the server happens to send."""
    if cfg.system.deadline:
        raise ConfigError(f"system.deadline times synchronous rounds; algorithm={section} has none (unset it)")
    if cfg.local.vectorize or cfg.server.partial_sums:
        raise ConfigError(f"algorithm={section} trains each client alone: unset local.vectorize and "
                          "server.partial_sums")


class Asynchronous(FedAvg):
    """FedAvg's client update, served asynchronously: `updates` keeps `concurrency` clients
    training and yields their updates in simulated-time order."""

    asynchronous = True  # the server gives the run a clock (world/clock.py) even without system.profile
    server_parts = ()  # subclasses say which server parts their step takes
    returns_model = False  # an arrival is applied alone: no cohort for a model attack to hide in
    sends_model = True  # ... but it is FedAvg's model: compress.up encodes its update
    trains_privately = False

    @classmethod
    def vectorizes(cls) -> bool:
        return False  # each client trains alone (needs_clock)

    def setup(self, server: Server) -> None:
        super().setup(server)
        self.version = 0  # server model updates so far
        self._payload = None

    def payload(self) -> tuple[dict, int]:
        """What a client starting now downloads, and its version (one copy per version)."""
        if self._payload is None or self._payload[1] != self.version:
            self._payload = ({"weights": cpu_state(self.model)}, self.version)
        return self._payload

    def updates(self, rnd: int, server: Server, n: int, concurrency: int, window: int) -> Iterator:
        """The next n updates that arrive, in windows of at most `window` arrivals over which
        the model clients download stays the same (the server plans and sends a window's
        clients at once: runtime/asynchronous.py). A client that went offline before its
        update was back (or whose actor died) brings none: the server waits for n updates,
        as both papers' servers do (FedBuff's buffer holds K updates). A run in which
        `stall_after(server)` clients in a row bring none stops and says so."""
        got, lost = 0, 0
        while got < n:
            for a in server.arrivals(rnd, min(window, n - got), concurrency, self.payload):
                if a.result is None:
                    lost += 1
                    continue
                got, lost = got + 1, 0
                yield a
            if lost >= self.stall_after(server):
                server.stop_early(rnd, "stalled", RunStalled,
                                  f"{self.cfg.algorithm} cannot go on: the last {lost} clients started went offline "
                                  f"before their update was back (system.availability={self.cfg.system.availability}: "
                                  "online intervals shorter than the clients' training)")

    @staticmethod
    def stall_after(server: Server) -> int:
        """Clients in a row without an update after which a run is taken to be stuck."""
        return max(100, 10 * int(server.cfg.num_clients))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.version = int(state["version"])
