"""FeSEM (Xie et al. 2021, "Multi-Center Federated Learning"), the FedGroup paper's
baseline: m group models (centres), randomly initialised apart; each selected client is
assigned to the centre nearest, in L2 distance over the trainable parameters, to its own
local model (the one it trained when last selected; w0 before that), trains that centre's
model and keeps the result as its local model (client state: survives actor restarts and
checkpoints); the server averages each centre over its clients (stochastic EM: E-step the
assignment, M-step the average).

Reference: morningD/FlexCFL, flearn/trainer/fesem.py (the FedGroup authors' FeSEM:
`schedule_clients` assigns by ||w_client - w_group||, clients train from the group model).
Shared machinery: clustered.py.
"""
from __future__ import annotations

import torch

from raysim.contract import Client, ClientResult
from raysim.algorithms.clustered import ClientPicksGroup, flat
from raysim.registry import ALGORITHMS
from raysim.training import cpu_state


@ALGORITHMS.register("fesem")
class FeSEM(ClientPicksGroup):
    client_state = True  # each client's local model

    def extra_payload(self, cohort: list[int]) -> dict:
        """w0 for clients that have no local model yet (never trained)."""
        return {"init": cpu_state(self.w0)} if any(self.group_of[c] < 0 for c in cohort) else {}

    def pick(self, client: Client, models: list[dict], payload: dict) -> int:
        names = sorted(n for n, p in client.model.named_parameters() if p.requires_grad)
        mine = flat(client.state.get("model") or payload["init"], names)
        dist = [float(torch.linalg.vector_norm(flat(w, names) - mine)) for w in models]
        return min(range(len(dist)), key=dist.__getitem__)

    def client_update(self, client: Client, payload) -> ClientResult:
        result = super().client_update(client, payload)
        client.state["model"] = result.update  # the client's local model, for its next assignment
        return result
