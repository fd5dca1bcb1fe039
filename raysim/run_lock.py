"""`<run dir>/.lock`: one process drives a run directory at a time.

Every process that drives a run directory holds its lock until the command (or
`raysim.simulate`) returns: a resumed run from before Ray starts, a new run from the moment
the server has made the directory (before round 1, whose checkpoint a resume would need).
A second `resume=DIR` of the same run is refused at once instead of both writing the same
files. The file records the holder's host, PID and
process start time; a lock whose process is gone (killed with SIGKILL, a crashed machine
rebooted) is stale and taken over. A lock held on another host cannot be checked from
here: the message says how to remove it.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

from raysim.errors import ConfigError

FILE = ".lock"


def _me() -> str:
    import psutil

    return f"{socket.gethostname()} {os.getpid()} {psutil.Process().create_time():.3f}"


def holder(run_dir) -> Optional[str]:
    """'host pid start' of the live process holding the run's lock, or None (no lock, or a
    stale one: its process has ended)."""
    import psutil

    try:
        text = (Path(run_dir) / FILE).read_text().strip()
    except OSError:
        return None
    parts = text.split()
    if len(parts) != 3:
        return None  # not ours, or half-written: stale
    host, pid, start = parts
    if host != socket.gethostname():
        return text  # another machine's process: assume it runs
    try:
        proc = psutil.Process(int(pid))
        return text if abs(proc.create_time() - float(start)) < 1.0 else None  # a reused PID is another process
    except (psutil.NoSuchProcess, ValueError):
        return None


def check_free(run_dir) -> None:
    """Refuse, with one line, a run directory another live process is driving."""
    held = holder(run_dir)
    if held is not None and held != _me():
        host, pid, _ = held.split()
        raise ConfigError(f"{run_dir} is in use: process {pid} on {host} is running it (resumed or still going); "
                          f"wait for it to end or stop it (if no such process runs, remove {Path(run_dir) / FILE})")


class RunLock:
    """Held while a command drives `run_dir` (a context manager)."""

    def __init__(self, run_dir):
        self.path = Path(run_dir) / FILE
        self.held = False

    def __enter__(self) -> "RunLock":
        for _ in range(2):  # once more after removing a stale lock
            check_free(self.path.parent)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if holder(self.path.parent) is None:
                    self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(_me() + "\n")
            self.held = True
            return self
        check_free(self.path.parent)
        raise ConfigError(f"could not take the lock {self.path}: another process took it at the same moment")

    def __exit__(self, *exc) -> None:
        if self.held and holder(self.path.parent) == _me():
            self.path.unlink(missing_ok=True)
        self.held = False
