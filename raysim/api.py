"""The Python API: `raysim.simulate(...)` runs one experiment from a notebook or a script.

It takes what the CLI takes (overrides, `--config` files), runs the same checks before Ray
starts, and returns a `RunResult`: the summary, the per-round metrics and the per-client
records as pandas DataFrames, read from the run directory it wrote. The CLI
(`raysim/run.py`) is a thin layer over the same functions in `raysim.launch`.

    import raysim
    res = raysim.simulate(algorithm="fedprox", rounds=20, overrides={"fedprox.mu": 0.01})
    res.summary["final_accuracy"], res.metrics[["round", "accuracy"]]

A local Ray started by `simulate` stays up for the next call (starting it costs seconds);
`raysim.shutdown()` or the end of the Python process stops it. Errors are raised:
`ConfigError` (bad input, nothing written), `RunDiverged`, `RunFailed`, `Interrupted`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Union

from raysim.errors import NothingToDo
from raysim.launch import check, launch, quiet, say_on_stderr
from raysim.runtime.ray_session import start_ray


@dataclass
class RunResult:
    """What a finished run wrote, read back from its directory."""

    run_dir: Path
    summary: dict

    @classmethod
    def read(cls, run_dir: Union[str, Path]) -> "RunResult":
        run_dir = Path(run_dir)
        return cls(run_dir, json.loads((run_dir / "summary.json").read_text()))

    @property
    def metrics(self):
        """One row per round (metrics.parquet) as a pandas DataFrame."""
        import pyarrow.parquet as pq

        return pq.read_table(self.run_dir / "metrics.parquet").to_pandas()

    @property
    def clients(self):
        """One row per client per round (clients.parquet) as a pandas DataFrame."""
        import pyarrow.parquet as pq

        return pq.read_table(self.run_dir / "clients.parquet").to_pandas()

    @property
    def config(self):
        """The resolved config the run used (its config.yaml)."""
        from omegaconf import OmegaConf

        return OmegaConf.load(self.run_dir / "config.yaml")


def as_overrides(overrides: Union[None, Mapping[str, Any], Iterable[str]] = None, **keys: Any) -> list[str]:
    """`{"fedprox.mu": 0.01}`, `["fedprox.mu=0.01"]` and `rounds=20` keywords as key=value strings."""
    from raysim.errors import ConfigError

    items: list[str] = []
    if isinstance(overrides, Mapping):
        keys = {**dict(overrides), **keys}
    elif isinstance(overrides, str):
        items = [overrides]
    elif overrides is not None:
        if not isinstance(overrides, Iterable):
            raise ConfigError(f"overrides must be a mapping {{key: value}} or a list of 'key=value' strings, got "
                              f"{type(overrides).__name__}")
        items = [str(o) for o in overrides]
    # JSON is YAML: strings stay strings, lists and None keep their meaning on the way back
    return items + [f"{k}={json.dumps(v)}" for k, v in keys.items()]


def config_files(config: Any) -> list[str]:
    """`config=`: one file (a str or Path) or several (a list of them), as a list of paths."""
    from raysim.errors import ConfigError

    if isinstance(config, (str, Path)):
        return [str(config)]
    files = list(config) if isinstance(config, Iterable) and not isinstance(config, Mapping) else None
    if files is not None and all(isinstance(c, (str, Path)) for c in files):
        return [str(c) for c in files]
    raise ConfigError(f"config= takes a config file's path (str or Path) or a list of them, got {config!r:.80}")


def simulate(overrides: Union[None, Mapping[str, Any], Iterable[str]] = None, *, config: Union[str, Path, Iterable[str]] = (),
             progress: bool = True, **keys: Any) -> RunResult:
    """Run one experiment: `configs/default.yaml` < config groups < `config` files <
    `overrides` and keyword keys (dotted keys through `overrides`), exactly as
    `python -m raysim.run`. `progress` prints the start-up lines and a progress bar."""
    t_start = time.time()
    say = say_on_stderr(t_start) if progress else quiet
    try:
        config = config_files(config)
        layers, cfg = check(config, as_overrides(overrides, **keys), say)
    except NothingToDo as e:  # resume= of a finished run: its results, nothing rerun
        say(str(e))
        return RunResult.read(e.run_dir)
    start_ray(cfg.ray, say)
    summary = launch(layers, cfg, t_start, progress=progress, say=say)
    return RunResult.read(summary["run_dir"])


def shutdown() -> None:
    """Stop the processes earlier runs left for reuse (`ray.reuse_workers`) and the local
    Ray that `simulate` started (a joined cluster is only disconnected)."""
    import ray

    from raysim.runtime import pool

    if ray.is_initialized():
        pool.release()
    ray.shutdown()
    pool.forget()


def load(run_dir: Union[str, Path]) -> RunResult:
    """A finished run's results, from its directory."""
    return RunResult.read(run_dir)


__all__ = ["RunResult", "simulate", "shutdown", "load"]
