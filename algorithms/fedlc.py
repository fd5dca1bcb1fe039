"""FedLC (Zhang et al. 2022): logit calibration against label skew. During local training
each logit is shifted by the client's own class count n_c:

    z_c - tau * n_c^(-1/4)

so rare local classes are pushed down before the softmax and the client learns less bias
towards its frequent ones. Absent classes (n_c = 0) take n_c = 1e-8, as the authors'
code does: their logits drop by 100 tau, out of the softmax. tau = 1 (chosen: the paper's
value did not survive extraction). Aggregation, evaluation: FedAvg's."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from raysim.contract import Client
from raysim.options import Options, option
from raysim.registry import ALGORITHMS

from raysim.algorithms.fedavg import FedAvg


@dataclass
class FedLCOptions(Options):
    tau: float = option(1.0, at_least=0)
    absent_count: float = option(1e-8, above=0)  # the n_c an absent class takes (the authors' 1e-8: its logit leaves the softmax)


def calibrated_logits(logits: torch.Tensor, counts: torch.Tensor, tau: float, absent: float = 1e-8) -> torch.Tensor:
    """z_c - tau * n_c^(-1/4), with n_c = 0 read as `absent` (the authors' 1e-8)."""
    n = counts.to(logits.dtype)
    n = torch.where(n > 0, n, torch.full_like(n, absent))
    return logits - tau * n.pow(-0.25)


@ALGORITHMS.register("fedlc")
class FedLC(FedAvg):
    Options = FedLCOptions
    trains_on_base_loss = False  # its own loss (local.focal_gamma does not apply)

    def local_loss(self, client: Client, payload: dict):
        counts = torch.from_numpy(client.label_counts().astype(np.float64)).to(client.device)
        tau, absent = float(self.cfg.fedlc.tau), float(self.cfg.fedlc.absent_count)

        def loss(model, x, y):
            return F.cross_entropy(calibrated_logits(model(x), counts, tau, absent), y)

        return loss
