"""FedRS (Li and Zhan 2021): restricted softmax. During local training, the logits of the
classes the client has no sample of are multiplied by alpha (0 < alpha <= 1), so that the
client pushes their classifier rows less; alpha = 1 is FedAvg. The paper scales those
classes' weight vectors; here the whole logit (bias included) is scaled. Aggregation,
evaluation: FedAvg's."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysim.algorithm import Client
from raysim.config import ConfigError
from raysim.registry import ALGORITHMS

from algorithms.fedavg import FedAvg


@dataclass
class FedRSConfig:
    alpha: float = 0.5


def restricted_logits(logits: torch.Tensor, present: torch.Tensor, alpha: float) -> torch.Tensor:
    """Logits of absent classes (present[c] False) scaled by alpha; the others unchanged."""
    scale = torch.where(present, torch.ones_like(logits[0]), torch.full_like(logits[0], alpha))
    return logits * scale


@ALGORITHMS.register("fedrs")
class FedRS(FedAvg):
    Config = FedRSConfig

    @staticmethod
    def validate_config(cfg) -> None:
        if not 0 < cfg.fedrs.alpha <= 1:
            raise ConfigError(f"fedrs.alpha must be in (0, 1], got {cfg.fedrs.alpha}")

    def local_loss(self, client: Client, payload: dict):
        present = torch.from_numpy(client.label_counts() > 0).to(client.device)
        alpha = float(self.cfg.fedrs.alpha)

        def loss(model, x, y):
            return F.cross_entropy(restricted_logits(model(x), present, alpha), y)

        return loss
