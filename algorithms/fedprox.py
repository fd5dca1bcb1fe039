"""FedProx (Li et al. 2020): FedAvg whose local loss adds mu/2 * ||w - w_global||^2."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.contract import Client
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import base_loss, cross_entropy

from raysim.algorithms.fedavg import FedAvg


@dataclass
class FedProxOptions(Options):
    mu: float = option(0.01, at_least=0)  # weight of the proximal term


def proximal_loss(mu: float, global_params: list[torch.Tensor], base=cross_entropy):
    """base (cross-entropy, or focal) + mu/2 * sum ||w - w_global||^2 over the trainable parameters."""
    def loss(model, x, y):
        prox = sum(((w - g) ** 2).sum() for w, g in zip(model.parameters(), global_params))
        return base(model, x, y) + 0.5 * mu * prox

    return loss


@ALGORITHMS.register("fedprox")
class FedProx(FedAvg):
    trains_privately = False  # privacy.mode=local refused: the proximal term's gradient is not a per-sample one
    Options = FedProxOptions

    def local_loss(self, client: Client, payload: dict):
        names = [n for n, _ in client.model.named_parameters()]
        global_params = [payload["weights"][n].to(client.device) for n in names]
        return proximal_loss(float(self.cfg.fedprox.mu), global_params, base_loss(client.cfg.local))

    def client_update_cohort(self, clients: list[Client], payload: dict):
        mu = float(self.cfg.fedprox.mu)
        device = clients[0].device
        names = [n for n, p in clients[0].model.named_parameters() if p.requires_grad]
        global_params = {n: payload["weights"][n].to(device) for n in names}

        def proximal(params: dict):  # one client's weights (under vmap)
            return 0.5 * mu * sum(((params[n] - g) ** 2).sum() for n, g in global_params.items())

        return self.train_cohort(clients, payload, penalty=proximal)
