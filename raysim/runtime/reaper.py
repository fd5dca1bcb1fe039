"""`python -m raysim.runtime.reaper PID`: stop the local Ray of a process that was killed outright.

A local Ray started by `ray.init` dies with its process on a clean exit (`ray.shutdown`)
and on Ctrl-C or SIGTERM, but after SIGKILL (or an OOM kill) Ray's raylet goes and its
DashboardAgent and RuntimeEnvAgent stay, for good. `start_ray` starts this small watcher
in its own session: it notes the Ray processes under PID every second and, once PID is
gone, terminates those still running (each checked by its start time, so a reused PID is
never hit)."""
from __future__ import annotations

import os
import sys
import time

import psutil


def ray_processes(parent: psutil.Process) -> dict:
    """{pid: create_time} of the Ray processes under `parent` (raylet, GCS, workers, agents)."""
    out = {}
    for child in parent.children(recursive=True):
        if child.pid == os.getpid():  # this watcher
            continue
        try:
            line = " ".join(child.cmdline())
            if "ray" in line:
                out[child.pid] = child.create_time()
        except psutil.Error:
            pass
    return out


def watch(pid: int, every: float = 1.0) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.Error:
        return
    seen: dict = {}
    while parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE:
        try:
            seen.update(ray_processes(parent))
        except psutil.Error:
            break
        time.sleep(every)
    left = []
    for child_pid, created in seen.items():
        try:
            p = psutil.Process(child_pid)
            if p.create_time() == created:
                p.terminate()
                left.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=5)
    for p in alive:
        p.kill()


if __name__ == "__main__":
    watch(int(sys.argv[1]))
