"""IFCA (Ghosh et al. 2020, "An Efficient Framework for Clustered Federated Learning"), the
FedGroup paper's baseline: m group models, randomly initialised apart; every selected
client receives all m, picks the one with the lowest loss on its own training data, trains
it (FedAvg's local SGD) and says which it picked; the server averages each model over the
clients that picked it (model averaging, sample-weighted). A client is served, in
per-client evaluation, by the model it last picked.

Reference: morningD/FlexCFL, flearn/trainer/ifca.py (the FedGroup authors' IFCA: the loss
of each group model on the client's whole training set, argmin; group models initialised
with different seeds). Shared machinery: clustered.py.
"""
from __future__ import annotations

from raysim.contract import Client
from raysim.algorithms.clustered import ClientPicksGroup
from raysim.registry import ALGORITHMS
from raysim.training import evaluate


@ALGORITHMS.register("ifca")
class IFCA(ClientPicksGroup):

    def pick(self, client: Client, models: list[dict], payload: dict) -> int:
        losses = []
        for weights in models:
            client.model.load_state_dict(weights)
            losses.append(evaluate(client.model, client.x, client.y, self.num_classes)["loss"])
        return min(range(len(losses)), key=losses.__getitem__)  # the first of equal losses
