"""FedBuff (Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous Aggregation",
Algorithm 1): `concurrency` clients train at once from the model they downloaded; the server
keeps a buffer of their updates Delta_i = x_i - w_(v_i), each scaled by s(tau_i) =
1/sqrt(1 + tau_i), and every `buffer` (K) arrivals applies their mean as one step: w <- w +
eta_g * (1/K) sum_i s(tau_i) Delta_i. The server step is a server optimiser's:
`server.optimizer` (default sgd with `server.lr` 1: eta_g = 1, plain mean; `momentum` / `adam` compose, as the
paper's server optimiser does) sees the pseudo-gradient -(1/K) sum s Delta; non-trainable
buffers (BatchNorm statistics) take the plain mean of the arrivals' own. A round is one
buffer of K updates: a client that went offline before its update was back brings none and
is not counted (the paper's server waits for K). See algorithms/_asynchronous.py for the
clock, the staleness and the references.

The references differ from the paper, and from each other:
- FedScale (fedscale/cloud/aggregation/async_aggregator.py) averages the buffered whole
  models, each weighted by 1/(1 + tau), w <- sum s_i x_i / sum s_i (a stale model pulls the
  server back towards the old one it trained from), and drops arrivals with tau over
  `max_staleness` (they do not count towards K): `fedbuff.reading=fedscale`
  (`fedbuff.max_staleness`, FedScale's default 5; `server.optimizer` is refused there).
- FLGo (flgo/algorithm/fedbuff.py) applies the plain mean update, no staleness weights:
  `fedbuff.staleness=none`.
The default is the paper's rule."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.contract import Server
from raysim.options import Options, option
from raysim.errors import ConfigError
from raysim.registry import ALGORITHMS
from raysim.training import WeightedMean

from raysim.algorithms._asynchronous import Asynchronous, needs_clock, staleness_weight


@dataclass
class FedBuffOptions(Options):
    concurrency: int = option(10, at_least=1)  # clients training at once
    buffer: int = option(5, at_least=1)  # K: arrivals per server step (a round)
    staleness: str = option("sqrt", choices=("sqrt", "none"))  # s(tau): 1/sqrt(1+tau) (the paper's) or 1 (FLGo's)
    reading: str = option("paper", choices=("paper", "fedscale"))  # fedscale: module docstring
    max_staleness: int = option(5, at_least=0)  # reading=fedscale: arrivals staler than this are dropped

    def check(self, cfg, section: str) -> None:
        needs_clock(cfg, section)
        if self.reading == "fedscale" and (cfg.server.optimizer != "sgd" or cfg.server.lr != 1):
            raise ConfigError(f"fedbuff.reading=fedscale averages whole models, with no server step: unset "
                              f"server.optimizer and server.lr (now {cfg.server.optimizer}, {cfg.server.lr})")


@ALGORITHMS.register("fedbuff")
class FedBuff(Asynchronous):
    Options = FedBuffOptions
    server_parts = ("optimizer",)

    def run_round(self, rnd: int, server: Server) -> dict:
        o = self.cfg.fedbuff
        now = self.model.state_dict()
        fedscale = o.reading == "fedscale"
        fold = WeightedMean() if fedscale else self.server_rule.round(now, rnd)
        taus, loss, n, kind = [], 0.0, 0, str(o.staleness)
        while n < int(o.buffer):  # FedScale's reading drops the arrivals over max_staleness: wait for more
            for a in self.updates(rnd, server, int(o.buffer) - n, int(o.concurrency), window=int(o.buffer) - n):
                tau = self.version - a.version
                if fedscale:
                    if tau > int(o.max_staleness):
                        self.dropped_stale += 1
                        continue
                    fold.add(a.result.update, 1.0 / (1.0 + tau))  # sum s x / sum s, whole models
                else:
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
        extra = {"dropped_stale": self.dropped_stale} if fedscale else {}
        return {"train_loss": loss / n, "staleness_mean": sum(taus) / n, "staleness_max": max(taus), **extra}

    def setup(self, server: Server) -> None:
        super().setup(server)
        self.dropped_stale = 0  # reading=fedscale: arrivals over max_staleness so far

    def state_dict(self) -> dict:
        state = super().state_dict()
        return {**state, "dropped_stale": self.dropped_stale} if self.cfg.fedbuff.reading == "fedscale" else state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.dropped_stale = int(state.get("dropped_stale", 0))
