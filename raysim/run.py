"""`python -m raysim.run`: the command-line entry point.

The CLI process stays light (no torch, no plugins): it reads the config layers, starts or
joins Ray, starts the driver actor, streams progress and prints where the results are.
The driver resolves and checks the config, loads and partitions the data and only then
writes anything; every input problem comes back as one line and exit code 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from raysim.config import ConfigError, read_layers, ray_section
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
    import ray

    if ray.is_initialized():
        return False
    kw = dict(logging_level=logging.ERROR, log_to_driver=False)
    if ray_cfg.address:
        ray.init(address=ray_cfg.address, **kw)
        return False
    ray.init(num_cpus=ray_cfg.num_cpus, include_dashboard=bool(ray_cfg.dashboard), **kw)
    return True


def launch(layers: list, t_start: float, progress: bool = True) -> dict:
    """Start the driver actor on this node (it writes the run directory here), run every
    round, return the summary."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raysim.runtime.driver import ServerDriver

    here = ray.get_runtime_context().get_node_id()
    driver = ServerDriver.options(
        name="raysim-server", scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(t_start)
    bar = None
    try:
        info = ray.get(driver.setup.remote(layers, os.getcwd()))
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
        ray_cfg = ray_section(layers)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import ray

    try:
        started = start_ray(ray_cfg)
    except ConnectionError as e:
        print(f"error: ray.address={ray_cfg.address!r}: cannot connect: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        summary = launch(layers, t_start, progress=not args.quiet)
    except ConfigError as e:  # raised by the driver while resolving and checking the input
        print(f"error: {getattr(e, 'cause', None) or e}", file=sys.stderr)  # the message, not Ray's traceback
        return 2
    except RunDiverged as e:  # the loss or the model turned non-finite: the rounds before are kept
        print(f"error: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return 3
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
