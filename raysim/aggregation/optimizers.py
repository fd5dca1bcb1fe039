"""Server optimisers: how the global model steps toward the clients' aggregate.

With x the global model's trainable parameters and a the clients' aggregate (the
`server.aggregator`'s combination of their models), the pseudo-gradient is Δ = a - x
(Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2, with Δ their
averaged client update). Every optimiser here maps (x, a) to the new x:

- `sgd`: x + η Δ (`server.lr` = η); η = 1 is the aggregate itself (FedAvg), taken as is.
- `momentum` (FedAvgM, Hsu et al. 2019): v <- β v + (x - a); x <- x - η v (`server.momentum` = β).
- `adam`, `yogi`, `adagrad` (FedOpt): m <- β1 m + (1 - β1) Δ, then
  adam v <- β2 v + (1 - β2) Δ²; yogi v <- v - (1 - β2) Δ² sign(v - Δ²); adagrad v <- v + Δ²;
  x <- x + η m / (√v + τ); m starts at 0 and v at τ² (the paper's v_{-1} ≥ τ²).

Reference: Reddi et al.'s Algorithm 2, which this follows (v's start at τ², no bias
correction). Flower's FedOpt family (adap/flower, flwr/server/strategy/fedadam.py,
fedyogi.py, fedadagrad.py; read 2026-11) makes the same m and v updates but starts v at 0,
and its FedAdam scales η by √(1 - β2^(t+1)) / (1 - β1^(t+1)) in server round t (Kingma &
Ba's bias correction, shifted by one; here t counts the optimiser's steps, which is the round
when every round steps); `server.fedopt=flower` does exactly that, for
comparing with numbers made with Flower. The paper's way stays the default: it is what the
paper's tables measure. With τ small the two differ mainly in FedAdam's step size: Flower's
factor is 0.74 in round 1, 0.47-0.54 in rounds 5-30 and 0.80 by round 100 (β 0.9 / 0.99),
so its FedAdam moves about half as far at the same `server.lr`. Flower's defaults (τ 1e-9, η 0.1) are not
taken: set `server.tau` / `server.lr`. Flower also steps BatchNorm statistics; raysim never
does (below). The optimiser sees trainable parameters only: buffers
take the plain weighted mean (raysim.aggregation.ServerRule). State (m, v, the velocity)
is checkpointed through `state_dict`.
"""
from __future__ import annotations

import torch

from raysim.registry import SERVER_OPTIMIZERS


class ServerOptimizer:
    """Base: `step(x, a)` -> the new trainable parameters; `state_dict` / `load_state_dict`."""

    def __init__(self, server_cfg):
        self.lr = float(server_cfg.lr)

    def step(self, x: dict[str, torch.Tensor], a: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@SERVER_OPTIMIZERS.register("sgd")
class SGD(ServerOptimizer):
    def step(self, x, a):
        if self.lr == 1.0:  # FedAvg: the aggregate itself, bit for bit
            return dict(a)
        return {k: x[k] + self.lr * (a[k] - x[k]) for k in x}


@SERVER_OPTIMIZERS.register("momentum")
class Momentum(ServerOptimizer):
    def __init__(self, server_cfg, beta: float | None = None, lr: float | None = None):
        super().__init__(server_cfg)
        self.beta = float(server_cfg.momentum if beta is None else beta)
        self.lr = self.lr if lr is None else float(lr)
        self.velocity: dict[str, torch.Tensor] = {}

    def step(self, x, a):
        new = {}
        for k, w in x.items():
            delta = w - a[k]
            v = self.velocity.get(k)
            v = delta if v is None else self.beta * v + delta
            self.velocity[k] = v
            new[k] = w - self.lr * v
        return new

    def state_dict(self) -> dict:
        return {"velocity": dict(self.velocity)}

    def load_state_dict(self, state: dict) -> None:
        self.velocity = dict(state.get("velocity", {}))


class Adaptive(ServerOptimizer):
    """FedOpt's shared part: the first moment m and the step; `second_moment` differs."""

    bias_corrected = False  # server.fedopt=flower: Flower corrects FedAdam's step only

    def __init__(self, server_cfg):
        super().__init__(server_cfg)
        self.beta1, self.beta2, self.tau = float(server_cfg.beta1), float(server_cfg.beta2), float(server_cfg.tau)
        self.flower = server_cfg.get("fedopt", "reddi") == "flower"
        self.v_start = 0.0 if self.flower else self.tau ** 2
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.t = 0  # steps taken: Flower's server round

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, x, a):
        self.t += 1
        lr = self.lr
        if self.flower and self.bias_corrected:
            lr = lr * (1 - self.beta2 ** (self.t + 1)) ** 0.5 / (1 - self.beta1 ** (self.t + 1))
        new = {}
        for k, w in x.items():
            delta = a[k] - w
            m = self.m.get(k, torch.zeros_like(w))
            v = self.v.get(k, torch.full_like(w, self.v_start))
            m = self.beta1 * m + (1 - self.beta1) * delta
            v = self.second_moment(v, delta * delta)
            self.m[k], self.v[k] = m, v
            new[k] = w + lr * m / (v.sqrt() + self.tau)
        return new

    def state_dict(self) -> dict:
        state = {"m": dict(self.m), "v": dict(self.v)}
        if self.flower:  # the step count FedAdam's correction reads, as a part of tensors like the others
            state["fedopt"] = {"steps": torch.tensor(self.t)}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.m, self.v = dict(state.get("m", {})), dict(state.get("v", {}))
        self.t = int(state["fedopt"]["steps"]) if "fedopt" in state else 0


@SERVER_OPTIMIZERS.register("adam")
class Adam(Adaptive):
    bias_corrected = True

    def second_moment(self, v, d2):
        return self.beta2 * v + (1 - self.beta2) * d2


@SERVER_OPTIMIZERS.register("yogi")
class Yogi(Adaptive):
    def second_moment(self, v, d2):
        return v - (1 - self.beta2) * d2 * torch.sign(v - d2)


@SERVER_OPTIMIZERS.register("adagrad")
class Adagrad(Adaptive):
    def second_moment(self, v, d2):
        return v + d2
