"""What FedBuff and FedAsync share (issue 43): clients train from the model version they
downloaded while the server updates its model; their updates arrive in simulated-time order
(runtime/asynchronous.py on the virtual clock, runtime/clock.py; without a `system.profile`
the run takes the `uniform` one). A round is a fixed number of arrivals (FedBuff: one buffer; FedAsync:
`fedasync.updates_per_round`), so rounds, evaluation and checkpoints work as for any
algorithm. Staleness tau = the server's version now - the version the client trained from.

`staleness_weight` is each paper's s(tau):
- FedBuff (Nguyen et al. 2022, AISTATS; "Federated Learning with Buffered Asynchronous
  Aggregation", Sec. 4): 1 / sqrt(1 + tau).
- FedAsync (Xie, Koyejo, Gupta 2019, "Asynchronous Federated Optimization", Sec. 5.2):
  constant 1; polynomial (tau + 1)^-a; hinge 1 if tau <= b else 1 / (a (tau - b) + 1).
Reference implementations read: FedScale's async FedBuff aggregator
(SymbioticLab/FedScale, fedscale/cloud/aggregation/async_aggregator.py) and FLGo's
fedasync / fedbuff algorithms (WwZzz/easyFL, flgo/algorithm/fedasync.py, fedbuff.py).
"""
from __future__ import annotations

import math
from typing import Iterator

from raysim.contract import Server
from raysim.errors import ConfigError
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
    """FedAvg's client update, served asynchronously: `arrivals` keeps `concurrency` clients
    training and yields their updates in simulated-time order."""

    asynchronous = True  # the server gives the run a clock (runtime/clock.py) even without system.profile
    server_parts = ()  # subclasses say which server parts their step takes
    returns_model = False  # an arrival is applied alone: no cohort for a model attack to hide in
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

    def arrivals(self, rnd: int, server: Server, n: int, concurrency: int, window: int) -> Iterator:
        """n arrivals, in windows of `window` over which the model clients download stays the
        same (the server plans and sends a window's clients at once: runtime/asynchronous.py)."""
        for first in range(0, n, window):
            yield from server.arrivals(rnd, min(window, n - first), concurrency, self.payload)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.version = int(state["version"])
