"""pFedMe (T. Dinh, Tran, Nguyen 2020, "Personalized Federated Learning with Moreau
Envelopes", Algorithm 1): each client's personal model theta_i is the proximal point of its
loss around the local copy w of the global model,

    theta_i(w) = argmin_theta f_i(theta; D) + lambda/2 ||theta - w||^2,

found approximately by `pfedme.k` gradient steps at `pfedme.personal_lr` on the batch D
(theta carried from one batch to the next, starting at the served w^t); then w moves
towards it, w <- w - eta lambda (w - theta), eta the round's `local.lr`. One batch is one of
the paper's R local rounds: `local.steps=20` is the authors' R, `local.epochs` a pass over
the client's data. The server: w^{t+1} = (1 - beta) w^t + beta avg(w_i) (`pfedme.beta`; 1:
FedAvg's mean), the server parts' SGD step at lr beta on the trainable parameters, BatchNorm
statistics the plain mean. A client's personal model: its last theta (client state; the
served model until it first trains), tested on its own test split (`personal_accuracy`).

Compared with the authors' code (CharlieDinh/pFedMe, userpFedMe.py `train` and
pFedMeOptimizer: theta <- theta - personal_lr (grad + lambda (theta - w) + mu theta), K
steps on each batch, then w <- w - lambda learning_rate (w - theta); serverpFedMe.py
`persionalized_aggregate_parameters`: (1 - beta) previous + beta sample-weighted mean).
Defaults are theirs for MNIST (lambda 15, K 5, beta 1) but personal_lr: 0.01 (PFLlib's `-lrp`),
not their 0.09, chosen for models that are an MLP and logistic regression. theta's step is
stable only where personal_lr (L + lambda) < 2, L the batch loss's curvature, which for the
zoo's CNN on MNIST is 18-26 in rounds 1-3 (docs/algorithms.md): at 0.09 (L under 7.2) a
first run with the CNN stopped as diverged in round 1 (MNIST and Fashion-MNIST #C=2, 20
clients, issue 85); 0.01 allows L up to 185. `pfedme.personal_lr=0.09` is the authors'. Not followed: their
server has every client train every round and aggregates the selected ones only; here only
the selected clients train (as FL-bench's and PFLlib's pFedMe). The w step goes through the
shared training loop (`local.momentum`, `local.weight_decay` apply; the authors' is plain:
`local.momentum=0`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call

from raysim.aggregation.optimizers import SGD
from raysim.contract import Client, ClientResult
from raysim.errors import ConfigError
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import base_loss, clipped, cpu_state, local_sgd

from raysim.algorithms.fedavg import FedAvg


@dataclass
class PFedMeOptions(Options):
    lam: float = option(15.0, above=0)  # lambda: the pull between theta and w (the authors' MNIST: 15)
    personal_lr: float = option(0.01, above=0)  # theta's step (PFLlib's -lrp; the authors' MNIST: 0.09, unstable on a CNN)
    k: int = option(5, at_least=1)  # theta's steps per batch
    mu: float = option(0.0, at_least=0)  # the authors' L2 term on theta (0 in their scripts)
    beta: float = option(1.0, above=0)  # the server's mix: (1 - beta) w + beta avg (1: FedAvg's mean)

    def check(self, cfg, section: str) -> None:
        # theta's step contracts (theta - w) by 1 - personal_lr x lam: past -1 it grows whatever the loss
        if self.personal_lr * self.lam >= 2:
            raise ConfigError(f"{section}.personal_lr x {section}.lam must be under 2 for theta's inner step to be "
                              f"stable (it is stable only where personal_lr x (L + lam) < 2, L the batch loss's "
                              f"curvature), got {self.personal_lr} x {self.lam} = {self.personal_lr * self.lam:g}")


@ALGORITHMS.register("pfedme")
class PFedMe(FedAvg):
    Options = PFedMeOptions
    personal = True
    client_state = True  # theta, the client's personal model
    server_parts = ("aggregator", "privacy")
    own_server_rule = "its server step is (1 - beta) w + beta avg, set by pfedme.beta"
    trains_privately = False  # theta's inner problem is no per-sample mean through the layers

    @classmethod
    def divergence_hint(cls, cfg) -> str:
        o = cfg.pfedme
        bound = 2 / float(o.personal_lr) - float(o.lam)
        return (f"pFedMe's inner step on theta is stable only where pfedme.personal_lr x (L + pfedme.lam) < 2 for "
                f"the batch loss's curvature L: here L under {bound:.3g} (a CNN's on MNIST is 18-26 in rounds 1-3, "
                f"docs/algorithms.md); try a smaller pfedme.personal_lr (now {o.personal_lr}), e.g. "
                f"{min(0.01, float(o.personal_lr) / 3):g}")

    @classmethod
    def config_notes(cls, cfg) -> list:
        if float(cfg.local.momentum):
            return [f"algorithm=pfedme: local.momentum={cfg.local.momentum} applies to w's step, which the authors' "
                    "code takes without momentum (set local.momentum=0 to follow it)"]
        return []

    def server_optimizer(self) -> SGD:
        step = SGD(self.cfg.server)
        step.lr = float(self.cfg.pfedme.beta)
        return step

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model = client.model
        model.load_state_dict(payload["weights"])
        theta: dict = {}  # carried from batch to batch; starts at the served w
        stats = local_sgd(client, model, self.moreau_loss(client, theta))
        client.state["theta"] = {**cpu_state(model), **{n: t.detach().to("cpu", copy=True) for n, t in theta.items()}}
        return ClientResult(client.cid, client.num_samples, cpu_state(model), stats)

    def moreau_loss(self, client: Client, theta: dict):
        """loss(model, x, y): K steps of theta on the batch, then a loss whose gradient w.r.t.
        w is lambda (w - theta) and whose value is f(theta; D) at theta's last step."""
        o, loss_of = client.cfg.pfedme, base_loss(client.cfg.local)
        lam, lr, mu = float(o.lam), float(o.personal_lr), float(o.mu)
        clip = client.cfg.local.get("clip_grad_norm")

        def loss(model, x, y):
            w = {n: p for n, p in model.named_parameters() if p.requires_grad}
            if not theta:
                theta.update({n: p.detach().clone() for n, p in w.items()})
            for _ in range(int(o.k)):
                t = {n: v.detach().requires_grad_(True) for n, v in theta.items()}
                value = loss_of(lambda z: functional_call(model, t, (z,)), x, y)
                g = torch.autograd.grad(value, list(t.values()))
                step = clipped([gi + lam * (v - w[n].detach()) + mu * v for (n, v), gi in zip(t.items(), g)],
                               clip)  # theta's step clipped as w's is (local.clip_grad_norm)
                for (n, v), d in zip(t.items(), step):
                    theta[n] = (v - lr * d).detach()
            pull = lam / 2 * sum(((p - theta[n]) ** 2).sum() for n, p in w.items())
            return value.detach() + pull - pull.detach()

        return loss

    def make_personal(self, client: Client, model: torch.nn.Module, payload) -> None:
        if "theta" in client.state:
            model.load_state_dict(client.state["theta"])
