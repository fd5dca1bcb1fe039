"""LG-FedAvg (Liang et al. 2020, "Think Locally, Act Globally: Federated Learning with Local
and Global Representations"): the reverse of FedPer's split. Each client keeps its own
representation (the encoder) and trains the whole model; only the head is uploaded and
averaged. Its personal model: its encoder + the global head. Compared with PFLlib's
clientlg.py / serverlg.py (the head is the global part). See algorithms/_personal.py."""
from __future__ import annotations

from raysim.registry import ALGORITHMS

from raysim.algorithms._personal import Personal


@ALGORITHMS.register("lg_fedavg")
class LGFedAvg(Personal):
    shared = "head"
    unshared = "encoder"  # on the server: the initial encoder, no client's
    kept = "encoder"
