"""The platform's metrics through Ray's metrics API, tagged with the run name.

Ray exports them, with its own, on every node's Prometheus endpoint (`ray_raysim_*`), which
the Dashboard's Metrics view (Grafana) and any Prometheus server read. A run with no Ray
(its clients trained in the command's process: runtime/here.py) has no endpoint, and
`for_run` gives it `NoMetrics`.
"""
from __future__ import annotations

from raysim import lazy_ray

Counter, Gauge = "counter", "gauge"  # the kinds, as ray.util.metrics names them

# attribute: (kind, name, description, tag keys): every metric raysim exports
METRICS = {
    "rounds": (Counter, "raysim_rounds_done", "Rounds completed", ("run",)),
    "updates": (Counter, "raysim_client_updates", "Client updates received", ("run",)),
    "dropped": (Counter, "raysim_clients_dropped", "Selected clients that returned nothing (dropout or a dead "
                "client actor)", ("run",)),
    "bytes_down": (Counter, "raysim_bytes_down", "Bytes sent to clients", ("run",)),
    "bytes_up": (Counter, "raysim_bytes_up", "Bytes received from clients", ("run",)),
    "round_seconds": (Gauge, "raysim_round_seconds", "Duration of the last round, evaluation included", ("run",)),
    "round": (Gauge, "raysim_round", "The last round completed", ("run",)),
    "accuracy": (Gauge, "raysim_accuracy", "Accuracy at the last evaluation", ("run",)),
    "loss": (Gauge, "raysim_loss", "Test loss at the last evaluation", ("run",)),
    "actor_updates": (Counter, "raysim_actor_client_updates", "Client calls a client actor returned (its "
                      "throughput: rate of this by actor)", ("run", "actor")),
}
# as Prometheus names them (Ray adds `ray_`, counters `_total`): the Grafana dashboard
# (raysim/grafana_dashboard.json) is checked against these
EXPORTED = tuple(f"ray_{name}{'_total' if kind is Counter else ''}" for kind, name, _, _ in METRICS.values())


def for_run(run: str):
    """The run's metrics: Ray's when this process has a Ray, else none."""
    return RayMetrics(run) if lazy_ray.initialized() else NoMetrics()


class NoMetrics:
    def record(self, row: dict) -> None:
        pass

    def actor_done(self, actor: int, clients: int) -> None:
        pass


class RayMetrics:
    def __init__(self, run: str):
        from ray.util import metrics

        # Ray's metric tags must be ASCII; a run name need not be (run_name=é): escape it here
        self.tags = {"run": run.encode("ascii", "backslashreplace").decode("ascii")}
        kinds = {Counter: metrics.Counter, Gauge: metrics.Gauge}
        for attr, (kind, name, description, keys) in METRICS.items():
            setattr(self, attr, kinds[kind](name, description, tag_keys=keys))

    def record(self, row: dict) -> None:
        """One round's metrics row (see FederatedServer.step)."""
        t = self.tags
        down, up = row["round_bytes_down"], row["round_bytes_up"]
        self.rounds.inc(1, tags=t)
        self.round.set(row["round"], tags=t)
        if row["clients"] > row["dropped"]:
            self.updates.inc(row["clients"] - row["dropped"], tags=t)
        if row["dropped"]:
            self.dropped.inc(row["dropped"], tags=t)
        if down:
            self.bytes_down.inc(down, tags=t)
        if up:
            self.bytes_up.inc(up, tags=t)
        self.round_seconds.set(row["seconds"] + row["eval_seconds"], tags=t)
        if row.get("accuracy") is not None:
            self.accuracy.set(row["accuracy"], tags=t)
        if row.get("loss") is not None:
            self.loss.set(row["loss"], tags=t)

    def actor_done(self, actor: int, clients: int) -> None:
        """Client actor `actor` returned `clients` client calls."""
        if clients:
            self.actor_updates.inc(clients, tags={**self.tags, "actor": str(actor)})
