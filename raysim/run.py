"""`python -m raysim.run`: the command-line entry point, a thin layer over `raysim.launch`
(which `raysim.simulate` uses too).

It checks everything that needs no data while it starts a local Ray on loopback only (on a
thread, whose torch import then serves the server, which runs in this process:
`launch.HereServers`) or joins `ray.address` (in a forked child; the server is an actor
there); a typo ends the command as soon as the check finds it, ~3 s, with Ray stopped. It
drives the run, printing
start-up progress, a progress bar and where the results are. Exit codes: 2 bad input
(nothing written), 3 a diverged run, 1 a failure in an algorithm's or plugin's code or a
dead server, 130 Ctrl-C or SIGTERM (both say how to resume); a local Ray we started is
stopped on every way out.
"""
from __future__ import annotations

if __name__ == "__main__":  # before the imports below (~0.1 s): a Ctrl-C there ends in one line too
    from raysim import stopping as _stopping

    _stopping.early()

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from raysim import stopping
from raysim.errors import ConfigError, NothingToDo, RunDiverged, StartFailed, WriteFailed
from raysim.launch import (HereServers, Interrupted, RunFailed, ServerDied, StoreTooSmall, launch, quiet,
                           say_on_stderr)
from raysim.runtime.ray_session import Meanwhile, start_ray


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raysim.run",
        description="Run a federated-learning simulation. Overrides are key=value, e.g. "
                    "algorithm=fedprox fedprox.mu=0.01 partition=dirichlet partition.beta=0.5 rounds=50",
    )
    p.add_argument("overrides", nargs="*", help="config overrides, key=value (dotted keys for nested ones)")
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config file(s), layered in the order given over configs/default.yaml and the config groups of the chosen dataset / algorithm / selection; configs/... names a shipped file from any directory")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--list", action="store_true", help="list registered datasets, partitions, models, algorithms, selections")
    p.add_argument("--show-partition", action="store_true", help="print the per-client label-count table and exit")
    p.add_argument("--plot", type=Path, metavar="FILE",
                   help="with --show-partition: also draw the per-client label counts into FILE (.png or .svg)")
    p.add_argument("--quiet", action="store_true", help="no start-up lines, no progress bar")
    return p


def list_plugins(overrides: list[str]) -> str:
    """The registered parts by kind; with `plugins=[...]` among the overrides, those modules
    are imported first and their parts marked with the module that registered them."""
    from raysim import registry
    from raysim.config import parse_overrides, plugin_names

    registry.load_plugins()
    registry.import_modules(plugin_names(parse_overrides(overrides).get("plugins")))
    lines = []
    for reg in (registry.DATASETS, registry.PARTITIONS, registry.MODELS, registry.ALGORITHMS, registry.SELECTIONS):
        names = []
        for name in reg.names():
            module = getattr(reg.get(name), "__module__", "") or ""
            names.append(name if module.startswith("raysim.") else f"{name} (from {module})")
        lines.append(f"{reg.kind + 's':<12} {', '.join(names)}")
    return "\n".join(lines)


SHOWN_USERS = 1000  # of a population made when picked, the users --show-partition lists and draws


def _local(args, say) -> int:
    """--print-config / --show-partition: resolved here, no Ray."""
    from raysim.config import describe_layers, read_layers, resolve, to_yaml

    layers = read_layers(args.config, args.overrides)
    cfg = resolve(layers)
    for line in describe_layers(layers, cfg):
        say(line)
    if args.print_config:
        print(to_yaml(cfg), end="")
    else:
        from raysim.data.partition import label_table
        from raysim.experiment import prepare

        if args.plot is not None:
            from raysim.results.figures import check_path

            check_path(args.plot)
        data, part, n_classes = prepare(cfg)
        many = data.population is not None and len(data.population) > 10_000  # made when picked: the first 1,000
        print(label_table(data.y_train, part, n_classes, max_rows=SHOWN_USERS if many else 0))
        if args.plot is not None:
            from raysim.data.partition import label_counts
            from raysim.experiment import describe_partition
            from raysim.results.figures import partition_figure

            if many:  # the same users the table lists, made for it: all of them would take ~40 min at 15 M
                counts = data.population.label_counts(range(SHOWN_USERS))
                title = f"{describe_partition(cfg)}, the first {SHOWN_USERS:,} of {len(part.train):,} clients"
            else:
                counts = label_counts(data.y_train, part, n_classes)
                title = f"{describe_partition(cfg)}, {len(part.train)} clients"
            partition_figure(counts, args.plot, f"{cfg.dataset}: {title}")
            say(f"partition picture: {args.plot}" + (f" (the first {SHOWN_USERS:,} users, as listed: the others "
                                                     "are made when picked)" if many else ""))
    return 0


def main(argv: list[str] | None = None, t_start: float | None = None) -> int:
    """CLI entry. `t_start` is when timing starts (the process start under `python -m`)."""
    t_start = t_start or time.time()
    args = _parser().parse_intermixed_args(argv)
    say = quiet if args.quiet else say_on_stderr(t_start)
    from raysim.launch import OPENED, interrupted_where

    opened = len(OPENED)
    # Ctrl-C and SIGTERM work at every moment (raysim/stopping.py): until the run is driven they
    # end the command at once; inside ray.init, ray_session.interruptible does the same
    with stopping.signals():
        try:
            return _main(args, say, t_start)
        except KeyboardInterrupt:  # the start-up's signal raised by stopping.started(), or one past the run
            print(interrupted_where(OPENED[-1] if len(OPENED) > opened else None).replace(
                "before the first round", "before the run started"), file=sys.stderr)
            return 130


def _main(args, say, t_start: float) -> int:
    on_service = contextlib.ExitStack()  # the warm service's lock and connection, when it runs the command
    servers = None
    started = deferred = False
    try:
        if args.list:
            print(list_plugins(args.overrides))
            return 0
        if args.plot is not None and not args.show_partition:
            raise ConfigError("--plot FILE draws the partition: give it with --show-partition")
        if args.print_config or args.show_partition:
            return _local(args, say)
        addr, layers = _service_address(args)
        if addr is not None:
            cfg, servers = _check_on_service(layers, addr, say, on_service)
        else:
            layers, cfg, started, deferred = _check_while_ray_starts(args, say)
            if started:  # a local Ray of this command's own: the server runs here (launch.HereServers)
                servers = HereServers()
            elif deferred:  # no Ray yet: the server may train the clients here (runtime/here.py)
                servers = HereServers(start_ray=_start_ray_later(cfg))
    except (ConfigError, NothingToDo, RunFailed, StartFailed) as e:
        on_service.close()
        return _said(e)
    except _Ended as e:
        return e.code

    from raysim.lazy_ray import ray  # imported when used: a run with no Ray needs none (runtime/here.py)

    try:
        stopping.reinstall()  # again: ray.init installs its own SIGTERM handler, which dumps a stack and aborts
        if addr is not None:  # the service's warm server takes the run: a signal now goes through launch.drive,
            stopping.started()  # which hands the server back (a local run's start-up ends in drive)
        try:  # a local Ray we started with Ray's default store is resized once if the data need it
            summary = launch(layers, cfg, t_start, progress=not args.quiet, say=say, servers=servers,
                             size_store=(started or deferred) and not cfg.ray.object_store_gb)
        except StoreTooSmall as e:
            print(f"note: {e}", file=sys.stderr)
            ray.shutdown()
            deferred = False
            cfg.ray.object_store_gb = e.size / 2**30
            started = start_ray(cfg.ray, say, command=True)
            summary = launch(layers, cfg, t_start, progress=not args.quiet, say=say, servers=HereServers())
    except ConfigError as e:  # raised by the server while checking the data, before anything is written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunDiverged as e:  # the loss or the model turned non-finite: the rounds before are kept
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (ServerDied, RunFailed, WriteFailed, StartFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return 130
    finally:
        on_service.close()
        if started or getattr(servers, "ray_started", False):
            ray.shutdown()  # the local Ray we started, its agents included
            from raysim.runtime import pool

            pool.forget()  # its actors went with it: a later run in this process starts its own
    acc, local = summary.get("final_accuracy"), summary.get("final_local_accuracy")
    personal = summary.get("final_personal_accuracy")
    if acc is None:
        print("no evaluation ran")
    elif personal is not None:  # a personalised run: the clients' own models first (personal_eval.py)
        unshared = summary.get("server_model_unshared")
        server = (f"the server's model (the shared part with the initial {unshared}, no client's model) {acc:.4f}"
                  if unshared else f"the global model {acc:.4f}"
                  + (f", on the clients' test data {local:.4f}" if local is not None else ""))
        print(f"final accuracy of the clients' own models on their own test data {personal:.4f}, best "
              f"{summary['best_personal_accuracy']:.4f}; {server}, {summary['wall_seconds']:.1f} s")
    else:  # with local test splits, the clients' own accuracy too (clustered FL's headline number)
        on_clients = (f"; on the clients' test data {local:.4f}, best {summary['best_local_accuracy']:.4f}"
                      if local is not None else "")
        after = summary.get("after_training")  # a post-hoc step (CCVR's calibration) made the final model
        best = f"best {summary['best_accuracy']:.4f}"
        if after:
            best = f"{next(iter(after))} after training; the rounds' {best}"
        print(f"final accuracy {acc:.4f}{f' ({best})' if after else f', {best}'}{on_clients}, "
              f"{summary['wall_seconds']:.1f} s")
    if cfg.eval.validation:
        print(f"note: eval.validation={cfg.eval.validation}: every accuracy above is on that share of the training "
              "clients' samples, held out for validation, not on a test set")
    empty = summary.get("rounds_without_updates")
    if empty:  # the model did not move in those rounds: the accuracy above may be the untrained model's
        print(f"note: {empty} of {summary['rounds']} rounds had no update (every selected client dropped: "
              "log.txt says why)")
    print(f"results: {summary['run_dir']}")
    return 0


def _check_while_ray_starts(args, say) -> tuple:
    """Every check that needs no data, in a forked child (`CheckApart`), while this process
    starts or joins Ray with the config's `ray` section: (layers, config, whether we started
    Ray, whether Ray's start waits for the server's word). A bad config found while Ray starts ends the command at once, Ray stopped, its
    error the only line (the progress lines are held until the check has passed)."""
    from raysim.config import read_layers
    from raysim.config.layers import may_train_here, ray_section
    from raysim.launch import CheckApart, CheckHere

    layers = read_layers(args.config, args.overrides)
    ray_cfg = ray_section(layers)
    if ray_cfg is not None and not _ray_running() and may_train_here(layers):
        # the clients may train in this process (runtime/here.py): Ray, if needed, starts after the
        # data, when the server knows (HereServers.start_ray); the check first, then
        checking = CheckHere(layers) if "torch" not in sys.modules else CheckApart(layers)
        cfg = checking.answer()
        for at, line in checking.lines:
            say(line, at=at)
        return layers, cfg, False, True
    # a local Ray: the server will run in this process, which imports torch for the check
    # while Ray starts; a joined cluster's server is an actor there, so the check's torch goes.
    # With torch loaded already (`main` called in a Python session) the check is quick and
    # runs first, here (CheckApart does so), and no bad config can end the caller's process.
    here = ray_cfg is not None and not ray_cfg.address and "torch" not in sys.modules
    checking = CheckHere(layers) if here else CheckApart(layers)
    if ray_cfg is None or checking.fileno() is None:  # the whole check first: it says what is wrong
        ray_cfg = checking.answer().ray
    held = _Held()
    started = False
    try:
        try:
            started = start_ray(ray_cfg, held, command=True,
                                meanwhile=_Checked(checking) if checking.fileno() is not None else None)
        except (ConfigError, StartFailed):  # Ray did not start: a bad config, found meanwhile, is said first
            checking.answer()
            raise
        cfg = checking.answer()
    except BaseException as e:
        code = _said(e) if isinstance(e, (ConfigError, NothingToDo, RunFailed, StartFailed)) else None
        if started:  # said first: stopping Ray takes a second
            import ray

            ray.shutdown()
        if code is None:
            raise
        raise _Ended(code) from None
    for at, line in sorted(held.lines + checking.lines):
        say(line, at=at)
    return layers, cfg, started, False


def _ray_running() -> bool:
    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized()


def _start_ray_later(cfg):
    """What starts the local Ray when the server asks for it after the data (see
    `_check_while_ray_starts`): `start_ray` as the command does, its signal handlers again."""
    def start(info: dict, say) -> None:
        start_ray(cfg.ray, say, command=True)
        stopping.reinstall()  # ray.init installs its own SIGTERM handler, which dumps a stack and aborts
    return start


class _Held:
    """A `say` that keeps its lines, and when they were said, to be said later."""

    def __init__(self):
        self.lines: list = []

    def __call__(self, line: str, at=None) -> None:
        self.lines.append((at or time.time(), line))


class _Checked(Meanwhile):
    """The check's answer, arriving while Ray starts: a bad config ends the command then."""

    def __init__(self, checking):
        self.checking = checking

    def fileno(self) -> int:
        return self.checking.fileno()

    def done(self):
        try:
            self.checking.answer()
        except (ConfigError, NothingToDo, RunFailed, StartFailed) as e:
            return _said(e)
        except KeyboardInterrupt:  # the signal reaches this process too: the watcher says so
            return None
        return None


def _said(e: Exception) -> int:
    """Say why the command ends before the run: its exit code (2 bad input, 0 nothing to do, 1 a failure)."""
    if isinstance(e, NothingToDo):
        print(str(e), file=sys.stderr, flush=True)
        return 0
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2 if isinstance(e, ConfigError) else 1


class _Ended(Exception):
    """The command ended before the run, its reason said: `code` is its exit code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _service_address(args) -> tuple:
    """(the warm service's address, the config layers) when the service runs (raysim/service.py)
    and the command names no `ray.address` of its own; else (None, None)."""
    from raysim import service

    addr = service.address()
    if addr is None:
        return None, None
    from raysim.config import read_layers

    layers = read_layers(args.config, args.overrides)
    for _, data in reversed(layers):
        ray_layer = data.get("ray")
        if isinstance(ray_layer, dict) and "address" in ray_layer:
            if ray_layer["address"]:
                return None, None
            break
    service.check_stamp()  # a service of another raysim / Ray / Python: one line, not Ray's traceback
    return addr, layers


def _check_on_service(layers: list, addr: str, say, on_service: contextlib.ExitStack):
    """Join the service, wait for its lock, and check the config in its warm server (this
    process then imports no torch): (the config, the service's servers for `launch`)."""

    from omegaconf import OmegaConf

    from raysim import service

    say(f"using the raysim service at {addr} (python -m raysim.down stops it)")
    try:
        service.connect(addr)
    except Exception as e:  # noqa: BLE001
        raise RunFailed(f"cannot join the raysim service at {addr} ({type(e).__name__}: {str(e)[:200]}); "
                        "`python -m raysim.down` stops it, then the command runs on its own") from None
    import ray  # imported by connect, which sets Ray's loopback switch first

    on_service.callback(ray.shutdown)  # leaves the service's Ray: this driver only
    on_service.enter_context(service.one_run_at_a_time(say))
    servers = service.WarmServers()
    try:
        lines, cfg = ray.get(servers.checker(say).check.remote(layers, os.getcwd()))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (ConfigError, NothingToDo)):
            raise e.cause from None
        raise RunFailed(f"checking the config failed: {type(e.cause).__name__}: {e.cause}") from None
    for line in lines:
        say(line)
    return OmegaConf.create(cfg), servers


def process_start() -> float:
    """When this process started (time.time()'s clock), for the start-up stamps. On Linux from
    /proc/self/stat and the boot clock, to 10 ms; psutil's create_time adds boot time in
    whole seconds there, which put every stamp up to 1 s late."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


def exit_now(code: int) -> None:
    """End the command once its work is done, without the interpreter's teardown: with torch
    loaded that took 1.2-1.5 s on 2 cores (module by module), after every file was written
    and every line said. What teardown would do that matters is done here first: output
    flushed, a joined Ray left (`ray.shutdown`; a local one was stopped already), logs closed."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(t_start=process_start()))
