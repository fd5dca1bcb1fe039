"""Worker processes kept between runs in one Ray session (`ray.reuse_workers`, on by default).

Starting a process that imports torch costs ~1.5 s, several seconds when a run's server and
client actors start together on two cores; a short run's rounds take well under a second.
So a finished run leaves its processes for the next run of the same Ray session (a notebook
calling `raysim.simulate`, a sweep, a test suite): the caller keeps the server actor
(`warm_server` / `keep_server`, in the caller's process) and the server keeps its client
actors (`take_client_actors` / `keep_client_actors`, in the server's process).

Nothing of a run survives in them: the server builds a new `FederatedServer` per run and
seeds its RNGs from the run's seed; a client actor gets the run's config, data and plugins
with its first call of the run and seeds every client from (seed, round, client id). The
same run gives the same model on warm and on fresh processes (tested). What does survive is
imported code, so a server is reused only while raysim's sources and the run's plugin
modules are unchanged on disk (`code_stamp`); edits to other modules a plugin imports need
`raysim.shutdown()` or `ray.reuse_workers=false`. A run that fails does not leave its
processes. The CLI's Ray stops when the command ends, so there this changes nothing. A
sweep whose points ask for no Ray runs them in its own process (`sweep.run_here`), each
point taking what the last one kept. One on Tune releases its caller's before its points
start (its points run in Tune's processes, which cannot take them over, and would wait for
their CPUs); Tune then runs each point in a finished point's process (`reuse_actors`),
which kept that point's.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

from raysim.lazy_ray import ray

# ---------------------------------------------------------------- the caller's side: the server
# the caller's last finished run's server; "key": (node id, job id, code stamp) when it was kept;
# "plugins": every plugin module it or its client actors imported
_warm: dict = {}


def code_stamp(plugins) -> tuple:
    """(path, mtime, size) of raysim's Python files (the package and the algorithms folder
    installed as raysim.algorithms) and of the plugin modules' files."""
    algorithms = importlib.util.find_spec("raysim.algorithms").submodule_search_locations
    roots = [Path(__file__).resolve().parents[1], *(Path(p).resolve() for p in algorithms)]
    for name in sorted(plugins or ()):
        try:
            spec = importlib.util.find_spec(str(name))
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            roots += [Path(p) for p in spec.submodule_search_locations]
        elif spec is not None and spec.origin:
            roots.append(Path(spec.origin))
    files = [f for r in roots for f in (sorted(r.rglob("*.py")) if r.is_dir() else [r])]
    return tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.exists())


def _session_key(plugins) -> tuple:
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), ctx.get_job_id(), code_stamp(plugins)


def warm_server(reuse: bool = True) -> Optional[Any]:
    """The server actor of this session's last finished run, if `reuse`, the code its
    processes imported is unchanged on disk and its process is alive; taken out of the pool
    (a run owns it until `keep_server`). One that is not reused is stopped (its name is the
    new server's)."""
    server, key, plugins = _warm.pop("server", None), _warm.pop("key", None), _warm.pop("plugins", ())
    if server is None:
        return None
    if reuse and key == _session_key(plugins):
        try:
            ray.get(server.ping.remote(), timeout=10)
            _warm["plugins"] = plugins  # until keep_server adds this run's
            return server
        except Exception:  # died, or belongs to a Ray that was shut down since
            pass
    try:
        ray.kill(server)  # its client actors go with it
        ray.get(server.ping.remote(), timeout=10)  # raises once it is gone, and its name free
    except Exception:
        pass
    return None


def keep_server(server, plugins) -> None:
    imported = tuple(sorted(set(_warm.pop("plugins", ())) | set(plugins or ())))
    _warm.update(server=server, plugins=imported, key=_session_key(imported))


def release() -> None:
    """Stop the kept server and its idle client actors (they hold CPUs and GPUs)."""
    warm_server(reuse=False)


def forget() -> None:
    """Drop every kept handle once this process's Ray is shut down: its actors went with it,
    and a later Ray in the same process (the CLI's `main` called twice, `--verify`'s runs)
    must not take them (Ray: "Can't find actor ... from a different cluster")."""
    _warm.clear()
    _idle.clear()


# ---------------------------------------------------------------- the server's side: client actors
_idle: list[tuple[tuple, Any]] = []  # (what the actor reserves: (cpus, gpus), handle)
_names: set = set()  # the actor names this server process has given


def actor_name(i: int, run: str) -> str:
    """`raysim-client-<i>.<run>`, made unique among the names this process gave: an actor
    just stopped may still hold its name for a moment (Ray frees it asynchronously)."""
    name, k = f"raysim-client-{i}.{run}", 1
    while name in _names:
        k += 1
        name = f"raysim-client-{i}.{run}.{k}"
    _names.add(name)
    return name


def take_client_actors(needs: tuple, n: int) -> list:
    """Up to `n` idle client actors that reserve `needs`. Idle ones that reserve something
    else are stopped (they hold CPUs and GPUs the run's new actors may need); more of the
    same than the run takes stay idle, for a later run of more actors (a run of fewer starts
    no actor, so they hold nothing it needs)."""
    taken, spare, stop = [], [], []
    for have, actor in _idle:
        if have != needs:
            stop.append(actor)
        elif len(taken) < n:
            taken.append(actor)
        else:  # n = 0 (ray.reuse_workers=false): the run starts all its actors, so none stays
            (spare if n else stop).append(actor)
    for actor in stop:
        ray.kill(actor)
    _idle[:] = [(needs, actor) for actor in spare]
    return taken


def keep_client_actors(needs: tuple, actors: list) -> None:
    _idle.extend((needs, a) for a in actors)
