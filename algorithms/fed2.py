"""Fed2 (Yu et al., KDD 2021): feature-aligned FL by structure adaptation and feature paired
averaging.

- Structure adaptation (`build_model`): the configured model with its last `fed2.layers`
  layers cut into `fed2.groups` parameter groups -- grouped convolutions, block-diagonal
  fully connected layers, a decoupled classifier whose class logits read only their group's
  features (gradient redirection) -- classes allocated to groups in blocks or round-robin,
  and GroupNorm for BatchNorm (`fed2.norm`). Built by `models/layered.py` for VGG-9, VGG-11,
  VGG-16 and MobileNet-v1; the same network on the server and in every client actor.
- Local training: FedAvg's. Each client also reports how many of its samples belong to
  each group's classes (metric `groups_held`).
- Feature paired averaging (`aggregate`, `fed2.pairing`): shared layers by the
  sample-weighted mean (FedAvg, Eq. 18); for the grouped layers, Eq. 19 averages a group
  with the groups it is "paired" with, and the paper pairs groups by the logits they are
  mapped to ("our group pairing process only needs to match the learning logits"):
  - `structure` (default): the structure adaptation gives group g the same classes in every
    model, so group g is paired with group g of every model and averaged over all the
    round's clients by samples. This is FedAvg on the adapted network (tested bit for bit);
    the alignment comes from the structure, not from who averages what;
  - `holders` (ALGORITHMS.md's reading): group g averaged only over the clients holding
    group g's classes, weighted by those samples; a group no selected client holds keeps
    its value (`training.GroupWeightedMean`). A grouped layer's BatchNorm statistics go
    with their group (`fed2.buffers: paired`) or take the plain mean (`plain`);
    `fed2.classifier: all` averages the decoupled classifier over every client.
- `fed2.absent: freeze` (ours, an ablation): a client leaves the feature groups of the
  classes it has no sample of as it received them, so only its classifier heads hear it
  about those classes; it measures how much of a dip comes from nodes without a class
  reshaping that class's group (below).

Why `structure` is the default, measured (issue 26; benchmarks/results-fed2-pairing.txt):
under `holders` a group's logits never hear from the clients without its classes -- the
"push down" a client gives the classes it lacks -- so absent-class logits drift up (mean
logit of the classes a sample is not: 9.2 under Fed2+GN, 17.0 under Fed2+BN, 0.03 under
FedAvg on the same network, digits, round 14) and training diverges: MNIST #C=3 over 10
nodes, all per round, VGG-9+GN, lr 0.01 momentum 0.9, seed 0: training loss 1.21, 0.45,
0.34, 0.41, 0.52, 1.29, 6.33, 5.10, 3.51, 6.57 under `holders`; 1.21, 0.60, 0.26, 0.25,
0.29, 0.34, 0.21, 0.18, 0.11, 0.12 under `structure`. In the paper's set-up (FedMA's: every
node in every round; MNIST split, 10 nodes x 5 classes, 20 rounds, seeds 0-2;
benchmarks/results-fed2-full.txt) Fed2+GN ends at 99.0 / 98.7 / 98.9 (mean of the last 5
rounds) against FedAvg+GN's 99.0 / 98.9 / 98.9 on the plain VGG-9 (98.9 both, on average),
its training loss falls every round but one per seed (largest rise +0.003; FedAvg+GN: 2-4
rises, up to +0.007), and its rounds take 23 % less time (856 vs 1107 s per run).
With half the nodes per round (configs/sweeps/fed2_ablation_mnist.yaml) Fed2+GN scores
98.6 / 97.8 / 93.3 against 98.5 / 98.0 / 97.9 (holders: 89.8 on average). Seed 2's dip
(rounds 12-16), instrumented round by round (benchmarks/README.md "Fed2's half-participation
dip, instrumented"): in round 12 one of the five nodes holds class 1 (181 of 4,310 samples);
class 1 falls from 1.00 to 0.08 while its logit still ranks class-1 images first (AUC 0.989)
-- its group's features moved (their norm on class 1: 11.0 -> 7.2, on the rest 7.8 -> 8.9;
the classifier row and bias did not), and subtracting each class's mean logit lifts
the round-12 model from 85.6 % to 96.2 %. Class 8, held by 2 nodes of 10 (no holder in 22 % of half cohorts),
has a group that has wasted away by round 11 (feature norm 1.8 against 8-13 for the other
groups; a linear probe on its 52 features separates class 8 at AUC 0.89, others >= 0.99), so
its accuracy rides on the other logits (0.81, 0.99, 0.17 in rounds 11-13). A class's group
is trained mostly by nodes without the class when few of the round's nodes hold it; FedAvg's
features are trained by every node's data. No reading closes the gap on seed 2 (last 5):
`structure` 93.3, G=5 (two classes per group) 94.5, `absent=freeze` (a node leaves the
feature groups of classes it lacks as received) 96.1, `holders` + `classifier=all` +
`absent=freeze` 95.4, against FedAvg+GN 97.9; `absent=freeze` over seeds 0-2:
97.6 / 96.6 / 96.1 (96.8 on average; `structure` 98.6 / 97.8 / 93.3, 96.5), better on the dip seed, worse on the other two.
The paper's experiments keep every node in every round (FedMA's set-up), where the
default is level with FedAvg.

No public code of the authors was found; a public review of the paper (creatis-myriad,
2022) reads the aggregation the same way: "groups of parameters dedicated to the same
classes are averaged together".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from omegaconf import OmegaConf

from raysim.contract import Client, ClientResult, Server
from raysim.algorithms.fedavg import FedAvg
from raysim.errors import ConfigError
from raysim.options import Options, option
from raysim.models import build_model, layered, model_option_defaults
from raysim.registry import ALGORITHMS, MODELS
from raysim.training import GroupWeightedMean, cpu_state, local_sgd

STRUCTURE = ("groups", "grouped_layers", "allocation", "norm")  # the model options fed2.* sets


@dataclass
class Fed2Options(Options):
    layers: int = option(6, at_least=2)  # L: how many of the last layers are grouped (the classifier counts)
    groups: int = option(10, at_least=2)  # G
    allocation: str = option("blocks", choices=layered.ALLOCATIONS)  # classes to groups: blocks (C/G consecutive classes) | round_robin
    norm: str = option("group", choices=layered.NORMS)  # the network's normalisation: group (the paper) | batch | none
    pairing: str = option("structure", choices=("structure", "holders"))  # which clients' group g is averaged: structure (every client's) | holders (of g's classes)
    buffers: str = option("paired", choices=("paired", "plain"))  # holders: grouped BatchNorm statistics with their group (paired) | by the sample mean (plain)
    classifier: str = option("paired", choices=("paired", "all"))  # holders: the decoupled classifier paired too | averaged over every client (all)
    absent: str = option("train", choices=("train", "freeze"))  # a client's feature groups of classes it has no sample of: trained (train) | left as received (freeze)

    def check(self, cfg, section: str) -> None:
        if cfg.model not in groupable_models():
            raise ConfigError(f"fed2 adapts the structure of {', '.join(groupable_models())}; model={cfg.model!r} "
                              f"has no grouped form")
        clash = [k for k in STRUCTURE if k in cfg.model_options]
        if clash:
            raise ConfigError(f"model_options.{clash[0]} is set by fed2's section under fed2 "
                              f"(fed2.layers, fed2.groups, fed2.allocation, fed2.norm); remove it")


def groupable_models() -> list[str]:
    return [m for m in MODELS.names() if "grouped_layers" in model_option_defaults(m)]


@ALGORITHMS.register("fed2")
class Fed2(FedAvg):
    trains_privately = False  # privacy.mode=local refused: its group-wise training corrects gradients outside DP-SGD
    server_parts = ()
    returns_model = False  # it returns the weights with its samples per group
    own_server_rule = "its aggregate is the paired, per-group weighted mean"

    Options = Fed2Options

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
        """FedAvg's update, plus the client's samples of each group's classes. With
        `fed2.absent=freeze` the feature groups of the classes the client has no sample of
        stay as received (their gradients zeroed, their rows restored after training): only
        the decoupled classifier hears the client about those classes."""
        groups = client.model.class_group.to(client.y.device)
        group_samples = torch.bincount(groups[client.y], minlength=int(self.cfg.fed2.groups))
        held = group_samples > 0
        if self.cfg.fed2.absent == "freeze" and not bool(held.all()):
            result = self.train_held_groups(client, payload, held.cpu())
        else:
            result = super().client_update(client, payload)
        result.update = {"weights": result.update, "group_samples": group_samples.tolist()}
        return result

    def train_held_groups(self, client: Client, payload: dict, held: torch.Tensor) -> ClientResult:
        """FedAvg's local SGD with the feature rows of the groups not `held` kept as received."""
        model = client.model
        model.load_state_dict(payload["weights"])
        rows = {k: v for k, v in model.parameter_groups(buffers=True).items() if not k.startswith("head.")}
        params = dict(model.named_parameters())
        masks = {k: held[rows[k]].to(p.device, p.dtype).reshape(-1, *[1] * (p.dim() - 1))
                 for k, p in params.items() if k in rows}

        def keep_absent_groups():
            for k, m in masks.items():
                if params[k].grad is not None:
                    params[k].grad.mul_(m)

        stats = local_sgd(client, model, self.local_loss(client, payload), on_gradients=keep_absent_groups)
        state = cpu_state(model)
        for k, group in rows.items():  # exact: weight decay and running statistics moved them too
            absent = ~held[group]
            state[k][absent] = payload["weights"][k].to(state[k].device)[absent]
        return ClientResult(client.cid, client.num_samples, state, stats)
