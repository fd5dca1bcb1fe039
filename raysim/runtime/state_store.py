"""Each stateful client's state, held by the server at about its own size (issue 58).

A stateful algorithm (SCAFFOLD's control variates, FedPer's heads, Ditto's personal
models) keeps one state per client between the rounds it is selected in. They used to be
one Ray object each: 10,000 FedPer heads of 7.9 KiB cost 199 KiB of memory per client (the
object's bookkeeping in the owner, the store and the raylet) and doubled the round, and
states larger than the object store spilled object by object, too slowly to finish.

Here the server keeps them itself: the packed state (raysim/wire.py: numpy arrays) of
each client in one dictionary, in memory up to `memory_bytes`, the least recently used
beyond it appended to one file in a folder of the run's own (pickled, protocol 5), read
back with one positioned read when the client is selected again. States travel to the
actors in the call's arguments and come back as the call's results: the object store
holds only a round's states in flight. What a state is, and so every model, is the same
whether it was in memory or on disk, and whatever the actors (tests/test_state_store.py).
A state rewritten leaves its old bytes in the file as garbage; the file is rewritten
when garbage passes both half of it and `COMPACT_BYTES`.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import socket
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from raysim.wire import Packed
from raysim.training import nbytes

COMPACT_BYTES = 256 * 2**20


def owned(state: Any) -> Any:
    """`state` with every array its own copy: an array Ray handed back may map the object
    store's buffer (read-only), which would pin the object there for as long as it is kept."""
    if isinstance(state, Packed):
        return Packed(state.array if state.array.flags.writeable and state.array.base is None
                      else np.array(state.array))
    if isinstance(state, np.ndarray):
        return state if state.flags.writeable and state.base is None else np.array(state)
    if isinstance(state, dict):
        return {k: owned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(owned(v) for v in state)
    return state


def state_memory_bytes(cfg) -> float:
    """How many bytes of client state the server keeps in memory: `resources.client_state_gb`,
    or by default the size of Ray's object store (where the states used to live: the memory
    a user sized for them), at most a third of the memory this machine has free now."""
    gb = cfg.resources.client_state_gb
    if gb is not None:
        return float(gb) * 2**30
    import psutil

    from raysim.lazy_ray import initialized, ray

    store = ray.cluster_resources().get("object_store_memory", 0) if initialized() else 0
    free = psutil.virtual_memory().available / 3
    return min(store, free) if store else free


def spill_folder() -> Path:
    """Where spilled states go: `$RAYSIM_CACHE_DIR/client-states` (a folder per run in it)."""
    from raysim.data.cache import cache_dir

    where = cache_dir() / "client-states"
    where.mkdir(parents=True, exist_ok=True)
    return where


def _remove_orphans(parent: Path) -> None:
    """Remove the spill folders that runs on this host left when they were killed before
    `close` (their process is gone); folders of other hosts (a shared cache) are theirs."""
    host = socket.gethostname()
    for folder in parent.glob("run-*"):
        made = re.fullmatch(r"run-(\d+)-(.+)-[a-z0-9_]+", folder.name)
        if made and made.group(2) == host and int(made.group(1)) != os.getpid() \
                and not Path(f"/proc/{made.group(1)}").exists():
            shutil.rmtree(folder, ignore_errors=True)


class ClientStates:
    """cid -> packed state: in memory up to `memory_bytes`, the rest in a file under
    `folder` (made when first needed, removed by `close`)."""

    def __init__(self, memory_bytes: float, folder: Optional[Path] = None):
        self.memory_bytes = memory_bytes
        self.folder_parent = folder
        self._memory: OrderedDict[int, Any] = OrderedDict()  # least recently used first
        self._sizes: dict[int, int] = {}
        self._held = 0  # bytes in memory
        self._disk: dict[int, tuple[int, int]] = {}  # cid -> (offset, length) in the file
        self._file: Optional[Path] = None
        self._fd: Optional[int] = None
        self._end = 0  # bytes written to the file
        self._garbage = 0  # of them, no longer any client's
        self.spilled_total = 0  # states written to disk so far (for the log)
        self.compactions = 0

    # ------------------------------------------------------------------ access
    def __contains__(self, cid: int) -> bool:
        return cid in self._memory or cid in self._disk

    def __len__(self) -> int:
        return len(self._memory) + len(self._disk)

    def cids(self) -> list[int]:
        return sorted([*self._memory, *self._disk])

    @property
    def memory_held(self) -> int:
        """Bytes of the states kept in memory."""
        return self._held

    def nbytes(self, cid: int) -> int:
        """Bytes of client `cid`'s state (0: none)."""
        if cid in self._sizes:
            return self._sizes[cid]
        return self._disk[cid][1] if cid in self._disk else 0

    def get(self, cid: int) -> Any:
        """Client `cid`'s state, or None when it has none yet."""
        if cid in self._memory:
            self._memory.move_to_end(cid)
            return self._memory[cid]
        if cid in self._disk:
            at, n = self._disk[cid]
            return pickle.loads(os.pread(self._fd, n, at))
        return None

    def put(self, cid: int, state: Any) -> None:
        """Keep `state` as client `cid`'s (a copy of any array that maps Ray's buffers)."""
        self._forget(cid)
        state = owned(state)
        size = nbytes(state)
        self._memory[cid], self._sizes[cid] = state, size
        self._held += size
        while self._held > self.memory_bytes and len(self._memory) > 1:
            self._spill(*self._memory.popitem(last=False))

    def items(self) -> Iterator[tuple[int, Any]]:
        """(cid, state) of every client, in client-id order."""
        for cid in self.cids():
            yield cid, self.get(cid)

    @property
    def on_disk(self) -> int:
        return len(self._disk)

    @property
    def disk_bytes(self) -> int:
        return self._end - self._garbage

    # ------------------------------------------------------------------ disk
    def _forget(self, cid: int) -> None:
        if cid in self._memory:
            del self._memory[cid]
            self._held -= self._sizes.pop(cid)
        elif cid in self._disk:
            self._garbage += self._disk.pop(cid)[1]

    def _spill(self, cid: int, state: Any) -> None:
        self._held -= self._sizes.pop(cid)
        if self._fd is None:
            parent = self.folder_parent or spill_folder()
            _remove_orphans(parent)
            where = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-{socket.gethostname()}-", dir=parent))
            self._file = where / "states.bin"
            self._fd = os.open(self._file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        blob = pickle.dumps(state, protocol=5)
        os.pwrite(self._fd, blob, self._end)
        self._disk[cid] = (self._end, len(blob))
        self._end += len(blob)
        self.spilled_total += 1
        if self._garbage > COMPACT_BYTES and self._garbage > self._end // 2:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the file with the live states only."""
        new = self._file.with_suffix(".new")
        fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        at, index = 0, {}
        for cid, (offset, n) in sorted(self._disk.items(), key=lambda kv: kv[1][0]):
            os.pwrite(fd, os.pread(self._fd, n, offset), at)
            index[cid] = (at, n)
            at += n
        os.close(self._fd)
        os.replace(new, self._file)
        self._fd, self._disk, self._end, self._garbage = fd, index, at, 0
        self.compactions += 1

    def close(self) -> None:
        """Drop every state and remove the file."""
        if self._fd is not None:
            os.close(self._fd)
            shutil.rmtree(self._file.parent, ignore_errors=True)
            self._fd = None
        self._memory.clear()
        self._sizes.clear()
        self._disk.clear()
        self._held = self._end = self._garbage = 0

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the folder is a temporary one
            pass
