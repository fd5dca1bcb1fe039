"""Client actors: long-lived workers that run the client half of an algorithm for many
simulated clients.

An actor starts while the server is still loading the data, then maps the dataset arrays
from the object store on its first call (zero-copy on the node; moved to its GPU once when
it has one) and slices a client's shard from them when that client runs. Per-client state
comes with each call and goes back with its results (the server keeps it:
runtime/state_store.py), so any actor can run any client and the state outlives the actor,
and the host, that wrote it.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Optional

import numpy as np
from raysim.lazy_ray import ray
import torch
from omegaconf import OmegaConf

from raysim.attacks import Adversaries
from raysim.compression.uplink import Uplink
from raysim.contract import Client
from raysim.config import augmentation_name
from raysim.data.augment import make_transform
from raysim.data.datasets import model_inputs
from raysim.registry import ALGORITHMS, SELECTIONS, import_modules
from raysim.runtime import determinism
from raysim.seeds import seeds_for
from raysim.wire import pack, unpack
from raysim.training import client_method, evaluate, new_client, partial_sum
from raysim.vectorized import Cohort, group_sum, unstack


class DataNotAttached(RuntimeError):
    """A call reached an actor without data: Ray restarted it while it was idle."""


class ClientRunner:
    """The work of one client actor (its Ray shell is runtime/clients.py's `ClientActor`)."""

    def __init__(self, here: bool = False):
        """Starts before the data exists (the server loads it meanwhile): imports torch and
        warms it up. Everything of a run (config, plugins, data) comes with the run's first
        call, so the actor can serve later runs too (runtime/pool.py) and Ray can restart it.
        `here`: in the server's own process, without Ray (runtime/here.py), on the CPU."""
        determinism.before_cuda()
        self.here = here
        self.fetch = None  # what reads the data references: ray.get, or here.get (set by here.HereActor)
        gpu = not here and bool(ray.get_gpu_ids()) and torch.cuda.is_available()
        self.device = torch.device("cuda" if gpu else "cpu")
        self.x = None
        self.population = None
        self._reader = None  # data_store=files: the thread that reads the next client's rows (_read_ahead)
        _warm_up(self.device)

    def _attach(self, cfg: dict, data_refs: list, num_classes: int, norm: Optional[tuple],
                pixel_max: Optional[float]) -> None:
        """Take the run's config and plugins, map the training arrays (zero-copy from the
        object store; copied once to the GPU when the actor has one) and build the plugins
        and the scratch model. Runs on a run's first call to this actor, and again on the
        first call after Ray restarted it."""
        self.cfg = OmegaConf.create(cfg)
        determinism.apply(self.cfg.determinism)  # before the run's first CUDA work in this actor
        import_modules(self.cfg.plugins)
        torch.set_num_threads(int(self.cfg.resources.torch_threads))
        arrays, train_index = (self.fetch or ray.get)(data_refs)
        self.population = arrays.get("population")  # users made when picked (data/population.py)
        if self.population is not None:
            from raysim.data.population import LazyRows

            self.x, self.y = LazyRows(self.population, "x"), None
            shape = self.population.input_shape
        elif "folder" in arrays:  # data_store=files: the manifest; a client's rows are read when it trains
            from raysim.data import replicate, store

            arrays = replicate.on_this_host(arrays)  # copied here first if this host does not see the folder
            self.x = store.Rows(arrays, "x_train")
            self.y = torch.from_numpy(np.array(store.open_arrays(arrays)["y_train"]))  # labels: small, read whole
            shape = self.x.shape[1:]
        else:
            with warnings.catch_warnings():  # object-store arrays are read-only; we never write them
                warnings.simplefilter("ignore", UserWarning)
                self.x = torch.from_numpy(arrays["x_train"]).to(self.device)  # moved to a GPU once, whole
                self.y = torch.from_numpy(arrays["y_train"]).to(self.device)
            shape = tuple(arrays["x_train"].shape[1:])
        self.train_index = train_index
        self.num_classes = num_classes
        self.seed = int(self.cfg.seed)  # read once: an OmegaConf lookup costs ~25 us, per client adds up
        self.crash = (int(self.cfg.faults.crash_round), int(self.cfg.faults.crash_client))
        self.redo = False  # run(redo=True): a lost call made again; an injected crash does not strike twice
        self.pixels = (pixel_max, norm)  # images stay uint8 here; a client's shard is decoded when it trains
        self.plugins = {
            "algorithm": ALGORITHMS.get(self.cfg.algorithm)(self.cfg, num_classes, shape),
            "selection": SELECTIONS.get(self.cfg.selection)(self.cfg, int(self.cfg.num_clients), num_classes),
        }
        self.model = self.plugins["algorithm"].build_model(shape).to(self.device)
        self.transform = make_transform(augmentation_name(self.cfg.local.augment), norm)
        self.adversaries = Adversaries(self.cfg, int(self.cfg.num_clients))  # attack.* (raysim/attacks.py)
        self.uplink = Uplink.from_config(self.cfg, self.model)  # compress.up (raysim/compression/uplink.py)

    def run(self, data: Optional[tuple], rnd: int, method: str, on: str, cids: list[int], epochs: list[int],
            group: int, blocks: Optional[list[int]], vectorized: bool, sums: bool, payload,
            states: Optional[list] = None, redo: bool = False):
        """Run `on.method(client, payload)` for each client in order, or, `vectorized`
        (`local.vectorize`), `client_update_cohort` once per block of `cids` (`blocks`: the
        sizes of consecutive blocks, placed whole). With `sums` (`server.partial_sums`), each
        block's results are folded into one (`training.partial_sum`).

        Returns the results in lists of `group` (one object each: a few objects for many
        small updates, one per client for big ones) and, for a plugin with
        `client_state = True` (`states`: each client's state, or None), then one object: the
        list of the clients' new states, None where a call left a state as it was (see
        `Dispatch.run`, runtime/dispatch.py; the server keeps them, runtime/state_store.py). `data` = (config, [train arrays ref, train index ref],
        num_classes, normalisation, pixel_max) on a run's first call to this actor and the first after a
        restart, else None: references cost a little on every call that carries them. `redo`:
        the call again, after the actor that had it was lost (`faults.crash_*` does not strike
        twice)."""
        if data is not None:
            self._attach(*data)
        elif self.x is None:
            raise DataNotAttached("client actor has no data (restarted since its last call)")
        self.redo = redo
        plugin = self.plugins[on]
        uplink = self.uplink if self.uplink is not None and Uplink.applies(method, on) else None
        stateful = bool(plugin.client_state) or (uplink is not None and uplink.keeps_state(method, on))
        states = states if stateful and states is not None else [None] * len(cids)
        payload = unpack(payload)
        results, new_states = [], []
        parts = _split(list(zip(cids, epochs, states)), blocks if vectorized else None)
        reads = self._read_ahead(parts)
        for part in parts:
            # built just before training: each client seeds torch's RNG
            raw = next(reads)
            part = self._cohort(rnd, part, raw) if vectorized else [self._client(rnd, *part[0], raw=raw)]
            # a population made when picked: the clients' true label counts go back with their results,
            # so the server need not make the cohort again for its label mix (taken before any attack)
            counts = (_label_counts(part, self.num_classes) if self.population is not None and method == "client_update"
                      else [None] * len(part))
            attacked = bool(self.adversaries.who)  # no attacker, no step per client for them (a group of 500)
            for client in part if attacked else ():
                self.adversaries.before(client, rnd, method)
            if attacked and vectorized and any(self.adversaries.attacking(c.cid, rnd, method) for c in part):
                part.y = torch.cat([c.y for c in part])  # a label-flipping attacker's labels, in the group's too
            residuals = [uplink.hide(c) for c in part] if uplink else [None] * len(part)  # compress.error_feedback's
            # the old values, so identity checks below are sound
            before = [dict(c.state) for c in part] if stateful else [None] * len(part)
            t0 = time.perf_counter()
            if vectorized:
                done = plugin.client_update_cohort(part, payload)
            else:
                done = [client_method(plugin, method)(part[0], payload)]
            done, stacked = unstack(done, sums, attacked and any(self.adversaries.changes_model(c.cid, rnd, method)
                                                                 for c in part))
            seconds = (time.perf_counter() - t0) / len(part)  # a group's time, shared by its clients
            for client, result, old, residual, labels in zip(part, done, before, residuals, counts):
                if labels is not None:
                    result.metrics["label_counts"] = labels
                if attacked:
                    result = self.adversaries.after(client, payload, result, rnd, method)
                if uplink is not None:
                    result = uplink.send(client, payload, result, rnd, residual, plugin)
                result.metrics.setdefault("seconds", seconds)
                if stateful:
                    # a state the call did not touch is not sent back: the server keeps what it has
                    # (big cached state, e.g. FedConcat's features, is not copied back every round)
                    result.state_changed = (client.state.keys() != old.keys()
                                            or any(client.state[k] is not v for k, v in old.items()))
                    new_states.append(pack(client.state) if client.state and result.state_changed else None)
                results.append(result)
                if not stateful and client.state:
                    raise RuntimeError(f"{type(plugin).__name__} wrote client.state but does not declare "
                                       "client_state = True, so the state would be lost")
            if sums and vectorized:  # the group's sum, made here, on the device it trained on
                results[len(results) - len(part):] = [group_sum(stacked, results[len(results) - len(part):])]
        if sums and not vectorized:
            results = [partial_sum(block) for block in _split(results, blocks)]
        results = [pack(r) for r in results]
        out = [results[i:i + group] for i in range(0, len(results), group)] + ([new_states] if stateful else [])
        return tuple(out) if len(out) > 1 else out[0]

    def _client(self, rnd: int, cid: int, n_epochs: int, state, x: Optional[torch.Tensor] = None,
                y: Optional[torch.Tensor] = None, raw: Optional[np.ndarray] = None,
                client_seed: Optional[int] = None, seed_torch: bool = True) -> Client:
        """Client `cid` in round `rnd`: its shard (`x`, `y` when the caller has cut it; `raw`:
        its inputs read ahead from files), its generator seeded from (seed, round, cid)."""
        if (rnd, cid) == self.crash and not self.redo and not self.here:
            os._exit(1)  # injected fault: this worker process dies mid-round
        if x is None:
            x, y = self._rows(np.asarray(self.train_index[cid]), raw)
        return new_client(self.cfg, rnd, cid, x, y, self.num_classes, unpack(state) if state else {}, self.model,
                          n_epochs, self.transform, self.seed, client_seed, seed_torch)

    def _cohort(self, rnd: int, part: list[tuple], raw: Optional[np.ndarray] = None) -> Cohort:
        """A vectorised group's clients (`part`: (cid, epochs, state) each): their samples
        gathered and decoded once for the group; each client's shard a view of them."""
        cids = np.asarray([cid for cid, _, _ in part], dtype=np.int64)
        # gathered even where each client's rows are consecutive in the arrays: the group's rows read
        # in order into a compact copy, then each step's batch from it, beat each step's batch taken
        # from the arrays themselves (500 clients of 2,000, 2 actors: 56 against 63 ms a round, issue 73)
        x, y = self._rows(self.train_index.rows(cids), raw)  # train_index: a Shards (data/partition.py)
        sizes = self.train_index.sizes_of(cids).tolist()
        xs, ys = torch.split(x, sizes), torch.split(y, sizes)  # every client's view in one call: 10x slicing's speed
        last = len(part) - 1  # torch's default generator: seeded once, for the last client (as in turn it ends so)
        clients = [self._client(rnd, cid, n_epochs, state, cx, cy, client_seed=seed, seed_torch=i == last)
                   for i, ((cid, n_epochs, state), cx, cy, seed)
                   in enumerate(zip(part, xs, ys, seeds_for(self.seed, rnd, cids).tolist()))]
        return Cohort(clients, x, y)

    def _read_ahead(self, parts: list[list]):
        """With data in files: each part's inputs read from them (`Rows.take`) on a thread of
        its own, the next part's while this one trains (I/O under compute: the 30 GB set of
        issue 42, cold, measured); two parts read at most. Yields None per part otherwise."""
        if isinstance(self.x, torch.Tensor) or self.population is not None:
            yield from (None for _ in parts)
            return
        if self._reader is None:
            from concurrent.futures import ThreadPoolExecutor

            self._reader = ThreadPoolExecutor(1, thread_name_prefix="raysim-read-ahead")
        rows = [self.train_index.rows([cid for cid, _, _ in part]) for part in parts]
        ahead = [self._reader.submit(self.x.take, r) for r in rows[:2]]
        for k in range(len(parts)):
            got = ahead[k].result()
            if k + 2 < len(rows):
                ahead.append(self._reader.submit(self.x.take, rows[k + 2]))
            ahead[k] = None
            yield got

    def _rows(self, rows: np.ndarray, raw: Optional[np.ndarray] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Training samples `rows`, decoded, on the device: gathered from the arrays this actor
        holds, or (`data_store=files`) those `_read_ahead` read from the files (`raw`), or made
        (a population made when picked)."""
        if self.population is not None:
            x, y = self.population.rows(rows)
            return model_inputs(torch.from_numpy(x).to(self.device), *self.pixels), torch.from_numpy(y).to(self.device)
        if self.y.device.type == "cpu":  # numpy's take: 2x torch's index_select for a group's 100,000 rows
            x = torch.from_numpy(np.take(self.x.numpy(), rows, axis=0)) if raw is None else torch.from_numpy(raw)
            y = torch.from_numpy(np.take(self.y.numpy(), rows))
        else:
            index = torch.from_numpy(rows).to(self.y.device)
            x = self.x.index_select(0, index) if raw is None else torch.from_numpy(raw)
            y = self.y.index_select(0, index)
        return model_inputs(x.to(self.device), *self.pixels), y.to(self.device)

    def probe_memory(self, *args, **kwargs) -> dict:
        """`run(*args)` once, measuring the GPU memory it takes (`resources.num_gpus_per_actor=auto`,
        runtime/gpu_packing.py): the device's total, what it held beyond torch's cache before
        (this process's CUDA context, and any other process's), and torch's peak reserved and
        allocated during the call. The results are thrown away. On a CPU: {"device": "cpu"}."""
        if self.device.type != "cuda":
            return {"device": str(self.device)}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        context = (total - free) - torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        out = {"device": str(self.device), "total": total, "context": context}
        try:
            self.run(*args, **kwargs)
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            out["oom"] = True
        out.update(peak_reserved=torch.cuda.max_memory_reserved(), peak_allocated=torch.cuda.max_memory_allocated())
        torch.cuda.empty_cache()
        return out

    def evaluate(self, test: list, models: list, num_classes: int) -> list[dict]:
        """`training.evaluate` of each model on the test set, on this actor's device (its GPU:
        runtime/remote_eval.py). `test`: [a reference to (x_test, y_test)], inside a list so
        that Ray hands over the reference, not the value: the set is moved to the device on
        the first call and kept for the run's later ones."""
        if self.x is None:
            raise DataNotAttached("client actor has no data (restarted since its last call)")
        key = test[0].hex()  # a new run puts its own set
        if getattr(self, "_test_key", None) != key:
            x, y = (self.fetch or ray.get)(test[0])
            self._test = (x.to(self.device), y.to(self.device))
            self._test_key = key
        return [evaluate(m.to(self.device), *self._test, num_classes) for m in models]

    def die(self) -> None:
        """Fault injection (`faults.kill_fraction`): this actor's process exits now."""
        if self.here:  # the server's process: faults.* need client actors (here.cannot)
            raise RuntimeError("faults.* kill client actors' processes; the clients train in the server's")
        os._exit(1)

    def device_info(self) -> dict:
        where = ({"node_id": "this process", "node_ip": "127.0.0.1"} if self.here else
                 {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()})
        info = {"device": str(self.device), "pid": os.getpid(), **where, **determinism.settings(),
                "processor": determinism.processor(self.device), "torch": torch.__version__}
        if self.device.type == "cuda":
            info["gpu_memory_bytes"] = torch.cuda.memory_allocated()
        return info


def _label_counts(clients: list[Client], num_classes: int) -> list[np.ndarray]:
    """Each client's training-label counts (one bincount for a group of them)."""
    y = torch.cat([c.y for c in clients]).cpu()
    owner = torch.repeat_interleave(torch.arange(len(clients)), torch.tensor([c.num_samples for c in clients]))
    return list(torch.bincount(owner * num_classes + y, minlength=len(clients) * num_classes)
                .view(len(clients), num_classes).numpy())


def _split(items: list, sizes: Optional[list[int]]) -> list[list]:
    """One item per part, or consecutive parts of the given sizes."""
    if sizes is None:
        return [[x] for x in items]
    starts = np.cumsum([0, *sizes]).tolist()
    return [items[a:b] for a, b in zip(starts, starts[1:])]


def _warm_up(device: torch.device) -> None:
    """Throw-away forward/backward passes: torch's first ones cost ~1 s of lazy set-up,
    which belongs in actor start-up (overlapping the server's data loading), not round 1."""
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8, 2)).to(device)
    out = net(torch.zeros(2, 1, 4, 4, device=device))
    torch.nn.functional.cross_entropy(out, torch.zeros(2, dtype=torch.long, device=device)).backward()
