"""FedPer (Arivazhagan et al. 2019, "Federated Learning with Personalization Layers"): each
client trains the whole model from the global encoder and its own head; only the encoder
(the "base layers") is uploaded and averaged, the head (the "personalization layers") never
leaves the client. Its personal model: the global encoder + its head. Compared with PFLlib's
clientper.py / serverper.py (the head stays on the client object; the base is averaged).
See algorithms/_personal.py for what the personalised algorithms share."""
from __future__ import annotations

from raysim.registry import ALGORITHMS

from raysim.algorithms._personal import Personal


@ALGORITHMS.register("fedper")
class FedPer(Personal):
    shared = "encoder"
    unshared = "head"  # on the server: the initial head, no client's
    kept = "head"
