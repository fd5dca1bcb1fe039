"""Every check a run needs before anything runs and that needs no data: the config resolved
against the schema, the run directory, a resumed run's lock and checkpoint. The cold command
runs it in a forked child (`launch.check_apart`), the warm service's server for its command
(`ServerActor.check`), `raysim.simulate` in its own process."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from raysim.config import describe_layers, resolve
from raysim.errors import ConfigError, NothingToDo


def quiet(line: str, at=None) -> None:
    """A `say` that says nothing."""


def check_layers(layers: list, cwd: str, say: Callable[[str], None] = quiet):
    """`check` from the layers read (the warm service's server runs it for the command)."""
    cfg = resolve(layers, cwd)
    if cfg.resume:
        from raysim.checkpoint import load_checked
        from raysim.run_lock import check_free

        check_finished(cfg)
        check_free(cfg.resume)  # not being run by another process right now
        load_checked(cfg)  # a safe, readable checkpoint that config.yaml still describes
    else:
        run_dir_for(cfg)  # refuses a run directory that exists, an output_dir under a file
    if cfg.data_store == "files" or (cfg.data_store == "auto" and cfg.data_store_dir):  # where the arrays may go
        from raysim.data.store import root

        can_create_in("data_store_dir", cfg.data_store_dir or root(cfg))
    if cfg.system.profile == "trace":  # a malformed device trace: one line naming the file and the row, now
        from raysim.world.traces import read_devices

        read_devices(cfg.system.trace)
    if cfg.system.availability == "trace":
        from raysim.world.traces import read_intervals

        read_intervals(cfg.system.availability_trace)
    for line in describe_layers(layers, cfg):
        say(line)
    return cfg


def check_finished(cfg) -> None:
    """`resume=` of a run whose summary says it finished `rounds` rounds: `NothingToDo`."""
    import json
    from pathlib import Path

    try:
        summary = json.loads((Path(cfg.resume) / "summary.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(summary, dict) and summary.get("status") == "finished" and summary.get("rounds", 0) >= int(cfg.rounds):
        raise NothingToDo(f"run {cfg.resume} already finished ({summary['rounds']} rounds); nothing to do "
                          f"(rounds=N with N > {summary['rounds']} runs more rounds)", str(cfg.resume))


def run_dir_for(cfg: DictConfig) -> Path:
    """`output_dir/run_name` (default name: algorithm-dataset-timestamp); must not exist."""
    name = cfg.run_name or f"{cfg.algorithm}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(cfg.output_dir)
    can_create_in("output_dir", cfg.output_dir)
    run_dir = out / name
    if run_dir.exists():
        raise ConfigError(f"run directory {run_dir} already exists; choose another run_name or output_dir")
    return run_dir


def can_create_in(key: str, value) -> None:
    """The folder `value` of config key `key` exists or can be made: the nearest part of it
    that exists is a folder this process can create folders in (found now rather than after
    Ray started: a read-only mount, /proc, no permission). A ConfigError naming the key."""
    path = Path(str(value)).expanduser()
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ConfigError(f"{key}={str(value)!r}: {folder} is a file, not a folder; choose another {key}")
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".raysim-check-", dir=folder))
            except OSError as e:
                raise ConfigError(f"{key}={str(value)!r}: cannot create folders in {folder} "
                                  f"({e.strerror or type(e).__name__}); choose another {key}") from None
            return
