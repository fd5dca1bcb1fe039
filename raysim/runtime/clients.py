"""Starting the client actors: how many, what each reserves, where, and the actor class
as Ray sees it.

`ClientActor` is a thin shell, as `ServerActor` is: its process imports the real work
(runtime/client_actor.py's `ClientRunner`, torch with it) when it starts, and this module
imports neither. So the server can start its client actors first thing, before it imports
torch itself: on 2 cores the three processes' imports then overlap instead of the clients'
waiting for the server's (~2 s of a cold command's start, benchmarks/startup.py).
"""
from __future__ import annotations

from raysim.lazy_ray import ray

from raysim.errors import ConfigError
from raysim.runtime import pool
from raysim.runtime.placement import actors_that_fit, cpus_per_actor, gpus_per_actor, num_actors


class ClientActor:
    """The Ray actor: every call is handed to the `ClientRunner` its process made at start."""

    def __init__(self):
        from raysim.runtime.client_actor import ClientRunner

        self.runner = ClientRunner()

    def run(self, *args, **kwargs):
        return self.runner.run(*args, **kwargs)

    def probe_memory(self, *args, **kwargs):
        return self.runner.probe_memory(*args, **kwargs)

    def evaluate(self, *args):
        return self.runner.evaluate(*args)

    def die(self) -> None:
        self.runner.die()

    def device_info(self) -> dict:
        return self.runner.device_info()


def start_client_actors(cfg, run: str) -> tuple[list, tuple, int]:
    """The client actors (how many: `placement.num_actors`), each reserving its CPU share and
    GPU fraction, spread over the cluster's nodes, restarted by Ray if its process dies:
    idle ones a finished run left (`ray.reuse_workers`, runtime/pool.py) first, then new
    ones named `raysim-client-<i>.<run>` (the Dashboard's actor view). Returns the actors,
    what each reserves (cpus, gpus) and how many were reused.

    On a local Ray (no `ray.address`) actors the machine cannot hold are refused now, with
    the numbers; a joined cluster may autoscale, so there the CLI waits for placement
    (bounded by `resources.placement_timeout`, see `Dispatch.placed`)."""
    res = cfg.resources
    total = ray.cluster_resources()
    if res.num_gpus_per_actor == "auto" and total.get("GPU", 0) > 0:  # the probe: one actor, a whole GPU
        n, cpus, gpus = 1, cpus_per_actor(cfg, 1, total.get("CPU", 0)), 1.0  # (runtime/gpu_packing.py)
    else:
        n = num_actors(cfg, total.get("CPU", 0), total.get("GPU", 0))
        cpus, gpus = cpus_per_actor(cfg, n, total.get("CPU", 0)), gpus_per_actor(res)
    reused = pool.take_client_actors((cpus, gpus), n if cfg.ray.reuse_workers else 0)
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    fit = actors_that_fit(nodes, cpus, gpus)
    if fit < n and cfg.ray.address is None:
        pool.keep_client_actors((cpus, gpus), reused)
        raise ConfigError(f"resources: {n} client actors need {describe(cpus, gpus)} each, but this machine's Ray "
                          f"can hold {fit} ({total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs); lower "
                          "resources.num_cpus_per_actor / num_gpus_per_actor or use fewer actors "
                          "(resources.num_actors, resources.clients_per_actor)")
    options = dict(num_cpus=cpus, num_gpus=gpus, max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD")
    cls = ray.remote(ClientActor)
    new = [cls.options(name=pool.actor_name(i, run), **options).remote() for i in range(len(reused), n)]
    return reused + new, (cpus, gpus), len(reused)


def describe(cpus: float, gpus: float) -> str:
    """'1 CPU', '0.5 CPU + 0.25 GPU': what one client actor reserves."""
    return " + ".join(f"{v:g} {k}" for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0) or "no CPU or GPU"
