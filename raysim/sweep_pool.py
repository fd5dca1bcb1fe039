"""A sweep's points in N processes of this machine, each point's clients trained in its own
process with no Ray (`python -m raysim.sweep --processes N`, or `processes: N` in a sweep file).

Why: on Ray Tune every point is a trial, and a small point pays Ray's part of it: a trial's
start-up (~16-22 s on 2 cores), its client actor's (~1.4 s, ~300 MB) and each round's
trips through the object store (mnist_c2 FedAvg, 20 rounds: 10.8 s trained in one process,
19.2 s on one client actor; issue 84: the results table's ~2,000 points). Here a point runs
as `python -m raysim.run` runs it on its own machine (runtime/here.py: the same
`ClientRunner`, the same bits as on client actors, tests/test_here.py), in one of N spawned
worker processes that live for the whole sweep (torch imported once each).

Each point's server gets `resources.server_threads` = CPUs / N unless the point sets it, and
`resources.ray_start_s=1e9`, `resources.num_actors=null`: a point never starts a Ray of its own
beside the others' (a point begun on Tune with a client actor resumes here with none). Points
that need Ray for what they do (`config.layers.asks_for_ray`: a cluster, client actors asked
for, faults that kill actors, Ray's dashboard) are refused before anything runs (`check`).
Ctrl-C or SIGTERM: the points in hand stop at their last checkpoint, the others do not start.
"""
from __future__ import annotations

import os
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context

from raysim.errors import ConfigError

_busy = False  # in a worker: a point is running (a signal then stops it; between points it is ignored)
_stopping = False  # in a worker: a signal was acted on (a second one, Ctrl-C's and the sweep's forwarded, is not)
_stop = None  # in a worker: the sweep's "stop" (a point queued to it before the stop does not start)


def processes_wanted(value, where: str) -> int:
    """`processes` as given (an int >= 1, or "auto": this machine's CPUs), checked."""
    if value in (None, ""):
        return 1
    if str(value) == "auto":
        return os.cpu_count() or 1
    try:
        n = int(str(value))
    except ValueError:
        n = 0
    if n < 1 or str(n) != str(value).strip():
        raise ConfigError(f"{where}: {value!r} is not a number of processes (an integer >= 1, or auto)")
    return n


def check(points: list[dict], processes: int) -> None:
    """Points run in processes must not need Ray: one line naming the first that does."""
    for p in points:
        if p["needs_ray"] is not None:
            raise ConfigError(f"processes {processes} (--processes, or the sweep file's processes:) runs each point's "
                              f"clients in the point's own process, with no Ray; point {p['name']} asks for Ray "
                              f"({p['needs_ray']}): drop that key from the sweep, or run with --processes 1 (Ray Tune)")


def _on_signal(signum, frame):
    global _stopping
    if _busy and not _stopping:
        from raysim import stopping

        _stopping = True
        stopping.stop_requested.set()  # the round loop checks it too (launch.drive)
        raise KeyboardInterrupt


def _worker_start(stop) -> None:
    global _stop
    _stop = stop
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)


def _point(point: dict, files: list, cwd: str):
    """One point in a worker: what `sweep.point_result` says, or None if it was stopped."""
    global _busy
    from raysim.launch import HereServers, Interrupted
    from raysim.sweep import point_result

    if _stopping or _stop.is_set():
        return None
    _busy = True
    try:
        return point_result(point, files, cwd, servers=HereServers())
    except (KeyboardInterrupt, Interrupted):
        return None  # the point kept its last checkpoint
    finally:
        _busy = False


def run_in_processes(todo: list, files: list, say, processes: int) -> list:
    """The points `processes` at a time; returns [(point, why it failed or None)] of those
    that ran to their end (an interrupted one is left out, as `sweep.run_here` leaves it)."""
    import threading

    n = max(1, min(processes, len(todo)))
    threads = max(1, (os.cpu_count() or 1) // n)
    for p in todo:
        keys = [o.split("=", 1)[0] for o in p["overrides"]]
        # no client actors, even for a point resumed from a run that had them (its recorded resources.*)
        p["overrides"] = [*p["overrides"], "resources.ray_start_s=1e9", "resources.num_actors=null",
                          "resources.clients_per_actor=auto",
                          *([] if "resources.server_threads" in keys else [f"resources.server_threads={threads}"])]
    say(f"running {len(todo)} point(s) in {n} process{'es' if n > 1 else ''} of this machine, each point's clients "
        f"in its own process (no Ray; {threads} server thread{'s' if threads > 1 else ''} each)")
    main_thread = threading.current_thread() is threading.main_thread()
    # Ctrl-C and SIGTERM as `python -m raysim.run` takes them, even where a shell started the sweep with SIGINT
    # ignored (`cmd &` in a script): the pkill -INT that stops a sweep then reaches the workers through this process
    before = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGINT, signal.SIGTERM)} \
        if main_thread else {}
    spawn = get_context("spawn")
    stop = spawn.Event()
    pool = ProcessPoolExecutor(max_workers=n, mp_context=spawn, initializer=_worker_start, initargs=(stop,))
    running = {pool.submit(_point, p, files, os.getcwd()): p for p in todo}
    ended = []
    try:
        try:
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in finished:
                    p = running.pop(f)
                    try:
                        result = f.result()
                    except Exception as e:  # noqa: BLE001  (a worker killed, the OOM killer's: every point in hand
                        # fails with BrokenProcessPool; each is a failed point, resumed by the next sweep command)
                        result = {"raysim_error": f"{type(e).__name__}: {e}"}
                    if result is not None:
                        ended.append((p, result.get("raysim_error")))
        except KeyboardInterrupt:  # Ctrl-C (the workers had it too) or a SIGTERM to this process alone
            stop.set()
            for f in running:
                f.cancel()
            for proc in list(getattr(pool, "_processes", {}).values()):  # a worker acts on the first signal only
                try:
                    os.kill(proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
            for f in running:
                if not f.cancelled() and f.exception() is None and f.result() is not None:
                    ended.append((running[f], f.result().get("raysim_error")))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for s, handler in before.items():
            signal.signal(s, handler)
    return ended
