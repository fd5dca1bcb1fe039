"""Clients over time: which clients exist in a round (`clients.join`) and, of those that
train, which drop out and which straggle (`system.*`), for any algorithm and selection
strategy. Both are functions of the config and seed: nothing to checkpoint.

`clients.join.fraction` of the clients (at least one when > 0; which ones is drawn once
from the seed) are newcomers: they are not there before round `clients.join.round` and
arrive in `clients.join.over` equal batches, one per round from then on. The server gives
the selection strategy only the clients that are there (`Selection.available`), tells the
algorithm who arrived (`Algorithm.clients_joined`, e.g. FedGroup's client cold start),
records a `join` row per newcomer in the clients table, and evaluates (per-client) only
clients that are there.

`system.dropout`: a training client does not return its update with this probability;
`system.stragglers`: this share of the clients (drawn once) train a random number of
epochs in `system.straggler_epochs`; each draw from (seed, round, client id).
"""
from __future__ import annotations

import numpy as np


class Availability:
    def __init__(self, cfg, num_clients: int):
        j = cfg.clients.join
        self.everyone = range(num_clients)  # with no newcomers, the clients there: nothing per client is held
        self.joins = None  # the round each client is there from (newcomers only)
        if j.fraction > 0:
            self.joins = np.ones(num_clients, dtype=np.int32)
            n_late = max(1, int(round(float(j.fraction) * num_clients)))
            late = np.sort(np.random.default_rng([int(cfg.seed), 6]).choice(num_clients, n_late, replace=False))
            for i, batch in enumerate(np.array_split(late, int(j.over))):
                self.joins[batch] = int(j.round) + i
        self.join_rounds = np.unique(self.joins) if self.joins is not None else np.ones(1, np.int64)
        self._listed: tuple = (None, None)  # (how many join rounds have passed, the list of the clients there)

    def available(self, rnd: int) -> list[int]:
        """The clients there in round `rnd`, sorted. The same list object for every round
        until the next clients join (callers read it, never change it): listing 100,000
        clients took ~4 ms a round, ~0.04 ms per update of an asynchronous run's round of
        100, and asynchronous runs compare it by identity (`InFlight.pick`). With no newcomers,
        a `range` of every client (15 million clients: no list of them, issue 73)."""
        if self.joins is None:
            return self.everyone
        passed = int(np.searchsorted(self.join_rounds, rnd, side="right"))
        if self._listed[0] != passed:
            self._listed = (passed, np.flatnonzero(self.joins <= rnd).tolist())
        return self._listed[1]

    def among(self, cids, rnd: int):
        """The clients of `cids` there in round `rnd`: `cids` itself when nobody joins late (no
        step per client), else an array of them."""
        if self.joins is None:
            return cids
        cids = np.asarray(cids, dtype=np.int64)
        return cids[self.joins[cids] <= rnd]

    def joining(self, rnd: int) -> list[int]:
        """The newcomers that arrive in round `rnd` (none in round 1: everyone there is)."""
        return np.flatnonzero(self.joins == rnd).tolist() if rnd > 1 and self.joins is not None else []


class SystemEffects:
    """Dropout and stragglers (module docstring)."""

    def __init__(self, cfg, num_clients: int):
        self.cfg = cfg.system
        self.seed = int(cfg.seed)
        share = float(self.cfg.stragglers)  # a share > 0 makes at least one straggler
        n_slow = max(1, int(round(share * num_clients))) if share > 0 else 0
        self.stragglers = set(np.random.default_rng([self.seed, 4]).choice(num_clients, n_slow, replace=False).tolist())
        self.active = self.cfg.dropout > 0 or bool(self.stragglers)  # read per client by asynchronous runs

    def apply(self, rnd: int, cids: list[int], epochs: dict) -> tuple[list[int], dict, list[int]]:
        """(the clients that train, their epochs, the clients that dropped out) of a
        training call in round `rnd`."""
        kept, dropped = [], []
        for c in cids:
            rng = np.random.default_rng([self.seed, rnd, c, 3])
            if self.cfg.dropout > 0 and rng.random() < self.cfg.dropout:
                dropped.append(c)
                continue
            if c in self.stragglers:
                epochs[c] = int(rng.integers(self.cfg.straggler_epochs[0], self.cfg.straggler_epochs[1] + 1))
            kept.append(c)
        return kept, epochs, dropped
