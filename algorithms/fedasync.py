"""FedAsync (Xie, Koyejo, Gupta 2019, "Asynchronous Federated Optimization", Algorithm 1):
`concurrency` clients train at once from the model they downloaded; each arriving model x
is mixed in at once: w <- (1 - alpha_t) w + alpha_t x, alpha_t = alpha * s(t - tau), with
s constant, polynomial (t - tau + 1)^-a or hinge (1 if t - tau <= b, else 1/(a (t - tau - b)
+ 1)). Every entry, buffers too, is mixed (a weighted mean of two models); integer buffers
(BatchNorm's batch count) take the arrival's. A round is `updates_per_round` arrivals. See
algorithms/_asynchronous.py for the clock, the staleness and the references."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.contract import Server
from raysim.options import Options, option
from raysim.registry import ALGORITHMS

from raysim.algorithms._asynchronous import Asynchronous, needs_clock, staleness_weight


@dataclass
class FedAsyncOptions(Options):
    concurrency: int = option(10, at_least=1)  # clients training at once
    alpha: float = option(0.6, above=0, at_most=1)  # the mixing weight before staleness
    staleness: str = option("poly", choices=("constant", "poly", "hinge"))
    a: float = option(0.5, above=0)  # poly: the exponent; hinge: the slope
    b: float = option(4.0, at_least=0)  # hinge: the staleness tolerated at full weight
    updates_per_round: int = option(5, at_least=1)  # arrivals per round (a metrics row)

    def check(self, cfg, section: str) -> None:
        needs_clock(cfg, section)


@ALGORITHMS.register("fedasync")
class FedAsync(Asynchronous):
    Options = FedAsyncOptions

    def run_round(self, rnd: int, server: Server) -> dict:
        o = self.cfg.fedasync
        taus, alphas, loss, n = [], [], 0.0, 0
        for a in self.arrivals(rnd, server, int(o.updates_per_round), int(o.concurrency), window=1):
            if a.result is None:
                continue
            tau = self.version - a.version
            alpha = float(o.alpha) * staleness_weight(o.staleness, tau, float(o.a), float(o.b))
            w = self.model.state_dict()
            self.model.load_state_dict({k: ((1 - alpha) * w[k] + alpha * x.to(w[k].dtype)) if w[k].is_floating_point()
                                        else x for k, x in a.result.update.items()})
            self.version += 1
            taus.append(tau)
            alphas.append(alpha)
            loss += a.result.metrics["loss"]
            n += 1
        if not n:
            return {}
        return {"train_loss": loss / n, "staleness_mean": sum(taus) / n, "staleness_max": max(taus),
                "alpha_mean": sum(alphas) / n}
