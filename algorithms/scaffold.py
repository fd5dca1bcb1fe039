"""SCAFFOLD, option II (Karimireddy et al. 2020): local steps corrected by control variates.

    client i, from the global model x with server variate c and its own c_i (0 at first):
        K local steps  y <- y - lr * (g(y) - c_i + c)
        c_i+ = c_i - c + (x - y) / (K * lr)              (option II)
        upload  dy = y - x,  dc = c_i+ - c_i;  keep c_i <- c_i+ (client state)
    server, over the clients S that returned (N clients in all):
        x <- x + server_lr * mean_S dy_i       (`weighting`: uniform, the paper; samples, NIID-Bench)
        c <- c + sum_i dc_i / N                (= |S|/N * mean dc)

`correction` (how the local step is corrected when the optimizer has momentum / weight
decay; for plain SGD both are the paper's step exactly):
- `gradient` (default): c - c_i is added to the gradient, so it passes through the same
  optimizer, and K counts effective steps under momentum rho: K_eff = (K - rho (1 - rho^K)
  / (1 - rho)) / (1 - rho), FedNova's count (= K at rho = 0). Then c_i+ is exactly the
  (momentum-weighted) mean gradient along the client's path.
- `weights`: NIID-Bench's code (Xtra-Computing/NIID-Bench, `train_net_scaffold`): the
  optimizer steps on the plain gradient, then w <- w - lr (c - c_i); K is the raw step count.
K is the number of steps the client really took (stragglers take more); lr is that
round's lr. Variates cover trainable parameters; buffers (BatchNorm statistics) take the
plain sample-weighted mean. SCAFFOLD needs small local steps: at momentum 0.9 it diverges
on standardised MNIST #C=2 under either reading (benchmarks/README.md); use momentum 0, as
the paper.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from raysim.contract import Client, ClientResult, Server
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import WeightedMean, base_sample_loss, cpu_state, effective_steps, local_sgd, round_lr

from raysim.algorithms.fedavg import FedAvg


@dataclass
class ScaffoldOptions(Options):
    server_lr: float = option(1.0, above=0)  # global step size on the averaged dy
    weighting: str = option("uniform", choices=("uniform", "samples"))  # mean of dy over the returned clients: uniform (the paper) | samples (NIID-Bench)
    correction: str = option("gradient", choices=("gradient", "weights"))  # gradient: g - c_i + c through the optimizer, K counted as effective steps;
    # weights: NIID-Bench's code, w -= lr (c - c_i) after each optimizer step, K = raw step count


def control_variate_update(c_i: dict, c: dict, x: dict, y: dict, steps: float, lr: float) -> dict:
    """Option II: c_i+ = c_i - c + (x - y) / (K lr)."""
    return {k: c_i[k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in c}


@ALGORITHMS.register("scaffold")
class Scaffold(FedAvg):
    trains_privately = False  # privacy.mode=local refused: it corrects the gradients outside DP-SGD
    server_parts = ()
    returns_model = False  # it returns dy and dc
    own_server_rule = "its server step adds the mean of dy and updates the control variate c"

    Options = ScaffoldOptions
    client_state = True  # c_i

    # ---- server ----
    def setup(self, server: Server) -> None:
        super().setup(server)
        self.num_clients = server.num_clients
        self.c = {n: torch.zeros_like(p) for n, p in self.model.named_parameters()}

    def broadcast(self, rnd: int) -> dict:
        return {"weights": cpu_state(self.model), "c": self.c}

    def aggregate(self, rnd: int, results: Iterator[ClientResult]) -> dict:
        dy, buffers, loss_sum = WeightedMean(), WeightedMean(), 0.0
        dc_sum = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in self.c.items()}
        uniform = self.cfg.scaffold.weighting == "uniform"
        for r in results:
            dy.add(r.update["dy"], 1.0 if uniform else r.num_samples)
            buffers.add(r.update["buffers"], r.num_samples)  # BatchNorm statistics: the plain weighted mean
            for k, v in r.update["dc"].items():
                dc_sum[k] += v.double()
            loss_sum += r.metrics["loss"] * r.num_samples
        mean_dy = dy.result(self.c)
        if mean_dy is None:  # nobody returned
            return {}
        lr = float(self.cfg.scaffold.server_lr)
        state = self.model.state_dict()
        new = {k: state[k] + lr * mean_dy[k] for k in mean_dy}
        new.update(buffers.result(state) or {})
        self.model.load_state_dict({**state, **new})
        self.c = {k: self.c[k] + (dc_sum[k] / self.num_clients).to(self.c[k].dtype) for k in self.c}
        return {"train_loss": loss_sum / buffers.total}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "c": dict(self.c)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.c = dict(state["c"])

    # ---- client ----
    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model = client.model
        model.load_state_dict(payload["weights"])
        params = dict(model.named_parameters())
        c_i = self.variate(client, payload)
        correction = [(params[k], (payload["c"][k] - c_i[k]).to(client.device)) for k in c_i]
        lr = round_lr(client.cfg.local, client.round)

        def correct_gradients() -> None:  # g <- g - c_i + c, then the optimizer's step
            for p, d in correction:
                if p.grad is not None:
                    p.grad.add_(d)

        @torch.no_grad()
        def correct_weights() -> None:  # NIID-Bench: w <- w - lr (c - c_i) after the optimizer's step
            for p, d in correction:
                p.add_(d, alpha=-lr)

        on_weights = self.cfg.scaffold.correction == "weights"
        stats = local_sgd(client, model, self.local_loss(client, payload),
                          on_gradients=None if on_weights else correct_gradients,
                          after_step=correct_weights if on_weights else None)
        return self.result(client, payload, c_i, cpu_state(model), stats)

    def client_update_cohort(self, clients: list[Client], payload: dict) -> list[ClientResult]:
        """The same for a group of clients at once (raysim/vectorized.py): client k's
        correction c - c_k is its row of the stacked shift."""
        from raysim.vectorized import cohort_sgd, per_client

        c_is = [self.variate(client, payload) for client in clients]
        shift = {k: torch.stack([payload["c"][k] - c_i[k] for c_i in c_is]).to(clients[0].device) for k in payload["c"]}
        on_weights = self.cfg.scaffold.correction == "weights"
        stacked, stats = cohort_sgd(clients, clients[0].model, payload["weights"], base_sample_loss(clients[0].cfg.local),
                                    gradient_shift=None if on_weights else shift, weight_shift=shift if on_weights else None)
        states = per_client(stacked)  # SCAFFOLD's upload is per client (dy, dc): cut the stack
        return [self.result(*args) for args in zip(clients, [payload] * len(clients), c_is, states, stats)]

    @staticmethod
    def variate(client: Client, payload: dict) -> dict:
        """The client's c_i (zero before its first round)."""
        return client.state.get("c") or {k: torch.zeros_like(v) for k, v in payload["c"].items()}

    def result(self, client: Client, payload: dict, c_i: dict, state: dict, stats: dict) -> ClientResult:
        """From the trained weights y (`state`, CPU): c_i+ (kept as client state) and the upload dy, dc."""
        c, x = payload["c"], payload["weights"]
        on_weights = self.cfg.scaffold.correction == "weights"
        steps = max(stats["steps"], 1)
        k = float(steps) if on_weights else effective_steps(steps, float(client.cfg.local.momentum))
        c_new = control_variate_update(c_i, c, x, state, k, stats["lr"])
        client.state["c"] = c_new
        update = {"dy": {k: state[k] - x[k] for k in c},
                  "dc": {k: c_new[k] - c_i[k] for k in c},
                  "buffers": {k: v for k, v in state.items() if k not in c}}
        return ClientResult(client.cid, client.num_samples, update, stats)
