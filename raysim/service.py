"""The warm local service: `python -m raysim.up` starts it, `python -m raysim.down` stops it.

Every `python -m raysim.run` pays a Ray start and three fresh torch imports (~10 s on two
cores) for rounds that take a fraction of a second. `raysim.up` starts one local Ray (on
loopback, with Ray's token authentication: the token is a 0600 file in the service's
folder) holding a detached, warm server actor; a later `raysim.run` without `ray.address`
finds the service (its address file), joins that Ray and drives the run with the warm
server, whose client actors stay between commands: the same reuse as `raysim.simulate`'s
in one process (runtime/pool.py), with the same rule. A run leaves nothing of itself in the
processes (each run seeds everything from its own config), so a run on the service gives
the model a cold command gives, bit for bit (tested); the server is kept only while the
code it imported (raysim's sources and the run's plugins) is unchanged on disk
(`pool.code_stamp`), otherwise the command starts a new one.

One run at a time: a command holds the service's lock (a file lock, released when its
process ends however it ends) and a second command waits, saying so. Ctrl-C stops that
command's run; its server is replaced by a fresh one, and the service stays up.

Files, in `RAYSIM_SERVICE_DIR` (default: <temp>/raysim-service-<uid>): `address` (the GCS
address, written when the service is up), `version` (`stamp()`: a command of another raysim, Ray
or Python refuses the service in one line), `token`, `lock`, `ray/` (Ray's temp folder, whose
path every process of this Ray carries: `down` stops exactly those).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

NAMESPACE = "raysim-service"
SERVICE_FORMAT = 1  # the files below; raise it when they change
SERVER_NAME = "raysim-server"


def folder() -> Path:
    return Path(os.environ.get("RAYSIM_SERVICE_DIR") or Path(tempfile.gettempdir()) / f"raysim-service-{os.getuid()}")


def address() -> Optional[str]:
    """The running service's GCS address, or None (no address file, or nothing listens there)."""
    try:
        if folder().stat().st_uid != os.getuid():  # another user's folder in a shared temp: not ours to use
            return None
        addr = (folder() / "address").read_text().strip()
        host, port = addr.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=1).close()
        return addr
    except (OSError, ValueError):
        return None


def stamp() -> str:
    """What a service's processes must share with a command that joins them: raysim's folder
    format and version, Ray's version (the wire protocol) and Python's (pickled code)."""
    import importlib.metadata

    from raysim import __version__

    return (f"raysim {__version__} (service format {SERVICE_FORMAT}), Ray {importlib.metadata.version('ray')}, "
            f"Python {sys.version_info[0]}.{sys.version_info[1]}")


def check_stamp() -> None:
    """ConfigError (one line) when the running service was started by another raysim, Ray or
    Python than this command's: joining it would fail deep inside Ray."""
    from raysim.errors import ConfigError

    try:
        theirs = (folder() / "version").read_text().strip()
    except OSError:
        theirs = "a raysim that writes no version file"
    if theirs != stamp():
        raise ConfigError(f"the raysim service in {folder()} was started by {theirs}; this command is {stamp()}: "
                          "stop it (python -m raysim.down) and start it again (python -m raysim.up)")


def use_token() -> None:
    """Ray's token authentication for this process and its children, from the service's token
    file; before Ray is imported (Ray reads these when it starts)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(folder() / "token")
    os.environ.pop("RAY_AUTH_TOKEN", None)


def connect(addr: str) -> None:
    """Join the service's Ray as a driver (in its namespace, where the warm server has its name)."""
    import logging

    from raysim.runtime.ray_session import loopback_only

    use_token()
    with loopback_only():  # else Ray swaps 127.0.0.1 for the machine's address, where nothing listens
        import ray

        ray.init(address=addr, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)


# ---------------------------------------------------------------- the command's side: the warm server
class WarmServers:
    """`launch.drive`'s source of server actors on the service. `checker` takes the detached
    warm server (or starts a new one when the code it imported changed on disk since) to
    check the command's config; `take` hands it to the run (a fresh one with
    ray.reuse_workers=false); `give_back` keeps it, its code stamp updated, or replaces it."""

    def __init__(self):
        self.server = None

    def checker(self, say: Callable[[str], None]):
        import ray

        from raysim.runtime import pool

        try:
            server = ray.get_actor(SERVER_NAME, namespace=NAMESPACE)
        except ValueError:
            server = None
        if server is not None:
            try:
                plugins, stamp = ray.get(server.kept.remote(), timeout=60)
                if stamp == pool.code_stamp(plugins):
                    self.server = server
                    return server
                say("raysim's code changed on disk since the service's server started: starting a new one")
            except Exception:  # died: start another
                pass
            _stop(server)
        say("starting the service's server")
        self.server = new_server()
        return self.server

    def take(self, reuse: bool, name: str, say: Callable[[str], None]):
        server, self.server = self.server or self.checker(say), None
        if not reuse:
            _stop(server)
            say("ray.reuse_workers=false: a new server for this run")
            return new_server()
        say("the service's warm server runs it (python -m raysim.up)")
        return server

    def give_back(self, server, keep: bool, plugins) -> None:
        import ray

        from raysim.runtime import pool

        if keep:
            imported = sorted(set(ray.get(server.kept.remote())[0]) | set(plugins or ()))
            ray.get(server.keep.remote(imported, pool.code_stamp(imported)))
        else:
            _stop(server)
            new_server()  # the service stays warm for the next command


def new_server():
    """A detached server actor under the service's name (its process starts importing torch
    and raysim at once; nobody waits for it here)."""
    from raysim.runtime import pool
    from raysim.runtime.server_actor import remote_server

    server = remote_server().options(name=SERVER_NAME, namespace=NAMESPACE, lifetime="detached").remote()
    server.warm.remote()
    server.keep.remote([], pool.code_stamp([]))  # the code it is importing now
    return server


def _stop(server) -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.kill(server)  # its client actors go with it
    for _ in range(100):  # Ray frees the name asynchronously
        try:
            ray.get_actor(SERVER_NAME, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)


@contextlib.contextmanager
def one_run_at_a_time(say: Callable[[str], None]):
    """The service's lock for the block; a second command waits for the first, saying so."""
    path = folder() / "lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another command"
            print(f"raysim: the service is running another run ({holder}); waiting for it to end "
                  "(Ctrl-C stops waiting)", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- up and down
def up(num_cpus: Optional[int] = None, say: Callable[[str], None] = print, dashboard: bool = False) -> int:
    """Start the service (a no-op, said, when it runs); `dashboard`: with Ray's Dashboard on
    loopback, behind the service's token."""
    import secrets
    import subprocess

    if (addr := address()) is not None:
        say(f"the raysim service is already up at {addr} ({folder()}); `python -m raysim.down` stops it")
        return 0
    down(quiet=True)  # what a service that died left behind
    d = folder()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = d / "token"
    token.touch(mode=0o600)
    token.chmod(0o600)  # a token file left by an earlier service keeps no wider mode
    token.write_text(secrets.token_hex(32))
    port = _free_port()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN_PATH=str(token))
    env.pop("RAY_AUTH_TOKEN", None)
    board = _free_port() if dashboard else None
    cmd = ["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
           *([f"--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={board}"] if board
             else ["--include-dashboard=false"]),
           "--disable-usage-stats", f"--temp-dir={d / 'ray'}"] + ([f"--num-cpus={num_cpus}"] if num_cpus else [])
    say(f"starting Ray on 127.0.0.1:{port} (token authentication; {d})")
    log = d / "ray-start.log"  # a file, not a pipe: Ray's daemons inherit it and never close it
    with open(log, "w") as out:
        r = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *cmd[1:]], env=env, stdout=out,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        down(quiet=True)
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        print(f"error: Ray did not start ({log}): {tail[0][:300]}", file=sys.stderr)
        return 1
    addr = f"127.0.0.1:{port}"
    connect(addr)
    import ray

    server = new_server()
    ray.get(server.ping.remote())  # torch and raysim imported
    (d / "version").write_text(stamp())
    (d / "address").write_text(addr)
    say(f"the raysim service is up at {addr}: `python -m raysim.run ...` uses it; `python -m raysim.down` stops it")
    if board:
        from raysim.runtime.ray_session import dashboard_line

        say(dashboard_line(f"127.0.0.1:{board}"))  # connect() pointed RAY_AUTH_TOKEN_PATH at the service's token
    return 0


def down(quiet: bool = False) -> int:
    """Stop every process of the service's Ray (found by its temp folder) and remove the address."""
    import psutil

    d = folder()
    with contextlib.suppress(OSError):
        (d / "address").unlink()
    mark = str(d / "ray")
    ours: dict = {}
    for p in psutil.process_iter(["cmdline"]):  # Ray's GCS, raylet and agents name the folder; workers are theirs
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and any(mark in a for a in p.info["cmdline"] or []):
                for q in [p, *p.children(recursive=True)]:
                    ours[q.pid] = q
    ours = list(ours.values())
    for p in ours:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(ours, timeout=10)
    if not quiet:
        print(f"the raysim service is down ({len(ours)} processes stopped)" if ours else
              "no raysim service was running")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
