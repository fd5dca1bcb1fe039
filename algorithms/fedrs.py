"""FedRS (Li and Zhan 2021): restricted softmax. During local training the logit of class c
is scaled by s_c, so that a client pushes the classifier rows of classes it lacks (or
barely has) less:

    soft   (the authors' code, default):  s_c = alpha + (1 - alpha) * n_c / max_j n_j
    binary (the paper's text):            s_c = 1 if n_c > 0 else alpha

with n_c the client's count of class c; alpha = 1 is FedAvg. The authors' classifier has
no bias (`fedrs.bias: false`, default: the head's bias is zeroed once and left out of the
local logits, so it stays 0); with `fedrs.bias: true` the whole logit, bias included, is
scaled. Aggregation, evaluation: FedAvg's.
Reference: lxcnju/FedRepo, algorithms/fedrs.py (logits = s * (h W^T), s as `soft` above).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from raysim.contract import Client, Server
from raysim.options import Options, option
from raysim.registry import ALGORITHMS

from raysim.algorithms.fedavg import FedAvg


@dataclass
class FedRSOptions(Options):
    alpha: float = option(0.5, above=0, at_most=1)
    scaling: str = option("soft", choices=("soft", "binary"))  # soft (authors' code) | binary (paper)
    bias: bool = False  # False: no classifier bias, as the authors' code


def logit_scale(counts: np.ndarray, alpha: float, scaling: str) -> torch.Tensor:
    """s_c per class from the client's label counts (see the module docstring)."""
    counts = np.asarray(counts, dtype=np.float64)
    if scaling == "binary":
        s = np.where(counts > 0, 1.0, alpha)
    else:
        s = alpha + (1.0 - alpha) * counts / max(counts.max(), 1.0)
    return torch.from_numpy(s).float()


def restricted_logits(logits: torch.Tensor, present: torch.Tensor, alpha: float) -> torch.Tensor:
    """Logits of absent classes (present[c] False) scaled by alpha; the others unchanged."""
    scale = torch.where(present, torch.ones_like(logits[0]), torch.full_like(logits[0], alpha))
    return logits * scale


@ALGORITHMS.register("fedrs")
class FedRS(FedAvg):
    trains_privately = False  # privacy.mode=local refused: its loss reads the classifier's weights directly, past Opacus' hooks
    Options = FedRSOptions
    trains_on_base_loss = False  # its own loss (local.focal_gamma does not apply)

    def setup(self, server: Server) -> None:
        super().setup(server)
        if not self.cfg.fedrs.bias:
            with torch.no_grad():
                self.model.head.bias.zero_()

    def local_loss(self, client: Client, payload: dict):
        c = self.cfg.fedrs
        scale = logit_scale(client.label_counts(), float(c.alpha), c.scaling).to(client.device)
        with_bias = bool(c.bias)

        def loss(model, x, y):
            head = model.head
            logits = F.linear(model.encoder(x), head.weight, head.bias if with_bias else None)
            return F.cross_entropy(logits * scale, y)

        return loss
