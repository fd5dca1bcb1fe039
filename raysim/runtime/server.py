"""The server: what the driver actor (`raysim-server`, see driver.py) runs. It owns a run.

It holds the algorithm's server half, the selection strategy, the client actors and the
run directory, and implements the `Server` calls an algorithm uses:

- `select_clients(rnd)`: the selection strategy, with an RNG from (seed, round);
- `run_clients(rnd, cids, payload)`: sends the payload once per round (through the object
  store when it is big), gives each client actor one task with its contiguous run of the
  cohort, and yields the results in client-id order, fetched in bounded batches, so the
  driver holds O(model) and the fold order never depends on which actor finishes first.
  A task whose actor died is a dropout for its clients this round (recorded); Ray
  restarts the actor, which maps its data again on its next call.

It also owns the data (put in the object store once), the client actors, checkpoints
(`checkpoint_every`, `resume=<run dir>`: see checkpoint.py), the injected faults
(`faults.*`) and the run's metrics: the run directory's tables and Ray's metrics (observe.py).
"""
from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import ray
import torch
from omegaconf import OmegaConf

from raysim.algorithm import ClientResult
from raysim.config import ConfigError, clients_per_round, resolve, run_record, to_yaml
from raysim.data.long_tail import shot_accuracy, shot_groups
from raysim.data.partition import label_counts, label_entropy
from raysim.errors import RunDiverged
from raysim.experiment import describe, prepare, run_dir_for
from raysim.registry import ALGORITHMS, SELECTIONS
from raysim.results.writer import RunWriter, summarize
from raysim.runtime import checkpoint, placement, pool
from raysim.runtime.observe import RayMetrics
from raysim.runtime.availability import Availability
from raysim.runtime.local_eval import clients_test_data
from raysim.runtime.client_actor import DataNotAttached, describe as describe_needs, start_client_actors
from raysim.runtime.wire import pack, unpack
from raysim.training import evaluate, nbytes, tau_normalised


FETCH_BYTES = 64 * 2**20
INLINE_BYTES = 64 * 2**10


class FederatedServer:
    def __init__(self, t_start: float):
        self.t_start = t_start
        torch.set_num_threads(max(1, os.cpu_count() or 1))

    def setup(self, layers: list, cwd: str) -> dict:
        """Resolve the config, check a resumed run against its checkpoint, start the client
        actors and, while they start, load and partition the data and put it in the object
        store. Input problems raise `ConfigError`; nothing is written yet (see `open_run`)."""
        self.cfg = resolve(layers, cwd)
        self.ckpt = None
        if self.cfg.resume:
            self.run_dir = Path(self.cfg.resume)
            self.ckpt = checkpoint.load_checked(self.cfg)
        else:
            self.run_dir = run_dir_for(self.cfg)
        # The client actors start now, while the data loads: each needs ~1.5 s for torch.
        self.actors, self.actor_key, self.reused = start_client_actors(self.cfg, self.run_dir.name)
        self.actor_needs = describe_needs(*self.actor_key)
        self._ready = [a.device_info.remote() for a in self.actors]
        try:
            data, part, num_classes = prepare(self.cfg)
        except ConfigError:
            self._release_actors()
            raise
        self.shared_data = (OmegaConf.to_container(self.cfg),
                            [ray.put({"x_train": data.x_train, "y_train": data.y_train}), ray.put(part.train)],
                            num_classes, data.norm, data.pixel_max)
        self.x_test, self.y_test = data.inputs(data.x_test.copy()), torch.from_numpy(data.y_test.copy())
        self.local_tests = clients_test_data(data, part, self.cfg)  # None: clients have no test data of their own
        self.input_range = (float(self.x_test.min()), float(self.x_test.max())) if len(self.x_test) else (0.0, 1.0)
        self.sizes = part.sizes()
        self.true_counts = label_counts(data.y_train, part, num_classes)  # for cohort metrics only
        # long-tailed data: accuracy on the many / medium / few-shot classes (data/long_tail.py)
        self.shots = (shot_groups(np.bincount(data.y_train, minlength=num_classes), self.cfg.eval.shots)
                      if self.cfg.long_tail.imbalance > 1 else None)
        self.test_counts = np.bincount(data.y_test, minlength=num_classes)
        self.num_clients = int(self.cfg.num_clients)
        self.availability = Availability(self.cfg, self.num_clients)
        share = float(self.cfg.system.stragglers)  # a share > 0 makes at least one straggler
        n_slow = max(1, int(round(share * self.num_clients))) if share > 0 else 0
        self.stragglers = set(np.random.default_rng([int(self.cfg.seed), 4]).choice(
            self.num_clients, n_slow, replace=False).tolist())
        self.num_classes = num_classes
        self.input_shape = data.input_shape
        self.n_actors = len(self.actors)
        self.one_per_client = self.cfg.resources.clients_per_actor == 1
        self.store_notice = placement.store_notice(data.x_train.nbytes + data.y_train.nbytes,
                                         ray.cluster_resources().get("object_store_memory", 0))
        return {"actors": self.n_actors, "needs": self.actor_needs, "notice": self.store_notice,
                "placement_timeout": float(self.cfg.resources.placement_timeout)}

    def placed(self, timeout: float) -> int:
        """How many client actors have been placed and have started (waits up to `timeout` s)."""
        ready, _ = ray.wait(self._ready, num_returns=len(self._ready), timeout=timeout)
        return len(ready)

    def open_run(self) -> dict:
        """Create (or, resuming, reopen) the run directory and set up the algorithm and the
        selection: from here on the run writes."""
        ckpt, run_dir = self.ckpt, self.run_dir
        saved = self.cfg.copy()
        saved.resume = None  # config.yaml describes the run, wherever it was resumed from
        self.writer = RunWriter(run_dir, to_yaml(saved), resume_round=ckpt["round"] if ckpt else None,
                                tensorboard=bool(self.cfg.log.tensorboard))
        self.writer.log(f"{self.n_actors} client actors ({self.actor_needs} each) for {self.num_clients} clients"
                        + (f"; {self.reused} of them reused from an earlier run" if self.reused else ""))
        if self.store_notice:
            self.writer.log(f"note: {self.store_notice}")
        torch.manual_seed(int(self.cfg.seed))  # nothing of an earlier run in this process (runtime/pool.py)
        self.metrics = RayMetrics(run_dir.name)
        self.algorithm = ALGORITHMS.get(self.cfg.algorithm)(self.cfg, self.num_classes, self.input_shape)
        self.selection = SELECTIONS.get(self.cfg.selection)(self.cfg, self.num_clients, self.num_classes)
        self.plugins = {"algorithm": self.algorithm, "selection": self.selection}
        self._round_records: list[dict] = []
        self._selected: Optional[list[int]] = None  # the last cohort select_clients returned
        self._restarting: set[int] = set()  # actors that died and are being restarted
        self._attached: set[int] = set()  # actors that have been sent the data references
        self._states: dict[int, ray.ObjectRef] = {}  # client id -> its state, owned by this actor
        self._bytes = [0, 0]  # down, up
        self._timing = {"select": 0.0, "broadcast": 0.0, "train": 0.0}  # this round's, see step()
        self._killed_in: Optional[int] = None  # the last round faults.kill_* struck
        self.client_updates = 0
        self.first_round_seconds: Optional[float] = None
        self.last_checkpoint: Optional[int] = ckpt["round"] if ckpt else None  # the round a resume would start after
        # the clients there in the first round this process runs (a resumed run: after its checkpoint)
        self.selection.available = self.availability.available(ckpt["round"] + 1 if ckpt else 1)
        self.selection.setup(self)
        self.algorithm.setup(self)
        self.start_round = 1
        if ckpt is not None:
            self._restore(ckpt)
            self.writer.log(f"checkpoint of round {ckpt['round']} loaded (weights only)")
            self.ckpt = None
        return {"rounds": int(self.cfg.rounds), "start_round": self.start_round, "run_dir": str(run_dir),
                "banner": f"{describe(self.cfg, self.num_clients)}; "
                          f"{self.n_actors} client actors ({self.actor_needs} each)"}

    # ------------------------------------------------------------------ Server API
    def new_model(self) -> torch.nn.Module:
        torch.manual_seed(int(self.cfg.seed))
        return self.algorithm.build_model(self.input_shape)

    def rng(self, rnd: int, stream: int = 0) -> np.random.Generator:
        return np.random.default_rng([int(self.cfg.seed), rnd, stream])

    def available_clients(self, rnd: int) -> list[int]:
        return self.availability.available(rnd)

    def select_clients(self, rnd: int, k: Optional[int] = None) -> list[int]:
        t0 = time.perf_counter()
        k = min(clients_per_round(self.cfg) if k is None else k, len(self.selection.available))
        self._selected = sorted(int(c) for c in self.selection.select(rnd, k, self.rng(rnd, 1)))
        absent = [c for c in self._selected if not self.availability.there(c, rnd)]
        if absent:
            raise RuntimeError(f"selection {self.cfg.selection!r} chose clients {absent[:5]} that are not there in round "
                               f"{rnd} (clients.join); a strategy draws from Selection.available")
        self._timing["select"] += time.perf_counter() - t0
        return self._selected

    def run_clients(self, rnd: int, cids: list[int], payload: Any, method: str = "client_update",
                    on: str = "algorithm") -> Iterator[ClientResult]:
        """Submits every task now (so several cohorts can train at once) and returns an
        iterator over the results in client-id order; dropped clients are skipped."""
        t0 = time.perf_counter()
        cids = sorted(int(c) for c in cids)
        epochs = {c: int(self.cfg.local.epochs) for c in cids}
        if method == "client_update" and (self.cfg.system.dropout > 0 or self.stragglers):
            cids, epochs = self._system_effects(rnd, cids, epochs)  # training calls only
        size = nbytes(payload)
        self._bytes[0] += size * len(cids)
        # A big payload goes to the object store once and every task gets the reference;
        # a small one is cheaper inlined in each task (Ray inlines arguments under 100 KB).
        payload_arg = ray.put(pack(payload)) if size > INLINE_BYTES else pack(payload)
        stateful = bool(self.plugins[on].client_state)
        work = {c: int(self.sizes[c]) * epochs[c] for c in cids}  # stragglers weigh more
        # Results come back in groups of about FETCH_BYTES (judged by the payload, about the
        # size of an update): one object for many small updates, one per client for big ones.
        group = max(1, int(FETCH_BYTES // max(size, 1)))
        calls = []
        self._await_restarts()
        if method == "client_update" and rnd in self.cfg.faults.kill_rounds and self._killed_in != rnd:
            self._kill_actors(rnd)
        if method == "client_update" and rnd == self.cfg.faults.crash_round and self.cfg.faults.crash_client not in cids:
            self.writer.log(f"round {rnd}: faults.crash_client={self.cfg.faults.crash_client} is not training "
                            "this round (not selected, or dropped out), so no actor crashes")
        vector_group = int(self.cfg.local.vectorize_group) if method == "client_update" and self.cfg.local.vectorize else 0
        for a, chunk, cohorts in placement.plan(cids, work, self.n_actors, self.one_per_client, vector_group):
            states = [self._states.get(c) for c in chunk] if stateful else []
            n_groups = -(-len(chunk) // group)
            n_returns = n_groups + len(states)
            data = None if a in self._attached else self.shared_data
            self._attached.add(a)
            refs = self.actors[a].run.options(num_returns=n_returns).remote(
                data, rnd, method, on, chunk, [epochs[c] for c in chunk], group, cohorts, payload_arg, *states)
            refs = [refs] if n_returns == 1 else list(refs)
            calls.append((a, chunk, refs[:n_groups], refs[n_groups:]))
        self._timing["broadcast"] += time.perf_counter() - t0
        return self._collect(rnd, method, calls, epochs)

    def _kill_actors(self, rnd: int) -> None:
        """Fault injection: `faults.kill_fraction` of the client actors, drawn from (seed,
        round), exit their processes now (at least one: a fraction that rounds to zero
        actors still kills one); their clients this round are recorded as dropped and Ray
        restarts them for the next round."""
        self._killed_in = rnd
        n = max(1, int(round(float(self.cfg.faults.kill_fraction) * self.n_actors)))
        victims = sorted(self.rng(rnd, 5).choice(self.n_actors, n, replace=False).tolist())
        for a in victims:
            self.actors[a].die.remote()  # runs before any task sent after it; those then fail
            self._attached.discard(a)
            self._restarting.add(a)
        self.writer.log(f"round {rnd}: fault injection kills client actors {victims}")

    def _system_effects(self, rnd: int, cids: list[int], epochs: dict) -> tuple[list[int], dict]:
        """Simulated dropout (the client never returns; recorded, not trained) and
        stragglers (a random number of epochs), each drawn from (seed, round, client id)."""
        sy = self.cfg.system
        kept = []
        for c in cids:
            rng = np.random.default_rng([int(self.cfg.seed), rnd, c, 3])
            if sy.dropout > 0 and rng.random() < sy.dropout:
                self._record(rnd, c, "client_update", "dropped", reason="dropout")
                continue
            if c in self.stragglers:
                epochs[c] = int(rng.integers(sy.straggler_epochs[0], sy.straggler_epochs[1] + 1))
            kept.append(c)
        return kept, epochs

    def _record(self, rnd: int, cid: int, method: str, status: str, reason: Optional[str] = None,
                result: Optional[ClientResult] = None, epochs: Optional[int] = None,
                accuracy: Optional[float] = None, num_samples: Optional[int] = None) -> None:
        """One row of the clients table: a call to a client (training, or another method),
        or (method `evaluate`) its accuracy on its local test data."""
        m = result.metrics if result is not None else {}
        if num_samples is None:
            num_samples = int(result.num_samples if result is not None else self.sizes[cid])
        self._round_records.append({
            "round": rnd, "cid": cid, "method": method, "status": status, "reason": reason,
            "num_samples": num_samples, "epochs": epochs, "straggler": cid in self.stragglers,
            "loss": m.get("loss"), "seconds": m.get("seconds"), "accuracy": accuracy})

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
                    self._record(rnd, c, method, "dropped", reason="actor_died", epochs=epochs[c])
                self.writer.log(f"round {rnd}: actor {a} lost clients {chunk}: {type(e).__name__}; dropped")
                continue
            finally:
                self._timing["train"] += time.perf_counter() - t0
            next_group = 1
            for j, c in enumerate(chunk):
                if not results:
                    t0 = time.perf_counter()
                    results = ray.get(group_refs[next_group])
                    self._timing["train"] += time.perf_counter() - t0
                    next_group += 1
                result = unpack(results.pop(0))
                if state_refs and result.state_changed:
                    self._states[c] = state_refs[j]
                self._bytes[1] += nbytes(result.update)
                self.client_updates += 1
                self._record(rnd, c, method, "ok", result=result, epochs=epochs[c])
                yield result

    def _await_restarts(self, timeout: float = 120.0) -> None:
        """Wait for actors that died to come back (Ray restarts them) before giving them
        work again; one that stays down keeps dropping its clients."""
        for a in sorted(self._restarting):
            deadline = time.time() + timeout
            while time.time() < deadline:
                try:
                    ray.get(self.actors[a].device_info.remote(), timeout=max(0.1, deadline - time.time()))
                    self._restarting.discard(a)
                    self.writer.log(f"client actor {a} is back")
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    time.sleep(0.2)

    # ------------------------------------------------------------------ round loop
    def step(self, rnd: int) -> dict:
        """Run round `rnd` and, when due, evaluate; returns the round's metrics row."""
        t0 = time.time()
        self._round_records = []
        self._selected = None
        self._timing = dict.fromkeys(self._timing, 0.0)
        bytes_before = list(self._bytes)
        self.selection.available = there = self.availability.available(rnd)
        joining = self.availability.joining(rnd)
        if joining:
            for c in joining:
                self._record(rnd, c, "join", "ok")
            self.writer.log(f"round {rnd}: {len(joining)} clients join: {joining}")
            self.selection.clients_joined(rnd, joining, self)
            self.algorithm.clients_joined(rnd, joining, self)
        extra = self.algorithm.run_round(rnd, self) or {}
        t_train = time.time() - t0
        models = self.algorithm.eval_models()
        self._check_finite(rnd, extra, models)
        if self.cfg.eval.tau_norm:  # tau-normalised classifiers, for evaluation only
            models = {name: tau_normalised(m, float(self.cfg.eval.tau_norm)) for name, m in models.items()}
        row: dict = {"round": rnd}
        evaluated: dict[int, float] = {}  # per-client accuracy on local test data
        if rnd % int(self.cfg.eval_every) == 0 or rnd == int(self.cfg.rounds):
            for i, (name, model) in enumerate(models.items()):
                ev = evaluate(model, self.x_test, self.y_test, self.num_classes)
                prefix = "" if i == 0 else f"{name}_"
                row.update({f"{prefix}{k}": v for k, v in ev.items()})
                if i == 0 and self.shots is not None:
                    row.update(shot_accuracy(ev["per_class_accuracy"], self.test_counts, self.shots))
            if self.local_tests is not None:
                cids = [c for c in self.local_tests.cids if self.availability.there(c, rnd)]
                local, evaluated = self.local_tests.evaluate(models, self.algorithm.serving(cids))
                row.update(local)
        row.update(extra)
        row.update(self.selection.round_metrics())
        if self._selected is not None:  # the cohort's true label mix, whatever the strategy saw
            cohort = self.true_counts[self._selected].sum(0)
            row.update({"selected": self._selected, "cohort_entropy": float(label_entropy(cohort)),
                        "cohort_labels": int((cohort > 0).sum())})
        # this round's calls (not joins, nor a selection's round-0 uploads for newcomers)
        calls = [r for r in self._round_records if r["method"] != "join" and r["round"] == rnd]
        ok = [r for r in calls if r["status"] == "ok"]
        row.update({
            "clients": len(calls),
            "dropped": len(calls) - len(ok),
            "available": len(there),
            "bytes_down": self._bytes[0],  # cumulative, from the start of the run
            "bytes_up": self._bytes[1],
            "round_bytes_down": self._bytes[0] - bytes_before[0],  # this round's (setup's only in the totals)
            "round_bytes_up": self._bytes[1] - bytes_before[1],
            "seconds": t_train,  # the round without evaluation = the four parts below
            # where the round's time went: selecting; preparing and sending the payload and
            # tasks; waiting for client results; the server's own work (building the
            # payload, aggregating) = the rest; then evaluation
            **{f"{k}_seconds": v for k, v in self._timing.items()},
            "aggregate_seconds": max(0.0, t_train - sum(self._timing.values())),
            "eval_seconds": time.time() - t0 - t_train,
            "elapsed": time.time() - self.t_start,
        })
        if self.first_round_seconds is None:
            self.first_round_seconds = time.time() - self.t_start
        for cid, acc in evaluated.items():
            self._record(rnd, cid, "evaluate", "ok", accuracy=acc, num_samples=int(self.local_tests.sizes[cid]))
        self.writer.round(row, self._round_records)
        self.metrics.record(row)
        every = int(self.cfg.checkpoint_every)
        if every and (rnd % every == 0 or rnd == int(self.cfg.rounds)):
            self._checkpoint(rnd)
        return row

    def _check_finite(self, rnd: int, extra: dict, models: dict) -> None:
        """Stop the run when the round's loss or any weight of a model is NaN or infinite:
        every later round would be noise at chance accuracy. The rounds before stay in the
        run directory, with a summary saying where it stopped (`RunDiverged`, exit 3)."""
        what = [f"{k}={v}" for k, v in extra.items() if isinstance(v, float) and not math.isfinite(v)]
        for name, model in models.items():
            bad = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
            if bad:
                what.append(f"model {name!r} has non-finite weights ({bad[0]}{' and more' if len(bad) > 1 else ''})")
        if not what:
            return
        loc = self.cfg.local
        kept = f"the metrics of rounds 1..{rnd - 1} are in {self.writer.dir}" if rnd > 1 else "no round finished"
        msg = (f"round {rnd}: {self.cfg.algorithm} diverged: {'; '.join(what)}. Try a smaller local.lr "
               f"(now {loc.lr}) or local.momentum (now {loc.momentum}); {kept}")
        self.writer.log(msg)
        summary = summarize(self.writer.rows, time.time() - self.t_start, self.client_updates,
                            self.first_round_seconds or 0.0)
        self.writer.finish({**summary, "status": "diverged", "diverged_round": rnd, "reason": msg,
                            "run_dir": str(self.writer.dir)}, None)
        self._release_actors()  # a clean stop: they can serve the next run
        raise RunDiverged(msg)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, rnd: int) -> None:
        """Metrics so far, then everything else a resumed run needs (see checkpoint.py)."""
        t0 = time.time()
        cids = sorted(self._states)
        states = ray.get([self._states[c] for c in cids])
        self.writer.flush_tables()
        checkpoint.save(self.writer.dir, {
            "round": rnd,
            "config": run_record(self.cfg),  # a resumed run's config.yaml must still say this
            "algorithm": self.algorithm.state_dict(),
            "selection": self.selection.state_dict(),
            "client_states": {c: unpack(s) for c, s in zip(cids, states)},
            "torch_rng": torch.get_rng_state(),
            "bytes": list(self._bytes),
            "client_updates": self.client_updates,
            "elapsed": time.time() - self.t_start,
            "first_round_seconds": self.first_round_seconds,
        }, last_good=self.last_checkpoint)
        self.last_checkpoint = rnd
        self.writer.log(f"checkpoint after round {rnd} ({len(cids)} client states, {time.time() - t0:.2f} s)")

    def _restore(self, ckpt: dict) -> None:
        self.algorithm.load_state_dict(ckpt["algorithm"])
        self.selection.load_state_dict(ckpt["selection"])
        self._states = {int(c): ray.put(pack(s)) for c, s in ckpt["client_states"].items()}
        torch.set_rng_state(ckpt["torch_rng"])
        self._bytes = list(ckpt["bytes"])
        self.client_updates = int(ckpt["client_updates"])
        self.t_start -= float(ckpt["elapsed"])  # elapsed time goes on from where it stopped
        self.first_round_seconds = ckpt["first_round_seconds"]
        self.start_round = int(ckpt["round"]) + 1

    def finish(self) -> dict:
        summary = summarize(self.writer.rows, time.time() - self.t_start, self.client_updates,
                            self.first_round_seconds or 0.0)
        summary["run_dir"] = str(self.writer.dir)
        summary["status"] = "finished"
        self._await_restarts()  # actors killed in the last round (faults) are asked where they run
        nodes: dict[str, int] = {}
        for info in self.actor_info():
            nodes[info["node_id"]] = nodes.get(info["node_id"], 0) + 1
        summary["client_actor_nodes"] = nodes
        self.writer.finish(summary, self.algorithm.state_dict())
        self._release_actors()
        return summary

    def _release_actors(self) -> None:
        """Leave the client actors to the next run of this Ray session (`ray.reuse_workers`),
        or stop them."""
        if self.cfg.ray.reuse_workers:
            pool.keep_client_actors(self.actor_key, self.actors)
            self.actors = []
        else:
            self.stop_actors()

    def stop_actors(self) -> None:
        for a in getattr(self, "actors", []):
            ray.kill(a)
        self.actors = []

    def flush(self) -> None:
        """Write the metrics of the rounds so far (the run is being stopped early)."""
        if hasattr(self, "writer") and not self.writer.log_file.closed:
            self.writer.flush_tables()
            self.writer.log("run stopped before its last round")

    def log_failure(self, rnd: int, text: str) -> None:
        """An exception stopped round `rnd`: its full traceback goes into log.txt."""
        if hasattr(self, "writer") and not self.writer.log_file.closed:
            plain = re.sub(r"\x1b\[[0-9;]*m", "", text.rstrip())  # Ray colours its actor names
            self.writer.log(f"round {rnd} failed:\n{plain}")

    def actor_info(self) -> list[dict]:
        return ray.get([a.device_info.remote() for a in self.actors])

