"""The server's host: `ServerHost`, and the named server actor, `raysim-server`, made of it.

A thin shell: the process starts without torch; `start_clients`, the driver's first
call, starts the run's client actors at once (their processes import torch while this one
does); `setup` imports `raysim.runtime.server`, makes a new `FederatedServer` for each run
(a finished run's server serves the next run of the session: runtime/pool.py), and every
other call is handed to it. The CLI sends the config layers (plain dicts), which the server
resolves again in its own process.

The command line on a local Ray it started hosts the server in its own process
(`launch.HereServers`: one process fewer, the check's torch import reused); the service,
`raysim.simulate`, sweeps and a joined cluster use the actor (`ServerActor`), whose process
Ray places and can restart apart from the caller's.
"""
from __future__ import annotations

import os
import traceback
from pathlib import Path

from raysim import lazy_ray
from raysim.lazy_ray import ray

from raysim.errors import ConfigError, RunDiverged


class ServerHost:
    def __init__(self):
        self.server = None
        self.started = None  # what start_clients started for the coming setup, or why it could not
        self.plugins, self.stamp = [], None  # the warm service's record (raysim/service.py)

    def warm(self) -> None:
        """Import torch and the server's code now (the warm service's server, between commands)."""
        import raysim.runtime.server  # noqa: F401  (torch and the rest)

    def start_clients(self, cfg: dict, cwd: str) -> None:
        """Start the coming run's client actors (the driver's resolved config): before this
        process imports torch, so theirs and its imports overlap. The run directory's name,
        which names them, is chosen here too. A problem (no room for the actors, the run
        directory taken) is raised by `setup`, where the driver looks for it."""
        from omegaconf import OmegaConf

        from raysim.preflight import run_dir_for
        from raysim.runtime.clients import start_client_actors

        os.chdir(cwd)
        try:
            c = OmegaConf.create(cfg)
            run_dir = Path(c.resume) if c.resume else run_dir_for(c)
            # no Ray yet (a command on its own machine): the server decides after the data (server.attach)
            self.started = (run_dir, start_client_actors(c, run_dir.name) if lazy_ray.initialized() else None)
        except Exception as e:  # noqa: BLE001  (raised again by setup)
            self.started = e

    def ping(self) -> bool:
        return True

    def kept(self) -> tuple:
        """(plugin modules imported, the code stamp they and raysim had when the last run ended)."""
        return self.plugins, self.stamp

    def keep(self, plugins: list, stamp: tuple) -> None:
        self.plugins, self.stamp = list(plugins), stamp

    def check(self, layers: list, cwd: str) -> tuple:
        """`preflight.check_layers` here (the service's command imports no torch): (the lines to
        say, the resolved config as plain containers)."""
        import os

        from omegaconf import OmegaConf

        from raysim.preflight import check_layers

        os.chdir(cwd)
        lines: list = []
        cfg = check_layers(layers, cwd, lines.append)
        return lines, OmegaConf.to_container(cfg)

    def setup(self, layers: list, cwd: str, t_start: float) -> dict:
        from raysim.runtime.server import FederatedServer

        if self.server is not None:
            self.server.stop_actors()  # those an earlier run did not leave to the pool
        started, self.started = self.started, None
        if isinstance(started, Exception):
            raise started
        self.server = FederatedServer(t_start)
        return self.server.setup(layers, cwd, started)

    def attach(self) -> dict:
        """After `setup` asked for Ray (`start_ray` in its answer) and the caller started it."""
        return self.server.attach()

    def stop_actors(self) -> None:
        """Stop the client actors of the run in hand (an in-process server's end, launch.InProcess)."""
        if self.server is not None:
            self.server.stop_actors()

    def placed(self, timeout: float) -> int:
        return self.server.placed(timeout)

    def open_run(self) -> dict:
        return self.server.open_run()

    def step(self, rnd: int) -> dict:
        try:
            return self.server.step(rnd)
        except (ConfigError, RunDiverged):  # one line each, logged by the server
            raise
        except Exception:  # the whole story (a client actor's traceback inside ours) goes to log.txt
            self.server.log_failure(rnd, traceback.format_exc())
            raise

    def finish(self) -> dict:
        return self.server.finish()

    def flush(self) -> None:
        self.server.flush()

    def state_bytes(self) -> dict:
        return self.server.state_bytes()

    def actor_info(self) -> list:
        return self.server.actor_info()


class ServerActor(ServerHost):
    """The Ray actor (its processes are named `ray::ServerActor`): `remote_server()`."""


_actor = None


def remote_server():
    """`ServerActor` as a Ray actor class: made on first use, so that importing this module
    imports no Ray (the command hosting its server with no Ray: runtime/here.py)."""
    global _actor
    if _actor is None:
        _actor = ray.remote(num_cpus=0, max_restarts=0)(ServerActor)
    return _actor
