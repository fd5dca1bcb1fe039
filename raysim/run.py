"""`python -m raysim.run`: the command-line entry point.

The CLI reads the config layers and checks everything that needs no data (names, keys,
values, the run directory) before Ray starts, so a typo costs a second or two; then it
starts a local Ray (listening on loopback only) or joins `ray.address`, starts the driver
actor, waits (bounded) for the client actors to be placed, streams progress and prints
where the results are. The driver loads and partitions the data and checks it, and only
then writes anything; every input problem comes back as one line and exit code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time

from raysim.config import ConfigError, read_layers, resolve
from raysim.errors import RunDiverged


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raysim.run",
        description="Run a federated-learning simulation. Overrides are key=value, e.g. "
                    "algorithm=fedprox fedprox.mu=0.01 partition=dirichlet partition.beta=0.5 rounds=50",
    )
    p.add_argument("overrides", nargs="*", help="config overrides, key=value (dotted keys for nested ones)")
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config file(s), layered over configs/default.yaml in the order given")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--list", action="store_true", help="list registered datasets, partitions, models, algorithms, selections")
    p.add_argument("--show-partition", action="store_true", help="print the per-client label-count table and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def list_plugins() -> str:
    from raysim import registry

    lines = []
    for reg in (registry.DATASETS, registry.PARTITIONS, registry.MODELS, registry.ALGORITHMS, registry.SELECTIONS):
        lines.append(f"{reg.kind + 's':<12} {', '.join(reg.names())}")
    return "\n".join(lines)


def start_ray(ray_cfg) -> bool:
    """Connect to `ray.address`, or start a local Ray. Returns True if we started it."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return False
    if ray_cfg.address:
        import ray

        check_reachable(ray_cfg.address)
        try:
            ray.init(address=ray_cfg.address, logging_level=logging.ERROR, log_to_driver=False)
        except ConnectionError as e:
            raise ConfigError(f"ray.address={ray_cfg.address!r}: cannot connect: {_first_line(e)}") from None
        return False
    with loopback_only():
        import ray

        try:
            ray.init(num_cpus=ray_cfg.num_cpus, include_dashboard=bool(ray_cfg.dashboard),
                     logging_level=logging.ERROR, log_to_driver=False)
        except Exception as e:  # e.g. a time-out waiting for Ray's processes on a loaded machine
            raise ConfigError(f"Ray did not start on this machine ({type(e).__name__}: {_first_line(e)}); Ray's "
                              "logs are in its temp folder's session_latest/logs; a time-out here means the "
                              "machine was too loaded: retry") from None
    return True


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
    """Fail within `timeout` seconds when nothing listens at a host:port `ray.address`
    (Ray itself retries for minutes). 'auto' is left to Ray, which answers at once."""
    import socket

    hostport = address.split("://", 1)[-1]
    if address == "auto" or ":" not in hostport:
        return
    host, port = hostport.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise ConfigError(f"ray.address={address!r}: nothing answers at {host}:{port} ({type(e).__name__}: "
                          f"{_first_line(e) or 'timed out'}); check the address and port (the head node's "
                          "`ray status`), that the head node runs, and that firewalls / security groups "
                          "let this machine in") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""


class DriverDied(Exception):
    """The driver actor's process died mid-run (killed, out of memory)."""


def launch(layers: list, t_start: float, progress: bool = True) -> dict:
    """Start the driver actor on this node (it writes the run directory here), wait for the
    client actors, run every round, return the summary."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raysim.runtime.driver import ServerDriver

    here = ray.get_runtime_context().get_node_id()
    driver = ServerDriver.options(
        name="raysim-server", scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(t_start)
    bar = None
    run_dir = None
    try:
        wait_for_actors(driver, ray.get(driver.setup.remote(layers, os.getcwd())))
        info = ray.get(driver.open_run.remote())
        run_dir = info["run_dir"]
        print(f"raysim: {info['banner']}", file=sys.stderr)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=info["rounds"], unit="round", dynamic_ncols=True)
            bar.update(info["start_round"] - 1)
        for rnd in range(info["start_round"], info["rounds"] + 1):
            row = ray.get(driver.step.remote(rnd))
            if bar is not None:
                if row.get("accuracy") is not None:
                    bar.set_postfix(acc=f"{row['accuracy']:.4f}", refresh=False)
                bar.update(1)
        return ray.get(driver.finish.remote())
    except ray.exceptions.ActorDiedError as e:
        if run_dir is None:
            raise
        raise DriverDied(f"the server process died in the run's middle ({_first_line(e)[:120]}); "
                         f"`python -m raysim.run resume={run_dir}` continues it from its last checkpoint") from None
    except BaseException:  # a crash or Ctrl-C: keep the metrics of the rounds that ran
        try:
            ray.get(driver.flush.remote(), timeout=30)
        except Exception:
            pass
        raise
    finally:
        if bar is not None:
            bar.close()
        ray.kill(driver)


def wait_for_actors(driver, info: dict) -> None:
    """Wait until every client actor is placed and started, saying what it waits for every
    10 s; after `resources.placement_timeout` seconds stop with one line (nothing is written
    before this: the driver opens the run directory after)."""
    import ray

    n, limit = info["actors"], info["placement_timeout"]
    t0 = time.time()
    said = t0
    while True:
        placed = ray.get(driver.placed.remote(max(0.0, min(5.0, t0 + limit - time.time()))))
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


def _local(args) -> int:
    """--print-config / --show-partition: resolved here, no Ray."""
    from raysim.config import load_config, to_yaml

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
    else:
        from raysim.data.partition import label_table
        from raysim.experiment import prepare

        data, part, n_classes = prepare(cfg)
        print(label_table(data.y_train, part, n_classes))
    return 0


def main(argv: list[str] | None = None, t_start: float | None = None) -> int:
    """CLI entry. `t_start` is when timing starts (the process start under `python -m`)."""
    t_start = t_start or time.time()
    args = _parser().parse_intermixed_args(argv)
    if args.list:
        print(list_plugins())
        return 0
    try:
        if args.print_config or args.show_partition:
            return _local(args)
        layers = read_layers(args.config, args.overrides)
        cfg = resolve(layers, os.getcwd())  # every check that needs no data, before Ray starts
        if cfg.resume:
            from raysim.runtime.checkpoint import load_checked

            load_checked(cfg)  # a safe, readable checkpoint that config.yaml still describes
        else:
            from raysim.experiment import run_dir_for

            run_dir_for(cfg)  # refuses a run directory that exists, an output_dir under a file
        started = start_ray(cfg.ray)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import ray

    try:
        summary = launch(layers, t_start, progress=not args.quiet)
    except ConfigError as e:  # raised by the driver while resolving and checking the input
        print(f"error: {getattr(e, 'cause', None) or e}", file=sys.stderr)  # the message, not Ray's traceback
        return 2
    except RunDiverged as e:  # the loss or the model turned non-finite: the rounds before are kept
        print(f"error: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return 3
    except DriverDied as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the rounds that ran are in the run directory", file=sys.stderr)
        return 130
    finally:
        if started:
            ray.shutdown()
    acc = summary.get("final_accuracy")
    print(f"final accuracy {acc:.4f}, best {summary['best_accuracy']:.4f}, "
          f"{summary['wall_seconds']:.1f} s" if acc is not None else "no evaluation ran")
    print(f"results: {summary['run_dir']}")
    return 0


if __name__ == "__main__":
    import psutil

    sys.exit(main(t_start=psutil.Process().create_time()))
