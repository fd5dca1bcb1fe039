"""Ditto (Li, Hu, Beirami, Smith 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization", Algorithm 1): the global model w is FedAvg's; each client also keeps a
personal model v_k, trained each round it is selected for `ditto.personal_epochs` on
    f_k(v_k) + lambda/2 ||v_k - w^t||^2
(w^t: the global model it received), before its FedAvg update of w. Its personal model is
v_k (the run's initial model until it is first selected). Compared with the authors' code
(litian96/ditto, flearn/trainers_MTL/ditto.py: per batch a personal step g + lam (v - w^t),
then a global step; as many of each; lam = 1 in their scripts) and PFLlib's clientditto.py
(`ptrain` for `plocal_epochs`, then `train`). Here the personal epochs run before the global
ones (PFLlib's order), `personal_epochs` 0 = as many as the global update's (the authors').
With 10 of 100 clients a round, v_k trains only in the rounds its client is selected: one
personal epoch and lam = 0.1 left it at 0.56 personal accuracy on MNIST #C=2, 5 epochs 0.95,
lam = 1 0.86 (benchmarks/results-personal-mnist.txt). See algorithms/_personal.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.contract import Client, ClientResult
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import base_loss, cpu_state, local_sgd

from raysim.algorithms._personal import Personal
from raysim.algorithms.fedprox import proximal_loss


@dataclass
class DittoOptions(Options):
    lam: float = option(1.0, at_least=0)  # lambda: the pull of v_k towards the global model (the authors' scripts: 1)
    personal_epochs: int = option(0, at_least=0)  # epochs on v_k per round; 0: local.epochs (the authors' code)


@ALGORITHMS.register("ditto")
class Ditto(Personal):
    Options = DittoOptions
    shared = "all"
    kept = None  # a whole model of its own: client.state["v"]

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model, o = client.model, client.cfg.ditto
        # 1. the personal model: v_k <- v_k - lr (grad f_k(v_k) + lambda (v_k - w^t))
        model.load_state_dict(client.state.get("v", self.initial(client)))
        anchor = [payload["weights"][n].to(client.device) for n, _ in model.named_parameters()]
        personal = local_sgd(client, model, proximal_loss(float(o.lam), anchor, base_loss(client.cfg.local)),
                             epochs=int(o.personal_epochs) or None, steps=0 if int(o.personal_epochs) else None)
        client.state["v"] = cpu_state(model)
        # 2. the global model's update: FedAvg's
        self.load_global(client, model, payload)
        stats = local_sgd(client, model, self.local_loss(client, payload))
        self.keep_buffers(client, model)
        return ClientResult(client.cid, client.num_samples, cpu_state(model),
                            {**stats, "personal_loss": personal["loss"]})

    def make_personal(self, client: Client, model: torch.nn.Module, payload) -> None:
        model.load_state_dict(client.state.get("v", self.initial(client)))
