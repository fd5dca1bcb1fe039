"""`data_store=files` on hosts that share no folder: each host copies the stored arrays it
needs from the host that wrote them, once, the first time a client actor there attaches.

The server writes the training arrays as files on its own host (data/store.py) and hands
the client actors their manifest, with the Ray node that wrote them. An actor on another
node whose file system does not have the folder (no shared mount) copies each `.npy` file
over Ray: small tasks pinned to the writer's node (`num_cpus=0`, so a cluster whose CPUs
the actors hold still runs them) read pieces of the file, which come back through Ray's
object store and are written into the same folder path on this host (or, when that path
cannot be made here, `$RAYSIM_CACHE_DIR/arrays`). Every 64 MB block is checked against the
manifest's SHA-256 as it arrives, and the folder is renamed into place whole, so a host
has all of a copy or none. Actors of one host take a file lock: the first copies, the
others wait and map its copy. A later run with the same data on that host finds the copy
(the folder is named by the content) and sends nothing.

What this costs: the training files cross the links once per host (not per round, not per
actor); after that a round moves the model (benchmarks/cluster.py measures both). With
`data_store=memory`, the default on several nodes, Ray's object store does the same by
itself. Files raysim did not write (a Hugging Face Arrow cache read in place) are not
copied: name a shared folder or use data_store=memory for those.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysim.data import store
from raysim.errors import ConfigError

PIECE = 8 * 2**20  # bytes a task reads at once (divides store.BLOCK: a piece lies in one block)
IN_FLIGHT = 8  # pieces asked for at once


@ray.remote(num_cpus=0, max_retries=0)
def _layout(paths: list[str]) -> list[tuple[int, int]]:
    """(file size, byte where the array's data start) of each `.npy` file, on the writer's host."""
    out = []
    for path in paths:
        a = np.load(path, mmap_mode="r", allow_pickle=False)  # the header only
        out.append((os.path.getsize(path), int(a.offset)))
        del a
    return out


@ray.remote(num_cpus=0, max_retries=0)
def _piece(path: str, at: int, size: int) -> bytes:
    with open(path, "rb", buffering=0) as f:
        f.seek(at)
        return f.read(size)


def on_this_host(manifest: dict) -> dict:
    """The manifest of the stored arrays as this host reads them: the writer's own when this
    is the writer's node or its folder is here (one machine, a shared mount), else that of a
    copy made here now (or by an earlier actor or run on this host)."""
    node = manifest.get("node")
    copied = {n: e for n, e in manifest["arrays"].items() if "segments" not in e}
    folder = Path(manifest["folder"])
    if (node is None or node == ray.get_runtime_context().get_node_id()
            or all((folder / f"{n}.npy").is_file() for n in copied)):
        return manifest
    where = folder.parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        lock = open(where / f".{folder.name}.lock", "w")
    except OSError:  # that path cannot be made on this host: its own cache
        from raysim.data.cache import cache_dir

        where = cache_dir() / "arrays"
        where.mkdir(parents=True, exist_ok=True)
        lock = open(where / f".{folder.name}.lock", "w")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one actor of this host copies; the others find its copy
        local = store.find(where, folder.name)
        if local is None:
            local = _copy(manifest, copied, where)
    return {**manifest, **local, "arrays": {**manifest["arrays"], **local["arrays"]}, "node": None}


def _copy(manifest: dict, entries: dict, where: Path) -> dict:
    folder, node = Path(manifest["folder"]), manifest["node"]
    pinned = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}
    paths = [str(folder / f"{n}.npy") for n in entries]
    t0, nbytes = time.perf_counter(), 0
    try:
        layout = ray.get(_layout.options(**pinned).remote(paths))
    except Exception as e:
        raise _lost(folder, node, e) from None
    writer = store.Writer(where, folder.name)
    try:
        for (name, entry), path, (size, offset) in zip(entries.items(), paths, layout):
            blocks = _fetch(path, size, offset, writer.tmp / f"{name}.npy", pinned, folder, node)
            if blocks != entry["blocks"]:
                raise ConfigError(f"data_store=files: {path} on node {node[:8]} no longer holds what raysim wrote "
                                  f"there (its copy on host {ray.util.get_node_ip_address()} has other bytes); "
                                  f"delete the folder {folder} and run again")
            nbytes += size
        local = writer.install({n: {"shape": e["shape"], "dtype": e["dtype"], "blocks": e["blocks"]}
                                for n, e in entries.items()})
    except BaseException:
        writer.abandon()
        raise
    print(f"raysim: host {ray.util.get_node_ip_address()} copied the training data ({nbytes / 2**20:.1f} MB) from "
          f"node {node[:8]} in {time.perf_counter() - t0:.1f} s into {local['folder']} (data_store=files, "
          "no shared folder)", file=sys.stderr, flush=True)
    return local


def _fetch(path: str, size: int, offset: int, into: Path, pinned: dict, folder: Path, node: str) -> list[str]:
    """Copy the file at `path` on the writer's node into `into`; the SHA-256 of its data's
    64 MB blocks (store.BLOCK), as the manifest has them."""
    spans = [(0, offset)] + [(at, min(PIECE, size - at)) for at in range(offset, size, PIECE)]
    hashes, block, block_end = [], hashlib.sha256(), offset + store.BLOCK
    with open(into, "wb") as out:
        def take() -> None:
            nonlocal block, block_end
            (at, want), ref = pending.popleft()
            try:
                data = ray.get(ref)
            except Exception as e:
                raise _lost(folder, node, e) from None
            if len(data) != want:
                raise ConfigError(f"data_store=files: {path} on node {node[:8]} is shorter than when raysim wrote "
                                  f"it; delete the folder {folder} and run again")
            out.write(data)
            if at >= offset:
                block.update(data)
                if at + want >= min(block_end, size):  # a block's last piece
                    hashes.append(block.hexdigest())
                    block, block_end = hashlib.sha256(), block_end + store.BLOCK

        pending = deque()
        for span in spans:
            pending.append((span, _piece.options(**pinned).remote(path, *span)))
            if len(pending) >= IN_FLIGHT:
                take()
        while pending:
            take()
    return hashes or [hashlib.sha256(b"").hexdigest()]


def _lost(folder: Path, node: str, e: Exception) -> ConfigError:
    return ConfigError(f"data_store=files: could not copy {folder} from node {node[:8]}, where the server wrote it "
                       f"({type(e).__name__}); name a folder every node reads as data_store_dir, or use "
                       "data_store=memory")
