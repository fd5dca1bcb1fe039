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

Written once and checked every run: the manifest records each array's shape, dtype and the
SHA-256 of every 64 MB block; the server reads the files back against it before a run (which
also warms the page cache for the actors), so a file truncated or changed since is one line
naming it, never wrong data. Client actors check the sizes when they map the files.
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
    """The manifest of `arrays` stored under `where`: written now (atomically: a folder
    renamed into place) unless an earlier run wrote the same content, which is checked."""
    entries = {name: {"shape": list(a.shape), "dtype": a.dtype.str, "blocks": _blocks(_bytes(a))}
               for name, a in sorted(arrays.items())}
    content = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:24]
    folder = where / content
    manifest = {"folder": str(folder.resolve()), "arrays": entries}
    if (folder / MANIFEST).is_file():
        check(manifest)
        return manifest
    try:
        where.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{content}-", dir=where))
    except OSError as e:
        raise ConfigError(f"data_store=files: cannot write under {where} ({e.strerror}); set data_store_dir to a "
                          "writable folder with room for the training data, or data_store=memory") from None
    try:
        for name, a in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(a), allow_pickle=False)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process wrote the same content first: use theirs, checked
            shutil.rmtree(tmp, ignore_errors=True)
            check(manifest)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"data_store=files: writing the training data under {where} failed ({e.strerror}); free "
                          "some room there, set data_store_dir elsewhere, or use data_store=memory") from None
    return manifest


def check(manifest: dict) -> None:
    """Read every stored array back against the manifest (its size, then each block's SHA-256)."""
    maps = open_arrays(manifest)
    for name, entry in manifest["arrays"].items():
        if _blocks(_bytes(maps[name])) != entry["blocks"]:
            raise _changed(manifest, name, "its content differs from what raysim wrote")


def open_arrays(manifest: dict, mode: Optional[str] = "r") -> dict[str, np.ndarray]:
    """The stored arrays, memory-mapped read-only; a missing, truncated or reshaped file is a
    `ConfigError` naming it."""
    out = {}
    for name, entry in manifest["arrays"].items():
        path = Path(manifest["folder"]) / f"{name}.npy"
        try:
            a = np.load(path, mmap_mode=mode, allow_pickle=False)
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
