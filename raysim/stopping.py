"""How Ctrl-C and SIGTERM end a command (`python -m raysim.run`), in two phases.

Starting (the checks, the imports of torch and Ray on two threads, Ray's start): nothing is
written yet, and a KeyboardInterrupt raised in the main thread can land inside Python's
import machinery while another thread imports the same modules (seen: one Ctrl-C in 14 hung
the command for good; a SIGTERM ended with "partially initialized module 'ray'"). So the
handler only sets a flag, and a watcher thread, woken by the signal through Python's wake-up
file descriptor, prints one line, stops this process's children (a local Ray, the forked
check) and exits 130 at once.

Running (`started()`, in `launch.drive` just before the server opens the run directory;
on the warm service before the run is handed to it, whose server `drive` must hand back):
the handler sets `stop_requested`,
which the round loop checks after every round, and raises KeyboardInterrupt, which
`launch.drive` turns into "interrupted ... resume=DIR". `started()` and the watcher share a
lock, so the watcher never exits once the run has begun, and a signal it left is raised by
`started()` itself.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

# Set by the handler. A KeyboardInterrupt raised inside Ray's own code can be lost there
# (seen: a Ctrl-C in round 2 ignored, all 400 rounds run); the round loop checks this flag
# after every round, so a stop is never lost.
stop_requested = threading.Event()
_starting = threading.Event()
_phase = threading.Lock()  # held by the watcher while it ends the process, by `started()` while it ends the phase
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def handler(signum, frame):
    """Ctrl-C and SIGTERM: the flag; then the exception, once the start-up is over."""
    stop_requested.set()
    if not _starting.is_set():
        raise KeyboardInterrupt


def early() -> None:
    """`python -m raysim.run`'s first line, before its imports (~0.1 s): a signal there is
    kept for `signals`, which ends the command with its one line as soon as it runs."""
    global _early
    _early = True
    _starting.set()
    for s in SIGNALS:
        signal.signal(s, handler)


_early = False


def started() -> None:
    """The start-up is over: a signal from now on raises KeyboardInterrupt; one that came
    during the start-up and that the watcher did not act on is raised here."""
    with _phase:
        _starting.clear()
    if stop_requested.is_set():
        raise KeyboardInterrupt


def stop_children() -> None:
    """Kill this process's child processes (a local Ray's raylet, GCS and workers, the forked
    check)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


@contextlib.contextmanager
def signals(message: str = "interrupted before the run started: nothing was written"):
    """The command's handlers for its whole life, in the starting phase until `started()`;
    the previous handlers after. Outside the main thread (a caller's thread): nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import psutil  # noqa: F401  (imported now: the watcher must not wait for an import lock)

    global _early
    if not _early:  # a signal before (`early`) is this command's: kept
        stop_requested.clear()
    _early = False
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    r, w = os.pipe()
    os.set_blocking(w, False)
    before = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    done = threading.Event()
    _starting.set()

    def watch() -> None:
        import select

        while not done.is_set():
            if r in select.select([r], [], [], 0.2)[0]:
                got = os.read(r, 64)
                if any(s in got for s in SIGNALS):
                    with _phase:
                        if _starting.is_set():
                            print(message, file=sys.stderr, flush=True)
                            with contextlib.suppress(Exception):
                                sys.stdout.flush()
                            stop_children()
                            os._exit(130)

    watcher = threading.Thread(target=watch, name="raysim-signals", daemon=True)
    watcher.start()
    if stop_requested.is_set():  # it came before the watcher ran
        os.write(w, bytes([signal.SIGINT]))
    try:
        yield
    finally:
        with _phase:
            _starting.clear()
        stop_requested.clear()  # this command's: a later run in this process (raysim.simulate) starts afresh
        done.set()
        signal.set_wakeup_fd(before)
        watcher.join()
        os.close(r)
        os.close(w)
        for s, h in previous.items():
            if h is not None:
                signal.signal(s, h)


def reinstall() -> None:
    """Our handlers again (ray.init puts its own SIGTERM handler in place, which dumps a
    stack and aborts)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, handler)
