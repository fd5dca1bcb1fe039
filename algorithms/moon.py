"""MOON (Li, He and Song 2021): model-contrastive federated learning.

The network is the configured model plus a projection head P = Linear(f, f), ReLU,
Linear(f, out_dim) on its encoder's features h. The local loss is

    CE(logits, y) + mu * l_con,
    l_con = -log( exp(sim(z, z_glob)/T) / (exp(sim(z, z_glob)/T) + exp(sim(z, z_prev)/T)) )

with z = P(h), sim the cosine similarity, z_glob from the global model received this round
and z_prev from the client's own model after its previous round (client state), both frozen.
What the classifier reads (`moon.classifier`):
- `encoder` (default): the configured model's own classifier on h; P only feeds l_con. At
  mu = 0 MOON is FedAvg on the same model, bit for bit (tested), so MOON is compared
  with FedAvg on one network;
- `projection` (the authors' `ModelFedCon`): a new Linear(out_dim, C) on z, the encoder
  then P then the classifier in one chain. The authors run FedAvg on that same network
  (`use_project_head=1` for every algorithm); raysim's FedAvg runs the configured model.
  Measured (MNIST split, simple CNN, lr 0.01 momentum 0.9, 20 rounds, seed 0): that chain
  learns slowly whatever the split -- IID, at mu = 0, 0.30 against FedAvg's 0.94 (last 10
  rounds) -- because its two extra default-initialised layers pass 3.7x less gradient to
  the first convolution at initialisation (0.0021 vs 0.0077); that, not the contrastive
  term or label skew, is the 22 points MOON lost on #C=2 (benchmarks/README.md, "MOON").
A client taking part for the first time has no previous model (`moon.first_previous`):
- `initial` (default, the authors' code): in round 1 the pool of previous models is empty
  and the contrastive term is 0; a client first selected later uses its own initial
  network (built from (seed, client id)), which it was given at the start and kept;
- `global`: the global model stands in, so l_con is the constant log 2 (no gradient) and
  the client's first round is FedAvg's.
Aggregation is FedAvg's, over all parts. Defaults mu = 1, T = 0.5, out_dim = 256.
Reference: QinbinLi/MOON, model.py (`ModelFedCon`: features -> l1 -> ReLU -> l2 -> l3) and
main.py (`train_net_fedcon`, `old_nets_pool`): the same loss with one previous model
(model_buffer_size 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.contract import Client, ClientResult
from raysim.models import EncoderHead
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import cpu_state, local_sgd, seed_for

from raysim.algorithms.fedavg import FedAvg


@dataclass
class MoonOptions(Options):
    mu: float = option(1.0, at_least=0)  # weight of the contrastive term
    temperature: float = option(0.5, above=0)
    out_dim: int = option(256, at_least=1)  # projection size
    first_previous: str = option("initial", choices=("initial", "global"))  # a client's first round: initial (authors' code) | global
    classifier: str = option("encoder", choices=("encoder", "projection"))  # what the classifier reads: encoder (mu=0 is FedAvg) | projection (authors' ModelFedCon)


def projection_head(feature_dim: int, out_dim: int) -> nn.Sequential:
    """Linear(f, f) -> ReLU -> Linear(f, out_dim): MOON's projection of the encoder's features."""
    return nn.Sequential(nn.Linear(feature_dim, feature_dim), nn.ReLU(), nn.Linear(feature_dim, out_dim))


def with_projection(base: EncoderHead, out_dim: int, num_classes: int) -> EncoderHead:
    """The authors' chain: base.encoder -> projection -> a new classifier. Still an
    `EncoderHead`, whose `encoder` now ends in the projection: z = model.encoder(x)."""
    return EncoderHead(nn.Sequential(base.encoder, projection_head(base.feature_dim, out_dim)), out_dim, num_classes)


def beside_projection(base: EncoderHead, out_dim: int) -> EncoderHead:
    """The configured model untouched (its classifier reads its encoder) with the projection
    as a side branch, `model.projection`, that only the contrastive term reads."""
    base.projection = projection_head(base.feature_dim, out_dim)
    return base


def representation_and_logits(model: EncoderHead, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, logits) for either network: z the projection the contrastive term compares."""
    h = model.encoder(x)
    z = model.projection(h) if hasattr(model, "projection") else h
    return z, model.head(h)


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over the batch of -log(e^{sim(z,z_glob)/T} / (e^{sim(z,z_glob)/T} + e^{sim(z,z_prev)/T}))."""
    pos = F.cosine_similarity(z, z_glob, dim=-1) / temperature
    neg = F.cosine_similarity(z, z_prev, dim=-1) / temperature
    logits = torch.stack([pos, neg], dim=1)
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


@ALGORITHMS.register("moon")
class Moon(FedAvg):
    trains_privately = False  # privacy.mode=local refused: its contrastive loss runs two more models
    Options = MoonOptions
    trains_on_base_loss = False  # its own loss (local.focal_gamma does not apply)
    client_state = True  # the client's model after its previous round

    def build_model(self, input_shape: tuple) -> EncoderHead:
        """The configured model with MOON's projection head (initialised after the base, so
        the base's weights are FedAvg's)."""
        base, out_dim = super().build_model(input_shape), int(self.cfg.moon.out_dim)
        if self.cfg.moon.classifier == "projection":
            return with_projection(base, out_dim, self.num_classes)
        return beside_projection(base, out_dim)

    # ---- client ----
    def _nets(self, client: Client) -> list[EncoderHead]:
        """The trained network (the actor's `client.model`) and two frozen scratch ones
        (global, previous), built once per actor."""
        if getattr(self, "_scratch", None) is None:
            shape = tuple(client.x.shape[1:])
            self._scratch = [self.build_model(shape).to(client.device) for _ in range(2)]
        return [client.model, *self._scratch]

    def initial_network(self, client: Client) -> dict:
        """The client's own initial network (the authors' code gives each client one), seeded
        from (seed, client id): what a client first selected after round 1 has as 'previous'."""
        torch.manual_seed(seed_for(int(self.cfg.seed), client.cid, 11))
        shape = tuple(client.x.shape[1:])
        return cpu_state(self.build_model(shape))

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        net, glob, prev = self._nets(client)
        net.load_state_dict(payload["weights"])
        glob.load_state_dict(payload["weights"])
        c = self.cfg.moon
        mu, t = float(c.mu), float(c.temperature)
        empty_pool = False
        if mu == 0:
            pass  # FedAvg's step: no frozen model is read
        elif "prev" in client.state:
            prev.load_state_dict(client.state["prev"])
        elif c.first_previous == "global":
            prev.load_state_dict(payload["weights"])
        elif client.round <= 1:
            mu, empty_pool = 0.0, True  # the authors' round 1: no previous model in the pool, no contrastive term
        else:
            prev.load_state_dict(self.initial_network(client))
        glob.eval()
        prev.eval()

        def loss(model, x, y):
            z, logits = representation_and_logits(model, x)
            with torch.no_grad():
                z_glob, z_prev = representation_and_logits(glob, x)[0], representation_and_logits(prev, x)[0]
            return F.cross_entropy(logits, y) + mu * contrastive_loss(z, z_glob, z_prev, t)

        def first_round(model, x, y):
            # the authors' contrastive term over an empty pool: a softmax over one logit, 0 with a zero
            # gradient that still reaches the projection head, so weight decay and momentum step it as theirs
            z, logits = representation_and_logits(model, x)
            return F.cross_entropy(logits, y) + 0.0 * z.sum()

        stats = local_sgd(client, net, loss if mu else first_round if empty_pool else
                          (lambda model, x, y: F.cross_entropy(model(x), y)))
        state = cpu_state(net)
        client.state["prev"] = state
        return ClientResult(client.cid, client.num_samples, state, stats)
