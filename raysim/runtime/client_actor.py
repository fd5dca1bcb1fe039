"""Client actors: long-lived workers that run the client half of an algorithm for many
simulated clients.

An actor maps the dataset arrays from the object store once (zero-copy on the node; moved
to its GPU once when it has one) and slices a client's shard from them when that client
runs. Per-client state travels as an object-store reference owned by the driver, so any
actor can run any client and the state outlives the actor that wrote it.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import ray
import torch
from omegaconf import OmegaConf

from raysim.algorithm import Client
from raysim.models import build_model
from raysim.registry import ALGORITHMS, SELECTIONS, import_modules
from raysim.runtime.wire import pack, unpack
from raysim.training import seed_for


class ClientActor:
    def __init__(self, cfg: dict, data_refs: list, num_classes: int):
        """`data_refs` = [train arrays, per-client train indices], as object-store references
        (inside a list, so Ray passes the references): on a restart the actor maps them again."""
        arrays, train_index = ray.get(data_refs)
        self.cfg = OmegaConf.create(cfg)
        import_modules(self.cfg.plugins)
        torch.set_num_threads(int(self.cfg.resources.torch_threads))
        gpu = bool(ray.get_gpu_ids()) and torch.cuda.is_available()
        self.device = torch.device("cuda" if gpu else "cpu")
        with warnings.catch_warnings():  # object-store arrays are read-only; we never write them
            warnings.simplefilter("ignore", UserWarning)
            self.x = torch.from_numpy(arrays["x_train"]).to(self.device)
            self.y = torch.from_numpy(arrays["y_train"]).to(self.device)
        self.train_index = train_index
        self.num_classes = num_classes
        shape = tuple(arrays["x_train"].shape[1:])
        self.plugins = {
            "algorithm": ALGORITHMS.get(self.cfg.algorithm)(self.cfg, num_classes, shape),
            "selection": SELECTIONS.get(self.cfg.selection)(self.cfg, int(self.cfg.num_clients), num_classes),
        }
        self.model = build_model(self.cfg.model, shape, num_classes).to(self.device)
        self._warm_up()

    def _warm_up(self) -> None:
        """One throw-away forward/backward pass: torch's first one costs ~1 s of lazy set-up,
        which should land in actor start-up (overlapping the driver's), not in round 1."""
        out = self.model(self.x[:2])
        out.sum().backward()
        self.model.zero_grad(set_to_none=True)

    def run(self, rnd: int, method: str, on: str, cids: list[int], payload, *states):
        """Run `on.method(client, payload)` for each client in order. Returns the results
        and, for a plugin with `client_state = True`, then the clients' new states, each
        as its own object (see `ServerDriver.run_clients`)."""
        plugin = self.plugins[on]
        stateful = bool(getattr(plugin, "client_state", False))
        states = states if stateful else [None] * len(cids)
        fn = getattr(plugin, method)
        payload = unpack(payload)
        f = self.cfg.faults
        results, new_states = [], []
        for cid, state in zip(cids, states):
            if rnd == f.crash_round and cid == f.crash_client:
                os._exit(1)  # injected fault: this worker process dies mid-round
            idx = torch.from_numpy(np.asarray(self.train_index[cid])).to(self.device)
            seed = seed_for(int(self.cfg.seed), rnd, cid)
            torch.random.default_generator.manual_seed(seed)  # torch.manual_seed also walks CUDA: slow
            if self.device.type == "cuda":
                torch.cuda.manual_seed(seed)
            client = Client(
                cid=cid, round=rnd, cfg=self.cfg, x=self.x[idx], y=self.y[idx], num_classes=self.num_classes,
                device=self.device, generator=torch.Generator().manual_seed(seed),
                state=unpack(state) if state else {}, model=self.model,
            )
            results.append(pack(fn(client, payload)))
            if stateful:
                new_states.append(pack(client.state) if client.state else None)
            elif client.state:
                raise RuntimeError(f"{type(plugin).__name__} wrote client.state but does not declare "
                                   "client_state = True, so the state would be lost")
        out = tuple(results + new_states)
        return out if len(out) > 1 else out[0]

    def device_info(self) -> dict:
        info = {"device": str(self.device), "pid": os.getpid()}
        if self.device.type == "cuda":
            info["gpu_memory_bytes"] = torch.cuda.memory_allocated()
        return info


def start_client_actors(cfg, train_ref, index_ref, num_classes: int) -> list:
    """Start the client actors (how many: `placement.num_actors`), each reserving its CPU
    share and GPU fraction, restarted by Ray if its process dies."""
    from raysim.runtime.placement import num_actors

    res = cfg.resources
    total = ray.cluster_resources()
    n = num_actors(cfg, total.get("CPU", 1), total.get("GPU", 0))
    cls = ray.remote(ClientActor).options(
        num_cpus=float(res.num_cpus_per_actor), num_gpus=float(res.num_gpus_per_actor),
        max_restarts=-1, max_task_retries=0,
    )
    plain = OmegaConf.to_container(cfg)
    # Ray warns that a restart needs these references alive: the driver holds them all run.
    return [cls.remote(plain, [train_ref, index_ref], num_classes) for _ in range(n)]
