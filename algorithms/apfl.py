"""APFL (Deng, Kamani, Mahdavi 2020, "Adaptive Personalized Federated Learning", Algorithm 1
with the adaptive alpha of Sec. 3): each client keeps a personal model v and a mixing weight
alpha; its personalised model is the mixture v_bar = alpha v + (1 - alpha) w. On each local
batch, at the current (w, v, alpha):
    w     <- w - lr grad f(w)                                  (FedAvg's local step; uploaded)
    v     <- v - lr grad_v f(v_bar)     = v - lr alpha grad f(v_bar)
    alpha <- alpha - alpha_lr grad_alpha f(v_bar) = alpha - alpha_lr <v - w, grad f(v_bar)>, clipped to [0, 1]
Evaluation mixes the client's v with the global model it is served: alpha v + (1 - alpha) w.

All three train in `training.local_sgd`'s loop, on the same batches (so `local.augment`,
`local.steps` and the guard against one-sample BatchNorm batches apply): w's step is the
loop's; v's and alpha's are taken after it (`after_step`) from gradients computed on the
same batch. v takes w's optimiser (`local.momentum`, `local.weight_decay`: the sweep's 0.9 for
both; PFLlib and the paper use plain SGD for both, which `local.momentum=0` gives); alpha, a
scalar, plain SGD. v is a whole model state: its BatchNorm statistics are its own (the
mixture's forward updates v's), as PFLlib's `model_per` has its own.

Compared with PFLlib's clientapfl.py, which differs in three places: it trains v on f(v)
rather than f(v_bar), its alpha gradient is <v - w, alpha grad f(v) + (1 - alpha) grad f(w)>
+ 0.02 alpha (after both steps), and after each round it replaces v's parameters by the
mixture, which it then tests as it is (`model_per`, clientapfl.test_metrics: no second mix).
`apfl.variant=pfllib` runs that reading; the default is the paper's. See
algorithms/_personal.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call

from raysim.contract import Client, ClientResult
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import SGD, base_loss, clipped, cpu_state, local_sgd, round_lr

from raysim.algorithms._personal import Personal


@dataclass
class APFLOptions(Options):
    alpha: float = option(0.5, at_least=0, at_most=1)  # alpha before a client's first round
    alpha_lr: float = option(0.0, at_least=0)  # alpha's step size; 0: local.lr (PFLlib's)
    variant: str = option("paper", choices=("paper", "pfllib"))  # see the module docstring


def mixture(alpha, v: dict, w: dict) -> dict:
    return {k: alpha * v[k] + (1 - alpha) * w[k] for k in v}


@ALGORITHMS.register("apfl")
class APFL(Personal):
    Options = APFLOptions
    shared = "all"
    kept = None  # client.state: "v" (its parameters) and "alpha"

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model, o = client.model, client.cfg.apfl
        self.load_global(client, model, payload)
        names = [n for n, _ in model.named_parameters()]
        v = {k: t.to(client.device).clone() for k, t in self.personal_state(client).items()}
        for n in names:
            v[n].requires_grad_(True)
        v_params = [v[n] for n in names]
        alpha = torch.tensor(float(client.state.get("alpha", o.alpha)), device=client.device, requires_grad=True)
        loc = client.cfg.local
        lr = round_lr(loc, client.round)
        alpha_lr = float(o.alpha_lr) or lr
        v_opt = SGD(v_params, lr=lr, momentum=float(loc.momentum), weight_decay=float(loc.weight_decay))
        pfllib = o.variant == "pfllib"
        loss_fn = base_loss(loc)
        grads: dict = {}

        def loss(model, x, y):
            """w's loss, after v's (and the paper's alpha's) gradients on the same batch."""
            w = {n: p.detach() for n, p in model.named_parameters()}
            if pfllib:  # v on its own loss
                grads["v"] = torch.autograd.grad(loss_fn(_call(model, v), x, y), v_params)
            else:  # v and alpha on the mixture's loss (v's buffers: the mixture's statistics)
                *grads["v"], grads["alpha"] = torch.autograd.grad(
                    loss_fn(_call(model, {**v, **mixture(alpha, {n: v[n] for n in names}, w)}), x, y),
                    [*v_params, alpha])
            return loss_fn(model, x, y)

        def after_step():
            with torch.no_grad():
                for p, g in zip(v_params, clipped(list(grads["v"]), loc.get("clip_grad_norm"))):
                    p.grad = g  # clipped as w's step is (local.clip_grad_norm)
                v_opt.step()
                if pfllib:  # after both steps, as PFLlib's alpha_update
                    ga = sum(((v[n] - p) * (alpha * g + (1 - alpha) * p.grad)).sum()
                             for (n, p), g in zip(model.named_parameters(), grads["v"])) + 0.02 * alpha
                else:
                    ga = grads["alpha"]
                alpha.sub_(alpha_lr * ga).clamp_(0.0, 1.0)

        stats = local_sgd(client, model, loss, after_step=after_step)
        v = {k: t.detach() for k, t in v.items()}
        if pfllib:  # PFLlib keeps the mixture's parameters as the next round's v (its buffers stay v's)
            v.update(mixture(alpha.detach(), {n: v[n] for n in names}, {n: p.detach() for n, p in model.named_parameters()}))
        client.state["v"] = {k: t.cpu().clone() for k, t in v.items()}
        client.state["alpha"] = float(alpha.detach())
        self.keep_buffers(client, model)
        return ClientResult(client.cid, client.num_samples, cpu_state(model), {**stats, "alpha": float(alpha.detach())})

    def personal_state(self, client: Client) -> dict:
        """v as the client left it, or the initial model (a state kept before v held its
        buffers takes the initial model's)."""
        return {**self.initial(client), **client.state.get("v", {})}

    def make_personal(self, client: Client, model: torch.nn.Module, payload) -> None:
        """The paper: alpha v + (1 - alpha) w, w the served global model (already in
        `model`), with v's buffers. PFLlib: v as it is (v is the mixture already)."""
        v = self.personal_state(client)
        if client.cfg.apfl.variant == "pfllib":
            model.load_state_dict(v)
            return
        alpha = float(client.state.get("alpha", client.cfg.apfl.alpha))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(alpha * v[k].to(p.device) + (1 - alpha) * p)
        model.load_state_dict({k: t for k, t in v.items() if k not in params}, strict=False)


def _call(model: torch.nn.Module, params: dict):
    """The model as a function of `params` (parameters, and the buffers `params` holds; the
    model's own for the rest), for loss_fn(model, x, y)."""
    return lambda x: functional_call(model, params, (x,))
