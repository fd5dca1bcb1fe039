"""FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization").

    client k, from the server's model x with its own lambda_k (0 at first; client state):
        minimise  L_k(w) + alpha_k <w, lambda_k - x> + alpha_k/2 ||w||^2      (local SGD)
        lambda_k <- lambda_k + (w_k - x)                                    (its -grad L_k / alpha_k)
        upload w_k
    server, over the clients S that returned (N clients in all):
        avg      = mean_S w_k
        sum_lam  = sum_lam + sum_S (w_k - x)          (= sum over all N clients of lambda_k)
        x        = avg + sum_lam / N                  (the paper's  avg - h / alpha)

The linear term plus alpha_k/2 ||w||^2 is the paper's  -<grad L_k(w_k^{t-1}), w> +
alpha/2 ||w - x||^2 up to a constant (grad L_k(w_k^{t-1}) = -alpha lambda_k). Reference: the
authors' code, alpemreacar/FedDyn (utils_methods.py `train_FedDyn`, utils_general.py
`train_feddyn_mdl`), followed here: alpha_k = alpha / w_k with w_k = N n_k / sum n
(`feddyn.adaptive_alpha`, default; false: the paper's one alpha), the uniform mean of the
returned models, and the server's sum of lambdas kept from the uploads. Two models are
evaluated: `global`, x (what clients start from, Algorithm 1's output), and `average`, the
mean of the round's models (what the authors' code reports as its test accuracy). The
authors clip every step's gradient to norm 10 (all their methods alike); `local.clip_grad_norm=10`
is the nearest raysim has, not the same: their quadratic term is their optimiser's weight decay,
added after the clip, where here it is part of the loss and clipped with it. Unset by default
(without it, one of the results table's mnist_c2 runs at alpha 0.1 blew up at round 63:
docs/results.md). lambda covers trainable parameters; buffers (BatchNorm
statistics) take the plain sample-weighted mean. Under a lossy `compress.up` each lambda_k
gathers the decoded moves the server summed (`uploaded`), not the exact ones, so
x = avg + sum(lambda) / N holds for the lambdas the clients train with.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterator

import torch

from raysim.contract import Client, ClientResult, Server
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import WeightedMean, base_loss, cpu_state, local_sgd

from raysim.algorithms.fedavg import FedAvg


@dataclass
class FedDynOptions(Options):
    alpha: float = option(0.01, above=0)  # weight of the dynamic regulariser (the authors' alpha_coef)
    adaptive_alpha: bool = option(True)  # alpha_k = alpha * mean samples / n_k (the authors' code); false: alpha for all


def dynamic_loss(alpha: float, lam: dict, x: dict, names: list[str], base):
    """base + alpha <w, lambda - x> + alpha/2 ||w||^2 over the trainable parameters `names`."""
    shift = [lam[n] - x[n] for n in names]

    def loss(model, xb, yb):
        params = dict(model.named_parameters())
        reg = sum((params[n] * s).sum() + 0.5 * (params[n] ** 2).sum() for n, s in zip(names, shift))
        return base(model, xb, yb) + alpha * reg

    return loss


@ALGORITHMS.register("feddyn")
class FedDyn(FedAvg):
    trains_privately = False  # privacy.mode=local refused: the regulariser's gradient is not a per-sample one
    server_parts = ()
    returns_model = True
    own_server_rule = "its server model is the mean of the returned models plus the mean of all clients' lambdas"

    Options = FedDynOptions
    client_state = True  # lambda_k

    # ---- server ----
    def setup(self, server: Server) -> None:
        super().setup(server)
        self.num_clients = server.num_clients
        self.mean_samples = float(sum(server.sizes)) / max(1, len(server.sizes))
        self.trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.sum_lam = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in self.model.named_parameters()
                        if n in self.trainable}
        self.average = copy.deepcopy(self.model)

    def broadcast(self, rnd: int) -> dict:
        return {"weights": cpu_state(self.model), "mean_samples": self.mean_samples}

    def aggregate(self, rnd: int, results: Iterator[ClientResult]) -> dict:
        x = self.model.state_dict()
        models, buffers, loss_sum = WeightedMean(), WeightedMean(), 0.0
        moved = {n: torch.zeros_like(v) for n, v in self.sum_lam.items()}
        for r in results:
            models.add({n: r.update[n] for n in self.trainable}, 1.0)  # the uniform mean, as the authors'
            buffers.add({k: v for k, v in r.update.items() if k not in self.sum_lam}, r.num_samples)
            for n in self.trainable:
                moved[n] += r.update[n].double() - x[n].double()
            loss_sum += r.metrics["loss"] * r.num_samples
        avg = models.result({n: x[n] for n in self.trainable})
        if avg is None:  # nobody returned
            return {}
        for n in self.trainable:
            self.sum_lam[n] += moved[n]
        new = {n: (avg[n].double() + self.sum_lam[n] / self.num_clients).to(x[n].dtype) for n in self.trainable}
        new.update(buffers.result(x) or {})
        self.average.load_state_dict({**x, **avg, **{k: v for k, v in new.items() if k not in avg}})
        self.model.load_state_dict({**x, **new})
        return {"train_loss": loss_sum / buffers.total}

    def eval_models(self) -> dict:
        return {"global": self.model, "average": self.average}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sum_lam": dict(self.sum_lam), "average": cpu_state(self.average)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sum_lam = dict(state["sum_lam"])
        self.average.load_state_dict(state["average"])

    # ---- client ----  (no vectorised path: local.vectorize is refused, FedAvg's would drop the regulariser)
    def alpha_for(self, client: Client, payload: dict) -> float:
        alpha = float(self.cfg.feddyn.alpha)
        if self.cfg.feddyn.adaptive_alpha:
            alpha *= float(payload["mean_samples"]) / max(1, client.num_samples)
        return alpha

    def local_loss(self, client: Client, payload: dict):
        names = [n for n, p in client.model.named_parameters() if p.requires_grad]
        lam = client.state.get("lambda") or {n: torch.zeros_like(payload["weights"][n]) for n in names}
        dev = client.device
        return dynamic_loss(self.alpha_for(client, payload), {n: lam[n].to(dev) for n in names},
                            {n: payload["weights"][n].to(dev) for n in names}, names, base_loss(client.cfg.local))

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model = client.model
        model.load_state_dict(payload["weights"])
        stats = local_sgd(client, model, self.local_loss(client, payload))
        w = cpu_state(model)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        lam = client.state.get("lambda") or {n: torch.zeros_like(payload["weights"][n]) for n in names}
        client.state["lambda"] = {n: lam[n] + (w[n] - payload["weights"][n]) for n in names}
        return ClientResult(client.cid, client.num_samples, w, stats)

    def uploaded(self, client: Client, payload: dict, trained: dict, received: dict) -> None:
        """Under `compress.up` the server adds the decoded move (received - x) to its sum of
        lambdas: the client's lambda_k takes that move too, in place of its exact one, so that
        the server's sum stays the sum of the clients' lambdas (FL-bench keeps each lambda_k
        on the server from the differences it received, src/server/feddyn.py: the same values)."""
        lam = client.state["lambda"]
        client.state["lambda"] = {n: lam[n] + (received[n] - trained[n]) for n in lam}
