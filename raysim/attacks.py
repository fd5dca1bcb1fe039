"""Adversarial clients, for any algorithm, to show what robust aggregation is for.

`attack.fraction` of the clients (at least one when > 0; which ones is drawn once from the
seed) attack in every training call from round `attack.start` on:

- `label_flip`: they train on flipped labels, y -> C - 1 - y (any algorithm);
- `sign_flip`: they send w - Δ instead of w + Δ, with Δ their honest update from the
  received model w (the update reversed);
- `scaled`: they send w + `attack.boost` Δ (model replacement, Bagdasaryan et al. 2020);
- `gaussian`: they send w + N(0, `attack.scale`²) per coordinate (a random update).

The three model attacks change the trainable parameters of the model the client returns,
so they apply to algorithms whose client update returns its whole model for the
payload's `weights` (`Algorithm.returns_model`, FedAvg and those built on it); the config
refuses them elsewhere. Every draw comes from (seed, round, client id); the clients table
marks attackers and each round's metrics count those in the cohort. Applied where the
client runs: in a client actor, and alike in raysim.testing's in-process server.
"""
from __future__ import annotations

import numpy as np
import torch

from raysim.training import parameter_names, seed_for

MODEL_ATTACKS = ("sign_flip", "scaled", "gaussian")
KINDS = ("none", "label_flip", *MODEL_ATTACKS)


def attackers(cfg, num_clients: int) -> set[int]:
    """The attacking clients: a seed-fixed `attack.fraction` of all (none when kind is none)."""
    a = cfg.attack
    if a.kind == "none" or a.fraction <= 0:
        return set()
    n = max(1, int(round(float(a.fraction) * num_clients)))
    return set(np.random.default_rng([int(cfg.seed), 7]).choice(num_clients, n, replace=False).tolist())


class Adversaries:
    def __init__(self, cfg, num_clients: int):
        self.cfg = cfg.attack
        self.seed = int(cfg.seed)
        self.who = attackers(cfg, num_clients)
        self.start = int(self.cfg.start)  # read once: asked per client per round (an OmegaConf lookup is ~25 us)
        self.model_attack = self.cfg.kind in MODEL_ATTACKS

    def attacking(self, cid: int, rnd: int, method: str) -> bool:
        return cid in self.who and method == "client_update" and rnd >= self.start

    def changes_model(self, cid: int, rnd: int, method: str) -> bool:
        """Whether `after` changes this client's returned model (a model attack on an attacker)."""
        return self.model_attack and self.attacking(cid, rnd, method)

    def before(self, client, rnd: int, method: str) -> None:
        """label_flip: the client's labels, flipped, for this call."""
        if self.attacking(client.cid, rnd, method) and self.cfg.kind == "label_flip":
            client.y = client.num_classes - 1 - client.y

    def after(self, client, payload, result, rnd: int, method: str):
        """A model attack: the returned model's trainable parameters, changed (module docstring)."""
        if not self.changes_model(client.cid, rnd, method):
            return result
        sent, trained = payload["weights"], result.update
        g = torch.Generator().manual_seed(seed_for(self.seed, rnd, client.cid, 8))
        out = dict(trained)
        for k in sorted(parameter_names(client.model)):
            w = sent[k].to(trained[k].dtype)
            delta = trained[k] - w
            if self.cfg.kind == "sign_flip":
                out[k] = w - delta
            elif self.cfg.kind == "scaled":
                out[k] = w + float(self.cfg.boost) * delta
            else:
                out[k] = w + float(self.cfg.scale) * torch.randn(w.shape, generator=g, dtype=w.dtype)
        result.update = out
        result.metrics["attacked"] = True
        return result
