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
    def __init__(self, server_cfg, trainable: set[str], optimizer: Optional[optimizers.ServerOptimizer] = None,
                 privacy=None):
        """`trainable`: the state-dict keys the aggregator and optimiser act on
        (`training.parameter_names`); `optimizer`: one the algorithm builds itself (FedAvgM's
        momentum from `fedavgm.*`), else `server.optimizer`'s; `privacy`: a
        `privacy.central.CentralDP` (`privacy.mode=central`), which replaces the mean of
        the models by the noised mean of the clipped updates."""
        self.cfg = server_cfg
        self.trainable = set(trainable)
        self.optimizer = optimizer or SERVER_OPTIMIZERS.get(server_cfg.optimizer)(server_cfg)
        self.privacy = privacy

    def round(self, current: Optional[dict] = None, rnd: int = 0) -> "RoundFold":
        """A fold of one round's client models (`add` each in client-id order, then `result`).
        With privacy the fold needs the model the clients started from (`current`: updates
        are clipped as they come) and the round (the noise's generator)."""
        if self.privacy is not None:
            if current is None:
                raise ValueError("a private fold needs the current model: ServerRule.round(current, rnd)")
            return PrivateFold(self, current, rnd)
        return RoundFold(self)

    def state_dict(self) -> dict:
        return {**self.optimizer.state_dict(), **(self.privacy.state_dict() if self.privacy is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
        if self.privacy is not None:
            self.privacy.load_state_dict(state)


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

    def metrics(self) -> dict:
        """The round's metrics of the fold itself (none; `PrivateFold` reports its clipping)."""
        return {}


class PrivateFold:
    """A round under `privacy.mode=central` (privacy/central.py): each client's update
    clipped as it comes, in client-id order; the result is the current model plus the noised
    sum over the fixed cohort size, then the server optimiser's step. Non-trainable entries
    stay as they are (a model with BatchNorm statistics is refused: they would leak)."""

    def __init__(self, rule: ServerRule, current: dict[str, torch.Tensor], rnd: int):
        self.rule, self.rnd = rule, rnd
        self.start = {k: v.detach().clone() for k, v in current.items() if k in rule.trainable}
        self.start64 = {k: v.double() for k, v in self.start.items()}  # updates are taken in float64, once per client
        self.sum = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in self.start.items()}
        self.total = 0.0  # the clients' sample weights, for the caller's weighted train loss
        self.clients = self.clipped = 0

    def add(self, state: dict[str, torch.Tensor], weight: float) -> None:
        update, clipped = self.rule.privacy.clip({k: state[k].double() - self.start64[k] for k in self.start})
        for k, u in update.items():
            self.sum[k] += u
        self.clients += 1
        self.clipped += int(clipped)
        self.total += float(weight)

    def add_sum(self, sums: dict[str, torch.Tensor], weight: float) -> None:
        raise ValueError("privacy clips each client's update: partial sums cannot be private (refused by the config)")

    def result(self, current: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new global state: always one, even when every client dropped out (the noise is
        the mechanism's output whatever came in)."""
        dp = self.rule.privacy
        noise = dp.noise(self.start, self.rnd)
        target = {k: (self.start64[k] + (self.sum[k] + noise[k]) / dp.clients_per_round).to(self.start[k].dtype)
                  for k in self.start}
        trainable = {k: v for k, v in current.items() if k in self.rule.trainable}
        stepped = self.rule.optimizer.step(trainable, target)
        self.clip_used = dp.clip_norm
        dp.adapt(self.clients - self.clipped, self.rnd)  # adaptive clipping: next round's clip
        return {k: stepped[k] if k in stepped else current[k] for k in current}

    def metrics(self) -> dict:
        """The round's clipping: the clip, how many updates it scaled down (tune `privacy.clip`
        with it, or let `privacy.adaptive_clip` follow a quantile)."""
        return {"dp_clients": self.clients, "dp_clip": getattr(self, "clip_used", self.rule.privacy.clip_norm),
                "dp_clipped_fraction": self.clipped / self.clients if self.clients else None}

