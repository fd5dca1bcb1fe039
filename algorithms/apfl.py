"""APFL (Deng, Kamani, Mahdavi 2020, "Adaptive Personalized Federated Learning", Algorithm 1
with the adaptive alpha of Sec. 3): each client keeps a personal model v and a mixing weight
alpha; its personalised model is the mixture v_bar = alpha v + (1 - alpha) w. On each local
batch, at the current (w, v, alpha):
    w     <- w - lr grad f(w)                                  (FedAvg's local step; uploaded)
    v     <- v - lr grad_v f(v_bar)     = v - lr alpha grad f(v_bar)
    alpha <- alpha - alpha_lr grad_alpha f(v_bar) = alpha - alpha_lr <v - w, grad f(v_bar)>, clipped to [0, 1]
Evaluation mixes the client's v with the global model it is served: alpha v + (1 - alpha) w.

Compared with PFLlib's clientapfl.py, which differs in three places: it trains v on f(v)
rather than f(v_bar), its alpha gradient is <v - w, alpha grad f(v) + (1 - alpha) grad f(w)>
+ 0.02 alpha, and after each round it replaces v by the mixture. `apfl.variant=pfllib` runs
that reading; the default is the paper's. See algorithms/_personal.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call

from raysim.contract import Client, ClientResult
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import SGD, base_loss, cpu_state, round_lr

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
        model, o, loc = client.model, client.cfg.apfl, client.cfg.local
        model.load_state_dict(payload["weights"])
        names = [n for n, _ in model.named_parameters()]
        start = client.state.get("v") or {n: self.initial(client)[n] for n in names}
        v = {n: start[n].to(client.device).clone().requires_grad_(True) for n in names}
        alpha = torch.tensor(float(client.state.get("alpha", o.alpha)), device=client.device, requires_grad=True)
        lr = round_lr(loc, client.round)
        alpha_lr = float(o.alpha_lr) or lr
        pfllib = o.variant == "pfllib"
        loss_fn = base_loss(loc)
        opt = SGD(model.parameters(), lr=lr, momentum=float(loc.momentum), weight_decay=float(loc.weight_decay))
        model.train()
        n, bs, total, count, steps = client.num_samples, int(loc.batch_size), 0.0, 0, 0
        for _ in range(client.epochs):
            perm = torch.randperm(n, generator=client.generator).to(client.x.device)
            for s in range(0, n, bs):
                idx = perm[s:s + bs]
                x, y = client.x[idx], client.y[idx]
                w = {k: p.detach() for k, p in model.named_parameters()}
                if pfllib:  # v on its own loss; alpha's gradient from f(v) and f(w)
                    gv = torch.autograd.grad(loss_fn(_call(model, v), x, y), list(v.values()))
                else:  # v and alpha on the mixture's loss
                    *gv, ga = torch.autograd.grad(loss_fn(_call(model, mixture(alpha, v, w)), x, y),
                                                  [*v.values(), alpha])
                opt.zero_grad()
                loss = loss_fn(model, x, y)
                loss.backward()
                with torch.no_grad():
                    opt.step()
                    for p, g in zip(v.values(), gv):
                        p.sub_(g, alpha=lr)
                    if pfllib:  # after both steps, as PFLlib's alpha_update
                        ga = sum(((v[k] - p) * (alpha * g + (1 - alpha) * p.grad)).sum()
                                 for (k, p), g in zip(model.named_parameters(), gv)) + 0.02 * alpha
                    alpha.sub_(alpha_lr * ga).clamp_(0.0, 1.0)
                total += float(loss.detach()) * len(idx)
                count += len(idx)
                steps += 1
        v = {k: p.detach() for k, p in v.items()}
        if pfllib:  # PFLlib keeps the mixture as the next round's v
            v = mixture(alpha.detach(), v, {k: p.detach() for k, p in model.named_parameters()})
        client.state["v"] = {k: t.cpu().clone() for k, t in v.items()}
        client.state["alpha"] = float(alpha.detach())
        return ClientResult(client.cid, client.num_samples, cpu_state(model),
                            {"loss": total / max(count, 1), "steps": steps, "lr": lr, "alpha": float(alpha.detach())})

    def make_personal(self, client: Client, model: torch.nn.Module, payload) -> None:
        """alpha v + (1 - alpha) w, w the served global model (already in `model`)."""
        params = dict(model.named_parameters())
        v = client.state.get("v") or {n: self.initial(client)[n] for n in params}
        alpha = float(client.state.get("alpha", client.cfg.apfl.alpha))
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(alpha * v[k].to(p.device) + (1 - alpha) * p)


def _call(model: torch.nn.Module, params: dict):
    """The model as a function of `params` (its buffers its own), for loss_fn(model, x, y)."""
    return lambda x: functional_call(model, params, (x,))
