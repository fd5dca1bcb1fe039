"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan 2023, "FedALA: Adaptive Local Aggregation
for Personalized Federated Learning"): FedAvg's server, and a client that does not overwrite
its model with the global one but mixes them element-wise. Its lower layers take the global
model's weights; its higher ones (the last `fedala.layer_idx` parameter tensors; 0: all)

    theta_hat = theta_i + (theta_global - theta_i) * W_i,   W_i in [0, 1] element-wise,

W_i (client state, all ones at first) learned by
    W_i <- clip(W_i - eta * grad_theta_hat L * (theta_global - theta_i), 0, 1)
on each batch of a window of `fedala.rand_percent`% of its training data (a random start,
batches in order, the last short batch kept), with theta_hat recomputed after each batch:
one pass a round, except the first time, when passes repeat until the std of the last
`fedala.num_pre_loss` pass losses is under `fedala.threshold` (at most
`fedala.max_start_epochs` passes). Then it trains theta_hat as FedAvg does and uploads it;
its trained model theta_i stays in client state. A client's model for evaluation is the
same mix of the served model and its theta_i (the weights W_i learned on a copy, its state
untouched); a client that never trained uses the served model.

Compared with the authors' ALA module (TsingZ0/FedALA, utils/ALA.py, also PFLlib's
utils/ALA.py and clientala.py; defaults eta 1, rand_percent 80, threshold 0.1, num_pre_loss 10,
PFLlib's layer_idx 2: a linear head's weight and bias). Differences: their clients keep their
own BatchNorm statistics; here buffers come from the served model (raysim's buffer rule); a
window of no sample (rand_percent of a client of a few samples rounds to 0) is one sample here
(their loader would be empty and their loop fail); the start phase is capped (theirs loops
until the std test passes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from raysim.contract import Client, ClientResult
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import base_loss, cpu_state, local_sgd

from raysim.algorithms.fedavg import FedAvg


@dataclass
class FedALAOptions(Options):
    layer_idx: int = option(2, at_least=0)  # the last this-many parameter tensors are mixed (0: all)
    eta: float = option(1.0, above=0)  # W's learning rate
    rand_percent: int = option(80, above=0, at_most=100)  # the share of the training data W learns on
    threshold: float = option(0.1, above=0)  # the first time: passes until the losses' std is under this
    num_pre_loss: int = option(10, at_least=1)  # ... over this many last passes
    max_start_epochs: int = option(100, at_least=1)  # ... and at most this many passes (the authors': no cap)


@ALGORITHMS.register("fedala")
class FedALA(FedAvg):
    Options = FedALAOptions
    personal = True
    client_state = True  # theta_i (its trained model) and W_i
    trains_privately = False  # W's learning reads the data outside DP-SGD

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model = client.model
        weights = self.adaptive_local_aggregation(client, model, payload["weights"])
        if weights is not None:
            client.state["W"] = weights
        stats = local_sgd(client, model, self.local_loss(client, payload))
        client.state["theta"] = cpu_state(model)
        return ClientResult(client.cid, client.num_samples, cpu_state(model), stats)

    def make_personal(self, client: Client, model: torch.nn.Module, payload) -> None:
        """Its model for evaluation: the served one mixed with its theta_i (state untouched)."""
        self.adaptive_local_aggregation(client, model, payload["weights"])

    def adaptive_local_aggregation(self, client: Client, model: torch.nn.Module, served: dict) -> Optional[list]:
        """Load the client's initialised model into `model`: the served weights where it has
        no theta_i yet, else the mix above; return the learned W_i (None: nothing learned)."""
        model.load_state_dict(served)
        if "theta" not in client.state:  # first time: the served model (the authors' 1st-iteration rule)
            return None
        o = client.cfg.fedala
        own = {k: v.to(client.device) for k, v in client.state["theta"].items()}
        params = [(n, p) for n, p in model.named_parameters()]
        higher = params[-int(o.layer_idx):] if int(o.layer_idx) else params
        names = [n for n, _ in higher]
        glob = {n: p.detach().clone() for n, p in higher}
        delta = {n: glob[n] - own[n] for n in names}
        start = "W" not in client.state
        weights = [w.to(client.device).clone() for w in client.state["W"]] if not start else \
            [torch.ones_like(p) for _, p in higher]
        lower = [p for n, p in params if n not in names]
        was = [p.requires_grad for p in lower]
        for p in lower:
            p.requires_grad_(False)
        loss_of = base_loss(client.cfg.local)

        def mix() -> None:
            with torch.no_grad():
                for (n, p), w in zip(higher, weights):
                    p.copy_(own[n] + delta[n] * w)

        n, bs = client.num_samples, int(client.cfg.local.batch_size)
        size = int(int(o.rand_percent) / 100 * n)
        at = int(torch.randint(0, n - size + 1, (1,), generator=client.generator))
        # the window's batches in order, the last short one kept (the authors' DataLoader, drop_last=False);
        # a window of no sample (a tiny client) is one sample here (theirs would have no batch and fail)
        window = [slice(s, min(s + bs, at + size)) for s in range(at, at + size, bs)] or [slice(at, at + 1)]
        mix()
        losses, buffers = [], {k: b.clone() for k, b in model.named_buffers()}  # W's passes leave no statistics (the authors' copy)
        try:
            model.train()
            for _ in range(int(o.max_start_epochs) if start else 1):
                for rows in window:
                    model.zero_grad()
                    loss = loss_of(model, client.x[rows], client.y[rows])
                    loss.backward()
                    with torch.no_grad():
                        for i, (name, p) in enumerate(higher):
                            weights[i] = torch.clamp(weights[i] - float(o.eta) * (p.grad * delta[name]), 0, 1)
                    mix()
                losses.append(float(loss.detach()))
                k = int(o.num_pre_loss)
                if len(losses) > k and torch.tensor(losses[-k:]).std(unbiased=False) < float(o.threshold):
                    break
        finally:
            for p, w in zip(lower, was):
                p.requires_grad_(w)
            model.zero_grad(set_to_none=True)
            model.load_state_dict(buffers, strict=False)
        return [w.detach().cpu() for w in weights]
