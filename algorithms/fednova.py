"""FedNova (Wang et al. 2020): normalised averaging, so that clients taking more local
steps (more data, more epochs, stragglers) do not pull the model towards their optimum.

    client i, tau_i local SGD steps with momentum rho from x to y_i:
        a_i = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)     (= tau_i when rho = 0)
        upload d_i = (x - y_i) / a_i  (the normalised update; lr is inside it) and a_i
    server, p_i = n_i / sum n over the clients that returned:
        tau_eff = sum_i p_i a_i;   x <- x - tau_eff * sum_i p_i d_i

With equal a_i this is FedAvg. a_i counts the effective steps of heavy-ball momentum
(the paper's and NIID-Bench's); weight decay is not counted. The rule covers the trainable
parameters only: buffers (BatchNorm statistics) take the plain sample-weighted mean of the
clients' values, so a running variance stays positive (NIID-Bench normalises them too,
which can make it negative and eval-mode BatchNorm return NaN).
Reference: NIID-Bench (Xtra-Computing/NIID-Bench, `train_net_fednova` and the `fednova`
branch of experiments.py): the same a_i, d_i and tau_eff.
"""
from __future__ import annotations

from typing import Iterator

from raysim.contract import Client, ClientResult
from raysim.registry import ALGORITHMS
from raysim.training import WeightedMean, cpu_state, effective_steps, local_sgd, parameter_names

from raysim.algorithms.fedavg import FedAvg


@ALGORITHMS.register("fednova")
class FedNova(FedAvg):
    server_parts = ()
    returns_model = False  # it returns d = (x - y) / a
    own_server_rule = "its server step is the normalised one, x - tau_eff * sum p_i d_i"

    def aggregate(self, rnd: int, results: Iterator[ClientResult]) -> dict:
        d, buffers, tau_eff, loss_sum = WeightedMean(), WeightedMean(), 0.0, 0.0
        for r in results:
            d.add(r.update["d"], r.num_samples)
            buffers.add(r.update["buffers"], r.num_samples)
            tau_eff += r.update["a"] * r.num_samples
            loss_sum += r.metrics["loss"] * r.num_samples
        state = self.model.state_dict()
        mean_d = d.result(state)
        if mean_d is None:
            return {}
        tau_eff /= d.total
        new = {k: state[k] - tau_eff * mean_d[k] for k in mean_d}
        new.update(buffers.result(state) or {})
        self.model.load_state_dict(new)
        return {"train_loss": loss_sum / d.total, "tau_eff": tau_eff}

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model = client.model
        model.load_state_dict(payload["weights"])
        stats = local_sgd(client, model, self.local_loss(client, payload))
        a = effective_steps(stats["steps"], float(client.cfg.local.momentum))
        x, y = payload["weights"], cpu_state(model)
        params = parameter_names(model)
        d = {k: (x[k] - y[k]) / a for k in y if k in params}
        buffers = {k: v for k, v in y.items() if k not in params}
        return ClientResult(client.cid, client.num_samples, {"d": d, "buffers": buffers, "a": a}, stats)
