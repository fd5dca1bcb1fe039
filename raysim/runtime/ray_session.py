"""The caller's Ray: start a local one (on loopback only, with a reaper that stops it if
the caller is killed outright) or join `ray.address` (checked first, so a wrong address
fails within seconds with one line). Used by the CLI, `raysim.simulate` and sweeps."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

from raysim.errors import ConfigError, StartFailed
from raysim.stopping import stop_children


def start_ray(ray_cfg, say: Optional[Callable[[str], None]] = None, command: bool = False,
              meanwhile: Optional["Meanwhile"] = None) -> bool:
    """Connect to `ray.address`, or start a local Ray (and `raysim.runtime.reaper`, which stops it if
    this process is killed outright). Returns True if we started it. `command`: the caller
    is a command-line process, which Ctrl-C may end inside `ray.init` (`interruptible`);
    not so for `raysim.simulate`, whose process may be a notebook's kernel. `meanwhile`
    (a command only): work finishing while Ray starts, which may end the command at once."""
    say = say or (lambda line: None)
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return False
    if ray_cfg.address:
        say(f"joining the Ray cluster at {ray_cfg.address}")
        import ray

        check_reachable(ray_cfg.address)
        try:
            with interruptible("while joining the Ray cluster", meanwhile) if command else contextlib.nullcontext():
                ray.init(address=ray_cfg.address, logging_level=logging.ERROR, log_to_driver=False)
        except ConnectionError as e:
            raise ConfigError(f"ray.address={ray_cfg.address!r}: cannot connect: {first_line(e)}") from None
        return False
    say("starting a local Ray" + (f" with {ray_cfg.num_cpus} CPUs" if ray_cfg.num_cpus else ""))
    with loopback_only():
        import ray

        try:
            store = ray_cfg.get("object_store_gb")
            with (interruptible("while starting the local Ray", meanwhile) if command else contextlib.nullcontext(),
                  without_cluster_daemons(not ray_cfg.dashboard)):
                port = ray_cfg.get("metrics_port")
                ctx = ray.init(num_cpus=ray_cfg.num_cpus, include_dashboard=bool(ray_cfg.dashboard),
                               object_store_memory=int(store * 2**30) if store else None,
                               logging_level=logging.ERROR, log_to_driver=False,
                               **({"_metrics_export_port": int(port)} if port else {}))
        except Exception as e:  # e.g. a time-out waiting for Ray's processes on a loaded machine
            raise StartFailed(f"Ray did not start on this machine ({type(e).__name__}: {first_line(e)}); Ray's "
                              "logs are in its temp folder's session_latest/logs; a time-out here means the "
                              "machine was too loaded: retry") from None
    import subprocess

    subprocess.Popen([sys.executable, "-m", "raysim.runtime.reaper", str(os.getpid())], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if ray_cfg.dashboard:
        say(dashboard_line(ctx.dashboard_url))
    if ray_cfg.get("metrics_port") or ray_cfg.dashboard:
        say(f"Ray's metrics, raysim's ray_raysim_* among them, for Prometheus: http://127.0.0.1:{metrics_port()}/metrics")
    return True


def metrics_port() -> int:
    """The port the local node's Prometheus endpoint serves on."""
    import ray

    return int(ray._private.worker.global_worker.node.metrics_export_port)


def token_source() -> Optional[str]:
    """Where the Dashboard's token comes from for a Ray this process started or joined, as
    words to print; None when Ray runs without token authentication (RAY_AUTH_MODE=disabled).
    Ray >= 2.60 turns token authentication on for every new local Ray unless told otherwise,
    keeping the token in ~/.ray/auth_token (or RAY_AUTH_TOKEN_PATH's file, or RAY_AUTH_TOKEN)."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the value of RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return f"the contents of {path}" + ("" if os.environ.get("RAY_AUTH_TOKEN_PATH") else " (`ray get-auth-token` prints it)")


def dashboard_line(url: str) -> str:
    """The line that says where the Dashboard is and how to get in."""
    url = url if url.startswith("http") else f"http://{url}"
    source = token_source()
    if source is None:
        return f"Ray's dashboard: {url} (no token: RAY_AUTH_MODE is disabled)"
    return f"Ray's dashboard: {url} ; it asks for Ray's token: paste {source}"


class Meanwhile:
    """Work done in another process while Ray starts (the command's config check): `fileno()`
    turns readable when it is done; `done()` then returns None to go on, or an exit code
    after saying why the command ends (it has printed a bad config's error)."""

    def fileno(self) -> int:
        raise NotImplementedError

    def done(self) -> Optional[int]:
        raise NotImplementedError


@contextlib.contextmanager
def interruptible(what: str, meanwhile: Optional[Meanwhile] = None):
    """Ctrl-C and SIGTERM end the process at once (exit 130) while the block runs, even when
    the main thread sits in Ray's C++ code and never returns to Python to run a signal
    handler (`ray.init` retrying an address). Python's C-level handler writes each signal's
    number to a wake-up pipe; a watcher thread reads it and exits, stopping the processes
    this one started (a half-started local Ray). The same watcher ends the process with
    `meanwhile`'s exit code when that work, done, says so (a typo found while Ray starts
    costs no wait for Ray). `ray.init` puts its own SIGTERM handler in place (it exits with
    15) while it runs: a SIGTERM that reaches that one first ends the block the same way (a
    race the suite lost twice in seven runs), and the block puts the caller's handlers back
    before its watcher stops (a SIGTERM just after `ray.init` returned met Ray's handler and
    exited 15: once in a full suite). Outside the main thread: a plain block."""
    import select
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    done = threading.Event()
    ending = threading.Lock()

    def interrupted() -> None:  # the watcher or the main thread, whichever comes first; one line
        if ending.acquire(blocking=False):
            print(f"interrupted {what}: nothing was written", file=sys.stderr, flush=True)
            stop_children()
            os._exit(130)

    def watch() -> None:
        waiting = [r] + ([meanwhile] if meanwhile is not None else [])
        while not done.is_set():
            ready = select.select(waiting, [], [], 0.2)[0]
            if r in ready:
                got = os.read(r, 64)
                if not done.is_set() and (signal.SIGINT in got or signal.SIGTERM in got):
                    interrupted()
            if meanwhile is not None and meanwhile in ready:
                waiting.remove(meanwhile)
                code = meanwhile.done()
                if code is not None:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    stop_children()
                    os._exit(code)

    watcher = threading.Thread(target=watch, name="raysim-interruptible", daemon=True)
    watcher.start()
    try:
        yield
    except SystemExit as e:  # ray.init installs a SIGTERM handler that exits 15: the watcher's race, lost
        if e.code != signal.SIGTERM:
            raise
        interrupted()
        time.sleep(60)  # the watcher is ending the process
    finally:
        for sig, handler in handlers.items():  # the caller's handlers again, before the watcher stops:
            if handler is not None:  # ray.init leaves its own (exit 15), and a signal in between met it
                signal.signal(sig, handler)
        done.set()
        signal.set_wakeup_fd(previous)
        watcher.join()
        os.close(r)
        os.close(w)


@contextlib.contextmanager
def without_cluster_daemons(on: bool = True):
    """While `ray.init` starts a local Ray: without the autoscaler's monitor and the log
    monitor, two Python daemons a one-machine run never uses (it adds no nodes, and its
    drivers take no worker logs: `log_to_driver=False`): ~2 s of CPU at start on 2 cores
    and ~165 MB. `ray.init` has no switch for them; Ray's own `RayParams` has (`ray start
    --no-monitor`, `--include-log-monitor`), so the parameters `ray.init` makes get them set.
    A Ray without those fields starts as it is. Kept with the Dashboard on (`ray.dashboard`),
    whose cluster and log views read them."""
    try:
        import inspect

        from ray._private import parameter
        init = parameter.RayParams.__init__
        fields = inspect.signature(init).parameters
    except (ImportError, AttributeError, ValueError):
        on = False
    if not on or "no_monitor" not in fields or "include_log_monitor" not in fields:
        yield
        return

    def lean(self, *args, **kwargs):
        kwargs.setdefault("no_monitor", True)
        kwargs.setdefault("include_log_monitor", False)
        init(self, *args, **kwargs)

    parameter.RayParams.__init__ = lean
    try:
        yield
    finally:
        parameter.RayParams.__init__ = init


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
