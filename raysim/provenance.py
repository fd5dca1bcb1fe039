"""What a run's numbers depend on beyond its config, for its summary.json and the results
table's runs.csv (issue 72): the raysim code that ran (its git commit, `-dirty` when tracked
files differ from it) and a hash of the config's computing keys (`config_sha256`: two runs
with the same hash ran the same experiment; where they were written does not count)."""
from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from pathlib import Path

from omegaconf import DictConfig


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The commit of the raysim checkout this module runs from, '<sha>-dirty' with changes to
    tracked files; the installed package's version outside a checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"raysim {version('raysim')}"
        except PackageNotFoundError:
            return "unknown"


def config_sha256(cfg: DictConfig) -> str:
    """A hash of the keys that decide what the run computes (config/record.py's run record)."""
    from raysim.config.record import run_record

    return hashlib.sha256(json.dumps(run_record(cfg), sort_keys=True, default=str).encode()).hexdigest()
