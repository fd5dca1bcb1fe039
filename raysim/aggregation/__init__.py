"""The server's rule, in parts any algorithm that aggregates client models can use:
an aggregator (`server.aggregator`, aggregators.py: how the clients' models combine) and an
optimiser (`server.optimizer`, optimizers.py: how the global model steps toward that
combination). `ServerRule` joins them and holds the one rule every server step in raysim
keeps: the aggregator and the optimiser see the trainable parameters only; buffers
(BatchNorm running statistics, counters) take the plain sample-weighted mean, so a running
variance stays a variance.

An algorithm opts in by folding its clients' models through `ServerRule.round()` (FedAvg
and the algorithms built on it do) and declaring which parts it takes
(`Algorithm.server_parts`); the config refuses a part an algorithm does not take.
"""
from __future__ import annotations

from typing import Optional

import torch

from raysim.aggregation import aggregators, optimizers  # noqa: F401  (their import registers the parts)
from raysim.registry import AGGREGATORS, SERVER_OPTIMIZERS
from raysim.training import WeightedMean


def is_plain(server_cfg) -> bool:
    """Whether `server.*` asks for plain FedAvg: the weighted mean, taken as the new model."""
    return server_cfg.aggregator == "mean" and server_cfg.optimizer == "sgd" and float(server_cfg.lr) == 1.0


class ServerRule:
    def __init__(self, server_cfg, trainable: set[str], optimizer: Optional[optimizers.ServerOptimizer] = None):
        """`trainable`: the state-dict keys the aggregator and optimiser act on
        (`training.parameter_names`); `optimizer`: one the algorithm builds itself (FedAvgM's
        momentum from `fedavgm.*`), else `server.optimizer`'s."""
        self.cfg = server_cfg
        self.trainable = set(trainable)
        self.optimizer = optimizer or SERVER_OPTIMIZERS.get(server_cfg.optimizer)(server_cfg)

    def round(self) -> "RoundFold":
        """A fold of one round's client models (`add` each in client-id order, then `result`)."""
        return RoundFold(self)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class RoundFold:
    def __init__(self, rule: ServerRule):
        self.rule = rule
        self.plain = rule.cfg.aggregator == "mean"
        self.aggregator = AGGREGATORS.get(rule.cfg.aggregator)(rule.cfg)
        self.buffers = WeightedMean()  # non-trainable entries (the mean aggregator folds them itself)
        self.total = 0.0

    def add(self, state: dict[str, torch.Tensor], weight: float) -> None:
        if self.plain:  # one running sum of every entry, as FedAvg always did
            self.aggregator.add(state, weight)
        else:
            self.aggregator.add({k: v for k, v in state.items() if k in self.rule.trainable}, weight)
            self.buffers.add({k: v for k, v in state.items() if k not in self.rule.trainable}, weight)
        self.total += float(weight)

    def add_sum(self, sums: dict[str, torch.Tensor], weight: float) -> None:
        """A partial sum of several clients' states (`server.partial_sums`, mean only)."""
        self.aggregator.mean.add_sum(sums, weight)
        self.total += float(weight)

    def result(self, current: dict[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        """The new global state from `current` (the model's state dict); None when no client
        was added (every client dropped out: keep the model)."""
        if self.total <= 0:
            return None
        trainable = {k: v for k, v in current.items() if k in self.rule.trainable}
        if self.plain:
            combined = self.aggregator.result(current)
        else:
            combined = {**(self.buffers.result(current) or {}), **self.aggregator.result(trainable)}
        stepped = self.rule.optimizer.step(trainable, {k: combined[k] for k in trainable})
        return {k: stepped[k] if k in stepped else combined[k] for k in current}
