"""A whole algorithm in one file: FedAvg with a server step size.

The worked example of docs/writing-an-algorithm.md; tests/test_example.py runs it.

Round t: the server sends w_t; each selected client k runs local SGD from it and returns
its model w_k; the server moves `eta` of the way to their sample-weighted mean,

    w_{t+1} = w_t + eta * (sum_k n_k w_k / sum_k n_k - w_t),

so eta = 1 is FedAvg. Only trainable parameters take the step: buffers (BatchNorm's
running statistics) take the plain weighted mean, as every server rule in raysim does.
(raysim's own `algorithm=fedavg server.lr=eta` computes the same through its server parts;
this file writes it out to show what an algorithm is made of.)

    PYTHONPATH=examples python -m raysim.run plugins=[my_algorithm] algorithm=server_step server_step.eta=0.5
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.contract import Algorithm, ClientResult
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import WeightedMean, base_loss, cpu_state, local_sgd, parameter_names


@dataclass
class ServerStepOptions(Options):
    eta: float = option(1.0, above=0)  # the server's step towards the clients' mean (1: FedAvg)


@ALGORITHMS.register("server_step")
class ServerStep(Algorithm):
    Options = ServerStepOptions  # the config section `server_step`, checked by the dataclass
    trains_on_base_loss = True  # local SGD on training.base_loss, so local.focal_gamma applies

    # ---- server half: runs in the server actor ----
    def setup(self, server):
        self.model = server.new_model()  # the configured model, seeded from the run's seed
        self.trainable = parameter_names(self.model)

    def broadcast(self, rnd):
        return {"weights": cpu_state(self.model)}

    def aggregate(self, rnd, results):
        mean, loss = WeightedMean(), 0.0
        for r in results:  # in client-id order, whichever client finished first
            mean.add(r.update, r.num_samples)
            loss += r.metrics["loss"] * r.num_samples
        averaged = mean.result(self.model.state_dict())
        if averaged is None:  # every selected client dropped out: keep the model
            return {}
        eta, now = float(self.cfg.server_step.eta), self.model.state_dict()
        self.model.load_state_dict({k: now[k] + eta * (v - now[k]) if k in self.trainable else v
                                    for k, v in averaged.items()})
        return {"train_loss": loss / mean.total}

    def eval_models(self):
        return {"global": self.model}

    # ---- client half: runs in a client actor, one client at a time ----
    def client_update(self, client, payload):
        model = client.model
        model.load_state_dict(payload["weights"])
        stats = local_sgd(client, model, base_loss(client.cfg.local))  # cross-entropy (or focal)
        return ClientResult(client.cid, client.num_samples, cpu_state(model), stats)
