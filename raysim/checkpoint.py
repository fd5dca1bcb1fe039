"""Run checkpoints: `<run dir>/checkpoint.pt`, what `resume=<run dir>` continues from.

A checkpoint holds the algorithm's and the selection's server state, every client's state,
the server's torch RNG state and the run's counters; the metrics so far are the run dir's
parquet files, flushed just before. All other randomness in raysim is a pure function of
(seed, round, client id, stream), so nothing more is needed for a resumed run to end with
the same model as an uninterrupted one. Files are replaced atomically: a run killed while
writing keeps its previous checkpoint.
"""
from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import torch

from raysim.config import ConfigError, check_resumable
from raysim.errors import WriteFailed

FILE = "checkpoint.pt"


def save(run_dir: Path, state: dict, last_good: int | None = None) -> None:
    """Write `state` as the run's checkpoint, atomically: through a temporary file, renamed
    when whole. A write that fails (a full disk) removes the temporary file, keeps the last
    good checkpoint (round `last_good`) and raises `WriteFailed` saying so."""
    tmp, path = Path(run_dir) / (FILE + ".tmp"), Path(run_dir) / FILE
    try:
        with open(tmp, "wb") as f:  # a Python file: a full disk is an OSError (ENOSPC), not torch's "unexpected pos"
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        why = "no space left on device" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
        kept = (f"the last good checkpoint is round {last_good} (resume=... continues from it)" if last_good
                else "no checkpoint was written before")
        raise WriteFailed(f"{why} writing {path}; {kept}") from None


def load_checked(cfg) -> dict:
    """The checkpoint of the run `cfg.resume`, after checking that the run's config.yaml still
    says what the checkpoint was made with and that `rounds` reaches past it. Tensors are
    memory-mapped, so the CLI can check a big checkpoint before Ray starts at little cost."""
    run_dir = Path(cfg.resume)
    ckpt = load(run_dir, mmap=True)
    check_resumable(ckpt.get("config"), cfg, str(run_dir))
    if ckpt["round"] > int(cfg.rounds):
        raise ConfigError(f"resume: rounds={cfg.rounds} but the checkpoint in {run_dir} is after "
                          f"round {ckpt['round']}; give rounds >= {ckpt['round']}")
    return ckpt


def load(run_dir: Path, mmap: bool = False) -> dict:
    """The run's checkpoint, read only with torch's safe loader (tensors, plain containers
    and the globals registered with `torch.serialization.add_safe_globals`): a run directory
    may come from anyone, and the full unpickler would run any code its file names. A
    plugin whose state holds other objects registers their classes as safe globals."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise ConfigError(f"resume={str(run_dir)!r}: no checkpoint ({path} not found): the run stopped before "
                          "its first checkpoint, or ran with checkpoint_every=0")
    try:
        return torch.load(path, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"resume: {path} holds objects the safe loader refuses ({first[:160]}); raysim never "
                          "unpickles code from a run directory (a plugin registers its own classes with "
                          "torch.serialization.add_safe_globals)") from None
    except Exception as e:  # truncated or not a torch file
        raise ConfigError(f"resume: {path} is not a readable checkpoint ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else 'empty'})") from None
