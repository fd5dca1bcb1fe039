"""Prepared arrays kept between commands, for a loader whose preparing costs more than
reading its result back: digits imports scikit-learn to load and split (1.4 s of CPU, on
the critical path of every cold command on 2 cores); its split arrays read back in
milliseconds. Files are `$RAYSIM_CACHE_DIR` (default `~/.cache/raysim`)/`<name>-<key hash>.npz`,
the key naming everything the arrays depend on (the library's version, the seed). A cache
that cannot be read or written is ignored: the arrays are made again, never wrong."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np


def cache_dir() -> Path:
    return Path(os.environ.get("RAYSIM_CACHE_DIR") or Path.home() / ".cache" / "raysim")


def cached_arrays(name: str, key: dict, make: Callable[[], dict]) -> dict:
    """`make()`'s arrays (a dict of name -> ndarray), read from the cache when it holds them
    for this `key`, else made and written there (atomically: a concurrent command reads a
    whole file or none)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{digest}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # not there yet, or unreadable: made again below
    arrays = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".npz", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only or full disk: the arrays are right, only not kept
    return arrays
