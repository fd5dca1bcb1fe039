"""How many client actors to start, and which actor runs which client this round.

Any actor can run any client (the data is shared through the object store and client
state travels by reference), so placement is only about balance: each round's cohort,
sorted by client id, is cut into contiguous runs of roughly equal work, one per actor.
With `clients_per_actor: 1` there is one actor per client and client i always runs on
actor i (the literal one-process-per-client model). A call too big to have in flight at
once (thousands of updates and states) is cut into pieces dealt to the actors in turn
(`waves`). Results never depend on placement.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import numpy as np
from omegaconf import DictConfig


def gpus_per_actor(r) -> float:
    """`resources.num_gpus_per_actor` as a number: `auto` before its measurement
    (runtime/gpu_packing.py) counts as none."""
    return 0.0 if r.num_gpus_per_actor == "auto" else float(r.num_gpus_per_actor)


def num_actors(cfg: DictConfig, cluster_cpus: float, cluster_gpus: float) -> int:
    n = int(cfg.num_clients)
    r = cfg.resources
    gpus = gpus_per_actor(r)
    if r.num_actors is not None:  # an autoscaling cluster grows until they all fit
        return min(n, int(r.num_actors))
    if r.clients_per_actor != "auto":
        return math.ceil(n / int(r.clients_per_actor))
    cpus = 1.0 if r.num_cpus_per_actor is None else float(r.num_cpus_per_actor)
    fits = []
    if cpus > 0:
        fits.append(int(cluster_cpus // cpus))
    if gpus > 0:
        fits.append(int(cluster_gpus // gpus))
    if not fits:  # 0 CPUs and no GPU each: nothing bounds the count; one per CPU, as the default
        fits.append(int(max(cluster_cpus, 1)))
    return max(1, min([n, *fits]))


def why_actors(cfg: DictConfig, n_actors: int, cluster_cpus: float, cluster_gpus: float) -> str:
    """Why `num_actors` chose that many, for the run's log."""
    r = cfg.resources
    if r.num_actors is not None:
        return f"resources.num_actors={r.num_actors}"
    if r.clients_per_actor != "auto":
        return f"resources.clients_per_actor={r.clients_per_actor}"
    if n_actors == int(cfg.num_clients):
        return "one per client: the cluster holds that many"
    gpus = gpus_per_actor(r)
    cpus = 1.0 if r.num_cpus_per_actor is None else float(r.num_cpus_per_actor)
    if cpus == 0 and not gpus:
        return (f"resources.num_cpus_per_actor=0 bounds nothing: one per CPU of the cluster's {cluster_cpus:g}; "
                "resources.num_actors sets the count")
    per = [f"{cluster_cpus:g} CPUs / {cpus:g}" if cpus > 0 else None,
           f"{cluster_gpus:g} GPUs / {gpus:g}" if gpus else None]
    return "as many as fit: " + " and ".join(p for p in per if p)


def cpus_per_actor(cfg: DictConfig, n_actors: int, cluster_cpus: float) -> float:
    """What each client actor reserves: `num_cpus_per_actor` when set; else 1 CPU, or an equal
    share of the CPUs when `clients_per_actor` asks for more actors than there are CPUs
    (one process per client on a laptop runs, slower, instead of waiting forever)."""
    r = cfg.resources
    if r.num_cpus_per_actor is not None:
        return float(r.num_cpus_per_actor)
    if r.num_actors is None and n_actors > cluster_cpus >= 1:
        return math.floor(cluster_cpus / n_actors * 1e4) / 1e4  # Ray keeps 4 decimals of a fraction
    return 1.0


def actors_that_fit(nodes: list[Mapping[str, float]], cpus: float, gpus: float) -> int:
    """How many actors of (cpus, gpus) the nodes' total resources can hold (each actor on one node)."""
    total = 0
    for res in nodes:
        fits = [int(res.get(kind, 0.0) / need + 1e-9) for kind, need in (("CPU", cpus), ("GPU", gpus)) if need > 0]
        total += min(fits) if fits else 10**9
    return total


def assign(cids: list[int], work: Mapping[int, float], n_actors: int, one_per_client: bool) -> list[tuple[int, list[int]]]:
    """Split the sorted cohort `cids` into (actor index, client ids) runs of similar total
    `work[cid]` (samples x epochs); contiguous so results can be folded in id order."""
    cids = sorted(cids)
    if one_per_client:
        return [(c, [c]) for c in cids]
    if not cids:
        return []
    w = np.asarray([work[c] for c in cids], dtype=np.float64)
    share = w / w.sum() * min(n_actors, len(cids))  # in units of one actor's fair load
    midpoint = np.cumsum(share) - share / 2  # a client goes to the actor its midpoint falls in
    chunk = np.minimum(midpoint.astype(int), n_actors - 1)
    out: dict[int, list[int]] = {}
    for c, a in zip(cids, chunk):
        out.setdefault(int(a), []).append(c)
    return sorted(out.items())


def plan(cids: list[int], work: Mapping[int, float], n_actors: int, one_per_client: bool,
         vector_group: int = 0) -> list[tuple[int, list[int], Optional[list[int]]]]:
    """(actor, its clients, the sizes of its vectorised groups or None) for each busy actor.
    `vector_group` > 0 (`local.vectorize`): the sorted cohort is cut into groups of that many
    clients by client id, and groups are placed whole, so a group's result does not depend on
    how many actors there are."""
    if not vector_group:
        return [(a, chunk, None) for a, chunk in assign(cids, work, n_actors, one_per_client)]
    cids = sorted(cids)
    groups = [cids[i:i + vector_group] for i in range(0, len(cids), vector_group)]
    units = assign(list(range(len(groups))), {i: sum(work[c] for c in g) for i, g in enumerate(groups)}, n_actors, False)
    return [(a, [c for i in idx for c in groups[i]], [len(groups[i]) for i in idx]) for a, idx in units]


def waves(cids: list[int], cost: Mapping[int, float], n_actors: int, wave: float,
          vector_group: int = 0) -> list[tuple[int, list[int], Optional[list[int]]]]:
    """A big call as pieces in client-id order, each of at most `wave` `cost` (bytes a
    client's update and state take through the object store; a piece has one unit at
    least), dealt to the actors in turn: (actor, its clients, its groups' sizes or None).
    Folded in id order, pieces dealt in turn come back from every actor alike, so the
    server can keep only a few in flight per actor (runtime/dispatch.py). `vector_group`
    > 0: groups cut from the sorted cohort as `plan` cuts them, placed whole."""
    cids = sorted(cids)
    size = vector_group or 1
    units = [cids[i:i + size] for i in range(0, len(cids), size)]
    pieces: list[list[list[int]]] = []
    held = 0.0
    for unit in units:
        c = sum(cost[x] for x in unit)
        if not pieces or held + c > wave:
            pieces.append([])
            held = 0.0
        pieces[-1].append(unit)
        held += c
    return [(k % n_actors, [x for u in piece for x in u], [len(u) for u in piece] if vector_group else None)
            for k, piece in enumerate(pieces)]


def store_notice(data_bytes: int, store_bytes: float) -> Optional[str]:
    """A warning when the training data take most of Ray's object store: what does not fit
    is spilled to disk and read back, which slows every round; None when they fit."""
    if not store_bytes or data_bytes <= 0.7 * store_bytes:
        return None
    return (f"the training data ({data_bytes / 2**30:.1f} GB) take {data_bytes / store_bytes:.0%} of Ray's object "
            f"store ({store_bytes / 2**30:.1f} GB): Ray spills what does not fit to disk, which slows every round; "
            "give it more room (ray.object_store_gb=..., on a local Ray) or use fewer or smaller clients")


def store_size_for(data_bytes: int, store_bytes: float, available_bytes: float, shm_bytes: float) -> Optional[int]:
    """The object store a local Ray should be restarted with so that the training data take
    at most 60 % of it (room for the rounds' models), in bytes rounded up to 0.5 GiB; None
    when the data fit the store already (at most 70 %, `store_notice`'s line) or no such store
    fits this machine: at most half of the memory available and 90 % of /dev/shm (Ray's
    store lives there)."""
    if not store_bytes or data_bytes <= 0.7 * store_bytes:
        return None
    half = 2**29
    want = -(-int(data_bytes / 0.6) // half) * half
    return want if want <= min(0.5 * available_bytes, 0.9 * shm_bytes) else None
