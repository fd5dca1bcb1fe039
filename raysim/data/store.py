"""Training arrays as files (`data_store=files`): written once, then read by every process
on the machine through the operating system's page cache.

With `data_store=memory` the server puts the training arrays into Ray's object store and the
client actors map them from there: fast rounds, but the data must fit the store (which is
sized at Ray's start), and the server's load and put hold them twice for a moment (issue
42). With `files` the server writes them as `.npy` files into a folder named by their
content (`data_store_dir`, default `$RAYSIM_CACHE_DIR/arrays`), or finds them there from an
earlier run: one copy on the machine, in the page cache, whatever Ray's object store holds.
A client actor reads a client's rows when the client trains (`Rows`: positioned reads, a run
of consecutive rows at a time, 16 at once), so a run touches only the selected clients' data
and data larger than memory train (the page cache keeps the hot rows). Measured on a 4.3 GB
file, cold: 2,500 scattered rows in 0.17 s this way, 2.9 s through a memory map (each page
fault reads ahead data it does not need). The models are bit-identical to the memory path's
(tested).

Written once and checked every run: the manifest records each array's shape, dtype, size,
the file's modification time and the SHA-256 of every 64 MB block. Before a run the server
checks the sizes, the first and the last block, and the modification time; a file whose
time changed is read back whole against every block. A file truncated or changed since is
one line naming it, never wrong data, and a run reads no more than two blocks of unchanged
files before it starts: start-up does not grow with the dataset.

Data larger than memory: a dataset class that can make its arrays in chunks provides
`generate(cfg, out)` (`out.array(name, shape, dtype)` gives an array to fill by slices of
rows, `out.put(name, array)` takes a small one) and `arrays_key(cfg)` (what its arrays
depend on). With `data_store=files` its arrays are then written straight into the files
(`Writer`, positioned writes: the server never maps or holds them), once per key; with
`data=memory` they are made as plain arrays (`InMemory`), with the same chunks and so the
same values.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np

from raysim.errors import ConfigError

BLOCK = 64 * 2**20
MANIFEST = "manifest.json"
CROWDED = 0.7  # data_store=auto: files when the training data would take more of Ray's object store than this
SPARE_DISK = 2**30  # what writing the files leaves free on their disk, at least
READERS = 16  # positioned reads in flight at once (Rows): a disk serves scattered rows faster so
RANDOM = True
PIECE = 4 * 2**20  # a run of consecutive rows is read in pieces of at most this many bytes


def root(cfg) -> Path:
    """Where the arrays' folders go: `data_store_dir`, or `$RAYSIM_CACHE_DIR/arrays`."""
    from raysim.data.cache import cache_dir

    return Path(cfg.data_store_dir).expanduser() if cfg.data_store_dir else cache_dir() / "arrays"


def choose(cfg, data_bytes: Optional[int]) -> str:
    """Where a run keeps its training arrays: `data_store`, or for `auto` files when the
    arrays (`data_bytes`) would take more than `CROWDED` of the object store of a one-node
    Ray (the store is sized when Ray starts; spilling slows every round), else memory. On
    several nodes auto keeps memory: the object store ships the arrays to each node once
    (files work there too: a host without the folder copies them, data/replicate.py).
    Without Ray (a script's `prepare`) or a size: memory."""
    if cfg.data_store != "auto":
        return cfg.data_store
    from raysim.lazy_ray import initialized, ray

    if not data_bytes or not initialized():
        return "memory"
    store_bytes = ray.cluster_resources().get("object_store_memory", 0)
    return "files" if _one_node() and store_bytes and data_bytes > CROWDED * store_bytes else "memory"


def _one_node() -> bool:
    """No Ray in this process (a script's `prepare`), or a Ray of one live node."""
    from raysim.lazy_ray import initialized, ray

    return not initialized() or sum(1 for n in ray.nodes() if n.get("Alive")) == 1


def in_place(cfg) -> bool:
    """Whether data already in files of their own format (an Arrow cache) are read where they
    are: data_store=files, or auto on one node (on several, auto ships them by the object
    store: their folder may not be on every node)."""
    if cfg.data_store != "auto":
        return cfg.data_store == "files"
    return _one_node()


def need_room(where: Path, nbytes: int) -> None:
    """One line, before anything is written, when the disk under `where` has no room for
    `nbytes` of training data (and `SPARE_DISK` more)."""
    at = where
    while not at.exists() and at != at.parent:
        at = at.parent
    free = shutil.disk_usage(at).free
    if nbytes + SPARE_DISK > free:
        raise ConfigError(f"data_store=files: the training data need {nbytes / 2**30:.1f} GB under {where}, whose "
                          f"disk has {free / 2**30:.1f} GB free (1 GB is left spare); set data_store_dir to a folder "
                          "with room for them")


def _hash_blocks(buffer: memoryview) -> list[str]:
    return [hashlib.sha256(buffer[i:i + BLOCK]).hexdigest() for i in range(0, len(buffer), BLOCK)] or \
        [hashlib.sha256(b"").hexdigest()]


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def _file_blocks(path: Path, which: Optional[list[int]] = None) -> dict[int, str]:
    """SHA-256 of the 64 MB blocks of a `.npy` file's data (all, or the block numbers in
    `which`), read with plain reads (nothing mapped)."""
    a = np.load(path, mmap_mode="r", allow_pickle=False)  # its header only: no page of it is read
    offset, nbytes = a.offset, a.nbytes
    del a
    count = max(1, -(-nbytes // BLOCK))
    out, buf = {}, bytearray(min(BLOCK, nbytes))
    with open(path, "rb", buffering=0) as f:
        for i in (range(count) if which is None else sorted({w % count for w in which})):
            want = min(BLOCK, nbytes - i * BLOCK)
            view = memoryview(buf)[:want]
            f.seek(offset + i * BLOCK)
            got = f.readinto(view) if want else 0
            out[i] = hashlib.sha256(view[:got]).hexdigest()
    return out


def put(arrays: dict[str, np.ndarray], where: Path) -> dict:
    """The manifest of `arrays` stored under `where`: written now (`Writer`) unless an earlier
    run wrote the same content, which is checked."""
    entries = {name: {"shape": list(a.shape), "dtype": a.dtype.str, "blocks": _hash_blocks(_bytes(a))}
               for name, a in sorted(arrays.items())}
    content = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:24]
    manifest = find(where, content)
    if manifest is not None:
        return manifest
    need_room(where, sum(a.nbytes for a in arrays.values()))
    writer = Writer(where, content)
    try:
        for name, a in arrays.items():
            np.save(writer.tmp / f"{name}.npy", np.ascontiguousarray(a), allow_pickle=False)
        return writer.install(entries)
    except OSError as e:
        writer.abandon()
        raise _cannot_write(where, e) from None


def _cannot_write(where: Path, e: OSError) -> ConfigError:
    return ConfigError(f"data_store=files: cannot write the training data under {where} ({e.strerror}); set "
                       "data_store_dir to a writable folder with room for them, or data_store=memory")


def check(manifest: dict) -> None:
    """The stored files against the manifest: shapes and sizes (`open_arrays`); then, for a
    file whose modification time is the one recorded, its first and last blocks' SHA-256,
    and for any other, every block's (a file changed in place has a new time)."""
    open_arrays(manifest)
    for name, entry in manifest["arrays"].items():
        if "segments" in entry:  # not raysim's files: their sizes and times, checked by open_arrays
            continue
        path = Path(manifest["folder"]) / f"{name}.npy"
        if entry.get("mtime_ns") == path.stat().st_mtime_ns:
            got = _file_blocks(path, [0, -1])
            same = got[0] == entry["blocks"][0] and got[max(got)] == entry["blocks"][-1]
        else:
            same = list(_file_blocks(path).values()) == entry["blocks"]
        if not same:
            raise _changed(manifest, name, "its content differs from what raysim wrote")


def open_arrays(manifest: dict) -> dict[str, np.ndarray]:
    """The stored arrays, memory-mapped read-only; a missing, truncated or reshaped file is a
    `ConfigError` naming it."""
    out = {}
    for name, entry in manifest["arrays"].items():
        if "segments" in entry:  # files raysim did not write (an Arrow cache): read by rows
            out[name] = StoredArray(manifest, name)
            continue
        path = Path(manifest["folder"]) / f"{name}.npy"
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:  # on a cluster: most often a folder this node does not share
            import socket

            raise ConfigError(f"data_store=files: {path} is not there on host {socket.gethostname()} "
                              f"({ray_node_ip()}): deleted since raysim wrote it (delete the folder "
                              f"{manifest['folder']} and run again), or, on a cluster, it could not be copied "
                              "here from the server's host: name a shared mount as data_store_dir, or use "
                              "data_store=memory (Ray's object store ships the arrays to each node)") from None
        except (OSError, ValueError) as e:
            raise _changed(manifest, name, f"it cannot be read as an array ({str(e).splitlines()[0][:80]})") from None
        if list(a.shape) != entry["shape"] or a.dtype.str != entry["dtype"]:
            raise _changed(manifest, name, f"it holds {a.dtype.str} {list(a.shape)}, not {entry['dtype']} "
                                           f"{entry['shape']}")
        out[name] = a
    return out


def ray_node_ip() -> str:
    """This process's Ray node address, or 'no Ray' (a script's own read)."""
    try:
        from raysim.lazy_ray import initialized, ray

        return ray.util.get_node_ip_address() if initialized() else "no Ray"
    except Exception:  # an address Ray cannot tell: the message goes without it
        return "address unknown"


def _changed(manifest: dict, name: str, what: str) -> ConfigError:
    path = Path(manifest["folder"]) / f"{name}.npy"
    return ConfigError(f"data_store=files: {path} changed since raysim wrote it: {what}; delete the folder "
                       f"{manifest['folder']} and run again (it is written anew)")


class Rows:
    """Rows of a stored array, read when asked for (`take`): each run of consecutive row
    numbers is one positioned read (in pieces of `PIECE` bytes), `READERS` of them in flight
    at once, straight into the array returned. Reads go through the page cache, so rows
    read before come from memory; nothing is mapped, so a process's memory holds only the
    rows it asked for. Same values as indexing the array (tested against the memory path).

    The rows lie in segments, each (file, byte offset, rows): a `.npy` file is one; an Arrow
    file (a Hugging Face cache) has one per record batch (`arrow_segments`)."""

    _pool: Optional[ThreadPoolExecutor] = None
    _lock = threading.Lock()

    def __init__(self, manifest: dict, name: str):
        entry = manifest["arrays"][name]
        if "segments" in entry:
            _check_outside(manifest, name)
            segments = entry["segments"]
        else:
            a = open_arrays({**manifest, "arrays": {name: entry}})[name]  # checks shape and size
            segments = [[a.filename, a.offset, a.shape[0]]]
        self.shape, self.dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
        self.paths = [str(path) for path, _, _ in segments]
        self.starts = np.cumsum([0] + [n for _, _, n in segments])  # first row of each segment (and the end)
        self.offsets = np.array([at for _, at, _ in segments], dtype=np.int64)
        self.row = int(np.prod(self.shape[1:])) * self.dtype.itemsize
        self._fds: dict[str, int] = {}

    def take(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), *self.shape[1:]), self.dtype)
        if not len(rows) or not self.row:
            return out
        if rows.min() < 0 or rows.max() >= self.shape[0]:
            raise IndexError(f"rows out of range for {self.paths[0]} ({self.shape[0]} rows)")
        seg = np.searchsorted(self.starts, rows, side="right") - 1
        at = self.offsets[seg] + (rows - self.starts[seg]) * self.row  # each row's byte in its file
        # a run: consecutive rows of one segment, read at once
        breaks = np.flatnonzero((np.diff(rows, prepend=rows[0] - 2) != 1) | (np.diff(seg, prepend=-1) != 0))
        ends = np.append(breaks[1:], len(rows))
        per = max(1, PIECE // self.row)
        pieces = [(j, min(j + per, e)) for s, e in zip(breaks.tolist(), ends.tolist()) for j in range(s, e, per)]
        view = memoryview(out.reshape(-1)).cast("B")
        where = [(self._fd(self.paths[seg[a]]), int(at[a])) for a, _ in pieces]

        def read(k: int) -> None:
            (a, b), (fd, pos) = pieces[k], where[k]
            into = view[a * self.row:b * self.row]
            while len(into):
                got = os.preadv(fd, [into], pos)
                if got <= 0:
                    raise OSError(f"{self.paths[0]}: short read at byte {pos}")
                into, pos = into[got:], pos + got

        if len(pieces) == 1:
            read(0)
        else:
            list(self._readers().map(read, range(len(pieces)), chunksize=max(1, len(pieces) // (4 * READERS))))
        return out

    def _fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
            if RANDOM:
                os.posix_fadvise(self._fds[path], 0, 0, os.POSIX_FADV_RANDOM)
        return self._fds[path]

    @classmethod
    def _readers(cls) -> ThreadPoolExecutor:
        with cls._lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(READERS, thread_name_prefix="raysim-rows")
            return cls._pool

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)


class StoredArray:
    """A stored array the server holds without reading it (an Arrow cache's column): shape,
    dtype and size for free, rows read by `Rows` when indexed, the whole when numpy asks."""

    def __init__(self, manifest: dict, name: str):
        self.rows = Rows(manifest, name)
        self.shape, self.dtype, self.ndim = self.rows.shape, self.rows.dtype, len(self.rows.shape)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return self.rows.take(np.array([key]))[0]
        if isinstance(key, slice):
            return self.rows.take(np.arange(*key.indices(len(self))))
        key = np.asarray(key)
        return self.rows.take(np.flatnonzero(key) if key.dtype == bool else key)

    def __array__(self, dtype=None, copy=None):
        whole = self.rows.take(np.arange(len(self)))
        return whole if dtype is None else whole.astype(dtype)


def arrow_segments(files: list[str], column: str) -> Optional[tuple[list, tuple, np.dtype]]:
    """Where the rows of `column` lie in these Arrow stream files (a Hugging Face dataset's
    cache, in order): ([file, byte offset, rows] per record batch, row shape, dtype), read
    from the files' metadata without copying their data; None when the column is not one
    fixed shape of plain numbers without nulls in every batch (then it must be copied)."""
    import pyarrow as pa

    segments, shape, dtype = [], None, None
    for path in files:
        with pa.memory_map(path) as mm:
            base = mm.read_buffer(1).address  # the mapping's start: a buffer's address - base = its byte in the file
            mm.seek(0)
            for batch in pa.ipc.open_stream(mm):
                part = _flat_values(batch.column(column))
                if part is None:
                    return None
                values, row_shape = part
                if (shape or row_shape) != row_shape or (dtype or values.type) != values.type:
                    return None
                shape, dtype = row_shape, values.type
                width = np.dtype(values.type.to_pandas_dtype()).itemsize
                at = values.buffers()[1].address + values.offset * width - base
                segments.append([path, int(at), len(batch)])
    if not segments:
        return None
    return segments, shape, np.dtype(dtype.to_pandas_dtype())


def _flat_values(array):
    """(the contiguous numbers under a column of fixed-shape rows, the row shape), or None."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(array.type, pa.ExtensionType):
        array = array.storage
    shape, rows = [], len(array)
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type):
        if array.null_count:
            return None
        lengths = pc.list_value_length(array)
        width = pc.min_max(lengths).as_py() if len(array) else {"min": 0, "max": 0}
        if width["min"] != width["max"]:
            return None
        shape.append(int(width["max"] or 0))
        array = array.flatten()
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)) or array.null_count:
        return None
    if len(array) != rows * int(np.prod(shape)):
        return None
    return array, tuple(shape)


def outside(segments: list, shape: tuple, dtype: np.dtype, rows: int) -> dict:
    """A manifest entry for an array that stays in files raysim did not write (`segments`):
    their sizes and modification times are checked every run (`_check_outside`)."""
    files = sorted({path for path, _, _ in segments})
    return {"shape": [rows, *shape], "dtype": np.dtype(dtype).str, "segments": segments,
            "files": {f: [os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files}}


def _check_outside(manifest: dict, name: str) -> None:
    for f, (size, mtime) in manifest["arrays"][name]["files"].items():
        try:
            st = os.stat(f)
        except FileNotFoundError:
            raise ConfigError(f"data_store: {f} (the training data's {name}) is missing (on a cluster, it must be in "
                              "a folder every node reads)") from None
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise ConfigError(f"data_store: {f} (the training data's {name}) changed since the run began reading it")


class InMemory:
    """What a dataset's `generate(cfg, out)` fills with `data_store=memory`: plain arrays."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple, dtype) -> np.ndarray:
        self.arrays[name] = np.empty(shape, dtype)
        return self.arrays[name]

    def put(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = np.ascontiguousarray(array)


class _BlockHashes:
    """The 64 MB blocks' SHA-256 of bytes written in order (`feed`), made as they are
    written; `blocks()` is None when the writes were not one pass in order (then the file is
    read back to hash it)."""

    def __init__(self, nbytes: int):
        self.nbytes, self.at, self.done, self.part, self.filled, self.in_order = nbytes, 0, [], hashlib.sha256(), 0, True

    def feed(self, at: int, view: memoryview) -> None:
        if not self.in_order or at != self.at:
            self.in_order = False
            return
        self.at += len(view)
        while len(view):
            take = min(BLOCK - self.filled, len(view))
            self.part.update(view[:take])
            self.filled, view = self.filled + take, view[take:]
            if self.filled == BLOCK:
                self.done.append(self.part.hexdigest())
                self.part, self.filled = hashlib.sha256(), 0

    def blocks(self) -> Optional[list[str]]:
        if not self.in_order or self.at != self.nbytes:
            return None
        return self.done + [self.part.hexdigest()] if self.filled or not self.done else self.done


class _FileArray:
    """A `.npy` file being written by slices of rows (`a[i:j] = rows`, `a[...] = whole`):
    positioned writes by a thread of its own, so the generator makes the next chunk while
    the disk takes this one (two chunks queued at most), and the writer's memory holds a
    few chunks, never the file. Blocks written in order are hashed as they go."""

    def __init__(self, path: Path, shape: tuple, dtype):
        self.path, self.shape, self.dtype = path, tuple(int(n) for n in shape), np.dtype(dtype)
        self.row = int(np.prod(self.shape[1:])) * self.dtype.itemsize
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                     "fortran_order": False, "shape": self.shape})
            self.offset = f.tell()
            f.truncate(self.offset + self.row * self.shape[0])
        self.fd = os.open(path, os.O_WRONLY)
        self.hashes = _BlockHashes(self.row * self.shape[0])
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="raysim-write")
        self._queued: list = []
        self._spare: list = []  # chunk buffers written, to be filled again

    def __len__(self) -> int:
        return self.shape[0]

    def __setitem__(self, key, value) -> None:
        if key is Ellipsis:
            key = slice(None)
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise IndexError(f"{self.path.name}: write whole rows by a slice a[i:j], got {key!r}")
        start, stop, _ = key.indices(len(self))
        stop = max(start, stop)
        while len(self._queued) >= 2:
            self._queued.pop(0).result()
        shape = (stop - start, *self.shape[1:])
        fits = [i for i, b in enumerate(self._spare) if b.shape == shape]
        data = self._spare.pop(fits[0]) if fits else np.empty(shape, self.dtype)  # reused: fresh pages cost more
        np.copyto(data, np.asarray(value), casting="same_kind")  # ours: the caller may reuse its buffer meanwhile
        self._queued.append(self._thread.submit(self._write, data, start * self.row))

    def _write(self, data: np.ndarray, at: int) -> None:
        view = memoryview(data.reshape(-1)).cast("B")
        self.hashes.feed(at, view)
        at += self.offset
        while len(view):
            got = os.pwrite(self.fd, view, at)
            view, at = view[got:], at + got
        self._spare.append(data)

    def close(self) -> None:
        """Wait for the queued writes (raising their error, if any) and close the file."""
        if self.fd is None:
            return
        try:
            for f in self._queued:
                f.result()
        finally:
            self._queued.clear()
            self._thread.shutdown()
            os.close(self.fd)
            self.fd = None


class Writer(InMemory):
    """What `generate(cfg, out)` fills with `data_store=files`: arrays written into files
    in a folder of their own, named `name` under `where` (`find` gives it back to a later
    run); `put` writes whole arrays through it too."""

    def __init__(self, where: Path, name: str):
        super().__init__()
        self.where, self.name = where, name
        try:
            where.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=where))
        except OSError as e:
            raise _cannot_write(where, e) from None

    def array(self, name: str, shape: tuple, dtype) -> _FileArray:
        self.arrays[name] = _FileArray(self.tmp / f"{name}.npy", shape, dtype)
        return self.arrays[name]

    def put(self, name: str, array: np.ndarray) -> None:
        self.array(name, array.shape, array.dtype)[...] = array

    def finish(self) -> dict:
        """Close the files written here, hash those not hashed as written (reading them back),
        and move them into place; their manifest."""
        entries = {}
        for name, a in sorted(self.arrays.items()):
            a.close()
            entries[name] = {"shape": list(a.shape), "dtype": a.dtype.str,
                             "blocks": a.hashes.blocks() or list(_file_blocks(a.path).values())}
        self.arrays.clear()
        return self.install(entries)

    def install(self, entries: dict) -> dict:
        """The files written in the temporary folder, with their manifest (`entries` and the
        files' modification times), renamed into place at once; if another process put the
        same folder there first, theirs, checked."""
        for name, entry in entries.items():
            entry["mtime_ns"] = (self.tmp / f"{name}.npy").stat().st_mtime_ns
        folder = self.where / self.name
        manifest = {"folder": str(folder.resolve()), "arrays": entries}
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(self.tmp, folder)
        except OSError:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return find(self.where, self.name)
        return manifest  # hashed as it was written: not read again

    def abandon(self) -> None:
        for a in self.arrays.values():
            if isinstance(a, _FileArray):
                try:
                    a.close()
                except OSError:
                    pass
        self.arrays.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def find(where: Path, name: str) -> Optional[dict]:
    """The manifest of the folder `name` under `where`, checked (`check`); None if there is none."""
    path = where / name / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    manifest["folder"] = str((where / name).resolve())
    check(manifest)
    return manifest


def generated(cls, cfg) -> tuple[dict[str, np.ndarray], Optional[dict]]:
    """The arrays of a dataset class that makes them in chunks (`generate`): in files
    (`choose`; the class's `train_bytes(cfg)`, if it has one, is the size auto goes by),
    written once per `arrays_key(cfg)` and mapped (their manifest returned too), else made in
    memory (manifest None)."""
    size = cls.train_bytes(cfg) if hasattr(cls, "train_bytes") else None
    if choose(cfg, size) != "files":
        out = InMemory()
        cls.generate(cfg, out)
        return out.arrays, None
    key = json.dumps({"dataset": cfg.dataset, **cls.arrays_key(cfg)}, sort_keys=True, default=str)
    name = f"{cfg.dataset}-{hashlib.sha256(key.encode()).hexdigest()[:24]}"
    where = root(cfg)
    manifest = find(where, name)
    if manifest is None:
        if size:
            need_room(where, size)
        writer = Writer(where, name)
        try:
            cls.generate(cfg, writer)
            manifest = writer.finish()
        except OSError as e:
            writer.abandon()
            raise _cannot_write(where, e) from None
        except BaseException:
            writer.abandon()
            raise
    return open_arrays(manifest), manifest
