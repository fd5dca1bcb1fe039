"""FedAvgM (Hsu et al. 2019): server momentum on the averaged update of the trainable
parameters,
    v <- beta * v + (w - w_avg);  w <- w - server_lr * v;
the server parts' `momentum` optimiser (raysim/aggregation/optimizers.py) with this
section's options, so `algorithm=fedavgm` is `server.optimizer=momentum` under its own
name (and takes any `server.aggregator`). Buffers (BatchNorm running statistics) take the
plain sample-weighted mean: momentum on a running variance can push it below zero (and
eval-mode BatchNorm to NaN).
Reference: Flower's `FedAvgM` strategy (adap/flower, flwr/server/strategy/fedavgm.py): the
same pseudo-gradient w - w_avg, momentum vector and step. Flower applies it to every array
a client sends, BatchNorm statistics included when clients send state dicts; we do not."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.aggregation.optimizers import Momentum
from raysim.options import Options, option
from raysim.registry import ALGORITHMS

from raysim.algorithms.fedavg import FedAvg


@dataclass
class FedAvgMOptions(Options):
    beta: float = option(0.9, at_least=0, below=1)  # server momentum
    server_lr: float = option(1.0, above=0)


@ALGORITHMS.register("fedavgm")
class FedAvgM(FedAvg):
    """FedAvg with the server's momentum optimiser, set by `fedavgm.beta` / `fedavgm.server_lr`."""

    Options = FedAvgMOptions
    server_parts = ("aggregator", "privacy")
    own_server_rule = "it is FedAvg with server.optimizer=momentum, set by fedavgm.beta and fedavgm.server_lr"

    def server_optimizer(self) -> Momentum:
        c = self.cfg.fedavgm
        return Momentum(self.cfg.server, beta=c.beta, lr=c.server_lr)
