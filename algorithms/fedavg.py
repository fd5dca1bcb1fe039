"""FedAvg (McMahan et al. 2017): clients run local SGD from the global model; the server
replaces it with the sample-weighted mean of the returned models. The server step goes
through raysim's server parts (raysim/aggregation/), so `server.aggregator` (median,
trimmed mean, Krum, ...), `server.optimizer` (FedAdam, FedYogi, ...) and `privacy.*`
(DP-FedAvg: raysim/privacy/) apply to FedAvg and to every algorithm built on it; with the
defaults it is the plain weighted mean."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from raysim.aggregation import ServerRule
from raysim.aggregation.optimizers import ServerOptimizer
from raysim.contract import Algorithm, Client, ClientResult, CohortResult, Server
from raysim.privacy.central import CentralDP
from raysim.registry import ALGORITHMS
from raysim.training import base_loss, base_sample_loss, cpu_state, local_sgd, parameter_names


@ALGORITHMS.register("fedavg")
class FedAvg(Algorithm):
    server_parts = ("aggregator", "optimizer", "privacy")  # server.aggregator / server.optimizer / privacy.* apply
    returns_model = True  # client_update returns the trained model: model attacks apply
    trains_privately = True  # local_sgd on base_loss: privacy.mode=local (DP-SGD) applies

    # ---- server ----
    def setup(self, server: Server) -> None:
        self.model = server.new_model()
        self.server_rule = ServerRule(self.cfg.server, parameter_names(self.model), self.server_optimizer(),
                                      CentralDP.from_config(self.cfg))

    def server_optimizer(self) -> Optional[ServerOptimizer]:
        """The optimiser of the server step; None: `server.optimizer` (FedAvgM overrides)."""
        return None

    def broadcast(self, rnd: int) -> dict:
        return {"weights": cpu_state(self.model)}

    def folded(self, state: dict) -> dict:
        """The entries of the model's state the clients' uploads replace: all of them (the
        personalised algorithms fold their shared part only)."""
        return state

    def aggregate(self, rnd: int, results: Iterator[ClientResult]) -> dict:
        state = self.model.state_dict()
        current = self.folded(state)
        fold, loss_sum = self.server_rule.round(current, rnd), 0.0
        for r in results:
            if r.clients is None:
                fold.add(r.update, r.num_samples)
            else:  # several clients' sum, made where they ran (server.partial_sums)
                fold.add_sum(r.update, r.num_samples)
            loss_sum += r.metrics["loss"] * r.num_samples
        new = fold.result(current)
        if new is None:  # every client dropped out: keep the model
            return {}
        self.model.load_state_dict({**state, **new})
        return {"train_loss": loss_sum / fold.total if fold.total > 0 else None, **fold.metrics()}

    def eval_models(self) -> dict:
        return {"global": self.model}

    def state_dict(self) -> dict:
        return {**super().state_dict(), **self.server_rule.state_dict()}  # + the optimiser's state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.server_rule.load_state_dict(state)

    # ---- client ----
    trains_on_base_loss = True  # training.base_loss (so local.focal_gamma applies); False: its own loss

    def local_loss(self, client: Client, payload: dict):
        """The loss local SGD minimises; FedProx, FedLC, FedRS, ... override this."""
        return base_loss(client.cfg.local)

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model = client.model
        model.load_state_dict(payload["weights"])
        stats = local_sgd(client, model, self.local_loss(client, payload))
        return ClientResult(client.cid, client.num_samples, cpu_state(model), stats)

    def client_update_cohort(self, clients: list[Client], payload: dict) -> CohortResult:
        return self.train_cohort(clients, payload)

    def train_cohort(self, clients: list[Client], payload: dict, sample_loss: Optional[Callable] = None,
                     penalty: Optional[Callable] = None) -> CohortResult:
        """FedAvg's client update for a group of clients at once (raysim/vectorized.py), with
        a per-sample loss (default: `base_loss`'s) and a penalty on the weights (FedProx).
        The models stay stacked: the runtime sums them where they trained."""
        from raysim.vectorized import cohort_result, cohort_sgd

        loss = sample_loss or base_sample_loss(clients[0].cfg.local)
        return cohort_result(clients, *cohort_sgd(clients, clients[0].model, payload["weights"], loss, penalty=penalty))
