"""The server of a run: what the server actor (`raysim-server`, server_actor.py) runs.

`FederatedServer` is the round loop and the `Server` calls an algorithm uses; it owns the
algorithm's server half and the selection strategy. Its two other jobs have their own
modules: `Dispatch` (dispatch.py, the only part that needs Ray) runs client calls on the
client actors, and `RunRecord` (record.py) keeps the run directory, the clients table and
the checkpoints. The `Server` calls:

- `select_clients(rnd)`: the selection strategy, with an RNG from (seed, round);
- `run_clients(rnd, cids, payload)`: system effects (dropout, stragglers:
  world/availability.py), then the call on the client actors; results in client-id order;
- `new_model()`, `rng(rnd, stream)`, `available_clients(rnd)`.

Checkpoints: `checkpoint_every`, `resume=<run dir>` (checkpoint.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
from raysim import lazy_ray
from raysim.lazy_ray import ray
import torch
from omegaconf import OmegaConf

from raysim.attacks import Adversaries
from raysim.compression.uplink import Uplink
from raysim.contract import ClientResult
from raysim.config import ConfigError, clients_per_round, resolve, run_record
from raysim.data import store
from raysim.data.long_tail import shot_accuracy, shot_groups
from raysim.data.partition import label_counts, label_entropy
from raysim.errors import ActorsLost, RunDiverged
from raysim.preflight import run_dir_for
from raysim.experiment import describe, prepare
from raysim.registry import ALGORITHMS, SELECTIONS
from raysim import checkpoint
from raysim.runtime import determinism, personal_eval, placement
from raysim.world.availability import Availability, SystemEffects
from raysim.runtime.asynchronous import Arrival, InFlight
from raysim.world.clock import Clock
from raysim.runtime.dispatch import Dispatch
from raysim.privacy.secagg import SecureAggregation
from raysim.runtime.local_eval import clients_test_data
from raysim.runtime.remote_eval import TestSet
from raysim.runtime.record import RunRecord
from raysim.training import nbytes, tau_normalised


class FederatedServer:
    def __init__(self, t_start: float):
        self.t_start = t_start
        torch.set_num_threads(max(1, os.cpu_count() or 1))

    def setup(self, layers: list, cwd: str, started: Optional[tuple] = None) -> dict:
        """Resolve the config, check a resumed run against its checkpoint, start the client
        actors (or take those `ServerActor.start_clients` started: (run directory, actors))
        and, while they start, load and partition the data and share it with them.
        Input problems raise `ConfigError`; nothing is written yet (see `open_run`)."""
        run_dir, actors = started or (None, None)
        try:
            self.cfg = resolve(layers, cwd)
            torch.set_num_threads(int(self.cfg.resources.server_threads) or max(1, os.cpu_count() or 1))
            determinism.apply(self.cfg.determinism)  # the server's own torch work (evaluation, server-side training)
            self.ckpt = None
            if self.cfg.resume:
                self.run_dir = Path(self.cfg.resume)
                self.ckpt = checkpoint.load_checked(self.cfg)
            else:
                self.run_dir = run_dir or run_dir_for(self.cfg)
            if self.cfg.privacy.mode == "central":
                from raysim.privacy.central import CentralDP

                CentralDP.from_config(self.cfg)  # refuses an adaptive clip whose count noise is too small, now
        except BaseException:
            for a in actors[0] if actors is not None else ():  # refused before the run: not kept
                ray.kill(a)
            raise
        # the actors start while the data loads; a command on its own machine starts Ray only when
        # its clients' training is worth it (`_where_clients_train`, after the data)
        self.dispatch = Dispatch(self.cfg, self.run_dir.name, actors) if lazy_ray.initialized() else None
        try:
            data, part, num_classes = prepare(self.cfg)
        except ConfigError:
            self.release_actors()
            raise
        self.sizes = part.sizes()
        self.secagg = SecureAggregation.from_config(self.cfg)
        self.accountant = None
        if self.cfg.privacy.mode != "none":  # the noise multiplier before the clients and the server rule read it
            from raysim.privacy.accountant import for_run

            self.accountant = for_run(self.cfg, self.sizes, resumed=bool(self.cfg.resume))
            self.cfg.privacy.noise_multiplier = self.accountant.noise_multiplier
        arrays = {"x_train": data.x_train, "y_train": data.y_train}
        files = None
        where = ("population" if data.population is not None else
                 "files" if data.stored else store.choose(self.cfg, sum(a.nbytes for a in arrays.values())))
        if where == "population":  # users made when picked (data/population.py): the actors get its sizes
            arrays = {"population": data.population}
        elif where == "memory":  # a stored array the loader did not read (an Arrow cache's): read now
            arrays = {k: np.asarray(v) for k, v in arrays.items()}
        else:  # written once, read by every process: data/store.py
            files = data.stored or store.put(arrays, store.root(self.cfg))  # made there already, or written now
            arrays = {k: v for k, v in store.open_arrays(files).items() if k in arrays}  # the server's copy goes
            data = dataclasses.replace(data, x_train=arrays["x_train"], y_train=arrays["y_train"], stored=files)
        self._shared = [OmegaConf.to_container(self.cfg), arrays if files is None else files, part.train,
                        num_classes, data.norm, data.pixel_max, self.sizes]
        tested = slice(None) if data.global_test is None else data.global_test  # synthetic.test_users: a sample's
        self.x_test, self.y_test = data.inputs(data.x_test[tested].copy()), torch.from_numpy(data.y_test[tested].copy())
        if not len(self.y_test):  # every accuracy would read 0.0 (a finished run "at 0 %", issue 85)
            self.release_actors()
            share = "synthetic.test_fraction" if self.cfg.dataset == "synthetic" else "partition.test_fraction"
            users = "" if data.global_test is None else f" of the {len(data.global_test)} test users drawn"
            raise ConfigError(f"the global test set is empty: the test splits{users} hold no sample "
                              f"({share}={OmegaConf.select(self.cfg, share)} of a client's {int(np.min(self.sizes))} "
                              f"to {int(np.max(self.sizes))} samples rounds to none); give the clients more samples "
                              f"or a larger {share}")
        self.local_tests = clients_test_data(data, part, self.cfg)  # None: clients have no test data of their own
        unshared = ALGORITHMS.get(self.cfg.algorithm).unshared
        if (int(self.cfg.eval.finetune_epochs) > 0 or unshared) and self.local_tests is None:
            self.release_actors()
            why = ("eval.finetune_epochs: fine-tuned models are" if not unshared else
                   f"algorithm={self.cfg.algorithm}: its clients' own models are (the server's keeps the initial "
                   f"{unshared})")
            raise ConfigError(f"{why} tested on each client's own test data, and these clients have none: set "
                              "partition.test_fraction (e.g. 0.2)")
        self.input_range = (float(self.x_test.min()), float(self.x_test.max())) if len(self.x_test) else (0.0, 1.0)
        self.true_counts = (label_counts(data.y_train, part, num_classes) if data.population is None else
                            data.population.label_counts)  # for cohort metrics only; when made per user, reported by the clients
        # long-tailed data: accuracy on the many / medium / few-shot classes (data/long_tail.py)
        self.shots = (shot_groups(np.bincount(data.y_train, minlength=num_classes), self.cfg.eval.shots)
                      if self.cfg.long_tail.imbalance > 1 else None)
        self.test_counts = np.bincount(self.y_test.numpy(), minlength=num_classes)
        self.num_clients = int(self.cfg.num_clients)
        self.availability = Availability(self.cfg, self.num_clients)
        self.system = SystemEffects(self.cfg, self.num_clients)
        self.adversaries = Adversaries(self.cfg, self.num_clients)  # who attacks, for the record
        self.num_classes = num_classes
        self.input_shape = data.input_shape
        self.data_bytes = int(data.x_train.nbytes + data.y_train.nbytes) if data.population is None else 0
        self.population = data.population
        self.files = files
        if self.dispatch is None:
            needs_ray = self._where_clients_train(data, part)
            if needs_ray is not None:  # the caller starts Ray, then calls attach
                return {"start_ray": needs_ray, "data_bytes": self.data_bytes if files is None else 0,
                        "placement_timeout": float(self.cfg.resources.placement_timeout)}
        return self.attach()

    def _where_clients_train(self, data, part) -> Optional[str]:
        """No Ray in this process yet (a command on its own machine, which hosts this server):
        train the clients here, without Ray (runtime/here.py), when nothing needs client actors
        and one client's epoch, timed, says the training would not pay for Ray's start; else
        why Ray is started (`attach` follows)."""
        from raysim.data.datasets import model_inputs
        from raysim.models import model_from
        from raysim.runtime import here

        why = here.cannot(self.cfg, self.files is not None)
        if why is not None:
            return why
        cid = int(np.argsort(self.sizes, kind="stable")[len(self.sizes) // 2])  # a client of the median size
        rows = np.asarray(part.train[cid])
        x, y = torch.from_numpy(np.asarray(data.x_train[rows])), torch.from_numpy(np.asarray(data.y_train[rows])).long()
        rng = torch.random.default_generator.get_state()
        rounds = int(self.cfg.rounds) - (int(self.ckpt["round"]) if self.ckpt else 0)
        try:
            model = model_from(self.cfg, tuple(self.input_shape), self.num_classes)
            seconds = here.training_seconds(self.cfg, rounds, model, x, y,
                                            lambda b: model_inputs(b, data.pixel_max, data.norm))
        except Exception as e:  # noqa: BLE001  (a model plain SGD cannot time: the actors, as before)
            return f"one client's epoch could not be timed ({type(e).__name__}: {str(e)[:100]})"
        finally:
            torch.random.default_generator.set_state(rng)
        ray_pays, words = here.worth_ray(seconds, self.cfg)
        if ray_pays:
            return words
        self.dispatch = Dispatch(self.cfg, self.run_dir.name, here_why=words)
        return None

    def attach(self) -> dict:
        """Give the data to the client actors (started by `setup`, or now, Ray having started
        since) or to this process's runner; what the caller waits for."""
        if self.dispatch is None:
            self.dispatch = Dispatch(self.cfg, self.run_dir.name)
        files = self.files
        if files is not None:  # the node that holds them: hosts without the folder copy from it (data/replicate.py)
            self._shared[1] = {**files, "node": ray.get_runtime_context().get_node_id()}
        self.dispatch.share_data(*self._shared)
        self.test_set = TestSet(self.cfg, self.dispatch, self.x_test, self.y_test, self.num_classes,
                                lambda line: self.record.log(line))
        store_bytes = self.dispatch.store_bytes if self.dispatch.ray is ray else 0
        self.store_notice = placement.store_notice(self.data_bytes, store_bytes) if files is None else None
        self.data_where = (f"training data: {self.data_bytes / 2**30:.2f} GB in "
                           + (f"files under {files['folder']}" if files else
                              "Ray's object store" if store_bytes else "this process")
                           + f" (data_store={self.cfg.data_store})")
        if self.population is not None:
            self.data_where = (f"training data: made when a client is picked ({len(self.population):,} users, "
                               f"{self.population.n_train:,} training samples; {self.population.nbytes() / 2**20:.0f} "
                               "MB of sizes held)")
        return {"actors": self.dispatch.n_actors, "needs": self.dispatch.needs, "notice": self.store_notice,
                "data_bytes": self.data_bytes if files is None else 0,  # what the object store holds of the data
                "store_bytes": float(store_bytes), "here": self.dispatch.ray is not ray,
                "placement_timeout": float(self.cfg.resources.placement_timeout)}

    def release_actors(self) -> None:
        """The run is refused before it starts: its client actors go back to the pool (or stop)."""
        if getattr(self, "dispatch", None) is not None:
            self.dispatch.release()

    def placed(self, timeout: float) -> int:
        return self.dispatch.placed(timeout)

    def open_run(self) -> dict:
        """Create (or, resuming, reopen) the run directory and set up the algorithm and the
        selection: from here on the run writes."""
        ckpt, d = self.ckpt, self.dispatch
        self.record = RunRecord(self.cfg, self.run_dir, self.t_start, ckpt, self.sizes, self.system.stragglers,
                                self.adversaries.attacking)
        d.record = self.record
        actors = ("the clients train in this process" if d.ray is not ray else
                  "1 client actor, resources.num_gpus_per_actor=auto's probe (1 GPU: the first training call measures "
                  "one client update, then as many actors per GPU as fit replace it)" if d.probe_pending else
                  f"{d.n_actors} client actors ({d.needs} each)")
        self.record.log(f"{actors} for {self.num_clients} clients ({d.why})"
                        + (f"; {d.reused} of them reused from an earlier run" if d.reused else ""))
        if self.cfg.resources.num_gpus_per_actor == "auto" and not d.probe_pending and d.ray is ray:
            self.record.log("resources.num_gpus_per_actor=auto: the cluster has no GPU; the client actors train on CPUs")
        self.record.log(self.data_where)
        if self.store_notice:
            self.record.log(f"note: {self.store_notice}")
        if self.accountant is not None:
            self.record.log(self.accountant.describe())
        torch.manual_seed(int(self.cfg.seed))  # nothing of an earlier run in this process (runtime/pool.py)
        self.algorithm = ALGORITHMS.get(self.cfg.algorithm)(self.cfg, self.num_classes, self.input_shape)
        self.selection = SELECTIONS.get(self.cfg.selection)(self.cfg, self.num_clients, self.num_classes)
        self.plugins = {"algorithm": self.algorithm, "selection": self.selection}
        rng = torch.get_rng_state()  # compress.up: its server end reads the trainable parameters' names
        self.uplink = Uplink.from_config(self.cfg, self.algorithm.build_model(self.input_shape))
        torch.set_rng_state(rng)
        self.dispatch.uplink = self.uplink
        self._selected: Optional[list[int]] = None  # the last cohort select_clients returned
        self._warned: set[str] = set()  # the kinds of round warnings said so far (_round_warnings)
        self._select_seconds = 0.0  # this round's, see step()
        # the clients there in the first round this process runs (a resumed run: after its checkpoint)
        self.selection.available = self.availability.available(ckpt["round"] + 1 if ckpt else 1)
        self.clock = self.flight = None
        asynchronous = bool(getattr(self.algorithm, "asynchronous", False))
        if self.cfg.system.profile != "none" or asynchronous:  # simulated time: FLOPs counted on a fresh model
            rng = torch.get_rng_state()
            self.clock = Clock.from_config(self.cfg, self.num_clients, self.sizes, self.new_model(), self.x_test[:1],
                                           asynchronous)
            torch.set_rng_state(rng)
            self.record.log(f"simulated time: system.profile={self.cfg.system.profile}"
                            f"{' (uniform: an asynchronous algorithm)' if self.cfg.system.profile == 'none' else ''}, "
                            f"{self.clock.flops / 1e6:.2f} MFLOP a sample (forward and backward)")
            if asynchronous:  # its clients in flight (runtime/asynchronous.py)
                self.flight = InFlight(self)
        self.selection.setup(self)
        self.algorithm.setup(self)
        self.start_round = 1
        if ckpt is not None:
            self._restore(ckpt)
            self.record.log(f"checkpoint of round {ckpt['round']} loaded (weights only)")
            self.ckpt = None
        return {"rounds": int(self.cfg.rounds), "start_round": self.start_round, "run_dir": str(self.run_dir),
                "banner": f"{describe(self.cfg, self.num_clients)}; {actors}"}

    # ------------------------------------------------------------------ Server API
    def new_model(self) -> torch.nn.Module:
        torch.manual_seed(int(self.cfg.seed))
        return self.algorithm.build_model(self.input_shape)

    def rng(self, rnd: int, stream: int = 0) -> np.random.Generator:
        return np.random.default_rng([int(self.cfg.seed), rnd, stream])

    def locally_evaluated(self, rnd: int) -> list[int]:
        """The clients evaluated on their own test splits in round `rnd`: every one there that
        has a split, or `eval.local_clients` of them drawn without replacement (the server's
        stream 11 of the round: the same sample for any number of actors)."""
        cids = self.availability.among(self.local_tests.cids, rnd)
        k = int(self.cfg.eval.local_clients)
        if 0 < k < len(cids):  # positions drawn, then taken: rng.choice(cids, k)'s draw, without listing range(N)
            return sorted(int(cids[int(i)]) for i in self.rng(rnd, 11).choice(len(cids), k, replace=False))
        return [int(c) for c in cids]

    def evaluates(self, rnd: int) -> bool:
        """Whether round `rnd` ends with an evaluation: every `eval_every` rounds, and the last."""
        from raysim.contract import ends_with_evaluation

        return ends_with_evaluation(self.cfg, rnd)

    def available_clients(self, rnd: int) -> list[int]:
        return self.availability.available(rnd)

    def select_clients(self, rnd: int, k: Optional[int] = None) -> list[int]:
        t0 = time.perf_counter()
        k = min(clients_per_round(self.cfg) if k is None else k, len(self.selection.available))
        self._selected = sorted(int(c) for c in self.selection.select(rnd, k, self.rng(rnd, 1)))
        there = self.availability.among(self._selected, rnd)
        if len(there) < len(self._selected):
            absent = sorted(set(self._selected) - set(np.asarray(there).tolist()))
            raise RuntimeError(f"selection {self.cfg.selection!r} chose clients {absent[:5]} that are not there in round "
                               f"{rnd} (clients.join); a strategy draws from Selection.available")
        self._select_seconds += time.perf_counter() - t0
        return self._selected

    def run_clients(self, rnd: int, cids: list[int], payload: Any, method: str = "client_update",
                    on: str = "algorithm") -> Iterator[ClientResult]:
        """Every task is submitted now (so several cohorts can train at once); the iterator
        gives the results in client-id order; dropped clients are skipped."""
        cids = sorted(int(c) for c in cids)
        cohort = cids
        epochs = dict.fromkeys(cids, int(self.cfg.local.epochs))
        if method == "client_update" and self.system.active:  # training calls only
            cids, epochs, dropped = self.system.apply(rnd, cids, epochs)
            for c in dropped:
                self.record.client(rnd, c, method, "dropped", reason="dropout")
        if method == "client_update" and self.clock is not None:  # simulated time: world/clock.py
            cids, lost, took = self.clock.call(cids, epochs, nbytes(payload), self.upload_bytes(payload))
            self.record.sim_seconds.update(took)
            for c, why in lost.items():
                self.record.client(rnd, c, method, "dropped", reason=why, epochs=epochs[c])
        results = self.dispatch.run(rnd, cids, epochs, payload, method, on, self.carries_state(method, on))
        if self.secagg is not None and method == "client_update" and on == "algorithm":  # the server sees the sum
            return self.secagg.round(rnd, cohort, results)
        return results

    def carries_state(self, method: str, on: str) -> bool:
        """Whether these calls send and take back client state: the plugin's own, or
        `compress.error_feedback`'s residuals."""
        return bool(self.plugins[on].client_state) or (self.uplink is not None and self.uplink.keeps_state(method, on))

    def upload_bytes(self, payload: Any) -> int:
        """What a client sends back for `payload`, for the clock: its encoded update's bytes
        with `compress.up`, else the payload's size (an update the model's size)."""
        if self.uplink is not None and isinstance(payload, dict) and "weights" in payload:
            return self.uplink.message_bytes(payload["weights"])
        return nbytes(payload)

    def arrivals(self, rnd: int, n: int, concurrency: int, payload: Callable[[], tuple]) -> Iterator[Arrival]:
        return self.flight.arrivals(rnd, n, concurrency, payload)

    # ------------------------------------------------------------------ round loop
    def step(self, rnd: int) -> dict:
        """Run round `rnd` and, when due, evaluate; returns the round's metrics row."""
        t0, cpu0 = time.time(), time.thread_time()
        record, d = self.record, self.dispatch
        record.new_round()
        self._selected = None
        self._select_seconds = 0.0
        d.seconds = dict.fromkeys(d.seconds, 0.0)
        bytes_before = list(d.bytes)
        there = self.availability.available(rnd)
        if self.clock is not None:  # of those, the ones online now (world/online.py); with
            # clients in flight (asynchronous) the clock does not wait for one to come online
            in_flight = self.flight is not None and len(self.flight) > 0
            there = self.clock.online.online(there, self.clock.now) if in_flight else self.clock.available(there)
        self.selection.available = there
        joining = self.availability.joining(rnd)
        if joining:
            for c in joining:
                record.client(rnd, c, "join", "ok")
            record.log(f"round {rnd}: {len(joining)} clients join: {joining}")
            self.selection.clients_joined(rnd, joining, self)
            self.algorithm.clients_joined(rnd, joining, self)
        if self.secagg is not None:
            self.secagg.metrics = {}
        sim_start = self.clock.now if self.clock is not None else None
        try:
            extra = self.algorithm.run_round(rnd, self) or {}
        except ActorsLost as e:  # no client actor left to train on (dispatch.py): resume when there are again
            last = self.record.last_checkpoint
            self.stop_early(rnd, "actors_lost", ActorsLost, f"{e}. `python -m raysim.run resume={self.run_dir}` "
                            + (f"continues from its checkpoint of round {last}" if last else
                               "starts it again (no checkpoint yet: checkpoint_every)"))
        t_train, cpu_train = time.time() - t0, time.thread_time() - cpu0
        models = self.algorithm.eval_models()
        rms = self._check_finite(rnd, extra, models)
        if self.cfg.eval.tau_norm:  # tau-normalised classifiers, for evaluation only
            models = {name: tau_normalised(m, float(self.cfg.eval.tau_norm)) for name, m in models.items()}
        row: dict = {"round": rnd}
        if self.clock is not None:
            row.update(sim_start=sim_start, sim_end=self.clock.now)
        evaluated: dict[int, float] = {}  # per-client accuracy on local test data
        personal_accuracy: dict[int, float] = {}  # ... of the client's own model (runtime/personal_eval.py)
        if self.evaluates(rnd):
            for i, (name, ev) in enumerate(zip(models, self.test_set.evaluate(list(models.values())))):
                prefix = "" if i == 0 else f"{name}_"
                row.update({f"{prefix}{k}": v for k, v in ev.items()})
                if i == 0 and self.shots is not None:
                    row.update(shot_accuracy(ev["per_class_accuracy"], self.test_counts, self.shots))
            if self.local_tests is not None:
                cids = self.locally_evaluated(rnd)
                local, evaluated = self.local_tests.evaluate(models, self.algorithm.serving(cids))
                row.update(local)
                if personal_eval.wanted(self.cfg, self.algorithm):  # each client's own model
                    personal, personal_accuracy = personal_eval.evaluate(self, rnd, models, cids)
                    row.update(personal)
        self._check_collapse(rnd, row.get("accuracy"))
        row.update(extra)
        if rms is not None:
            row["weight_rms"] = rms
        if self.secagg is not None:  # what the secure sum cost, and whether it failed
            row.update(self.secagg.metrics)
            if self.secagg.metrics.get("secagg_failed"):
                record.log(f"round {rnd}: secure aggregation failed ({self.secagg.metrics['secagg_survivors']} clients "
                           "returned, too few neighbours left to rebuild a seed): the model is unchanged")
        if self.accountant is not None:  # the (epsilon, delta) spent so far
            row["epsilon"] = self.accountant.after_round(rnd, record.rows)
        row.update(self.selection.round_metrics())
        if self._selected is not None:  # the cohort's true label mix, whatever the strategy saw
            cohort = cohort_label_counts(self._selected, self.true_counts, record.label_counts)
            row.update({"selected": self._selected, "cohort_entropy": float(label_entropy(cohort)),
                        "cohort_labels": int((cohort > 0).sum())})
        # this round's calls (not joins, nor a selection's round-0 uploads for newcomers)
        calls = [r for r in record.rows if r["method"] not in ("join", "personalise") and r["round"] == rnd]
        ok = [r for r in calls if r["status"] == "ok"]
        timing = {"select": self._select_seconds, **d.seconds}
        row.update({
            "clients": len(calls),
            "dropped": len(calls) - len(ok),
            "attackers": sum(bool(r["attacker"]) for r in ok),  # attack.*: of the clients that returned
            "available": len(there),
            "bytes_down": d.bytes[0],  # cumulative, from the start of the run
            "bytes_up": d.bytes[1],
            "round_bytes_down": d.bytes[0] - bytes_before[0],  # this round's (setup's only in the totals)
            "round_bytes_up": d.bytes[1] - bytes_before[1],
            "seconds": t_train,  # the round without evaluation = the four parts below
            # where the round's time went: selecting; preparing and sending the payload and
            # tasks; waiting for client results; the server's own work (building the
            # payload, aggregating) = the rest; then evaluation
            **{f"{k}_seconds": v for k, v in timing.items()},
            "aggregate_seconds": max(0.0, t_train - sum(timing.values())),
            # the server's own CPU in the round (its thread's: waiting for clients is not counted)
            "server_cpu_seconds": cpu_train,
            "eval_seconds": time.time() - t0 - t_train,
        })
        warnings = self._round_warnings(rnd, row, there, calls)
        for cid, acc in evaluated.items():
            record.client(rnd, cid, "evaluate", "ok", accuracy=acc, num_samples=int(self.local_tests.sizes[cid]))
        for cid, acc in personal_accuracy.items():
            record.client(rnd, cid, "evaluate_personal", "ok", accuracy=acc, num_samples=int(self.local_tests.sizes[cid]))
        record.round(row)
        every = int(self.cfg.checkpoint_every)
        if every and (rnd % every == 0 or rnd == int(self.cfg.rounds)):
            self._checkpoint(rnd)
        return {**row, "warnings": warnings} if warnings else row

    def _round_warnings(self, rnd: int, row: dict, there: list, calls: list[dict]) -> list[str]:
        """What a user must hear of round `rnd` although the run goes on: every training call
        dropped (no update arrived: said in log.txt each time), fewer clients online or there
        than `clients_per_round` (the row's `available` says how many, each round). Each kind
        is also returned once per run, for the command to print as a `warning:` line."""
        said = []
        if self.flight is None and row["clients"] and row["dropped"] == row["clients"]:  # as finish() counts them
            why = Counter(r["reason"] for r in calls)
            line = (f"round {rnd}: no update arrived: all {len(calls)} selected clients were dropped ("
                    + ", ".join(f"{n} {reason}" for reason, n in sorted(why.items())) + ")"
                    + (f"; system.deadline={self.cfg.system.deadline:g} s is shorter than their updates"
                       if "deadline" in why else ""))
            self.record.log(line)
            said.append(("dropped", line))
        asked = clients_per_round(self.cfg)
        if self.flight is None and len(there) < asked:
            where = "online" if self.cfg.system.availability != "always" else "there (clients.join)"
            said.append(("fewer", f"round {rnd}: {len(there)} client{'s' if len(there) != 1 else ''} {where}, "
                                  f"fewer than clients_per_round={asked}: the round trains those; metrics.parquet's "
                                  "`available` has each round's count"))
        out = []
        for kind, line in said:
            if kind not in self._warned:
                self._warned.add(kind)
                out.append(line + (" (said once; log.txt has every such round)" if kind == "dropped" else " (said once)"))
                if kind != "dropped":
                    self.record.log(f"warning: {line}")
        return out

    def _check_finite(self, rnd: int, extra: dict, models: dict) -> float | None:
        """Stop the run when the round's loss or any weight of a model is NaN or infinite:
        every later round would be noise at chance accuracy. The rounds before stay in the
        run directory, with a summary saying where it stopped (`RunDiverged`, exit 3).
        Returns the first model's weight RMS (metrics.parquet's `weight_rms`: a collapse
        shows as a jump, 0.124 -> 0.186 in one round of FedDyn's, where its rounds before grew
        it by under 1 %)."""
        what = [f"{k}={v}" for k, v in extra.items() if isinstance(v, float) and not math.isfinite(v)]
        first = None
        for name, model in models.items():
            state = model.state_dict()
            bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
            if bad:
                what.append(f"model {name!r} has non-finite weights ({bad[0]}{' and more' if len(bad) > 1 else ''})")
            elif first is None:
                first = weight_rms([v for v in state.values() if v.is_floating_point()])
        if not what:
            return first
        hint = type(self.algorithm).divergence_hint(self.cfg)
        self.stop_early(rnd, "diverged", RunDiverged, f"{self.cfg.algorithm} diverged: {'; '.join(what)}. {hint}")

    def _check_collapse(self, rnd: int, accuracy: float | None) -> None:
        """Stop the run as diverged when the server's model has collapsed to chance without
        turning non-finite: its test accuracy at most 1.5 / classes at this evaluation and the
        two before, after it had reached 3 / classes (issue 84: FedDyn's objective ran away
        below zero, -33 to -160, its accuracy from 96.5 % to 10-14 % and never back; such a
        run counted as finished). Off with `diverged_collapse=false`, for a method whose server
        model does not serve its clients (`serves_clients`: it may sit at chance by design) and
        under an attack (`attack.kind`: there a collapse is what is measured)."""
        if accuracy is None or not self.cfg.diverged_collapse or not serves_clients(type(self.algorithm)) \
                or self.cfg.attack.kind != "none":  # under attack a collapse is the attack's result, not divergence
            return
        before = [r["accuracy"] for r in self.record.writer.rows if r.get("accuracy") is not None]
        if collapsed([*before, accuracy], self.num_classes):
            last = [*before[-2:], accuracy]
            hint = type(self.algorithm).divergence_hint(self.cfg)
            self.stop_early(rnd, "diverged", RunDiverged,
                            f"{self.cfg.algorithm} collapsed to chance: test accuracy "
                            f"{', '.join(f'{a:.3f}' for a in last)} at its last three evaluations, after "
                            f"{max(before):.3f} (diverged_collapse=false runs on). {hint}")

    def _where_trained(self) -> dict:
        """Summary fields: where the client actors ran and what their bits depend on
        (deterministic kernels, device, processor and torch build: a CUDA run and a CPU run of
        one config, or runs on two CPU kinds, differ by float rounding; docs/guide.md)."""
        nodes: dict[str, int] = {}
        devices: set[str] = set()
        processors: set[str] = set()
        for info in self.dispatch.actor_info():
            nodes[info["node_id"]] = nodes.get(info["node_id"], 0) + 1
            devices.add(info["device"])
            processors.add(f'{info["processor"]}, torch {info["torch"]}')
        from raysim.provenance import code_version, config_sha256

        return {"client_actor_nodes": nodes, "determinism": bool(self.cfg.determinism),
                "client_devices": sorted(devices),
                "client_processors": sorted(processors),  # "Intel(R) Xeon(R) Processor, torch 2.14.1+cu130"
                "raysim_commit": code_version(), "config_sha256": config_sha256(self.cfg),
                "test_class_counts": self.test_counts.tolist()}  # the test set's classes (validation mode: its)

    def stop_early(self, rnd: int, status: str, error: type, why: str) -> None:
        """End the run in round `rnd`, which cannot go on: the rounds before stay in the run
        directory, its summary says `status` and why; raises `error` (RunDiverged's kind)."""
        kept = f"the metrics of rounds 1..{rnd - 1} are in {self.record.dir}" if rnd > 1 else "no round finished"
        msg = f"round {rnd}: {why}; {kept}"
        self.record.log(msg)
        self.record.finish({**self.record.summary(), "status": status, f"{status}_round": rnd, "reason": msg,
                            **self._where_trained()}, None)
        self.dispatch.release()  # a clean stop: the actors can serve the next run
        raise error(msg)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, rnd: int) -> None:
        self.record.checkpoint(rnd, {
            "config": run_record(self.cfg),  # a resumed run's config.yaml must still say this
            "algorithm": self.algorithm.state_dict(),
            "selection": self.selection.state_dict(),
            "client_states": self.dispatch.client_states(),
            "torch_rng": torch.get_rng_state(),
            "bytes": list(self.dispatch.bytes),
            "privacy": self.accountant.state_dict() if self.accountant is not None else {},
            "clock": self.clock.now if self.clock is not None else None,
            "flight": self.flight.state_dict() if self.flight is not None else None,
        })

    def _restore(self, ckpt: dict) -> None:
        self.algorithm.load_state_dict(ckpt["algorithm"])
        self.selection.load_state_dict(ckpt["selection"])
        self.dispatch.restore(ckpt["client_states"], ckpt["bytes"])
        if self.accountant is not None:
            self.accountant.load_state_dict(ckpt.get("privacy", {}))
        torch.set_rng_state(ckpt["torch_rng"])
        if self.clock is not None:
            self.clock.now = float(ckpt["clock"])
        if self.flight is not None:
            self.flight.load_state_dict(ckpt["flight"])
        self.record.restore(ckpt)
        self.start_round = int(ckpt["round"]) + 1

    # ------------------------------------------------------------------ the end
    def finish(self) -> dict:
        summary = {**self.record.summary(), "status": "finished"}
        empty = sum(1 for r in self.record.writer.rows if r.get("clients") and r.get("dropped") == r["clients"])
        if empty and self.flight is None:
            summary["rounds_without_updates"] = empty
        if self.clock is not None:
            summary.update(self.clock.summary(self.record.writer.rows, self.cfg.system.target_accuracy))
        summary.update(self._after_training(summary["final_accuracy"], summary.get("final_local_accuracy")))
        if self.local_tests is not None and int(self.cfg.eval.local_clients):  # the per-client figures: a sample's
            summary["local_eval_clients"] = len(self.locally_evaluated(int(self.cfg.rounds)))
        if self.algorithm.unshared:  # the server's model is no client's: its accuracy is not the method's
            summary["server_model_unshared"] = self.algorithm.unshared
        self.dispatch.await_restarts()  # actors killed in the last round (faults) are asked where they run
        summary.update(self._where_trained())
        summary["eval_where"] = self.test_set.where or "server"
        if self.dispatch.gpu_packing is not None:
            summary["gpu_packing"] = self.dispatch.gpu_packing
        if self.accountant is not None:
            a = self.accountant
            spent = a.epsilon(int(self.cfg.rounds))  # inf without noise: null in JSON, which has no infinity
            summary.update({"dp_epsilon": spent if math.isfinite(spent) else None, "dp_delta": a.delta,
                            "dp_noise_multiplier": a.noise_multiplier, "dp_clip": a.clip})
        states = self.dispatch.states
        if len(states):  # the clients ever picked, not every client (issue 73)
            summary.update(client_states=len(states), client_state_gb=(states.memory_held + states.disk_bytes) / 2**30)
            self.record.log(f"client states: {len(states)} kept by the server, {states.on_disk} of them on disk "
                            f"({states.disk_bytes / 2**20:.1f} MB; resources.client_state_gb), "
                            f"{states.memory_held / 2**30:.3f} GB in memory")
        self.record.finish(summary, self.algorithm.state_dict())
        self.dispatch.release()
        return summary

    def _after_training(self, last_round_accuracy: Optional[float], last_round_local: Optional[float] = None) -> dict:
        """The algorithm's post-hoc step (`Algorithm.after_training`, e.g. CCVR's calibration),
        its models evaluated on the test set: summary fields. The first model's accuracy is
        the run's `final_accuracy` (and shot groups), and it serves the clients' own test splits
        (`final_local_accuracy`: it is the model the run ends with); the last round's are kept
        beside them (`final_round_accuracy`, `final_round_local_accuracy`)."""
        rnd = int(self.cfg.rounds)
        self.record.new_round()
        t0 = time.time()
        models = self.algorithm.after_training(self) or {}
        self.record.clients_only()  # the calls it made, in the clients table under the last round
        if not models:
            return {}
        if self.cfg.eval.tau_norm:
            models = {name: tau_normalised(m, float(self.cfg.eval.tau_norm)) for name, m in models.items()}
        self._check_finite(rnd, {}, models)
        out: dict = {"final_round_accuracy": last_round_accuracy, "after_training": {}}
        for i, (name, ev) in enumerate(zip(models, self.test_set.evaluate(list(models.values())))):
            out["after_training"][name] = {"accuracy": ev["accuracy"], "loss": ev["loss"],
                                           "per_class_accuracy": ev["per_class_accuracy"]}
            if i == 0:
                out["final_accuracy"] = ev["accuracy"]
                if self.shots is not None:
                    out.update({f"final_{k}": v for k, v in
                                shot_accuracy(ev["per_class_accuracy"], self.test_counts, self.shots).items()})
        first = next(iter(models))
        if self.local_tests is not None:
            cids = self.locally_evaluated(rnd)  # as the last round's
            local, _ = self.local_tests.evaluate(models, {first: cids})
            out.update(final_local_accuracy=local["local_accuracy"], final_round_local_accuracy=last_round_local)
        last = "-" if last_round_accuracy is None else f"{last_round_accuracy:.4f}"
        self.record.log(f"after training: {first} accuracy={out['final_accuracy']:.4f} (the last round's: {last}), "
                        f"{time.time() - t0:.2f} s")
        return out

    def state_bytes(self) -> dict:
        """{part: bytes} of what this server holds (runtime/footprint.py), the dispatch's and the
        record's parts one by one: benchmarks/scale.py's state per idle client."""
        from raysim.runtime.footprint import parts_bytes

        return parts_bytes(self, expand=("record", "record.writer", "dispatch"))

    def stop_actors(self) -> None:
        if hasattr(self, "dispatch"):
            self.dispatch.stop()

    def flush(self) -> None:
        """Write the metrics of the rounds so far (the run is being stopped early)."""
        if hasattr(self, "record"):
            self.record.flush()

    def log_failure(self, rnd: int, text: str) -> None:
        """An exception stopped round `rnd`: its full traceback goes into log.txt."""
        if hasattr(self, "record"):
            self.record.log_failure(rnd, text)

    def actor_info(self) -> list[dict]:
        return self.dispatch.actor_info()


def cohort_label_counts(selected: list[int], true_counts, reported: dict) -> np.ndarray:
    """The selected clients' training-label counts, summed: rows of `true_counts` (a table held
    for every client), or, for a population made when picked (`true_counts` then makes users:
    `Population.label_counts`), the counts its clients reported with their updates (`reported`,
    cid: counts), the users made again only for those that did not report (dropped, lost)."""
    if isinstance(true_counts, np.ndarray):
        return true_counts[selected].sum(0)
    total = true_counts([c for c in selected if c not in reported]).sum(0)  # none missing: zeros
    for c in selected:
        if c in reported:
            total += reported[c]
    return total


def weight_rms(tensors: list) -> float:
    """The root mean square of every entry of `tensors` (a model's floating-point state), in
    float64: a trained network's is well under 1; one whose weights blew up, orders above."""
    total = sum(float(t.detach().double().pow(2).sum()) for t in tensors)
    count = sum(t.numel() for t in tensors)
    return math.sqrt(total / count) if count else 0.0


def collapsed(accuracies: list[float], num_classes: int) -> bool:
    """A run's test accuracies so far (one per evaluation) say its model collapsed to chance:
    the last three at most 1.5 / classes, after an earlier one reached 3 / classes."""
    chance = 1.0 / num_classes
    earlier, last = accuracies[:-3], accuracies[-3:]
    eps = 1e-9  # 3 / 10 is 0.30000000000000004 in floats
    return (len(last) == 3 and bool(earlier) and max(earlier) >= 3 * chance - eps
            and all(a <= 1.5 * chance + eps for a in last))


def serves_clients(cls) -> bool:
    """Whether an algorithm's server model is the model its clients are served: not for a
    personalised method whose server model is no client's (`Algorithm.unshared`), nor for a
    clustered one (`Algorithm.serving` overridden), whose "global" model is the mean of its
    group models (FeSEM's sat at 10-13 % on mnist_c2 while its clients scored 87-90 %)."""
    from raysim.contract import Algorithm

    return not cls.unshared and cls.serving is Algorithm.serving
