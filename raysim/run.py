"""`python -m raysim.run`: config -> data and partition -> Ray -> server driver -> results.

Everything that can be wrong with the input (config keys and values, names, data files,
a partition that leaves a client empty, a model that does not fit the data) is checked
here, before Ray starts and before the run directory exists, and reported as one line.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from raysim.config import ConfigError, clients_per_round, load_config, to_yaml


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


def prepare(cfg):
    """Load the dataset, partition it and check the model fits: all before Ray starts."""
    import torch

    from raysim.data.datasets import load_dataset, num_classes
    from raysim.data.partition import make_partition
    from raysim.models import build_model

    data = load_dataset(cfg)
    n_classes = num_classes(cfg)
    part = make_partition(data.y_train, cfg, n_classes, data.users_train)
    try:
        model = build_model(cfg.model, data.input_shape, n_classes)
        with torch.no_grad():
            model.eval()(torch.zeros(2, *data.input_shape))
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"model={cfg.model!r} does not fit dataset {cfg.dataset!r} with inputs "
                          f"{data.input_shape}: {str(e).splitlines()[0]}") from None
    return data, part, n_classes


def _run_dir(cfg) -> Path:
    name = cfg.run_name or f"{cfg.algorithm}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.output_dir) / name
    if run_dir.exists():
        raise ConfigError(f"run directory {run_dir} already exists; choose another run_name or output_dir")
    return run_dir


def start_ray(cfg) -> bool:
    """Connect to `ray.address`, or start a local Ray. Returns True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    kw = dict(logging_level=logging.ERROR, log_to_driver=False)
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, **kw)
        return False
    ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=bool(cfg.ray.dashboard), **kw)
    return True


def launch(cfg, data, part, n_classes, t_start: float, progress: bool = True) -> dict:
    """Start the server driver on this node, run every round, return the summary."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from omegaconf import OmegaConf

    from raysim.runtime.client_actor import start_client_actors
    from raysim.runtime.server import ServerDriver

    run_dir = _run_dir(cfg)
    refs = [
        ray.put({"x_train": data.x_train, "y_train": data.y_train}),
        ray.put(part.train),
        ray.put({"x_test": data.x_test, "y_test": data.y_test}),
    ]
    input_shape, sizes = data.input_shape, part.sizes().tolist()
    data.x_train = data.x_test = None  # the object store holds them now; free this process's copy
    # The client actors start here, alongside the driver rather than after it: each needs
    # ~1.5 s to import torch, and on a small machine that chain is most of the start-up.
    actors = start_client_actors(cfg, refs[0], refs[1], n_classes)
    here = ray.get_runtime_context().get_node_id()
    driver = ray.remote(ServerDriver).options(
        name="raysim-server", num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),  # writes the run dir here
    ).remote(OmegaConf.to_container(cfg), actors, refs[2], sizes, n_classes, input_shape, str(run_dir.resolve()), t_start)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=int(cfg.rounds), desc=f"{cfg.algorithm} on {cfg.dataset}", unit="round", dynamic_ncols=True)
    try:
        for rnd in range(1, int(cfg.rounds) + 1):
            row = ray.get(driver.step.remote(rnd))
            if bar is not None:
                if row.get("accuracy") is not None:
                    bar.set_postfix(acc=f"{row['accuracy']:.4f}", refresh=False)
                bar.update(1)
        return ray.get(driver.finish.remote(time.time() - t_start))
    finally:
        if bar is not None:
            bar.close()
        ray.kill(driver)


def main(argv: list[str] | None = None, t_start: float | None = None) -> int:
    """CLI entry. `t_start` is when timing starts (the process start under `python -m`)."""
    t_start = t_start or time.time()
    args = _parser().parse_intermixed_args(argv)
    if args.list:
        print(list_plugins())
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        if args.show_partition:
            from raysim.data.partition import label_table

            data, part, n_classes = prepare(cfg)
            print(label_table(data.y_train, part, n_classes))
            return 0
        _run_dir(cfg)  # fail before starting Ray if it exists
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import ray

    # Loading and partitioning the data (CPU work) overlaps Ray's start-up (mostly waiting
    # for its processes); a data problem still stops the run before anything is written.
    with ThreadPoolExecutor(1) as pool:
        prepared = pool.submit(prepare, cfg)
        try:
            started = start_ray(cfg)
        except ConnectionError as e:
            prepared.cancel()
            print(f"error: ray.address={cfg.ray.address!r}: cannot connect: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        try:
            data, part, n_classes = prepared.result()
        except ConfigError as e:
            if started:
                ray.shutdown()
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        print(f"raysim: {cfg.algorithm} on {cfg.dataset} ({cfg.partition.name}), {cfg.num_clients} clients, "
              f"{clients_per_round(cfg)} per round, {cfg.rounds} rounds", file=sys.stderr)
        summary = launch(cfg, data, part, n_classes, t_start, progress=not args.quiet)
    except ConfigError as e:  # raised inside the driver (e.g. by an algorithm's setup)
        print(f"error: {e}", file=sys.stderr)
        return 2
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
