"""FedRep (Collins et al. 2021, "Exploiting Shared Representations for Personalized Federated
Learning", Algorithm 1): each round a client first trains its own head for
`fedrep.head_epochs` with the encoder (the representation) fixed, then the encoder for
`local.epochs` with the head fixed; the encoder is uploaded and averaged, the head never
leaves the client. Compared with PFLlib's clientrep.py (head first for `plocal_epochs`, then
the base, each with its own SGD; the same order here). See algorithms/_personal.py."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.contract import Client
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import local_sgd

from raysim.algorithms._personal import Personal, frozen


@dataclass
class FedRepOptions(Options):
    head_epochs: int = option(1, at_least=1)  # epochs on the head (encoder fixed) before the encoder's local.epochs


@ALGORITHMS.register("fedrep")
class FedRep(Personal):
    Options = FedRepOptions
    shared = "encoder"
    unshared = "head"  # on the server: the initial head, no client's
    kept = "head"

    def train(self, client: Client, model, payload: dict) -> dict:
        loss = self.local_loss(client, payload)
        with frozen(model, "encoder"):
            head = local_sgd(client, model, loss, epochs=int(client.cfg.fedrep.head_epochs), steps=0)
        with frozen(model, "head"):
            body = local_sgd(client, model, loss)
        return {**body, "head_steps": head["steps"], "head_loss": head["loss"]}
