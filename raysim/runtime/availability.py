"""Clients over time: which clients exist in a round (`clients.join`), for any algorithm and
selection strategy.

`clients.join.fraction` of the clients (at least one when > 0; which ones is drawn once
from the seed) are newcomers: they are not there before round `clients.join.round` and
arrive in `clients.join.over` equal batches, one per round from then on. The server gives
the selection strategy only the clients that are there (`Selection.available`), tells the
algorithm who arrived (`Algorithm.clients_joined`, e.g. FedGroup's client cold start),
records a `join` row per newcomer in the clients table, and evaluates (per-client) only
clients that are there. A function of the config and seed: nothing to checkpoint.
"""
from __future__ import annotations

import numpy as np


class Availability:
    def __init__(self, cfg, num_clients: int):
        j = cfg.clients.join
        self.joins = np.ones(num_clients, dtype=np.int64)  # the round each client is there from
        if j.fraction > 0:
            n_late = max(1, int(round(float(j.fraction) * num_clients)))
            late = np.sort(np.random.default_rng([int(cfg.seed), 6]).choice(num_clients, n_late, replace=False))
            for i, batch in enumerate(np.array_split(late, int(j.over))):
                self.joins[batch] = int(j.round) + i

    def available(self, rnd: int) -> list[int]:
        """The clients there in round `rnd`, sorted."""
        return np.flatnonzero(self.joins <= rnd).tolist()

    def there(self, cid: int, rnd: int) -> bool:
        return bool(self.joins[cid] <= rnd)

    def joining(self, rnd: int) -> list[int]:
        """The newcomers that arrive in round `rnd` (none in round 1: everyone there is)."""
        return np.flatnonzero(self.joins == rnd).tolist() if rnd > 1 else []
