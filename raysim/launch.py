"""Driving one run from the caller's process (the CLI, `raysim.simulate`, a sweep's trial).

`check` reads and validates the config before anything runs (the CLI's `CheckApart` does it
in a forked child while Ray starts); the caller starts or joins Ray (runtime/ray_session.py); `launch` starts
the server actor, waits (bounded) for the client actors to be placed, steps the rounds and
returns the summary. Failures come back as exceptions whose message is a few lines:
`ConfigError` (bad input, nothing written), `RunDiverged`, `RunFailed` (an exception in
an algorithm's or a plugin's code; the full traceback is in the run's log.txt),
`ServerDied` and `Interrupted` (both say how to resume).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from omegaconf import OmegaConf

from raysim import stopping
from raysim.config import ConfigError, read_layers
from raysim.errors import NothingToDo, RunDiverged, WriteFailed
from raysim.preflight import check_layers, quiet
from raysim.runtime.ray_session import first_line

# Every run directory this process's `drive` opened, the newest last: where a Ctrl-C that
# escaped `drive` (raised in its clean-up) or reached `run.main` left rounds to resume from.
OPENED: list = []

Say = Callable[[str], None]


def say_on_stderr(t_start: float) -> Say:
    """Progress lines on stderr, stamped with the seconds since `t_start` (to when the line
    was said: `at`, for a line held back a moment, see run.py's `_Held`)."""
    def say(line: str, at: Optional[float] = None) -> None:
        print(f"raysim [{(at or time.time()) - t_start:5.1f} s] {line}", file=sys.stderr, flush=True)
    return say


class ServerDied(Exception):
    """The server actor's process died mid-run (killed, out of memory)."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the rounds that ran are kept; the message says how to resume."""


class StoreTooSmall(Exception):
    """The training data would crowd the local Ray's object store: restart it with `size`
    bytes (nothing was written yet)."""

    def __init__(self, size: int, data_bytes: int, store_bytes: float):
        self.size = size
        super().__init__(f"the training data ({data_bytes / 2**30:.1f} GB) would take {data_bytes / store_bytes:.0%} "
                         f"of the local Ray's object store ({store_bytes / 2**30:.1f} GB, Ray's default): restarting "
                         f"it with {size / 2**30:.1f} GB (ray.object_store_gb sets it yourself)")


class RunFailed(Exception):
    """An exception raised by an algorithm's, selection's or plugin's code during a round.
    The message is a few lines: the exception, where it was raised; log.txt has the rest."""


def check(config_files=(), overrides=(), say: Say = quiet) -> tuple[list, object]:
    """Read and resolve the config and check everything that needs no data (names, keys,
    values, the run directory, a resumed run's checkpoint): before Ray starts."""
    layers = read_layers(config_files, overrides)
    return layers, check_layers(layers, os.getcwd(), say)


def check_apart(config_files=(), overrides=(), say: Say = quiet) -> tuple[list, object]:
    """`check`, its costly part in a forked child (`CheckApart`). Same result, same errors."""
    layers = read_layers(config_files, overrides)
    checking = CheckApart(layers)
    cfg = checking.answer()
    for at, line in checking.lines:
        say(line, at=at)
    return layers, cfg


class CheckApart:
    """`check_layers` in a forked child process, for the command line: checking imports every
    algorithm's module and with them torch (~500 MB, ~2 s), which the command itself never
    needs (its server and client actors are other processes); the child's memory goes when
    it exits. The command starts Ray while the child checks (`fileno` is the pipe its answer
    comes on); `answer()` waits for it: the config, or the same error as in-process; `lines`
    are then what the check had to say, with when. Where there is no fork (or torch is
    loaded already) the check runs here, at once."""

    def __init__(self, layers: list):
        self._answer = None
        self.lines: list = []
        if not hasattr(os, "fork") or "torch" in sys.modules:
            self._read, self._pid = None, None
            self._answer = self._in_process(layers)
            return
        read, write = os.pipe()
        self._pid = os.fork()
        if self._pid == 0:  # the child: check, send back plain containers or the error, leave at once
            os.close(read)
            out = self._in_process(layers)
            try:
                with os.fdopen(write, "wb") as f:
                    pickle.dump(out if out[0] != "ok" else ("ok", OmegaConf.to_container(out[1]), out[2]), f)
            except BaseException:  # noqa: BLE001  (the parent is gone, e.g. Ctrl-C: nothing to say)
                pass
            os._exit(0)
        os.close(write)
        self._read = read

    @staticmethod
    def _in_process(layers: list) -> tuple:
        lines = []
        try:
            cfg = check_layers(layers, os.getcwd(), lambda line: lines.append((time.time(), line)))
            return "ok", cfg, lines
        except ConfigError as e:
            return "error", str(e), []
        except NothingToDo as e:
            return "finished", str(e), []
        except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent reports it
            return "interrupted", "", []
        except BaseException as e:  # noqa: BLE001  (reported as a failure of the check, in one line)
            return "crash", f"{type(e).__name__}: {e}", []

    def fileno(self) -> Optional[int]:
        """The pipe the child answers on (readable once it has): for `select`; None in-process."""
        return self._read

    def answer(self):
        """Wait for the check: the resolved config, or its `ConfigError`, `NothingToDo`,
        `KeyboardInterrupt` or `RunFailed` (a bug in a check, said in one line)."""
        if self._answer is None:
            with os.fdopen(self._read, "rb") as f:
                data = f.read()
            os.waitpid(self._pid, 0)
            self._answer = pickle.loads(data) if data else (
                "error", "checking the config failed: its process ended without an answer", [])
            if self._answer[0] == "ok":
                self._answer = ("ok", OmegaConf.create(self._answer[1]), self._answer[2])
        kind, value, self.lines = self._answer
        if kind == "ok":
            return value
        if kind == "error":
            raise ConfigError(value)
        if kind == "finished":
            raise NothingToDo(value)
        if kind == "interrupted":
            raise KeyboardInterrupt
        raise RunFailed(f"checking the config failed: {value}")


class SessionServers:
    """Where `drive` gets its server actor: the one a finished run of this Ray session left
    (`ray.reuse_workers`, runtime/pool.py), or a new one on this node (it writes the run
    directory here). The warm service's counterpart is `raysim.service.WarmServers`."""

    def take(self, reuse: bool, name: str, say: Say):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from raysim.runtime import pool
        from raysim.runtime.server_actor import remote_server

        server = pool.warm_server(reuse)
        if server is not None:
            say("the server and client actors of the last run are reused (ray.reuse_workers); loading the data")
            return server
        here = ray.get_runtime_context().get_node_id()
        say("starting the server: it loads and partitions the data while the client actors start")
        return remote_server().options(name=name, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()

    def give_back(self, server, keep: bool, plugins) -> None:
        import ray

        from raysim.runtime import pool

        if keep:
            pool.keep_server(server, plugins)
        else:
            ray.kill(server)  # and the client actors it owns


class HereServers:
    """The server in the caller's process (the command line on a local Ray it started): one
    process fewer than `SessionServers`' actor (its torch import, ~4 s of CPU on 2 cores that
    day, and ~400 MB), and torch was imported already, by the config's check, while Ray
    started (`CheckHere`). Its calls run one at a
    time on a thread of their own, as an actor's would, so the caller's main thread stays
    free for Ctrl-C; the client actors are this process's, and go with its Ray."""

    def __init__(self, start_ray: Optional[Callable[[dict, Say], None]] = None):
        """`start_ray`: no Ray was started yet; the server asks for it after the data when
        its clients should not train in this process (runtime/here.py), and this starts it."""
        self._start_ray = start_ray
        self.ray_started = False

    def take(self, reuse: bool, name: str, say: Say):
        from raysim.runtime.server_actor import ServerHost

        say("the server runs in this process; it loads and partitions the data"
            + (" while the client actors start" if self._start_ray is None else ""))
        return InProcess(ServerHost())

    def start_ray(self, info: dict, say: Say) -> None:
        say(f"starting Ray for client actors: {info['start_ray']}")
        self._start_ray(info, say)
        self.ray_started = True

    def give_back(self, server, keep: bool, plugins) -> None:
        # a stopped run (Ctrl-C while the data load): its Ray goes next, with the actors;
        # what the call in hand leaves behind (a spill folder) the next run removes
        server.close(timeout=30.0 if keep else 5.0)


class ServerRaised(Exception):
    """An `InProcess` server's call raised `cause` (Ray's `RayTaskError` for an actor's)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.traceback_str = "".join(traceback.format_exception(cause))


class InProcess:
    """An object's methods called as an actor's: `obj.method.remote(*args)` runs the call on
    this host's one thread, in order, and returns a `Future` (`awaited` takes it as a ref)."""

    def __init__(self, obj):
        import queue

        self._obj, self._calls = obj, queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="raysim-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            future, name, args = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(getattr(self._obj, name)(*args))
                except BaseException as e:  # noqa: BLE001  (the caller's awaited raises it, as Ray would)
                    future.set_exception(ServerRaised(e))

    def __getattr__(self, name: str):
        from concurrent.futures import Future

        host = self

        class _Method:
            @staticmethod
            def remote(*args):
                future = Future()
                host._calls.put((future, name, args))
                return future
        return _Method

    def close(self, timeout: float = 30.0) -> None:
        """Stop the run's client actors once the call in hand (if any) has ended, within
        `timeout` s; the thread ends then."""
        done = self.stop_actors.remote()
        self._calls.put(None)
        with contextlib.suppress(Exception):
            done.result(timeout=timeout)


class CheckHere(CheckApart):
    """`CheckApart`'s check on a thread of this process instead of a forked child, for a
    command that will host the server itself (`HereServers`): the check's torch import,
    done while Ray starts, is then the server's. `fileno` turns readable when it is done."""

    def __init__(self, layers: list):
        from raysim.runtime import determinism

        determinism.before_cuda()  # this process may run CUDA work: before torch starts cuBLAS
        self._answer, self.lines = None, []
        self._read, self._write = os.pipe()
        self._pid = None
        self._thread = threading.Thread(target=self._check, args=(layers,), name="raysim-check", daemon=True)
        self._thread.start()

    def _check(self, layers: list) -> None:
        self._result = self._in_process(layers)
        if self._result[0] == "ok":
            with contextlib.suppress(Exception):  # the server's code and torch, while Ray still starts
                import raysim.runtime.server  # noqa: F401
        os.write(self._write, b"1")

    def answer(self):
        if self._answer is None:
            self._thread.join()
            os.close(self._read)
            os.close(self._write)
            self._answer = self._result
        return super().answer()


def launch(layers: list, cfg, t_start: float, progress: bool = True, say: Say = quiet,
           server_name: str = "raysim-server", servers=None, size_store: bool = False) -> dict:
    """`drive` the run; a resumed run holds its run directory's lock meanwhile (a new run
    takes it in `drive`, once the server has made the directory)."""
    from raysim.run_lock import RunLock

    before = len(OPENED)
    try:
        with RunLock(cfg.resume) if cfg.resume else contextlib.nullcontext():
            return drive(layers, cfg, t_start, progress, say, server_name, servers or SessionServers(), size_store)
    except KeyboardInterrupt:  # raised in drive's clean-up, after its own handler (a second signal, Ray's code)
        raise Interrupted(interrupted_where(OPENED[-1] if len(OPENED) > before else None)) from None


def interrupted_where(run_dir: Optional[str]) -> str:
    """The line a stopped run ends with: where its rounds are and how to continue them (a
    run stopped before its first checkpoint cannot be: it says so)."""
    if not run_dir:
        return "interrupted before the first round: nothing was written"
    if not os.path.isfile(os.path.join(run_dir, "checkpoint.pt")):  # checkpoint.FILE (that module imports torch)
        return (f"interrupted before the run's first checkpoint: {run_dir} holds no round to resume from "
                "(checkpoint_every); remove it and run again")
    return (f"interrupted: the rounds that ran are in {run_dir}; `python -m raysim.run resume={run_dir}` continues "
            "from its last checkpoint (checkpoint_every)")


def _lock_if_here(run_dir: str):
    """The run directory's lock, when this machine sees the directory (a server on another
    host of a cluster may write it where this driver cannot: nothing to lock here)."""
    from raysim.run_lock import RunLock

    return RunLock(run_dir) if os.path.isdir(run_dir) else contextlib.nullcontext()


def drive(layers: list, cfg, t_start: float, progress: bool = True, say: Say = quiet,
          server_name: str = "raysim-server", servers=None, size_store: bool = False) -> dict:
    """Take a server actor from `servers` (SessionServers by default), wait for the client
    actors, run every round, return the summary. `server_name`: the server actor's name (a
    sweep's points that run at once each have their own). `size_store`: the caller started
    this Ray with the default object store and can restart it: `StoreTooSmall` when the data
    loaded would crowd it and the machine has room for a bigger one."""
    from raysim.lazy_ray import ray  # none imported by a command whose clients train in it (runtime/here.py)

    servers = servers or SessionServers()
    reuse = bool(cfg.ray.reuse_workers)
    server = servers.take(reuse, server_name, say)
    server.start_clients.remote(OmegaConf.to_container(cfg), os.getcwd())  # first thing, see runtime/server_actor.py
    bar = None
    run_dir = None
    keep = False
    held = contextlib.ExitStack()
    try:
        info = awaited(server.setup.remote(layers, os.getcwd(), t_start))
        if info.get("start_ray"):  # no Ray yet, and the clients should not train here (runtime/here.py)
            servers.start_ray(info, say)
            info = awaited(server.attach.remote())
        if size_store:
            size = store_size_for_this_machine(info["data_bytes"], info["store_bytes"])
            if size is not None:
                raise StoreTooSmall(size, info["data_bytes"], info["store_bytes"])
        if info.get("notice"):
            print(f"note: {info['notice']}", file=sys.stderr)
        if info.get("here"):
            say("data ready; the clients train in this process, no Ray (resources.ray_start_s)")
        else:
            say(f"data ready; waiting for {info['actors']} client actors ({info['needs']} each)")
            wait_for_actors(server, info, say)
        stopping.started()  # a signal from here stops the run where it is (before: the command ends at once)
        info = awaited(server.open_run.remote())
        run_dir = info["run_dir"]
        OPENED.append(run_dir)
        if not cfg.resume:  # the first process holds the new run's lock too (a resumed one holds it from the start)
            held.enter_context(_lock_if_here(run_dir))
        say(info["banner"])
        say(f"run directory: {run_dir}")
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=info["rounds"], unit="round", dynamic_ncols=True)
            bar.update(info["start_round"] - 1)
        fields: dict = {}
        for rnd in range(info["start_round"], info["rounds"] + 1):
            row = awaited(server.step.remote(rnd))
            if stopping.stop_requested.is_set():
                raise KeyboardInterrupt
            for line in row.get("warnings", ()):  # once per run each (server._round_warnings)
                (bar.write if bar is not None else print)(f"warning: {line}", file=sys.stderr)
            if bar is not None:  # the last accuracy stays until the next evaluation
                fields = {**{k: v for k, v in fields.items() if k != "dropped"}, **progress_fields(row)}
                bar.set_postfix(fields, refresh="dropped" in fields)  # such a round is always shown
                bar.update(1)
        summary = awaited(server.finish.remote())
        keep = True
        return summary
    except ray.exceptions.ActorDiedError as e:
        if run_dir is None:
            raise
        raise ServerDied(f"the server process died in the run's middle ({first_line(e)[:120]}); "
                         f"`python -m raysim.run resume={run_dir}` continues it from its last checkpoint") from None
    except (ray.exceptions.RayTaskError, ServerRaised) as e:
        flush(server)
        known = e.cause if isinstance(e.cause, Exception) and _is_ours(e.cause) else None
        # the processes are fit for another run after a clean stop: the data checks refused
        # the run (nothing started), or it diverged (its summary says where)
        keep = known is not None and (run_dir is None or isinstance(known, RunDiverged))
        if known is not None:
            raise known from None  # ConfigError, RunDiverged: their message is the whole story
        raise RunFailed(failure_message(e, run_dir)) from None
    except KeyboardInterrupt:
        if run_dir is not None:  # before the run directory there is nothing to write (and the server, busy
            flush(server)        # loading the data, would answer only when done)
        raise Interrupted(interrupted_where(run_dir)) from None
    except BaseException:
        flush(server)
        raise
    finally:
        if bar is not None:
            bar.close()
        servers.give_back(server, keep and reuse, cfg.plugins)
        held.close()


def progress_fields(row: dict) -> dict:
    """The progress bar's fields after a round: its accuracy (a personalised run's: the
    clients' own models, `own`), and `dropped=all` when no update arrived."""
    out = {}
    if row.get("personal_accuracy") is not None:
        out["own"] = f"{row['personal_accuracy']:.4f}"
    elif row.get("accuracy") is not None:
        out["acc"] = f"{row['accuracy']:.4f}"
    if row.get("clients") and row.get("dropped") == row["clients"]:
        out["dropped"] = "all"
    return out


def store_size_for_this_machine(data_bytes: int, store_bytes: float):
    import shutil

    import psutil

    from raysim.runtime.placement import store_size_for

    try:
        shm = shutil.disk_usage("/dev/shm").free
    except OSError:  # no /dev/shm (macOS): Ray's store is a file elsewhere; memory decides
        shm = psutil.virtual_memory().available
    return store_size_for(data_bytes, store_bytes, psutil.virtual_memory().available, shm)


def _is_ours(e: BaseException) -> bool:
    return isinstance(e, (ConfigError, RunDiverged, WriteFailed))


def flush(server) -> None:
    """Keep the metrics of the rounds that ran (a crash or Ctrl-C)."""
    try:
        awaited(server.flush.remote(), timeout=30)
    except Exception:
        pass


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n[ \t]+(\S[^\n]*)')


def failure_message(e, run_dir: Optional[str]) -> str:
    """A few lines for an exception raised in a round: the innermost exception (a client
    actor's inside the server's), and the last frame of it outside installed libraries
    (the plugin's or algorithm's own line)."""
    from ray.exceptions import RayTaskError

    inner = e.cause if isinstance(e, ServerRaised) and isinstance(e.cause, RayTaskError) else e
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


def awaited(ref, timeout: Optional[float] = None):
    """`ray.get(ref)`, waiting in steps of 0.2 s: Ray 2.60's `ray.get` sits in C++ until the
    result is there, so a Ctrl-C or SIGTERM (`run._terminate`) met Python only when the
    server's call returned (the data loaded, the actors started: 10 s after the signal on 2
    cores); between steps it is raised at once. A `Future` (an `InProcess` server's call) is
    waited for the same way. Past `timeout` s: `TimeoutError`."""
    from concurrent.futures import Future, TimeoutError as FutureTimeout

    end = None if timeout is None else time.time() + timeout
    if isinstance(ref, Future):
        while True:
            try:
                return ref.result(timeout=0.2)
            except FutureTimeout:
                if end is not None and time.time() > end:
                    raise TimeoutError from None
    import ray

    while not ray.wait([ref], timeout=0.2)[0]:
        if end is not None and time.time() > end:
            raise TimeoutError
    return ray.get(ref)


def wait_for_actors(server, info: dict, say: Say = quiet) -> None:
    """Wait until every client actor is placed and started, saying what it waits for every
    10 s; after `resources.placement_timeout` seconds stop with one line (nothing is written
    before this: the server opens the run directory after)."""
    import ray

    n, limit = info["actors"], info["placement_timeout"]
    t0 = time.time()
    said = t0
    while True:
        placed = awaited(server.placed.remote(max(0.0, min(5.0, t0 + limit - time.time()))))
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
