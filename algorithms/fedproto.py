"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang 2022, "FedProto: Federated Prototype
Learning across Heterogeneous Clients", Algorithm 1): no weights are shared at all. Each
client trains a model of its own on

    CE(f(x), y) + lambda * MSE(z, C^y)      (z = encoder(x); C^y the global prototype of y)

(the MSE over the batch, a sample whose class has no global prototype adding 0, PFLlib's
reading), then uploads its local prototypes: the mean of z over its training samples of each
class it holds (eval mode, after training: the prototypes of the model it ends with;
`fedproto.collect=training` takes the authors' instead, the mean of z over the last epoch's
training batches, each before its step, in train mode; PFLlib's clientproto.py pools every
epoch's, the same at one epoch). The server's global prototype of class j is the
mean of the round's uploaded prototypes of j (`fedproto.weighting=clients`, the authors' and
PFLlib's; `samples`: weighted by each client's count of j), replacing the last round's: a class
no client of the round holds has none (the authors', who run every client every round; with a
tenth of the clients a round on MNIST #C=2 a round's cohort misses a class in 65 % of the rounds,
and the clients' accuracy follows the count, 96 % at 10 prototypes, 85 at 9, 77 at 8: the
results table's mnist_c2), or keeps its last one (`fedproto.absent=keep`). A
client's model predicts by its nearest global prototype, argmin_j ||z - C^j||^2 =
argmax_j 2 z.C^j - ||C^j||^2: one linear head (weights 2C, biases -||C||^2; a class with no
prototype never predicted), which is what `personalise` returns
(`fedproto.inference=prototypes`, the paper's); `head`: the client's own classifier.

Compared with PFLlib (TsingZ0/PFLlib, clientproto.py `train`, `collect_protos`,
`test_metrics`; serverproto.py `proto_cluster`: the unweighted mean per class) and the
authors' code (yuetan031/FedProto, `proto_aggregation`: the same mean). The server keeps
the initial model, no client's (its accuracy is never reported as the method's); each
client's whole model lives in its client state (`_personal.Personal` with nothing shared).
The authors' clients each have their own architecture; here they share the configured one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from raysim.contract import Client, ClientResult, Server
from raysim.errors import ConfigError
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim import training
from raysim.training import base_loss

from raysim.algorithms._personal import Personal


@dataclass
class FedProtoOptions(Options):
    lam: float = option(1.0, at_least=0)  # lambda: the prototype term's weight (the authors' and PFLlib's: 1)
    weighting: str = option("clients", choices=("clients", "samples"))  # a class's global prototype: mean over clients | by their counts
    inference: str = option("prototypes", choices=("prototypes", "head"))  # a client's prediction: nearest global prototype | its own classifier
    collect: str = option("after", choices=("after", "training"))  # local prototypes: of the trained model (eval mode) | the last epoch's training passes (the authors')
    absent: str = option("drop", choices=("drop", "keep"))  # a class no client of the round holds: no prototype (the authors') | its last one


@ALGORITHMS.register("fedproto")
class FedProto(Personal):
    Options = FedProtoOptions
    shared = "all"
    kept = "all"  # the whole model stays on its client: nothing of it is shared
    unshared = "model (FedProto shares class prototypes only)"
    server_parts = ()
    own_server_rule = "its server averages class prototypes; no weights are shared"
    trains_on_base_loss = False  # CE plus the prototype term (local.focal_gamma does not apply)

    @classmethod
    def config_notes(cls, cfg) -> list:
        from raysim.config import clients_per_round

        if cfg.fedproto.absent == "drop" and clients_per_round(cfg) < int(cfg.num_clients):
            return ["algorithm=fedproto: a class that no client of a round holds then has no global prototype and is "
                    "never predicted (its authors' rule, who run every client every round); fedproto.absent=keep keeps "
                    "its last one (MNIST #C=2, 10 of 100 clients a round: 84.3 % -> 97.0 %, docs/algorithms.md)"]
        return []

    def setup(self, server: Server) -> None:
        super().setup(server)
        head = self.model.head
        if not isinstance(head, torch.nn.Linear):
            raise ConfigError(f"algorithm=fedproto: model={self.cfg.model!r} has a head that is not one linear layer "
                              f"({type(head).__name__}); FedProto's prototypes are the features that head reads")
        self.protos = torch.zeros(head.out_features, head.in_features)  # C^j, valid where self.has[j]
        self.has = torch.zeros(head.out_features, dtype=torch.bool)

    def broadcast(self, rnd: int) -> dict:
        return {"weights": {}, "protos": self.protos.clone(), "has": self.has.clone()}

    def personal_payload(self, name: str, model: torch.nn.Module) -> dict:
        return {**super().personal_payload(name, model), "protos": self.protos.clone(), "has": self.has.clone()}

    def aggregate(self, rnd: int, results: Iterator[ClientResult]) -> dict:
        total, weight, loss_sum, n = torch.zeros_like(self.protos, dtype=torch.float64), \
            torch.zeros(len(self.has), dtype=torch.float64), 0.0, 0
        samples = self.cfg.fedproto.weighting == "samples"
        for r in results:
            counts = r.update["counts"].double()
            w = counts if samples else (counts > 0).double()
            total += r.update["protos"].double() * w[:, None]
            weight += w
            loss_sum += r.metrics["loss"] * r.num_samples
            n += r.num_samples
        if n == 0:  # every client dropped out: keep the prototypes
            return {}
        now = weight > 0
        kept = self.has & ~now if self.cfg.fedproto.absent == "keep" else torch.zeros_like(now)
        self.protos = torch.where(now[:, None], total / weight.clamp(min=1e-12)[:, None],
                                  torch.where(kept[:, None], self.protos.double(), 0.0)).float()
        self.has = now | kept
        return {"train_loss": loss_sum / n, "prototypes": int(self.has.sum())}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "protos": self.protos.clone(), "has": self.has.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.protos, self.has = state["protos"].clone(), state["has"].clone()

    # ---- client ----
    def local_loss(self, client: Client, payload: dict):
        lam, ce = float(client.cfg.fedproto.lam), base_loss(client.cfg.local)
        protos, has = payload["protos"].to(client.device), payload["has"].to(client.device)

        seen = self._passes = PassSums(client.num_samples, client.num_classes) \
            if client.cfg.fedproto.collect == "training" else None

        def loss(model, x, y):
            z = model.encoder(x)
            if seen is not None:
                seen.add(z.detach(), y)
            target = torch.where(has[y][:, None], protos[y], z.detach())  # no prototype: no pull
            return F.cross_entropy(model.head(z), y) + lam * F.mse_loss(z, target) if lam else ce(model, x, y)

        return loss

    def upload(self, client: Client, model: torch.nn.Module) -> dict:
        """Its class prototypes, and each class's count: no weights. `collect=after`: of the
        trained model, in eval mode; `training`: the mean z of the last epoch's training
        batches, each taken before its step (the authors' `update_weights_het`)."""
        passes = getattr(self, "_passes", None)
        if client.cfg.fedproto.collect == "training" and passes is not None and passes.sums is not None:
            self._passes = None
            return {"protos": (passes.sums / passes.counts.clamp(min=1)[:, None]).float(), "counts": passes.counts}
        protos, counts = local_prototypes(model, client.x, client.y, client.num_classes,
                                          int(client.cfg.local.batch_size))
        return {"protos": protos, "counts": counts}

    def personalise(self, client: Client, payload) -> ClientResult:
        """The client's own model (fine-tuned with `eval.finetune_epochs`), predicting by its
        nearest global prototype (`inference=prototypes`): its head made (2C, -||C||^2)."""
        result = training.personalise(self, client, payload)
        if client.cfg.fedproto.inference == "prototypes":
            protos, has = payload["protos"], payload["has"]
            result.update["head.weight"] = 2 * protos
            result.update["head.bias"] = torch.where(has, -(protos ** 2).sum(1), torch.tensor(-1e30))
        return result


class PassSums:
    """Each class's sum of z over the current pass through a client's n samples (a new pass
    starts after every n samples: what is left at the end is the last epoch's)."""

    def __init__(self, n: int, num_classes: int):
        self.n, self.num_classes, self.seen = n, num_classes, 0
        self.sums, self.counts = None, torch.zeros(num_classes, dtype=torch.float64)

    def add(self, z: torch.Tensor, y: torch.Tensor) -> None:
        if self.sums is None or (self.seen and self.seen % self.n == 0):  # a new pass
            self.sums = torch.zeros(self.num_classes, z.shape[1], dtype=torch.float64)
            self.counts = torch.zeros(self.num_classes, dtype=torch.float64)
        self.sums.index_add_(0, y.cpu(), z.double().cpu())
        self.counts += torch.bincount(y.cpu(), minlength=self.num_classes).double()
        self.seen += len(y)


@torch.no_grad()
def local_prototypes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                     batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean feature z of each class over (x, y), in eval mode; each class's count)."""
    was = model.training
    model.eval()
    sums, counts = None, torch.zeros(num_classes, dtype=torch.float64)
    for start in range(0, len(y), batch_size):
        z = model.encoder(x[start:start + batch_size]).double().cpu()
        yb = y[start:start + batch_size].cpu()
        if sums is None:
            sums = torch.zeros(num_classes, z.shape[1], dtype=torch.float64)
        sums.index_add_(0, yb, z)
        counts += torch.bincount(yb, minlength=num_classes).double()
    model.train(was)
    return (sums / counts.clamp(min=1)[:, None]).float(), counts
