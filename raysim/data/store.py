"""Training arrays as memory-mapped files (`data_store=files`): written once, then read by
every process on the machine through the operating system's page cache.

With `data_store=memory` (the default) the server puts the training arrays into Ray's
object store and the client actors map them from there: fast rounds, but the data must fit
the store (which is sized at Ray's start), and the server's load and put hold them twice for
a moment (issue 42). With `files` the server writes them as `.npy` files into a folder named
by their content (`data_store_dir`, default `$RAYSIM_CACHE_DIR/arrays`), or finds them there
from an earlier run, and every process maps those files read-only: one copy on the machine,
in the page cache, whatever Ray's object store holds; a client's shard is read when the
client trains. The models are bit-identical to the memory path's (tested).

Written once and checked every run: the manifest records each array's shape, dtype, size
and the SHA-256 of every 64 MB block; before a run the server reads the files back against
it (all of them up to `CHECK_ALL_BYTES`, which also warms the page cache for the actors;
above, the sizes, the first and last blocks and the files' modification times), so a file
truncated or changed since is one line naming it, never wrong data. Client actors check the
sizes when they map the files.

Data larger than memory: a dataset class that can make its arrays in chunks provides
`generate(cfg, out)` (`out.array(name, shape, dtype)` gives an array to fill, `out.put(name,
array)` takes a small one) and `arrays_key(cfg)` (what its arrays depend on). With
`data_store=files` its arrays are then made straight into the files (`Writer`), once per
key, and never held whole; `data=memory` makes them into plain arrays (`InMemory`), with the
same chunks and so the same values.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from raysim.errors import ConfigError

BLOCK = 64 * 2**20
MANIFEST = "manifest.json"
CHECK_ALL_BYTES = 4 * 2**30


def root(cfg) -> Path:
    """Where the arrays' folders go: `data_store_dir`, or `$RAYSIM_CACHE_DIR/arrays`."""
    from raysim.data.cache import cache_dir

    return Path(cfg.data_store_dir).expanduser() if cfg.data_store_dir else cache_dir() / "arrays"


def _blocks(buffer: memoryview) -> list[str]:
    return [hashlib.sha256(buffer[i:i + BLOCK]).hexdigest() for i in range(0, len(buffer), BLOCK)] or \
        [hashlib.sha256(b"").hexdigest()]


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def put(arrays: dict[str, np.ndarray], where: Path) -> dict:
    """The manifest of `arrays` stored under `where`: written now (`Writer`) unless an earlier
    run wrote the same content, which is checked."""
    entries = {name: _entry(a) for name, a in sorted(arrays.items())}
    content = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:24]
    manifest = find(where, content)
    if manifest is not None:
        return manifest
    writer = Writer(where, content)
    try:
        for name, a in arrays.items():
            np.save(writer.tmp / f"{name}.npy", np.ascontiguousarray(a), allow_pickle=False)
        return writer.install(entries)
    except OSError as e:
        writer.abandon()
        raise _cannot_write(where, e) from None


def _entry(a: np.ndarray) -> dict:
    return {"shape": list(a.shape), "dtype": a.dtype.str, "blocks": _blocks(_bytes(a))}


def _cannot_write(where: Path, e: OSError) -> ConfigError:
    return ConfigError(f"data_store=files: cannot write the training data under {where} ({e.strerror}); set "
                       "data_store_dir to a writable folder with room for them, or data_store=memory")


def check(manifest: dict) -> None:
    """Read the stored arrays back against the manifest: their sizes, then every block's
    SHA-256 (up to `CHECK_ALL_BYTES` in all; above, the first and last blocks and the
    files' modification times, so that a run on data larger than memory does not read them
    all before it starts)."""
    maps = open_arrays(manifest)
    whole = sum(a.nbytes for a in maps.values()) <= CHECK_ALL_BYTES
    for name, entry in manifest["arrays"].items():
        data = _bytes(maps[name])
        if whole:
            same = _blocks(data) == entry["blocks"]
        else:
            last = (len(entry["blocks"]) - 1) * BLOCK
            same = (_blocks(data[:BLOCK]) == entry["blocks"][:1] and _blocks(data[last:]) == entry["blocks"][-1:]
                    and entry.get("mtime_ns") == (Path(manifest["folder"]) / f"{name}.npy").stat().st_mtime_ns)
        if not same:
            raise _changed(manifest, name, "its content differs from what raysim wrote")


def open_arrays(manifest: dict) -> dict[str, np.ndarray]:
    """The stored arrays, memory-mapped read-only; a missing, truncated or reshaped file is a
    `ConfigError` naming it."""
    out = {}
    for name, entry in manifest["arrays"].items():
        path = Path(manifest["folder"]) / f"{name}.npy"
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise _changed(manifest, name, "it is missing (on this node: data_store_dir must be a folder every "
                                           "node reads)") from None
        except (OSError, ValueError) as e:
            raise _changed(manifest, name, f"it cannot be read as an array ({str(e).splitlines()[0][:80]})") from None
        if list(a.shape) != entry["shape"] or a.dtype.str != entry["dtype"]:
            raise _changed(manifest, name, f"it holds {a.dtype.str} {list(a.shape)}, not {entry['dtype']} "
                                           f"{entry['shape']}")
        out[name] = a
    return out


def _changed(manifest: dict, name: str, what: str) -> ConfigError:
    path = Path(manifest["folder"]) / f"{name}.npy"
    return ConfigError(f"data_store=files: {path} changed since raysim wrote it: {what}; delete the folder "
                       f"{manifest['folder']} and run again (it is written anew)")


class InMemory:
    """What a dataset's `generate(cfg, out)` fills with `data_store=memory`: plain arrays."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple, dtype) -> np.ndarray:
        self.arrays[name] = np.empty(shape, dtype)
        return self.arrays[name]

    def put(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = np.ascontiguousarray(array)


class Writer(InMemory):
    """What `generate(cfg, out)` fills with `data_store=files`: arrays memory-mapped on files
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

    def array(self, name: str, shape: tuple, dtype) -> np.ndarray:
        self.arrays[name] = np.lib.format.open_memmap(self.tmp / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)
        return self.arrays[name]

    def put(self, name: str, array: np.ndarray) -> None:
        self.array(name, array.shape, array.dtype)[...] = array

    def finish(self) -> dict:
        """Flush and hash the arrays made here, and move their files into place; their manifest."""
        entries = {}
        for name, a in sorted(self.arrays.items()):
            a.flush()
            entries[name] = _entry(a)
        self.arrays.clear()
        return self.install(entries)

    def install(self, entries: dict) -> dict:
        """The files written in the temporary folder, with their manifest (`entries` and the
        files' modification times), renamed into place at once; if another process put the
        same folder there first, theirs, checked."""
        for name, entry in entries.items():
            entry["mtime_ns"] = (self.tmp / f"{name}.npy").stat().st_mtime_ns
        folder = self.where / self.name
        (self.tmp / MANIFEST).write_text(json.dumps({"folder": str(folder.resolve()), "arrays": entries}, indent=1))
        try:
            os.rename(self.tmp, folder)
        except OSError:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return find(self.where, self.name)

    def abandon(self) -> None:
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
    """The arrays of a dataset class that makes them in chunks (`generate`): with
    `data_store=files` made once into files per `arrays_key(cfg)` and mapped (their manifest
    returned too), else made in memory (manifest None)."""
    if cfg.data_store != "files":
        out = InMemory()
        cls.generate(cfg, out)
        return out.arrays, None
    key = json.dumps({"dataset": cfg.dataset, **cls.arrays_key(cfg)}, sort_keys=True, default=str)
    name = f"{cfg.dataset}-{hashlib.sha256(key.encode()).hexdigest()[:24]}"
    where = root(cfg)
    manifest = find(where, name)
    if manifest is None:
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
