"""FedAsync (Xie, Koyejo, Gupta 2019, "Asynchronous Federated Optimization", Algorithm 1):
`concurrency` clients train at once from the model x_tau they downloaded, each on the
paper's regularised local objective f(x) + rho/2 ||x - x_tau||^2 (`fedasync.rho`; FedProx's
proximal term); each arriving model x is mixed in at once: w <- (1 - alpha_t) w + alpha_t x,
alpha_t = alpha * s(t - tau), with s constant, polynomial (t - tau + 1)^-a or hinge (1 if
t - tau <= b, else 1/(hinge_a (t - tau - b) + 1)). Every entry, buffers too, is mixed (a
weighted mean of two models); integer buffers (BatchNorm's batch count) take the arrival's.
A round is `updates_per_round` updates (clients that went offline bring none and are not
counted). See algorithms/_asynchronous.py for the clock, the staleness and the references.

Defaults and the references: rho 0.005 is FLGo's (flgo/algorithm/fedasync.py: `mu` 0.005,
a FedProx client); the paper's algorithm has the term, rho=0 drops it (a FedAvg client, what
raysim ran before). The hinge's slope and threshold are the paper's experiments' (a=10, b=4;
FLGo: 10 and 6, with s = 1/(a (t - tau - b)), no +1: `fedasync.b=6` reads its threshold);
the polynomial's exponent a=0.5 is the paper's. FLGo mixes the models that arrive at the
same moment and averages them; raysim applies arrivals one at a time (ties by start order)."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.contract import Client, Server
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import base_loss

from raysim.algorithms._asynchronous import Asynchronous, needs_clock, staleness_weight
from raysim.algorithms.fedprox import proximal_loss


@dataclass
class FedAsyncOptions(Options):
    concurrency: int = option(10, at_least=1)  # clients training at once
    alpha: float = option(0.6, above=0, at_most=1)  # the mixing weight before staleness
    staleness: str = option("poly", choices=("constant", "poly", "hinge"))
    a: float = option(0.5, above=0)  # poly: the exponent (the paper's 0.5)
    hinge_a: float = option(10.0, above=0)  # hinge: the slope (the paper's and FLGo's 10)
    b: float = option(4.0, at_least=0)  # hinge: the staleness tolerated at full weight (the paper's 4; FLGo's 6)
    rho: float = option(0.005, at_least=0)  # the local objective's proximal weight (FLGo's 0.005; 0: none)
    updates_per_round: int = option(5, at_least=1)  # arrivals per round (a metrics row)

    def check(self, cfg, section: str) -> None:
        needs_clock(cfg, section)


@ALGORITHMS.register("fedasync")
class FedAsync(Asynchronous):
    Options = FedAsyncOptions

    def local_loss(self, client: Client, payload: dict):
        """f(x) + rho/2 ||x - x_tau||^2, x_tau the model the client downloaded."""
        rho = float(client.cfg.fedasync.rho)
        if not rho:
            return super().local_loss(client, payload)
        anchor = [payload["weights"][n].to(client.device) for n, _ in client.model.named_parameters()]
        return proximal_loss(rho, anchor, base_loss(client.cfg.local))

    def run_round(self, rnd: int, server: Server) -> dict:
        o = self.cfg.fedasync
        taus, alphas, loss, n = [], [], 0.0, 0
        slope = float(o.hinge_a) if o.staleness == "hinge" else float(o.a)
        for a in self.updates(rnd, server, int(o.updates_per_round), int(o.concurrency), window=1):
            tau = self.version - a.version
            alpha = float(o.alpha) * staleness_weight(o.staleness, tau, slope, float(o.b))
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
