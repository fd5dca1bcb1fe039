"""FedAvg (McMahan et al. 2017): clients run local SGD from the global model; the server
replaces it with the sample-weighted mean of the returned models."""
from __future__ import annotations

from typing import Iterator


from raysim.algorithm import Algorithm, Client, ClientResult, Server
from raysim.registry import ALGORITHMS
from raysim.training import WeightedMean, base_loss, cpu_state, local_sgd


@ALGORITHMS.register("fedavg")
class FedAvg(Algorithm):
    # ---- server ----
    def setup(self, server: Server) -> None:
        self.model = server.new_model()

    def broadcast(self, rnd: int) -> dict:
        return {"weights": cpu_state(self.model)}

    def aggregate(self, rnd: int, results: Iterator[ClientResult]) -> dict:
        mean, loss_sum = WeightedMean(), 0.0
        for r in results:
            mean.add(r.update, r.num_samples)
            loss_sum += r.metrics["loss"] * r.num_samples
        new = mean.result(self.model.state_dict())
        if new is None:  # every client dropped out: keep the model
            return {}
        self.apply(new)
        return {"train_loss": loss_sum / mean.total}

    def apply(self, averaged: dict) -> None:
        """Take the averaged weights as the new global model (FedAvgM overrides)."""
        self.model.load_state_dict(averaged)

    def eval_models(self) -> dict:
        return {"global": self.model}

    # ---- client ----
    trains_on_base_loss = True  # training.base_loss (so local.focal_gamma applies); False: its own loss

    def local_loss(self, client: Client, payload: dict):
        """The loss local SGD minimises; FedProx, MOON, FedRS, ... override this."""
        return base_loss(client.cfg.local)

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model = client.model
        model.load_state_dict(payload["weights"])
        stats = local_sgd(client, model, self.local_loss(client, payload))
        return ClientResult(client.cid, client.num_samples, cpu_state(model), stats)
