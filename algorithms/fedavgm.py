"""FedAvgM (Hsu et al. 2019): server momentum on the averaged update of the trainable
parameters,
    v <- beta * v + (w - w_avg);  w <- w - server_lr * v;
buffers (BatchNorm running statistics) take the plain sample-weighted mean: momentum on a
running variance can push it below zero (and eval-mode BatchNorm to NaN).
Reference: Flower's `FedAvgM` strategy (adap/flower, flwr/server/strategy/fedavgm.py): the
same pseudo-gradient w - w_avg, momentum vector and step. Flower applies it to every array
a client sends, BatchNorm statistics included when clients send state dicts; we do not."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import parameter_names

from raysim.algorithms.fedavg import FedAvg


@dataclass
class FedAvgMOptions(Options):
    beta: float = option(0.9, at_least=0, below=1)  # server momentum
    server_lr: float = option(1.0, above=0)


@ALGORITHMS.register("fedavgm")
class FedAvgM(FedAvg):
    Options = FedAvgMOptions

    def setup(self, server) -> None:
        super().setup(server)
        self.velocity: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "velocity": dict(self.velocity)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.velocity = dict(state["velocity"])

    def apply(self, averaged: dict) -> None:
        c = self.cfg.fedavgm
        state = self.model.state_dict()
        new = {}
        params = parameter_names(self.model)
        for k, w in state.items():
            if k not in params:  # buffers are taken as averaged
                new[k] = averaged[k]
                continue
            delta = w - averaged[k]
            v = self.velocity.get(k)
            v = delta if v is None else c.beta * v + delta
            self.velocity[k] = v
            new[k] = w - c.server_lr * v
        self.model.load_state_dict(new)
