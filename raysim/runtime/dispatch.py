"""Dispatch: the run's client calls on Ray's client actors. The only part of the server
that needs Ray.

It takes the client actors (runtime/clients.py) and hands them the data references
once, then, per call of `run`:

- sends the payload once (through the object store when it is big), gives each client
  actor its contiguous run of the cohort (runtime/placement.py) as one task, or, for big
  models on GPUs, a few (`pipeline`: the server folds the first while the actor trains on), and yields
  the results in client-id order, fetched in bounded batches, so the server holds O(model)
  and the fold order never depends on which actor finishes first; a call of thousands of
  clients goes in pieces dealt to the actors in turn, a few in flight per actor, so the
  object store holds those pieces' updates and states, not the whole round's (`resources.wave_mb`);
- keeps each stateful client's state itself (runtime/state_store.py: in memory at about its
  own size, the least recently used on disk beyond `resources.client_state_gb`), sends a
  call's states with it and takes the changed ones back with its results (any actor can
  run any client; a state outlives the actor, and the host, that wrote it);
- makes a call again when its actor was lost (its process or its host died, or it came
  back restarted without its data): the same clients, epochs, payload and states, on the
  next actor that answers, within the same round and in the same client-id order of the
  fold, so a lost actor changes no result (`redone` in the clients table, a line in log.txt;
  an infrastructure fault is not a client's behaviour: `system.dropout` simulates those).
  Ray restarts the lost actor, which maps its data again on its next call; with no actor
  left, `ActorsLost` stops the run;
- injects the faults of `faults.*` (an actor's process really exits).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Iterator, Optional

import numpy as np
from raysim.lazy_ray import ray

from raysim.config import sum_block
from raysim.contract import ClientResult
from raysim.errors import ActorsLost
from raysim.runtime import placement, pool
from raysim.runtime.client_actor import DataNotAttached
from raysim.runtime.clients import describe as describe_needs, start_client_actors
from raysim.runtime.state_store import ClientStates, state_memory_bytes
from raysim.wire import pack, unpack
from raysim.training import nbytes

@dataclasses.dataclass
class Call:
    """One task of a call: actor `actor` runs `chunk` with `args` (ClientRunner.run's after
    its data), `n_groups` result objects then `n_states` (0 or 1) objects: the list of the
    clients' new states; `refs` its object refs. `redone`:
    made again after the actor that had it was lost."""
    actor: int
    chunk: list[int]
    n_groups: int
    n_states: int
    args: tuple
    refs: list
    redone: bool = False
    blocks: Optional[list] = None


def later_lost() -> tuple:
    """A later group of results, fetched after its task returned, lost with its node (or its actor)."""
    return ray.exceptions.ObjectLostError, ray.exceptions.RayActorError

RESTART_POLL = 0.2  # s: how long a call waits to hear whether lost actors are back (the others take their clients)
FETCH_BYTES = 64 * 2**20
INLINE_BYTES = 64 * 2**10
PIPELINE_BYTES = 2**20  # models (payloads) from this size up are worth folding while the actors train
PIPELINE_TASKS = 4
STATE_SHARE = 1 / 16  # of the object store: the most client state one task carries (`_tasks_for_states`)
WINDOW = 2  # pieces of a big call (resources.wave_mb) in flight per actor: one training, one waiting (placement.waves)


def _why(e: BaseException) -> str:
    """How a call's actor was lost, in a few words for log.txt."""
    return "restarted without its data" if isinstance(e, DataNotAttached) else type(e).__name__


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
    return PIPELINE_TASKS if placement.gpus_per_actor(resources) > 0 and payload_bytes >= PIPELINE_BYTES else 1


def tasks_for_states(state_bytes: int, store_bytes: float) -> int:
    """Tasks enough that none carries more client state than `STATE_SHARE` of the object
    store (a call's states travel through it, both ways: Ditto's 3,000 whole models in two
    calls were more than a 0.3 GB store holds)."""
    return max(1, math.ceil(state_bytes / max(1.0, STATE_SHARE * store_bytes)))


class Dispatch:
    def __init__(self, cfg, run_name: str, started: Optional[tuple] = None, here_why: Optional[str] = None):
        """Take the client actors the server started first thing (`started`, what
        `start_client_actors` returned), or start them now: each needs ~1.5 s for torch,
        which overlaps the server's loading of the data (`share_data` follows). `here_why`:
        no Ray; the clients train in this process (runtime/here.py), for that reason."""
        self.cfg = cfg
        if here_why is not None:
            from raysim.runtime import here

            self.ray = here  # Ray's get / put / wait / kill, for the one runner in this process
            self.actors, self.actor_key, self.reused = [here.HereActor()], None, 0
            self.needs, self.why = "this process", f"no Ray: {here_why}"
        else:
            self.ray = ray
            self.actors, self.actor_key, self.reused = started or start_client_actors(cfg, run_name)
            self.needs = describe_needs(*self.actor_key)
            total = ray.cluster_resources()
            self.why = placement.why_actors(cfg, len(self.actors), total.get("CPU", 0), total.get("GPU", 0))  # for the log
        self.here = here_why is not None
        self.run_name = run_name
        # num_gpus_per_actor=auto on a cluster with GPUs: the one actor started is the probe, measured at the
        # first training call (runtime/gpu_packing.py); `gpu_packing` is then what was measured and chosen
        self.probe_pending = not self.here and cfg.resources.num_gpus_per_actor == "auto" and self.actor_key[1] > 0
        self.gpu_packing: Optional[dict] = None
        self.n_actors = len(self.actors)
        total = self.ray.cluster_resources()
        self.one_per_client = cfg.resources.clients_per_actor == 1
        self.sum_block = sum_block(cfg)  # clients per sum made in the actors (0: each client's result)
        self._ready = [a.device_info.remote() for a in self.actors]
        self.record = None  # the run record (runtime/record.py): `client` rows and `log` lines; set by the server
        self.states = ClientStates(state_memory_bytes(cfg))  # client id -> its state (runtime/state_store.py)
        self.bytes = [0, 0]  # down, up: cumulative
        self.uplink = None  # compress.up's server end (raysim/compression/uplink.py); set by the server
        self.seconds = {"broadcast": 0.0, "train": 0.0}  # this round's; the server resets it
        self._restarting: set[int] = set()  # actors that died and are being restarted
        self.restart_wait = float(cfg.resources.lost_actor_wait)
        self.store_bytes = total.get("object_store_memory", 2**30)
        self._attached: set[int] = set()  # actors that have been sent the data references
        self._killed_in: Optional[int] = None  # the last round faults.kill_* struck
        self._waves_said = False  # log.txt says once when a run's calls go in pieces

    def share_data(self, cfg_plain: dict, arrays: dict, train_index, num_classes: int, norm, pixel_max,
                   sizes) -> None:
        """Put the training arrays (or, `data_store=files`, the manifest of their files:
        data/store.py) and the partition in the object store once; each actor gets the
        references with its first call. `sizes`: samples per client (task planning)."""
        self.shared = (cfg_plain, [self.ray.put(arrays), self.ray.put(train_index)], num_classes, norm, pixel_max)
        self.sizes = sizes

    def device(self) -> str:
        """The first client actor's device ('cuda', 'cpu'), once it has started."""
        return str(self.ray.get(self._ready[0])["device"])

    def placed(self, timeout: float) -> int:
        """How many client actors have been placed and have started (waits up to `timeout` s)."""
        ready, _ = self.ray.wait(self._ready, num_returns=len(self._ready), timeout=timeout)
        return len(ready)

    # ------------------------------------------------------------------ calls
    def run(self, rnd: int, cids: list[int], epochs: dict, payload: Any, method: str, on: str,
            stateful: bool, actor: Optional[int] = None) -> Iterator[ClientResult]:
        """Submit every task now (so several cohorts can train at once) and return an
        iterator over the results in client-id order; dropped clients are skipped. A call
        whose updates and states would pass `WINDOW` x `resources.wave_mb` per actor goes in
        pieces dealt in turn (`placement.waves`), `WINDOW` per actor in flight: the next is
        submitted as the server takes one, so a round of 10,000 clients holds a few pieces
        in the object store, not 10,000 updates. `actor`: all of them on that actor, in the
        order given (the asynchronous loop places its clients itself)."""
        t0 = time.perf_counter()
        size = nbytes(payload)
        if self.probe_pending and method == "client_update" and cids:
            self._pack_by_memory(rnd, cids, epochs, payload, on, stateful)
        self.bytes[0] += size * len(cids)
        # A big payload goes to the object store once and every task gets the reference;
        # a small one is cheaper inlined in each task (Ray inlines arguments under 100 KB).
        payload_arg = self.ray.put(pack(payload)) if size > INLINE_BYTES else pack(payload)
        work = {c: int(self.sizes[c]) * epochs[c] for c in cids}  # stragglers weigh more
        # Results come back in groups of about FETCH_BYTES (judged by the payload, about the
        # size of an update): one object for many small updates, one per client for big ones.
        group = max(1, int(FETCH_BYTES // max(size, 1)))
        live = self.live_actors()  # the actors given work: not those lost and not back yet
        training = method == "client_update"
        faults = self.cfg.faults
        if training and rnd in faults.kill_rounds and self._killed_in != rnd:
            self._kill_actors(rnd)  # after placement was decided: the victims' calls are lost, then redone
        if training and rnd == faults.crash_round and faults.crash_client not in cids:
            self.record.log(f"round {rnd}: faults.crash_client={faults.crash_client} is not training "
                            "this round (not selected, or dropped out), so no actor crashes")
        vectorized = training and bool(self.cfg.local.vectorize)
        sums = training and self.sum_block > 0  # a block's results come back as one sum
        # blocks of consecutive clients placed whole: vectorised groups, or partial sums' blocks
        # (one size for both: the config checks), so neither depends on the number of actors
        block = int(self.cfg.local.vectorize_group) if vectorized else self.sum_block if sums else 0
        if actor is not None and actor % self.n_actors not in live:  # lost: a live one takes its clients
            actor = live[actor % len(live)]
        # what the updates and states take through the object store, both ways (the asynchronous
        # loop's calls, placed by it, are never cut)
        wave = min(float(self.cfg.resources.wave_mb) * 2**20, STATE_SHARE * self.store_bytes)
        traffic = 0
        if actor is None and not self.one_per_client:
            traffic = size * len(cids) + (2 * sum(self.states.nbytes(c) for c in cids) if stateful else 0)
        in_waves = traffic > WINDOW * wave * len(live)
        if in_waves:
            cost = {c: size + 2 * self.states.nbytes(c) for c in cids} if stateful else dict.fromkeys(cids, size)
            pieces = [(live[i], chunk, blocks) for i, chunk, blocks in placement.waves(cids, cost, len(live), wave, block)]
            if not self._waves_said and self.record is not None:
                self._waves_said = True
                self.record.log(f"round {rnd}: {len(cids)} clients' updates and states ({traffic / 2**20:.0f} MB) "
                                f"go in {len(pieces)} pieces of at most {wave / 2**20:.3g} MB, {WINDOW} in flight per "
                                "actor (resources.wave_mb)")
        else:
            placed = ([(actor % self.n_actors, cids, None)] if actor is not None else
                      [(live[i], chunk, blocks) for i, chunk, blocks in
                       placement.plan(cids, work, len(live), self.one_per_client, block)])
            tasks = tasks_per_actor(self.cfg.resources, size)
            pieces = [(a, piece, blocks) for a, chunk, blocks in placed
                      for piece in pipeline(chunk, blocks, max(tasks, self._tasks_for_states(chunk) if stateful else 1))]
        calls = [Call(a, chunk, -(-(len(blocks) if sums else len(chunk)) // group), int(stateful), (), [], blocks=blocks)
                 for a, chunk, blocks in pieces]

        def start(call: Call, later: bool = True) -> None:  # its states read now: those not sent stay in the store
            if later and call.actor in self._restarting:  # lost since the call was dealt: a live one takes it
                alive = [a for a in range(self.n_actors) if a not in self._restarting] or [call.actor]
                call.actor = alive[call.actor % len(alive)]
            states = [self.states.get(c) for c in call.chunk] if stateful else None
            call.args = (rnd, method, on, call.chunk, [epochs[c] for c in call.chunk], group, call.blocks, vectorized,
                         sums, payload_arg, states)
            call.refs = self._submit(call.actor, call.args, call.n_groups + call.n_states)

        window = WINDOW * len(live) if in_waves else len(calls)
        for call in calls[:window]:
            start(call, later=False)  # an actor faults.* just killed loses its calls, which are redone
        self.seconds["broadcast"] += time.perf_counter() - t0
        uplink = self.uplink if self.uplink is not None and self.uplink.applies(method, on) else None
        decode = None if uplink is None else (lambda update, cid: uplink.receive(update, payload, rnd, cid))
        return self._collect(rnd, method, calls, epochs, start, window, decode)

    def _pack_by_memory(self, rnd: int, cids: list[int], epochs: dict, payload: Any, on: str, stateful: bool) -> None:
        """`resources.num_gpus_per_actor=auto`: one client update on the probe actor (a whole
        GPU), measured; the probe goes and as many actors per GPU as fit start instead
        (runtime/gpu_packing.py). The probe's results are thrown away."""
        from raysim.runtime import gpu_packing

        self.probe_pending = False
        group = int(self.cfg.local.vectorize_group) if self.cfg.local.vectorize else 0
        chunk = gpu_packing.probe_clients(cids, self.sizes, group)
        states = [self.states.get(c) for c in chunk] if stateful else None
        sums = self.sum_block > 0
        blocks = [len(chunk)] if group or sums else None
        probe = self.actors[0].probe_memory.remote(self.shared, rnd, "client_update", on, chunk, [epochs[c] for c in chunk],
                                                   1, blocks, bool(group), sums, pack(payload), states, redo=True)
        measured = self.ray.get(probe)
        what = (f"clients {chunk[0]}-{chunk[-1]}, a vectorised group" if group else
                f"client {chunk[0]}, {int(self.sizes[chunk[0]])} samples") + f", batch {int(self.cfg.local.batch_size)}"
        frac, self.gpu_packing, line = gpu_packing.decide(measured, float(self.cfg.resources.gpu_memory_headroom), what)
        self.record.log(line)
        for a in self.actors:
            self.ray.kill(a)
        self.cfg.resources.num_gpus_per_actor = frac
        self.actors, self.actor_key, self.reused = start_client_actors(self.cfg, self.run_name)
        self.n_actors = len(self.actors)
        self._attached, self._restarting = set(), set()
        self._ready = [a.device_info.remote() for a in self.actors]
        total = ray.cluster_resources()
        self.needs = describe_needs(*self.actor_key)
        self.why = placement.why_actors(self.cfg, self.n_actors, total.get("CPU", 0), total.get("GPU", 0))
        self.gpu_packing["actors"] = self.n_actors
        self.record.log(f"{self.n_actors} client actors ({self.needs} each) replace the probe ({self.why})")

    def _submit(self, a: int, args: tuple, n_returns: int, redo: bool = False) -> list:
        """Actor `a`'s task for `args` (the data references with its first call); its refs."""
        data = None if a in self._attached else self.shared
        self._attached.add(a)
        got = self.actors[a].run.options(num_returns=n_returns).remote(data, *args, redo=redo)
        return [got] if n_returns == 1 else list(got)

    def _collect(self, rnd: int, method: str, calls: list, epochs: dict, start, window: int,
                 decode=None) -> Iterator[ClientResult]:
        """The calls' results in order; the calls from `window` on are started (`start`) one
        as each earlier one is taken, and a taken call lets its objects go. `decode(update,
        cid)`: a compressed update's model, counted as the bytes that came."""
        for i, call in enumerate(calls):
            if i and i + window - 1 < len(calls):
                start(calls[i + window - 1])
            a, chunk = call.actor, call.chunk
            t0 = time.perf_counter()
            try:
                results = self.ray.get(call.refs[0])  # all of a task's objects arrive together
            except (ray.exceptions.RayActorError, DataNotAttached) as e:
                a, results = self._redo(call, e)
            finally:
                self.seconds["train"] += time.perf_counter() - t0
            new_states = self._states_of(call)
            group_refs = call.refs[:call.n_groups]
            next_group, j = 1, 0  # j: the position in `chunk` of the next client
            while j < len(chunk):
                if not results:
                    t0 = time.perf_counter()
                    try:
                        results = self.ray.get(group_refs[next_group])
                    except later_lost() as e:  # the task returned, then its node was lost with its results
                        a, _ = self._redo(call, e)  # the whole call again; the groups before this one are taken
                        group_refs = call.refs[:call.n_groups]
                        results = self.ray.get(group_refs[next_group])
                    self.seconds["train"] += time.perf_counter() - t0
                    next_group += 1
                result = unpack(results.pop(0))
                came = nbytes(result.update)
                self.bytes[1] += came
                if decode is not None:
                    result.metrics["bytes_up"] = came
                    result.update = decode(result.update, result.cid)
                for cid, n, metrics, changed in result.clients or [(chunk[j], None, None, result.state_changed)]:
                    if new_states is not None and changed:
                        self.states.put(cid, new_states[j])
                    one = result if n is None else ClientResult(cid, n, None, metrics)
                    self.record.client(rnd, cid, method, "ok", result=one, epochs=epochs[cid], redone=call.redone)
                    j += 1
                if j == len(chunk):
                    self.record.metrics.actor_done(a, len(chunk))
                yield result
            call.args, call.refs, results, new_states = (), [], None, None  # its objects can go

    def _tasks_for_states(self, chunk: list[int]) -> int:
        return tasks_for_states(sum(self.states.nbytes(c) for c in chunk), self.store_bytes)

    def _states_of(self, call: "Call") -> Optional[list]:
        """The new states `call` sent back (None where a client's was left as it was), or
        None for a plugin without client state; a call whose states were lost with its
        host is made again."""
        if not call.n_states:
            return None
        try:
            return self.ray.get(call.refs[-1])
        except later_lost() as e:
            self._redo(call, e)
            return self.ray.get(call.refs[-1])

    def _lost(self, a: int, e: BaseException) -> None:
        """Actor `a`'s call failed with `e`: dead (Ray restarts it; no work until it is back),
        or restarted unseen (alive, without data): either way, data with its next call."""
        self._attached.discard(a)
        if isinstance(e, ray.exceptions.RayActorError):
            self._restarting.add(a)

    def _redo(self, call: "Call", error: BaseException) -> tuple[int, list]:
        """Make `call` again after its actor failed with `error`: on the same actor when it
        is alive but restarted without its data, else on the next live actors in turn, then,
        when each failed, on the first Ray brings back (`live_actors`). Returns the actor
        that answered and its first results; `call` then holds that task's refs.
        `ActorsLost` when none does."""
        t0 = time.perf_counter()
        rnd, first = call.args[0], call.actor
        self._lost(first, error)
        why = {first: _why(error)}
        n = self.n_actors
        order = [first] if isinstance(error, DataNotAttached) else []
        order += [(first + i) % n for i in range(1, n) if (first + i) % n not in self._restarting]
        for attempt in (0, 1):
            if attempt:  # every actor failed once: wait for those Ray restarts
                order = self.live_actors()
            for b in order:
                call.refs = self._submit(b, call.args, call.n_groups + call.n_states, redo=True)
                try:
                    results = self.ray.get(call.refs[0])
                except (ray.exceptions.RayActorError, DataNotAttached) as e:
                    self._lost(b, e)
                    why[b] = _why(e)
                    continue
                call.actor, call.redone = b, True
                lost = ", ".join(f"{x} ({w}{self._where(x)})" for x, w in why.items())
                self.record.log(f"round {rnd}: client actor{'s' if len(why) > 1 else ''} {lost} lost the call of "
                                f"clients {call.chunk}; redone on actor {b}{self._where(b)} in "
                                f"{time.perf_counter() - t0:.2f} s")
                return b, results
        raise ActorsLost(f"every client actor was lost ({', '.join(f'{x}: {w}' for x, w in why.items())}) and none "
                         f"came back within resources.lost_actor_wait={self.restart_wait:g} s, so clients {call.chunk} cannot train")

    def _where(self, a: int) -> str:
        """', on node <id> at <address>' where actor `a` was last seen (its start-up answer), or ''."""
        try:
            info = self.ray.get(self._ready[a], timeout=0)
        except Exception:  # not known: it died before answering
            return ""
        return f", on node {info['node_id'][:8]} at {info.get('node_ip', '?')}"

    # ------------------------------------------------------------------ faults and restarts
    def _kill_actors(self, rnd: int) -> None:
        """Fault injection: `faults.kill_fraction` of the client actors, drawn from (seed,
        round), exit their processes now (at least one: a fraction that rounds to zero
        actors still kills one), after this call's placement: their calls are lost and made
        again on the others (`redone`), and Ray restarts them."""
        self._killed_in = rnd
        n = max(1, int(round(float(self.cfg.faults.kill_fraction) * self.n_actors)))
        victims = sorted(np.random.default_rng([int(self.cfg.seed), rnd, 5]).choice(
            self.n_actors, n, replace=False).tolist())
        for a in victims:
            self.actors[a].die.remote()  # runs before any task sent after it; those then fail
            self._attached.discard(a)
            self._restarting.add(a)
        self.record.log(f"round {rnd}: fault injection kills client actors {victims}")

    def live_actors(self) -> list[int]:
        """The actors to give work to: all but those lost and not back. Lost ones are asked
        whether Ray has restarted them (briefly: one whose host is gone may never come
        back, and the others can take its clients, which changes no result); when every
        actor is lost, the first to come back is waited for, up to `resources.lost_actor_wait` s."""
        if self._restarting:
            everyone = len(self._restarting) == self.n_actors
            asked = {self.actors[a].device_info.remote(): a for a in sorted(self._restarting)}
            ready, _ = self.ray.wait(list(asked), num_returns=1 if everyone else len(asked),
                                timeout=self.restart_wait if everyone else RESTART_POLL)
            if everyone and ready:  # the others may be back by now too
                ready, _ = self.ray.wait(list(asked), num_returns=len(asked), timeout=RESTART_POLL)
            for ref in ready:
                try:
                    self.ray.get(ref)
                except ray.exceptions.RayActorError:
                    continue
                self._restarting.discard(asked[ref])
                if self.record is not None:
                    self.record.log(f"client actor {asked[ref]} is back{self._where(asked[ref])}")
        return [a for a in range(self.n_actors) if a not in self._restarting]

    def await_restarts(self, timeout: float = 10.0) -> None:
        """Give actors lost in the last round up to `timeout` s to come back (the end of a
        run, before asking where they run)."""
        deadline = time.time() + timeout
        while self._restarting and time.time() < deadline:
            self.live_actors()
            if self._restarting:
                time.sleep(0.2)

    # ------------------------------------------------------------------ checkpoints
    def client_states(self) -> dict[int, Any]:
        """Every stateful client's state, fetched (for a checkpoint)."""
        return {c: unpack(s) for c, s in self.states.items()}

    def restore(self, client_states: dict, sent: list) -> None:
        """Take the client states and byte counters of a checkpoint."""
        self.states.close()
        for c, state in client_states.items():
            self.states.put(int(c), pack(state))
        self.bytes = list(sent)

    # ------------------------------------------------------------------ the actors' end
    def actor_info(self) -> list[dict]:
        """Where each live actor runs (one lost with its host may never answer)."""
        return self.ray.get([self.actors[a].device_info.remote() for a in self.live_actors()])

    def release(self) -> None:
        """Leave the client actors to the next run of this Ray session (`ray.reuse_workers`),
        or stop them."""
        if self.cfg.ray.reuse_workers and self.ray is ray:
            live = self.live_actors()  # the lost ones are not worth keeping: stopped
            for a in range(self.n_actors):
                if a not in live:
                    self.ray.kill(self.actors[a])
            pool.keep_client_actors(self.actor_key, [self.actors[a] for a in live])
            self.actors = []
            self.states.close()
        else:
            self.stop()

    def stop(self) -> None:
        self.states.close()
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []

