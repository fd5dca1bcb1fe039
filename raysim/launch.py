"""Starting Ray and driving one run from the caller's process (the CLI or `raysim.simulate`).

`check` reads and validates the config before Ray starts (a typo costs a second or two);
`start_ray` starts a local Ray (on loopback only) or joins `ray.address`; `launch` starts
the server actor, waits (bounded) for the client actors to be placed, steps the rounds and
returns the summary. Failures come back as exceptions whose message is a few lines:
`ConfigError` (bad input, nothing written), `RunDiverged`, `RunFailed` (an exception in
an algorithm's or a plugin's code; the full traceback is in the run's log.txt),
`ServerDied` and `Interrupted` (both say how to resume).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from typing import Callable, Optional

from raysim.config import ConfigError, describe_layers, read_layers, resolve
from raysim.errors import NothingToDo, RunDiverged, WriteFailed

# Set by the CLI's Ctrl-C / SIGTERM handler (run.py). A KeyboardInterrupt raised inside Ray's
# own code can be lost there (seen: a Ctrl-C in round 2 ignored, all 400 rounds run); the
# round loop checks this flag after every round, so a stop is never lost.
stop_requested = threading.Event()

Say = Callable[[str], None]


def say_on_stderr(t_start: float) -> Say:
    """Progress lines on stderr, stamped with the seconds since `t_start`."""
    def say(line: str) -> None:
        print(f"raysim [{time.time() - t_start:5.1f} s] {line}", file=sys.stderr, flush=True)
    return say


def quiet(line: str) -> None:
    pass


class ServerDied(Exception):
    """The server actor's process died mid-run (killed, out of memory)."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the rounds that ran are kept; the message says how to resume."""


class RunFailed(Exception):
    """An exception raised by an algorithm's, selection's or plugin's code during a round.
    The message is a few lines: the exception, where it was raised; log.txt has the rest."""


def check(config_files=(), overrides=(), say: Say = quiet) -> tuple[list, object]:
    """Read and resolve the config and check everything that needs no data (names, keys,
    values, the run directory, a resumed run's checkpoint): before Ray starts."""
    layers = read_layers(config_files, overrides)
    cfg = resolve(layers, os.getcwd())
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
    return layers, cfg


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


def check_apart(config_files=(), overrides=(), say: Say = quiet) -> tuple[list, object]:
    """`check` in a forked child process, for the command line: checking imports every
    algorithm's module and with them torch (~500 MB, ~2 s), which the command itself never
    needs (its server and client actors are other processes); the child's memory goes when
    it exits. Same result, same errors; in-process where there is no fork."""
    if not hasattr(os, "fork") or "torch" in sys.modules:
        return check(config_files, overrides, say)
    import pickle

    from omegaconf import OmegaConf

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: check, send back plain containers or the error, leave at once
        os.close(read)
        try:
            layers, cfg = check(config_files, overrides, say)
            out = ("ok", layers, OmegaConf.to_container(cfg))
        except ConfigError as e:
            out = ("error", str(e), None)
        except NothingToDo as e:
            out = ("finished", str(e), None)
        except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent reports it
            out = ("interrupted", "", None)
        except BaseException as e:  # noqa: BLE001  (reported by the parent, as in-process)
            out = ("crash", f"{type(e).__name__}: {e}", None)
        try:
            with os.fdopen(write, "wb") as f:
                pickle.dump(out, f)
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001  (the parent is gone, e.g. Ctrl-C: nothing to say)
            pass
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    if not data:
        raise ConfigError("checking the config failed: its process ended without an answer")
    kind, first, cfg = pickle.loads(data)
    if kind == "error":
        raise ConfigError(first)
    if kind == "finished":
        raise NothingToDo(first)
    if kind == "interrupted":
        raise KeyboardInterrupt
    if kind == "crash":  # not bad input the checks know: a bug, said in one line
        raise RunFailed(f"checking the config failed: {first}")
    return first, OmegaConf.create(cfg)


def start_ray(ray_cfg, say: Say = quiet, command: bool = False) -> bool:
    """Connect to `ray.address`, or start a local Ray (and `raysim.runtime.reaper`, which stops it if
    this process is killed outright). Returns True if we started it. `command`: the caller
    is a command-line process, which Ctrl-C may end inside `ray.init` (`interruptible`);
    not so for `raysim.simulate`, whose process may be a notebook's kernel."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return False
    if ray_cfg.address:
        say(f"joining the Ray cluster at {ray_cfg.address}")
        import ray

        check_reachable(ray_cfg.address)
        try:
            with interruptible("while joining the Ray cluster") if command else contextlib.nullcontext():
                ray.init(address=ray_cfg.address, logging_level=logging.ERROR, log_to_driver=False)
        except ConnectionError as e:
            raise ConfigError(f"ray.address={ray_cfg.address!r}: cannot connect: {first_line(e)}") from None
        return False
    say("starting a local Ray" + (f" with {ray_cfg.num_cpus} CPUs" if ray_cfg.num_cpus else ""))
    with loopback_only():
        import ray

        try:
            store = ray_cfg.get("object_store_gb")
            with interruptible("while starting the local Ray") if command else contextlib.nullcontext():
                ctx = ray.init(num_cpus=ray_cfg.num_cpus, include_dashboard=bool(ray_cfg.dashboard),
                               object_store_memory=int(store * 2**30) if store else None,
                               logging_level=logging.ERROR, log_to_driver=False)
        except Exception as e:  # e.g. a time-out waiting for Ray's processes on a loaded machine
            raise ConfigError(f"Ray did not start on this machine ({type(e).__name__}: {first_line(e)}); Ray's "
                              "logs are in its temp folder's session_latest/logs; a time-out here means the "
                              "machine was too loaded: retry") from None
    import subprocess

    subprocess.Popen([sys.executable, "-m", "raysim.runtime.reaper", str(os.getpid())], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if ray_cfg.dashboard:
        say(f"Ray's dashboard: http://{ctx.dashboard_url} (it asks for a token only when Ray runs with "
            "RAY_AUTH_MODE=token: see README, Security)")
    return True


@contextlib.contextmanager
def interruptible(what: str):
    """Ctrl-C and SIGTERM end the process at once (exit 130) while the block runs, even when
    the main thread sits in Ray's C++ code and never returns to Python to run a signal
    handler (`ray.init` retrying an address). Python's C-level handler writes each signal's
    number to a wake-up pipe; a watcher thread reads it and exits, stopping the processes
    this one started (a half-started local Ray). Outside the main thread: a plain block."""
    import select
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if select.select([r], [], [], 0.2)[0]:
                got = os.read(r, 64)
                if not done.is_set() and (signal.SIGINT in got or signal.SIGTERM in got):
                    print(f"interrupted {what}: nothing was written", file=sys.stderr, flush=True)
                    _stop_children()
                    os._exit(130)

    watcher = threading.Thread(target=watch, name="raysim-interruptible", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        watcher.join()
        os.close(r)
        os.close(w)


def _stop_children() -> None:
    """Kill this process's child processes (a local Ray's raylet, GCS and workers)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


@contextlib.contextmanager
def loopback_only():
    """Ray binds its servers to the node's IP address, and to loopback only when that address
    is 127.0.0.1. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (Ray's laptop setting, read when ray
    is first imported) makes a single-machine Ray take 127.0.0.1. Set only while the local
    Ray starts: a multi-node `ray start` later in this process's children would refuse it."""
    key = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    ours = key not in os.environ and "ray" not in sys.modules
    if ours:
        os.environ[key] = "0"
    try:
        yield
    finally:
        if ours:
            os.environ.pop(key, None)


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail within about `timeout` seconds, with one line, when `ray.address` is not a Ray
    head: nothing listens there, or something else does (the dashboard's port, an SSH
    tunnel to another service, a proxy). Ray itself retries such an address for minutes, or
    for ever, printing C++ warnings. A GCS address is asked the GCS's own question
    (`GetClusterId`, plain gRPC with a deadline); `ray://` (Ray Client) and `auto` are left
    to Ray, which answers them at once."""
    if address == "auto" or address.startswith("ray://"):
        if address.startswith("ray://"):
            host, port = address[len("ray://"):].rsplit(":", 1)
            _connect(address, host, port, timeout)
        return
    host, port = address.rsplit(":", 1)
    _connect(address, host, port, timeout)
    import grpc

    channel = grpc.insecure_channel(f"{host}:{port}", options=[("grpc.enable_http_proxy", 0)])
    try:
        channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(b"", timeout=timeout)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        if code == grpc.StatusCode.UNAUTHENTICATED:  # a GCS with token auth (RAY_AUTH_MODE=token): Ray's
            return
        why = ("it does not answer within {:g} s".format(timeout) if code == grpc.StatusCode.DEADLINE_EXCEEDED
               else "it speaks gRPC but has no Ray GCS service" if code == grpc.StatusCode.UNIMPLEMENTED
               else "it does not speak Ray's protocol (gRPC)")
        raise ConfigError(f"ray.address={address!r}: {host}:{port} answers but is not a Ray head node's GCS ({why}); "
                          "give the head node's GCS address (`ray status` on the head node; port 6379 by default), "
                          "not the dashboard's (8265) or the Ray Client's (10001, as ray://host:10001)") from None
    finally:
        channel.close()


def _connect(address: str, host: str, port: str, timeout: float) -> None:
    import socket

    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise ConfigError(f"ray.address={address!r}: nothing answers at {host}:{port} ({type(e).__name__}: "
                          f"{first_line(e) or 'timed out'}); check the address and port (the head node's "
                          "`ray status`), that the head node runs, and that firewalls / security groups "
                          "let this machine in") from None


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""


def launch(layers: list, cfg, t_start: float, progress: bool = True, say: Say = quiet,
           server_name: str = "raysim-server") -> dict:
    """`drive` the run; a resumed run holds its run directory's lock meanwhile."""
    from raysim.runtime.run_lock import RunLock

    with RunLock(cfg.resume) if cfg.resume else contextlib.nullcontext():
        return drive(layers, cfg, t_start, progress, say, server_name)


def drive(layers: list, cfg, t_start: float, progress: bool = True, say: Say = quiet,
          server_name: str = "raysim-server") -> dict:
    """Start the server actor on this node (it writes the run directory here), or take the
    one a finished run of this session left (`ray.reuse_workers`, runtime/pool.py), wait for
    the client actors, run every round, return the summary. `server_name`: the server
    actor's name (a sweep's points that run at once each have their own)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raysim.runtime import pool
    from raysim.runtime.server_actor import ServerActor

    reuse = bool(cfg.ray.reuse_workers)
    server = pool.warm_server(reuse)
    if server is None:
        here = ray.get_runtime_context().get_node_id()
        server = ServerActor.options(
            name=server_name, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote()
        say("starting the server: it loads and partitions the data while the client actors start")
    else:
        say("the server and client actors of the last run are reused (ray.reuse_workers); loading the data")
    bar = None
    run_dir = None
    keep = False
    try:
        info = ray.get(server.setup.remote(layers, os.getcwd(), t_start))
        if info.get("notice"):
            print(f"note: {info['notice']}", file=sys.stderr)
        say(f"data ready; waiting for {info['actors']} client actors ({info['needs']} each)")
        wait_for_actors(server, info, say)
        info = ray.get(server.open_run.remote())
        run_dir = info["run_dir"]
        say(info["banner"])
        say(f"run directory: {run_dir}")
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=info["rounds"], unit="round", dynamic_ncols=True)
            bar.update(info["start_round"] - 1)
        for rnd in range(info["start_round"], info["rounds"] + 1):
            row = ray.get(server.step.remote(rnd))
            if stop_requested.is_set():
                raise KeyboardInterrupt
            if bar is not None:
                if row.get("accuracy") is not None:
                    bar.set_postfix(acc=f"{row['accuracy']:.4f}", refresh=False)
                bar.update(1)
        summary = ray.get(server.finish.remote())
        keep = True
        return summary
    except ray.exceptions.ActorDiedError as e:
        if run_dir is None:
            raise
        raise ServerDied(f"the server process died in the run's middle ({first_line(e)[:120]}); "
                         f"`python -m raysim.run resume={run_dir}` continues it from its last checkpoint") from None
    except ray.exceptions.RayTaskError as e:
        flush(server)
        known = e.cause if isinstance(e.cause, Exception) and _is_ours(e.cause) else None
        # the processes are fit for another run after a clean stop: the data checks refused
        # the run (nothing started), or it diverged (its summary says where)
        keep = known is not None and (run_dir is None or isinstance(known, RunDiverged))
        if known is not None:
            raise known from None  # ConfigError, RunDiverged: their message is the whole story
        raise RunFailed(failure_message(e, run_dir)) from None
    except KeyboardInterrupt:
        flush(server)
        where = (f"the rounds that ran are in {run_dir}; `python -m raysim.run resume={run_dir}` continues from "
                 "its last checkpoint (checkpoint_every)") if run_dir else "before the first round: nothing was written"
        raise Interrupted(f"interrupted {where}") from None
    except BaseException:
        flush(server)
        raise
    finally:
        if bar is not None:
            bar.close()
        if keep and reuse:
            pool.keep_server(server, cfg.plugins)
        else:
            ray.kill(server)  # and the client actors it owns


def _is_ours(e: BaseException) -> bool:
    return isinstance(e, (ConfigError, RunDiverged, WriteFailed))


def flush(server) -> None:
    """Keep the metrics of the rounds that ran (a crash or Ctrl-C)."""
    import ray

    try:
        ray.get(server.flush.remote(), timeout=30)
    except Exception:
        pass


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n[ \t]+(\S[^\n]*)')


def failure_message(e, run_dir: Optional[str]) -> str:
    """A few lines for an exception raised in a round: the innermost exception (a client
    actor's inside the server's), and the last frame of it outside installed libraries
    (the plugin's or algorithm's own line)."""
    from ray.exceptions import RayTaskError

    inner = e
    while isinstance(getattr(inner, "cause", None), RayTaskError):
        inner = inner.cause
    cause = getattr(inner, "cause", None) or inner
    text = getattr(inner, "traceback_str", "") or str(inner)
    frames = _FRAME.findall(text)
    own = [f for f in frames if "site-packages" not in f[0] or "site-packages/raysim/" in f[0]]
    own = [f for f in own if "/ray/" not in f[0]] or own or frames
    lines = [f"{type(cause).__name__}: {first_line(cause)}"]
    if own:
        path, line, func, code = own[-1]
        lines.append(f"  at {path}:{line}, in {func}: {code.strip()}")
    lines.append(f"  the full traceback is in {run_dir}/log.txt" if run_dir else
                 "  (raised before the run directory was opened)")
    return "\n".join(lines)


def wait_for_actors(server, info: dict, say: Say = quiet) -> None:
    """Wait until every client actor is placed and started, saying what it waits for every
    10 s; after `resources.placement_timeout` seconds stop with one line (nothing is written
    before this: the server opens the run directory after)."""
    import ray

    n, limit = info["actors"], info["placement_timeout"]
    t0 = time.time()
    said = t0
    while True:
        placed = ray.get(server.placed.remote(max(0.0, min(5.0, t0 + limit - time.time()))))
        if placed == n:
            return
        waited = time.time() - t0
        free = ray.available_resources()
        have = f"{free.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} GPUs free in the cluster"
        if waited >= limit:
            raise ConfigError(f"resources: {n - placed} of {n} client actors ({info['needs']} each) were not placed "
                              f"within resources.placement_timeout={limit:g} s ({have}); add nodes, lower "
                              "resources.num_cpus_per_actor / num_gpus_per_actor, or use fewer actors")
        if time.time() - said >= 10:
            said = time.time()
            print(f"raysim: waiting for {n - placed} of {n} client actors ({info['needs']} each; {have}): "
                  f"{waited:.0f} s of resources.placement_timeout={limit:g} s", file=sys.stderr)
