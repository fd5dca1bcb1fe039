"""FedBuff (Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous Aggregation",
Algorithm 1): `concurrency` clients train at once from the model they downloaded; the server
keeps a buffer of their updates Delta_i = x_i - w_(v_i), each scaled by s(tau_i) =
1/sqrt(1 + tau_i), and every `buffer` (K) arrivals applies their mean as one step: w <- w +
eta_g * (1/K) sum_i s(tau_i) Delta_i. The server step is a server optimiser's:
`server.optimizer` (default none: eta_g = 1, plain mean; `momentum` / `adam` compose, as the
paper's server optimiser does) sees the pseudo-gradient -(1/K) sum s Delta; non-trainable
buffers (BatchNorm statistics) take the plain mean of the arrivals' own. A round is one
buffer. See algorithms/_asynchronous.py for the clock, the staleness and the references."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.contract import Server
from raysim.options import Options, option
from raysim.registry import ALGORITHMS

from raysim.algorithms._asynchronous import Asynchronous, needs_clock, staleness_weight


@dataclass
class FedBuffOptions(Options):
    concurrency: int = option(10, at_least=1)  # clients training at once
    buffer: int = option(5, at_least=1)  # K: arrivals per server step (a round)
    staleness: str = option("sqrt", choices=("sqrt", "none"))  # s(tau): 1/sqrt(1+tau) (the paper's) or 1

    def check(self, cfg, section: str) -> None:
        needs_clock(cfg, section)


@ALGORITHMS.register("fedbuff")
class FedBuff(Asynchronous):
    Options = FedBuffOptions
    server_parts = ("optimizer",)

    def run_round(self, rnd: int, server: Server) -> dict:
        o = self.cfg.fedbuff
        now = self.model.state_dict()
        fold = self.server_rule.round(now, rnd)
        taus, loss, n, kind = [], 0.0, 0, str(o.staleness)
        for a in self.arrivals(rnd, server, int(o.buffer), int(o.concurrency), window=int(o.buffer)):
            if a.result is None:  # went offline (or its actor died): nothing arrives
                continue
            tau = self.version - a.version
            s = staleness_weight(kind, tau)
            base = a.payload["weights"]
            # the arrival as a model relative to now: w + s (x_i - w_(v_i)); the plain mean
            # of K of these is w + (1/K) sum s Delta (buffers: the client's own)
            fold.add({k: (now[k] + s * (x - base[k]) if k in self.server_rule.trainable else x)
                      for k, x in a.result.update.items()}, 1.0)
            taus.append(tau)
            loss += a.result.metrics["loss"]
            n += 1
        new = fold.result(now)
        if new is None:
            return {}
        self.model.load_state_dict(new)
        self.version += 1
        return {"train_loss": loss / n, "staleness_mean": sum(taus) / n, "staleness_max": max(taus)}
