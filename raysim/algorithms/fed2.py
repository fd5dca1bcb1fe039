"""Fed2 (Yu et al., KDD 2021): feature-aligned FL by structure adaptation and feature paired
averaging.

- Structure adaptation (`build_model`): the configured model with its last `fed2.layers`
  layers cut into `fed2.groups` parameter groups -- grouped convolutions, block-diagonal
  fully connected layers, a decoupled classifier whose class logits read only their group's
  features (gradient redirection) -- classes allocated to groups in blocks or round-robin,
  and GroupNorm for BatchNorm (`fed2.norm`). Built by `models/layered.py` for VGG-9, VGG-11,
  VGG-16 and MobileNet-v1; the same network on the server and in every client actor.
- Local training: FedAvg's. Each client also reports how many of its samples belong to
  each group's classes.
- Feature paired averaging (`aggregate`): shared layers by the sample-weighted mean (FedAvg);
  group g's parameters by the mean over the clients holding group g's classes, weighted by
  those samples; a group no selected client holds keeps its value. Built on the general
  `training.GroupWeightedMean` (per-parameter-group weights). Buffers of shared layers take
  the plain sample-weighted mean; a grouped layer's BatchNorm statistics go with their
  group (`fed2.buffers`, below), so they describe the weights they normalise.

Defaults are the paper's: L = 6 layers, G = 10 groups, GroupNorm. No public code of the
authors was found; the statement follows the paper (Sec. 4-5) and ../shared/ALGORITHMS.md.

Options beyond the paper, from measurements (VGG-9 on digits, 10 nodes x 5 classes, SGD
lr 0.02 momentum 0.9; configs/sweeps/fed2_ablation_digits.yaml):
- `fed2.buffers`: a grouped layer's BatchNorm statistics are averaged with their group
  (`paired`, default: statistics from the clients whose weights they normalise) or by the
  plain sample mean (`plain`). Both gave Fed2+BN 29-49 % final accuracy at this lr.
- `fed2.classifier`: `paired` (the paper) or `all`. Pairing throws away what the clients
  without group g's classes teach group g's logit: that it should be low on their data.
  Measured on the test set, the mean logit of the classes a sample is *not* is 9.2 under
  Fed2+GN and 17.0 under Fed2+BN (round 14, rising), against 0.03 for FedAvg on the same
  grouped network. With GroupNorm this stays stable (98.4 % vs FedAvg+GN's 98.7 %); with
  BatchNorm at lr 0.02 the local training loss climbs from 0.2 to hundreds after round
  10 (at lr 0.005 it trains on 2 of 3 seeds, 97.7 and 98.7 %). `all` averages the decoupled classifier over
  every client (only the grouped feature layers are paired). On the default digits run
  (Dirichlet, 20 clients, 10 per round, 2 epochs, GroupNorm) at lr 0.02, `paired` swings
  (0.91 at round 9, 0.11 at round 18, 0.94 at 30) where `all` climbs steadily to 0.99;
  at lr 0.01 (this algorithm's config group) `paired` is steady too (0.97).
On the MNIST split with half the 10 nodes per round (20 rounds, lr 0.01) Fed2+GN ends at
89.8 % against FedAvg+GN's 98.1 %, swinging between rounds (best 96.8 %): a group is
averaged over the round's one or two holders of its classes only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from omegaconf import OmegaConf

from raysim.algorithm import Client, ClientResult, Server
from raysim.algorithms.fedavg import FedAvg
from raysim.config import ConfigError
from raysim.models import build_model, layered, model_option_defaults
from raysim.registry import ALGORITHMS, MODELS
from raysim.training import GroupWeightedMean

STRUCTURE = ("groups", "grouped_layers", "allocation", "norm")  # the model options fed2.* sets


@dataclass
class Fed2Config:
    layers: int = 6  # L: how many of the last layers are grouped (the classifier counts)
    groups: int = 10  # G
    allocation: str = "blocks"  # classes to groups: blocks (C/G consecutive classes) | round_robin
    norm: str = "group"  # the network's normalisation: group (the paper) | batch | none
    pairing: str = "structure"  # which clients' group g is averaged: structure (every client's) | holders (of g's classes)
    buffers: str = "paired"  # holders: grouped BatchNorm statistics with their group (paired) | by the sample mean (plain)
    classifier: str = "paired"  # holders: the decoupled classifier paired too | averaged over every client (all)


def groupable_models() -> list[str]:
    return [m for m in MODELS.names() if "grouped_layers" in model_option_defaults(m)]


@ALGORITHMS.register("fed2")
class Fed2(FedAvg):
    Config = Fed2Config

    @staticmethod
    def validate_config(cfg) -> None:
        c = cfg.fed2
        if cfg.model not in groupable_models():
            raise ConfigError(f"fed2 adapts the structure of {', '.join(groupable_models())}; model={cfg.model!r} "
                              f"has no grouped form")
        if not (c.layers >= 2 and c.groups >= 2):
            raise ConfigError(f"fed2.layers and fed2.groups must be >= 2, got {c.layers} and {c.groups}")
        for key, allowed in (("allocation", layered.ALLOCATIONS), ("norm", layered.NORMS),
                             ("pairing", ("structure", "holders")), ("buffers", ("paired", "plain")),
                             ("classifier", ("paired", "all"))):
            if c[key] not in allowed:
                raise ConfigError(f"fed2.{key} must be one of {', '.join(allowed)}, got {c[key]!r}")
        clash = [k for k in STRUCTURE if k in cfg.model_options]
        if clash:
            raise ConfigError(f"model_options.{clash[0]} is set by fed2's section under fed2 "
                              f"(fed2.layers, fed2.groups, fed2.allocation, fed2.norm); remove it")

    def build_model(self, input_shape: tuple) -> torch.nn.Module:
        c = self.cfg.fed2
        options = {**OmegaConf.to_container(self.cfg.model_options), "groups": int(c.groups),
                   "grouped_layers": int(c.layers), "allocation": c.allocation, "norm": c.norm}
        return build_model(self.cfg.model, input_shape, self.num_classes, options)

    # ---- server ----
    def setup(self, server: Server) -> None:
        super().setup(server)
        if self.cfg.fed2.pairing == "structure":  # group g pairs with group g of every model: one shared weight
            self.row_groups = {}
            return
        rows = self.model.parameter_groups(buffers=self.cfg.fed2.buffers == "paired")
        if self.cfg.fed2.classifier == "all":  # group logits also learn from the clients without their classes
            rows = {k: v for k, v in rows.items() if not k.startswith("head.")}
        self.row_groups = rows

    def aggregate(self, rnd: int, results: Iterator[ClientResult]) -> dict:
        mean, loss_sum, held = GroupWeightedMean(self.row_groups), 0.0, set()
        for r in results:
            mean.add(r.update["weights"], r.num_samples, r.update["group_samples"])
            loss_sum += r.metrics["loss"] * r.num_samples
            held |= {g for g, n in enumerate(r.update["group_samples"]) if n > 0}
        new = mean.result(self.model.state_dict())
        if new is None:  # every client dropped out: keep the model
            return {}
        self.model.load_state_dict(new)
        return {"train_loss": loss_sum / mean.total, "groups_held": len(held)}

    # ---- client ----
    def client_update(self, client: Client, payload: dict) -> ClientResult:
        """FedAvg's update, plus the client's samples of each group's classes."""
        result = super().client_update(client, payload)
        groups = client.model.class_group.to(client.y.device)
        group_samples = torch.bincount(groups[client.y], minlength=int(self.cfg.fed2.groups))
        result.update = {"weights": result.update, "group_samples": group_samples.tolist()}
        return result
