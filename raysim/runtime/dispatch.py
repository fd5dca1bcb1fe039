"""Dispatch: the run's client calls on Ray's client actors. The only part of the server
that needs Ray.

It takes the client actors (runtime/clients.py) and hands them the data references
once, then, per call of `run`:

- sends the payload once (through the object store when it is big), gives each client
  actor its contiguous run of the cohort (runtime/placement.py) as one task, or, for big
  models on GPUs, a few (`pipeline`: the server folds the first while the actor trains on), and yields
  the results in client-id order, fetched in bounded batches, so the server holds O(model)
  and the fold order never depends on which actor finishes first;
- keeps each stateful client's state as an object-store reference (any actor can run any
  client; the state outlives the actor that wrote it);
- turns an actor that died into dropped clients for this call (recorded); Ray restarts the
  actor, which maps its data again on its next call;
- injects the faults of `faults.*` (an actor's process really exits).
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Optional

import numpy as np
import ray

from raysim.config import sum_block
from raysim.contract import ClientResult
from raysim.runtime import placement, pool
from raysim.runtime.client_actor import DataNotAttached
from raysim.runtime.clients import describe as describe_needs, start_client_actors
from raysim.runtime.wire import pack, unpack
from raysim.training import nbytes

FETCH_BYTES = 64 * 2**20
INLINE_BYTES = 64 * 2**10
PIPELINE_BYTES = 2**20  # models (payloads) from this size up are worth folding while the actors train
PIPELINE_TASKS = 4


def pipeline(chunk: list[int], blocks: Optional[list[int]], tasks: int) -> list[list[int]]:
    """An actor's clients as the tasks it is given: up to `tasks` consecutive runs of them.
    An actor runs its tasks one after another and each returns when it ends, so the server
    folds the first tasks' models while the actor trains the rest, and only the last one's
    fold is left after training. The fold's order, and so its bits, stay the client-id
    order. Blocks (vectorised groups, partial sums) are one task."""
    if blocks is not None or tasks <= 1 or len(chunk) < 2:
        return [chunk]
    per = -(-len(chunk) // tasks)
    return [chunk[i:i + per] for i in range(0, len(chunk), per)]


def tasks_per_actor(resources, payload_bytes: int) -> int:
    """`resources.tasks_per_actor`, or by default `PIPELINE_TASKS` where the client actors
    hold a GPU and a model is `PIPELINE_BYTES` or more, else 1. Issue 41: on a GPU the fold
    of 10 VGG-9 models took a third of the round, after the training; on a CPU-only machine
    the actors' training holds the cores the server would fold on, and folding meanwhile was
    slower (MLP of 9.9 M parameters, 1 actor on 2 cores: 6.99 s a round against 6.34 s)."""
    if resources.tasks_per_actor is not None:
        return int(resources.tasks_per_actor)
    return PIPELINE_TASKS if resources.num_gpus_per_actor > 0 and payload_bytes >= PIPELINE_BYTES else 1


class Dispatch:
    def __init__(self, cfg, run_name: str, started: Optional[tuple] = None):
        """Take the client actors the server started first thing (`started`, what
        `start_client_actors` returned), or start them now: each needs ~1.5 s for torch,
        which overlaps the server's loading of the data (`share_data` follows)."""
        self.cfg = cfg
        self.actors, self.actor_key, self.reused = started or start_client_actors(cfg, run_name)
        self.needs = describe_needs(*self.actor_key)
        self.n_actors = len(self.actors)
        total = ray.cluster_resources()
        self.why = placement.why_actors(cfg, self.n_actors, total.get("CPU", 0), total.get("GPU", 0))  # for the run's log
        self.one_per_client = cfg.resources.clients_per_actor == 1
        self.sum_block = sum_block(cfg)  # clients per sum made in the actors (0: each client's result)
        self._ready = [a.device_info.remote() for a in self.actors]
        self.record = None  # the run record (runtime/record.py): `client` rows and `log` lines; set by the server
        self.states: dict[int, ray.ObjectRef] = {}  # client id -> its state
        self.bytes = [0, 0]  # down, up: cumulative
        self.seconds = {"broadcast": 0.0, "train": 0.0}  # this round's; the server resets it
        self._restarting: set[int] = set()  # actors that died and are being restarted
        self._attached: set[int] = set()  # actors that have been sent the data references
        self._killed_in: Optional[int] = None  # the last round faults.kill_* struck

    def share_data(self, cfg_plain: dict, arrays: dict, train_index, num_classes: int, norm, pixel_max,
                   sizes) -> None:
        """Put the training arrays (or, `data_store=files`, the manifest of their files:
        data/store.py) and the partition in the object store once; each actor gets the
        references with its first call. `sizes`: samples per client (task planning)."""
        self.shared = (cfg_plain, [ray.put(arrays), ray.put(train_index)], num_classes, norm, pixel_max)
        self.sizes = sizes

    def placed(self, timeout: float) -> int:
        """How many client actors have been placed and have started (waits up to `timeout` s)."""
        ready, _ = ray.wait(self._ready, num_returns=len(self._ready), timeout=timeout)
        return len(ready)

    # ------------------------------------------------------------------ calls
    def run(self, rnd: int, cids: list[int], epochs: dict, payload: Any, method: str, on: str,
            stateful: bool, actor: Optional[int] = None) -> Iterator[ClientResult]:
        """Submit every task now (so several cohorts can train at once) and return an
        iterator over the results in client-id order; dropped clients are skipped. `actor`:
        all of them on that actor, in the order given (the asynchronous loop places its
        clients itself)."""
        t0 = time.perf_counter()
        size = nbytes(payload)
        self.bytes[0] += size * len(cids)
        # A big payload goes to the object store once and every task gets the reference;
        # a small one is cheaper inlined in each task (Ray inlines arguments under 100 KB).
        payload_arg = ray.put(pack(payload)) if size > INLINE_BYTES else pack(payload)
        work = {c: int(self.sizes[c]) * epochs[c] for c in cids}  # stragglers weigh more
        # Results come back in groups of about FETCH_BYTES (judged by the payload, about the
        # size of an update): one object for many small updates, one per client for big ones.
        group = max(1, int(FETCH_BYTES // max(size, 1)))
        calls = []
        self.await_restarts()
        training = method == "client_update"
        faults = self.cfg.faults
        if training and rnd in faults.kill_rounds and self._killed_in != rnd:
            self._kill_actors(rnd)
        if training and rnd == faults.crash_round and faults.crash_client not in cids:
            self.record.log(f"round {rnd}: faults.crash_client={faults.crash_client} is not training "
                            "this round (not selected, or dropped out), so no actor crashes")
        vectorized = training and bool(self.cfg.local.vectorize)
        sums = training and self.sum_block > 0  # a block's results come back as one sum
        # blocks of consecutive clients placed whole: vectorised groups, or partial sums' blocks
        # (one size for both: the config checks), so neither depends on the number of actors
        block = int(self.cfg.local.vectorize_group) if vectorized else self.sum_block if sums else 0
        placed = ([(actor % self.n_actors, cids, None)] if actor is not None else
                  placement.plan(cids, work, self.n_actors, self.one_per_client, block))
        pieces = [(a, piece, blocks) for a, chunk, blocks in placed
                  for piece in pipeline(chunk, blocks, tasks_per_actor(self.cfg.resources, size))]
        for a, chunk, blocks in pieces:
            states = [self.states.get(c) for c in chunk] if stateful else []
            n_groups = -(-(len(blocks) if sums else len(chunk)) // group)
            n_returns = n_groups + len(states)
            data = None if a in self._attached else self.shared
            self._attached.add(a)
            got = self.actors[a].run.options(num_returns=n_returns).remote(
                data, rnd, method, on, chunk, [epochs[c] for c in chunk], group, blocks, vectorized, sums, payload_arg,
                *states)
            got = [got] if n_returns == 1 else list(got)
            calls.append((a, chunk, got[:n_groups], got[n_groups:]))
        self.seconds["broadcast"] += time.perf_counter() - t0
        return self._collect(rnd, method, calls, epochs)

    def _collect(self, rnd: int, method: str, calls: list, epochs: dict) -> Iterator[ClientResult]:
        for a, chunk, group_refs, state_refs in calls:
            results = []
            t0 = time.perf_counter()
            try:
                results = ray.get(group_refs[0])  # all of a task's objects arrive together
            except (ray.exceptions.RayActorError, DataNotAttached) as e:
                # died now, or was restarted unseen (no data): either way, data on its next call
                self._attached.discard(a)
                if isinstance(e, ray.exceptions.RayActorError):
                    self._restarting.add(a)
                for c in chunk:
                    self.record.client(rnd, c, method, "dropped", reason="actor_died", epochs=epochs[c])
                self.record.log(f"round {rnd}: actor {a} lost clients {chunk}: {type(e).__name__}; dropped")
                continue
            finally:
                self.seconds["train"] += time.perf_counter() - t0
            next_group, j = 1, 0  # j: the position in `chunk` of the next client
            while j < len(chunk):
                if not results:
                    t0 = time.perf_counter()
                    results = ray.get(group_refs[next_group])
                    self.seconds["train"] += time.perf_counter() - t0
                    next_group += 1
                result = unpack(results.pop(0))
                self.bytes[1] += nbytes(result.update)
                for cid, n, metrics, changed in result.clients or [(chunk[j], None, None, result.state_changed)]:
                    if state_refs and changed:
                        self.states[cid] = state_refs[j]
                    one = result if n is None else ClientResult(cid, n, None, metrics)
                    self.record.client(rnd, cid, method, "ok", result=one, epochs=epochs[cid])
                    j += 1
                if j == len(chunk):
                    self.record.metrics.actor_done(a, len(chunk))
                yield result

    # ------------------------------------------------------------------ faults and restarts
    def _kill_actors(self, rnd: int) -> None:
        """Fault injection: `faults.kill_fraction` of the client actors, drawn from (seed,
        round), exit their processes now (at least one: a fraction that rounds to zero
        actors still kills one); their clients this round are recorded as dropped and Ray
        restarts them for the next round."""
        self._killed_in = rnd
        n = max(1, int(round(float(self.cfg.faults.kill_fraction) * self.n_actors)))
        victims = sorted(np.random.default_rng([int(self.cfg.seed), rnd, 5]).choice(
            self.n_actors, n, replace=False).tolist())
        for a in victims:
            self.actors[a].die.remote()  # runs before any task sent after it; those then fail
            self._attached.discard(a)
            self._restarting.add(a)
        self.record.log(f"round {rnd}: fault injection kills client actors {victims}")

    def await_restarts(self, timeout: float = 120.0) -> None:
        """Wait for actors that died to come back (Ray restarts them) before giving them
        work again; one that stays down keeps dropping its clients."""
        for a in sorted(self._restarting):
            deadline = time.time() + timeout
            while time.time() < deadline:
                try:
                    ray.get(self.actors[a].device_info.remote(), timeout=max(0.1, deadline - time.time()))
                    self._restarting.discard(a)
                    self.record.log(f"client actor {a} is back")
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    time.sleep(0.2)

    # ------------------------------------------------------------------ checkpoints
    def client_states(self) -> dict[int, Any]:
        """Every stateful client's state, fetched (for a checkpoint)."""
        cids = sorted(self.states)
        return {c: unpack(s) for c, s in zip(cids, ray.get([self.states[c] for c in cids]))}

    def restore(self, client_states: dict, sent: list) -> None:
        """Take the client states and byte counters of a checkpoint."""
        self.states = {int(c): ray.put(pack(s)) for c, s in client_states.items()}
        self.bytes = list(sent)

    # ------------------------------------------------------------------ the actors' end
    def actor_info(self) -> list[dict]:
        return ray.get([a.device_info.remote() for a in self.actors])

    def release(self) -> None:
        """Leave the client actors to the next run of this Ray session (`ray.reuse_workers`),
        or stop them."""
        if self.cfg.ray.reuse_workers:
            pool.keep_client_actors(self.actor_key, self.actors)
            self.actors = []
        else:
            self.stop()

    def stop(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []

