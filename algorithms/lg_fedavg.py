"""LG-FedAvg (Liang et al. 2020, "Think Locally, Act Globally: Federated Learning with Local
and Global Representations"): the reverse of FedPer's split. Each client keeps its own
representation (the encoder) and trains the whole model; only the head is uploaded and
averaged. Its personal model: its encoder + the global head. Compared with PFLlib's
clientlg.py / serverlg.py (the head is the global part). See algorithms/_personal.py.

Warm start (`lg_fedavg.warm_rounds`): the authors start LG-FedAvg from a FedAvg-trained model
(pliang279/LG-FedAvg, main_lg.py `--load_fed best_<N>.pt`, N = 400-800 FedAvg rounds in
scripts/main_lg_mnist.sh): every client's local model is that model, then only the top layers
are averaged. Here the first `warm_rounds` rounds are FedAvg on the whole model (nothing kept
on the clients); after them the server sends the whole model each round, its encoder the warm
one, which a client starts from in its first LG round (its own encoder afterwards). The
download counts that encoder every round (a returning client would not need it). 0 (the
default): LG-FedAvg from the initial model, PFLlib's way. `warm_share`: the warm rounds as a share
of `rounds` (a sweep over settings of different lengths)."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.aggregation import ServerRule
from raysim.contract import Client, ClientResult, Server
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import cpu_state, local_sgd, parameter_names

from raysim.algorithms._personal import Personal


@dataclass
class LGFedAvgOptions(Options):
    warm_rounds: int = option(0, at_least=0)  # rounds of FedAvg on the whole model first (the authors' warm start)
    warm_share: float = option(0.0, at_least=0, below=1)  # with warm_rounds 0: that share of `rounds` (rounded down) instead


@ALGORITHMS.register("lg_fedavg")
class LGFedAvg(Personal):
    shared = "head"
    unshared = "encoder"  # on the server: the initial encoder, no client's (the warm one after a warm start)
    kept = "encoder"
    Options = LGFedAvgOptions

    @property
    def warm_rounds(self) -> int:
        o = self.cfg.lg_fedavg
        return int(o.warm_rounds) or int(float(o.warm_share) * int(self.cfg.rounds))

    # ---- server ----
    def setup(self, server: Server) -> None:
        super().setup(server)
        self._warm_now = False
        if self.warm_rounds:  # FedAvg's rule over every parameter, for the warm rounds
            self.warm_rule = ServerRule(self.cfg.server, parameter_names(self.model), self.server_optimizer())

    def broadcast(self, rnd: int) -> dict:
        if not self.warm_rounds:
            return super().broadcast(rnd)
        return {"weights": cpu_state(self.model), "warm": rnd <= self.warm_rounds}

    def folded(self, state: dict) -> dict:
        return state if self._warm_now else super().folded(state)

    def aggregate(self, rnd: int, results) -> dict:
        if not self.warm_rounds or rnd > self.warm_rounds:
            return super().aggregate(rnd, results)
        rule, self.server_rule, self._warm_now = self.server_rule, self.warm_rule, True
        try:
            return super().aggregate(rnd, results)
        finally:
            self.server_rule, self._warm_now = rule, False

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.warm_rounds:
            out["warm_rule"] = self.warm_rule.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.warm_rounds:
            self.warm_rule.load_state_dict(state["warm_rule"])

    # ---- client ----
    def client_update(self, client: Client, payload: dict) -> ClientResult:
        if not payload.get("warm"):
            return super().client_update(client, payload)
        model = client.model  # a warm round: FedAvg on the whole model, nothing kept
        model.load_state_dict(payload["weights"])
        stats = local_sgd(client, model, self.local_loss(client, payload))
        return ClientResult(client.cid, client.num_samples, cpu_state(model), stats)
