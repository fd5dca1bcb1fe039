"""Every check a run needs before anything runs and that needs no data: the config resolved
against the schema, the run directory, a resumed run's lock and checkpoint. The cold command
runs it in a forked child (`launch.check_apart`), the warm service's server for its command
(`ServerActor.check`), `raysim.simulate` in its own process."""
from __future__ import annotations

from typing import Callable

from raysim.config import describe_layers, resolve
from raysim.errors import NothingToDo


def quiet(line: str) -> None:
    """A `say` that says nothing."""


def check_layers(layers: list, cwd: str, say: Callable[[str], None] = quiet):
    """`check` from the layers read (the warm service's server runs it for the command)."""
    cfg = resolve(layers, cwd)
    if cfg.resume:
        from raysim.runtime.checkpoint import load_checked
        from raysim.runtime.run_lock import check_free

        check_finished(cfg)
        check_free(cfg.resume)  # not being run by another process right now
        load_checked(cfg)  # a safe, readable checkpoint that config.yaml still describes
    else:
        from raysim.experiment import run_dir_for

        run_dir_for(cfg)  # refuses a run directory that exists, an output_dir under a file
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
