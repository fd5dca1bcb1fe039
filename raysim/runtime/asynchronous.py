"""Clients in flight, for asynchronous algorithms (FedBuff, FedAsync; issue 43): the part of
the server that keeps clients training while the server updates its model, on the virtual
clock (world/clock.py).

`arrivals(n)` hands over the next n updates in simulated-time order. The caller promises
that the model clients download does not change until the n-th is taken (FedBuff: a buffer;
FedAsync: one arrival), so the whole window is planned on the clock first: each arrival in
turn leaves (the earliest end, ties by start order) and a client starts in its place, from
the same payload. Who starts and when depends only on the clock, the availability and the
selection's random stream, never on a result. The clients started in the window are then
sent at once, one task per (model version, actor), to the least busy actors, so they train
in parallel at a few tasks a window (a task per client ran at 0.67 of the synchronous
throughput: benchmarks/results-simulated-time-cpu-2core.txt). Results are taken in the
planned order, whatever the order in which actors really finish, so an asynchronous run is
the same, bit for bit, on any number of actors. A client whose online time ends first
(world/online.py) arrives as a dropout at that time, untrained. A client that drops out
(`system.dropout`, fixed per (seed, round, client)) is not started, is recorded once, and is
not picked again in that round; when no client can start and none is in flight (all dropped,
or none will come online), the run stops and says so (`RunStalled`).

Checkpoints hold the clients in flight (each one's round, start, arrival and payload, one
copy per model version); a resumed run sends them again, so it continues bit for bit.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

from raysim.contract import ClientResult
from raysim.errors import RunStalled
from raysim.training import nbytes


@dataclass(order=True)
class Flight:
    end: float  # simulated time its update arrives (or it goes offline)
    seq: int  # start order: ties
    cid: int = field(compare=False)
    rnd: int = field(compare=False)  # the round it started in: its training seed
    start: float = field(compare=False)
    version: int = field(compare=False)  # the server's model version it trains from
    offline: bool = field(compare=False)
    epochs: int = field(compare=False, default=1)
    seconds: float = field(compare=False, default=0.0)  # its simulated seconds, had it stayed online
    actor: int = field(compare=False, default=0)
    task: Optional["_Task"] = field(compare=False, default=None, repr=False)  # None: not sent yet


class _Task:
    """One task's clients (sent together: same model version, same actor) and their results
    as they are read, each with its clients-table rows, held until the client's arrival."""

    def __init__(self, results: Iterator[ClientResult]):
        self.results = results
        self.got: dict[int, tuple[Optional[ClientResult], list]] = {}
        self.done = False

    def take(self, cid: int, record) -> tuple[Optional[ClientResult], list]:
        """Client `cid`'s result (None: its actor died) and rows, reading the task's results
        up to it; the rows are taken out of the round being recorded."""
        while cid not in self.got and not self.done:
            before = len(record.rows)
            result = next(self.results, None)
            rows, record.rows[before:] = record.rows[before:], []
            for row in rows:  # a dead actor's clients are recorded as dropped rows without a result
                self.got.setdefault(row["cid"], (None, []))[1].append(row)
            if result is None:
                self.done = True
            else:
                self.got[result.cid] = (result, self.got.get(result.cid, (None, []))[1])
        return self.got.pop(cid, (None, []))


@dataclass
class Arrival:
    cid: int
    result: Optional[ClientResult]  # None: it went offline before its update was back
    version: int
    start: float
    end: float
    payload: Any  # what it downloaded (FedBuff's update is its model minus this)


LISTED = 1_000_000  # FreeClients keeps Python lists up to this many clients, numpy arrays beyond


class FreeClients:
    """The round's clients that can start (there, not in flight, not dropped), in client-id
    order, with the k-th found in O(log n): a Fenwick tree of one flag per client there.
    `InFlight.pick` draws uniformly from them without listing 100,000 clients per arrival."""

    def __init__(self, there, taken: set[int]):
        # sorted (Availability.available); a range of every client stays a range: no array of 15 million ids
        self.there = there if isinstance(there, range) and there.step == 1 else np.asarray(there, dtype=np.int64)
        n = len(self.there)
        flags = np.ones(n, dtype=np.int64)
        if taken:
            ids = np.fromiter(taken, dtype=np.int64, count=len(taken))
            if isinstance(self.there, range):
                ids = ids[(ids >= self.there.start) & (ids < self.there.stop)] - self.there.start
                flags[ids] = 0
            else:
                flags[np.isin(self.there, ids)] = 0
        prefix = np.concatenate([[0], np.cumsum(flags)])
        i = np.arange(1, n + 1)
        self.tree = np.zeros(n + 1, dtype=np.int64)
        self.tree[1:] = prefix[i] - prefix[i - (i & -i)]  # node i sums the flags of (i - lowbit(i), i]
        self.flags = flags
        self.count = int(prefix[-1])
        self.top = 1 << max(0, n.bit_length() - 1) if n else 0
        if n <= LISTED:  # plain ints: cheap one at a time
            self.tree, self.flags = self.tree.tolist(), self.flags.tolist()
        else:  # millions: numpy's (a Python int per client is 28 bytes and a list slot 8 more)
            self.tree, self.flags = self.tree.astype(np.int32 if n < 2**31 else np.int64), self.flags.astype(np.int8)

    def _position(self, cid: int) -> Optional[int]:
        if isinstance(self.there, range):
            at = cid - self.there.start
            return at if 0 <= at < len(self.there) else None
        at = int(np.searchsorted(self.there, cid))
        return at if at < len(self.there) and self.there[at] == cid else None

    def set(self, cid: int, free: bool) -> None:
        """Client `cid` can start (`free`) or cannot (it started, or dropped out)."""
        at = self._position(cid)
        if at is None or self.flags[at] == int(free):
            return
        self.flags[at] = int(free)
        step = 1 if free else -1
        self.count += step
        i = at + 1
        while i < len(self.tree):
            self.tree[i] += step
            i += i & -i

    def kth(self, k: int) -> int:
        """The k-th (from 0) free client in client-id order."""
        at, left = 0, k + 1
        bit = self.top
        while bit:
            nxt = at + bit
            if nxt < len(self.tree) and self.tree[nxt] < left:
                at, left = nxt, left - self.tree[nxt]
            bit >>= 1
        return int(self.there[at])


class InFlight:
    """The clients training now (module docstring)."""

    def __init__(self, server):
        self.server = server
        self.flights: list[Flight] = []  # a heap by (end, seq)
        self.payloads: dict[int, Any] = {}  # version: what clients of that version downloaded
        self.seq = 0
        self.round: Optional[tuple] = None  # (round, the clients there, the stream its picks draw from)
        self.dropped: set[int] = set()  # the round's clients that dropped out: not picked again in it
        self.busy = [0] * server.dispatch.n_actors
        self.pending: list[Flight] = []  # started, not sent yet
        self.epochs = int(server.cfg.local.epochs)  # read once: an OmegaConf lookup per client adds up
        self.sizes: dict[int, int] = {}
        # a uniform draw among always-online clients (`Selection.uniform_draw`): from `FreeClients`,
        # the same draw the selection makes from the list of them (`pick`), without listing them
        self.fast = server.selection.uniform_draw and server.clock.online.mode == "always"
        self.free: Optional[FreeClients] = None

    def __len__(self) -> int:
        return len(self.flights)

    def cids(self) -> set[int]:
        return {f.cid for f in self.flights}

    def pick(self, rnd: int) -> Optional[int]:
        """One client for the selection strategy to start: from those online now and not in
        flight (None when there is none)."""
        s = self.server
        if self.round is None or self.round[0] != rnd:  # a round's picks draw in turn from one stream
            there = s.availability.available(rnd)
            if self.fast and self.free is not None and self.round[1] is there:
                for cid in self.dropped:  # the same clients there: the last round's free set, its dropouts back
                    self.free.set(cid, True)  # (a dropout is never in flight)
            else:  # O(clients there): once, and again when clients join
                self.free = FreeClients(there, self.cids()) if self.fast else None
            self.round = (rnd, there, s.rng(rnd, 1000))
            self.dropped = set()
        if self.free is not None:  # as UniformSelection.select on the list of free clients: same draw
            if not self.free.count:
                return None
            return self.free.kth(int(self.round[2].choice(self.free.count, size=1, replace=False)[0]))
        busy = self.cids() | self.dropped
        free = [c for c in s.clock.online.online(self.round[1], s.clock.now) if c not in busy]
        if not free:
            return None
        s.selection.available = free
        return int(s.selection.select(rnd, 1, self.round[2])[0])

    def keep_training(self, rnd: int, concurrency: int, payload) -> None:
        """Start clients (`pick`) until `concurrency` are in flight, each with `payload()` =
        (what it downloads, its version); with none online and none in flight, the clock
        first waits for a client to come online; with none that ever can, the run stops."""
        s = self.server
        while len(self) < concurrency:
            cid = self.pick(rnd)
            if cid is None:
                if self.flights:
                    return
                waiting = [c for c in self.round[1] if c not in self.dropped]  # none is in flight
                if not waiting or s.clock.online.mode == "always":
                    s.stop_early(rnd, "stalled", RunStalled,
                                 f"{s.cfg.algorithm} cannot go on: no client can start and none is training (of "
                                 f"{len(self.round[1])} clients there, {len(self.dropped)} dropped out: "
                                 f"system.dropout={s.cfg.system.dropout})")
                s.clock.now = s.clock.online.next_start(waiting, s.clock.now)
                continue
            self.start(rnd, cid, *payload())

    def start(self, rnd: int, cid: int, payload: Any, version: int) -> None:
        s = self.server
        epochs = self.epochs
        if s.system.active:  # stragglers' epochs (a dropout simply does not arrive: it is not started)
            kept, got, dropped = s.system.apply(rnd, [cid], {cid: epochs})
            if dropped:  # recorded once: not picked again this round
                self.dropped.add(cid)
                if self.free is not None:
                    self.free.set(cid, False)
                s.record.client(rnd, cid, "client_update", "dropped", reason="dropout")
                return
            epochs = got[cid]
        if version not in self.sizes:  # counted once per model version: (down, up)
            self.sizes = {version: (nbytes(payload), s.upload_bytes(payload))}
        down, up = self.sizes[version]
        took = s.clock.seconds(cid, epochs, down, up)
        gone = s.clock.online.until(cid, s.clock.now)
        offline = gone is None or gone < s.clock.now + took
        self.payloads.setdefault(version, payload)
        self.seq += 1
        flight = Flight(gone if offline and gone is not None else s.clock.now + took, self.seq, cid, rnd,
                        s.clock.now, version, offline, epochs, took)
        heapq.heappush(self.flights, flight)
        if self.free is not None:
            self.free.set(cid, False)
        if not offline:
            self.pending.append(flight)  # sent with the next batch (`_send_pending`)

    def _send_pending(self) -> None:
        """Send the clients started since the last batch: each to the least busy actor, one
        task per (model version, actor). Which task trains a client changes nothing in its
        result (its seed is (seed, start round, cid))."""
        s = self.server
        groups: dict[tuple, list[Flight]] = {}
        for f in sorted(self.pending, key=lambda f: f.seq):
            f.actor = min(range(len(self.busy)), key=lambda a: (self.busy[a], a))
            self.busy[f.actor] += 1
            groups.setdefault((f.version, f.actor, f.rnd), []).append(f)
        self.pending = []
        for (version, actor, rnd), flights in groups.items():
            results = s.dispatch.run(rnd, [f.cid for f in flights], {f.cid: f.epochs for f in flights},
                                     self.payloads[version], "client_update", "algorithm",
                                     s.carries_state("client_update", "algorithm"), actor=actor)
            task = _Task(results)
            for f in flights:
                f.task = task

    def arrivals(self, rnd: int, n: int, concurrency: int, payload: Callable[[], tuple]) -> Iterator[Arrival]:
        """The next `n` updates in simulated time, `concurrency` clients kept in flight, each
        starting with `payload()` = (what it downloads, its version), which must not change
        before the n-th is taken (module docstring)."""
        window = []
        for _ in range(n):
            self.keep_training(rnd, concurrency, payload)
            window.append(self._leave(rnd))
        self._send_pending()
        downloaded = {f.version: self.payloads[f.version] for f in window}
        training = {f.version for f in self.flights}  # the payloads a checkpoint keeps
        self.payloads = {v: p for v, p in self.payloads.items() if v in training}
        for f in window:
            yield self._land(rnd, f, downloaded[f.version])

    def _leave(self, rnd: int) -> Flight:
        """The client in flight that arrives first: the clock moves there."""
        s = self.server
        f = heapq.heappop(self.flights)
        if self.free is not None and f.cid not in self.dropped:
            self.free.set(f.cid, True)  # free to start again (if it is there this round)
        s.clock.now = max(s.clock.now, f.end)
        s.record.sim_seconds[f.cid] = f.seconds
        if f.offline:
            s.record.client(rnd, f.cid, "client_update", "dropped", reason="offline", epochs=f.epochs)
        return f

    def _land(self, rnd: int, f: Flight, payload: Any) -> Arrival:
        """Its result (None when it went offline or its actor died); its clients-table row is
        this round's, with its simulated seconds."""
        s = self.server
        result = None
        if not f.offline:
            self.busy[f.actor] -= 1
            result, rows = f.task.take(f.cid, s.record)
            for row in rows:  # recorded under the round it arrives in
                row.update({"round": rnd, "sim_seconds": f.seconds})
            s.record.rows.extend(rows)
        return Arrival(f.cid, result, f.version, f.start, f.end, payload)

    # ---- checkpoints ----
    def state_dict(self) -> dict:
        return {"flights": [(f.end, f.seq, f.cid, f.rnd, f.start, f.version, f.offline, f.epochs, f.seconds)
                            for f in self.flights],
                "payloads": dict(self.payloads), "seq": self.seq}

    def load_state_dict(self, state: dict) -> None:
        """The clients in flight at the checkpoint, sent again (their training is a function
        of their round, client and payload)."""
        self.payloads = dict(state["payloads"])
        self.seq = state["seq"]
        self.flights = []
        self.round = self.free = None  # rebuilt at the next pick, from the flights below
        for end, seq, cid, rnd, start, version, offline, epochs, seconds in state["flights"]:
            f = Flight(end, seq, cid, rnd, start, version, offline, epochs, seconds)
            heapq.heappush(self.flights, f)
            if not offline:
                self.pending.append(f)
