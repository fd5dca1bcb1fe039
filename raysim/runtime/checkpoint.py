"""Run checkpoints: `<run dir>/checkpoint.pt`, what `resume=<run dir>` continues from.

A checkpoint holds the algorithm's and the selection's server state, every client's state,
the driver's torch RNG state and the run's counters; the metrics so far are the run dir's
parquet files, flushed just before. All other randomness in raysim is a pure function of
(seed, round, client id, stream), so nothing more is needed for a resumed run to end with
the same model as an uninterrupted one. Files are replaced atomically: a run killed while
writing keeps its previous checkpoint.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

from raysim.config import ConfigError

FILE = "checkpoint.pt"


def save(run_dir: Path, state: dict) -> None:
    tmp = Path(run_dir) / (FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, Path(run_dir) / FILE)


def load(run_dir: Path) -> tuple[dict, bool]:
    """The run's checkpoint and whether torch's safe loader (tensors and plain containers
    only) could read it; a plugin that keeps other objects in its state needs the full
    unpickler, which is used only for this run's own file."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise ConfigError(f"resume={str(run_dir)!r}: no checkpoint ({path} not found): the run stopped before "
                          "its first checkpoint, or ran with checkpoint_every=0")
    try:
        return torch.load(path, weights_only=True), True
    except pickle.UnpicklingError:
        return torch.load(path, weights_only=False), False
