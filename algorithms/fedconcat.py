"""FedConcat and FedConcat-ID (Diao, Li and He, paper 000): concatenate the encoders of
cluster models, then train one linear classifier on the cached concatenated features.

    stage 1  cluster the clients into K groups with K-means (scikit-learn) on
             - fedconcat:    their label distributions (counts / n, uploaded once), or
             - fedconcat_id: distributions inferred on the server: every client trains one
               round from the same initial model; the mean softmax of its model over
               `probe_samples` random inputs (uniform between the test set's smallest and
               largest input value: "each pixel uniform in [0, 1]" after the dataset's
               normalisation) stands for its label distribution.
             `rebalance` (off by default, as the official code for MNIST / CIFAR-10):
             - `constrained` (the official code, its CIFAR-100 / Tiny-ImageNet runs): 100
               rounds of constrained K-means with clusters capped at int(1.2 N / K);
             - `farthest`: while a cluster is bigger than ceil(N / K), its member farthest
               from its centre moves to the nearest cluster below the cap.
    stage 2  rounds 1..encoder_rounds: FedAvg inside every cluster, all clusters in the same
             rounds; the round's cohort (any selection strategy) is split by cluster and each
             cluster model goes only to its own members.
    stage 3  the K encoders (each model without its last layer), frozen and concatenated,
             go once to every client (`cache_features`), which computes its features once and
             keeps them as client state; rounds encoder_rounds+1..rounds train a linear
             classifier on the concatenated features by FedAvg, `classifier_steps` local SGD
             steps per round (the paper: 3) on the cached features only; the server averages
             the heads unweighted (`classifier_weighting: uniform`, the official code: every
             client takes the same steps) or by samples. `init_classifier` starts it from
             the cluster classifiers instead of a fresh layer: `sum` (the official code:
             W = [W_1 .. W_K], b = sum b_k, the sum of the cluster models' logits) or `mean`
             (W / K, mean b_k: their mean; the same predictions, a softer start).

Evaluation: during stage 2 the model evaluated is the concatenated encoders with the
cluster-classifier initialisation (the mean of the cluster models' logits); during stage 3
the trained classifier. Reference: sjtudyq/FedConcat, experiments.py (`fedconcat` branch)
and kmeanslimited.py. Bytes are the runtime's: label counts or the ID round, the cluster
models to their members, the encoders once per client, then the classifier only.
A client that missed the encoders (its actor died) gets them when next selected.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from raysim.contract import Algorithm, Client, ClientResult, Server
from raysim.errors import ConfigError
from raysim.options import Options, option
from raysim.models import EncoderHead
from raysim.registry import ALGORITHMS
from raysim.training import WeightedMean, cpu_state, local_sgd


@dataclass
class FedConcatOptions(Options):
    clusters: int = option(5, at_least=1)  # K
    encoder_rounds: int = option(31, at_least=1)  # stage 2; the remaining `rounds` train the classifier
    classifier_steps: int = option(3, at_least=1)  # local SGD steps per classifier round
    classifier_weighting: str = option("uniform", choices=("uniform", "samples"))  # uniform: the official code's
    rebalance: Any = option(False, choices=(False, "constrained", "farthest"))  # constrained: the official code's
    init_classifier: Any = option(False, choices=(False, "sum", "mean"))  # sum: the official code's
    probe_samples: int = option(10000, at_least=1)  # fedconcat_id: random inputs for label inference

    def check(self, cfg, section: str) -> None:
        if self.clusters > cfg.num_clients:
            raise ConfigError(f"{section}.clusters must be in [1, num_clients={cfg.num_clients}], got {self.clusters}")
        if self.encoder_rounds >= cfg.rounds:
            raise ConfigError(f"{section}.encoder_rounds must be in [1, rounds={cfg.rounds}) (the rest of "
                              f"the rounds train the classifier), got {self.encoder_rounds}")
        if cfg.clients.join.fraction > 0:
            raise ConfigError(f"{cfg.algorithm} clusters every client before round 1 and trains its classifier on "
                              f"all of them, so clients cannot join late: set clients.join.fraction=0 "
                              f"(got {cfg.clients.join.fraction})")


class ConcatModel(nn.Module):
    """classifier(concat(encoder_1(x), ..., encoder_K(x)))."""

    def __init__(self, encoders: list[nn.Module], feature_dim: int, num_classes: int):
        super().__init__()
        self.encoders = nn.ModuleList(encoders)
        self.head = nn.Linear(feature_dim * len(encoders), num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([e(x) for e in self.encoders], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def cluster(vectors: np.ndarray, k: int, seed: int, rebalance=False) -> np.ndarray:
    """K-means labels of the rows of `vectors` (deterministic for a seed), then rebalanced
    when asked (`constrained` or `farthest`, see the module docstring)."""
    from sklearn.cluster import KMeans  # here, not at the top: the CLI imports this module to check a config

    km = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(vectors)
    labels = km.labels_.copy()
    if rebalance == "farthest":
        labels = balance(vectors, labels, km.cluster_centers_)
    elif rebalance == "constrained":
        cap = max(int(1.2 * len(vectors) / k), math.ceil(len(vectors) / k))  # never below a feasible cap
        labels = constrained_kmeans(vectors, km.cluster_centers_, cap, np.random.default_rng(seed))
    return labels


def constrained_kmeans(vectors: np.ndarray, centres: np.ndarray, cap: int, rng, iterations: int = 100) -> np.ndarray:
    """The official code's size-capped K-means: assign to the nearest centre; a cluster over
    `cap` gives up its farthest members, which go to their nearest cluster with room; an
    empty cluster restarts at a random point; centres move to their members' mean."""
    centres = centres.copy()
    n, k = len(vectors), len(centres)
    for _ in range(iterations):
        dist = np.linalg.norm(vectors[:, None, :] - centres[None, :, :], axis=-1)
        labels = dist.argmin(1)
        for j in range(k):
            if not (labels == j).any():
                centres[j] = vectors[rng.integers(n)]
        for j in range(k):
            while (labels == j).sum() > cap:
                members = np.flatnonzero(labels == j)
                far = members[dist[members, j].argmax()]
                labels[far] = -1
                dist[far, j] = np.inf
        for i in np.flatnonzero(labels == -1):
            labels[i] = next(j for j in np.argsort(dist[i], kind="stable") if (labels == j).sum() < cap)
        for j in range(k):
            if (labels == j).any():
                centres[j] = vectors[labels == j].mean(0)
    return labels


def balance(vectors: np.ndarray, labels: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Move members out of clusters above ceil(N / K): the farthest member of the biggest
    cluster goes to the nearest cluster below the cap, until none is above it."""
    labels = labels.copy()
    k = len(centres)
    cap = math.ceil(len(vectors) / k)
    dist = ((vectors[:, None, :] - centres[None, :, :]) ** 2).sum(-1)
    while True:
        sizes = np.bincount(labels, minlength=k)
        big = int(sizes.argmax())
        if sizes[big] <= cap:
            return labels
        members = np.flatnonzero(labels == big)
        far = int(members[dist[members, big].argmax()])
        open_ = [j for j in range(k) if sizes[j] < cap]
        labels[far] = min(open_, key=lambda j: dist[far, j])


def inferred_distribution(model: nn.Module, probe: torch.Tensor) -> np.ndarray:
    """Mean softmax of `model` over the probe inputs: FedConcat-ID's label distribution."""
    model.eval()
    with torch.no_grad():
        return torch.softmax(model(probe), dim=1).mean(0).double().numpy()


@ALGORITHMS.register("fedconcat")
class FedConcat(Algorithm):
    own_server_rule = "its stages average cluster encoders and a classifier of their own"

    Options = FedConcatOptions
    config_section = "fedconcat"  # fedconcat_id reads the same options
    client_state = True  # the cached features
    finetunes = False  # its evaluated model is the concatenation, not a client's model
    infer_labels = False  # FedConcat-ID: True

    @classmethod
    def config_notes(cls, cfg) -> list:
        e, rounds = int(cfg.fedconcat.encoder_rounds), int(cfg.rounds)
        if e < rounds / 2:
            return [f"{cfg.algorithm}: its encoders train in fedconcat.encoder_rounds={e} of the {rounds} rounds, the "
                    f"other {rounds - e} its classifier alone; its paper gives the encoders 31 rounds against FedAvg's "
                    "50 at the same bytes (62 %): on MNIST #C=2, 10 of 100 clients a round, 20 of 150 reached 86.8 % "
                    "and 93 of 150 96.8 % (docs/algorithms.md); set fedconcat.encoder_rounds for a longer run"]
        return []

    @property
    def opts(self):
        return self.cfg.fedconcat

    # ------------------------------------------------------------------ server
    def setup(self, server: Server) -> None:
        """Stage 1: cluster the clients (in round 0, before the first round)."""
        self.num_clients = server.num_clients
        init = server.new_model()
        self.feature_dim = init.feature_dim
        if self.infer_labels:
            self.distributions = self._inferred(server, init)
        else:
            self.distributions = np.zeros((server.num_clients, self.num_classes))
            for r in server.run_clients(0, list(range(server.num_clients)), {}, method="label_distribution"):
                self.distributions[r.cid] = r.update
        k = int(self.opts.clusters)
        self.cluster_of = cluster(self.distributions, k, int(self.cfg.seed), self.opts.rebalance)
        self.models = [copy.deepcopy(init) for _ in range(k)]
        self.concat: Optional[ConcatModel] = None
        self.cached: set[int] = set()  # clients holding the concatenated features

    def _inferred(self, server: Server, init: EncoderHead) -> np.ndarray:
        """FedConcat-ID: one local round from `init` on every client, then each model's mean
        softmax over random inputs. Models are folded one at a time (O(model) memory)."""
        lo, hi = server.input_range
        g = torch.Generator().manual_seed(int(self.cfg.seed))
        probe = torch.rand(int(self.opts.probe_samples), *self.input_shape, generator=g) * (hi - lo) + lo
        dist = np.full((server.num_clients, self.num_classes), 1.0 / self.num_classes)  # for clients that drop
        model = copy.deepcopy(init)
        for r in server.run_clients(0, list(range(server.num_clients)), {"stage": "encoder", "weights": cpu_state(init)}):
            model.load_state_dict(r.update)
            dist[r.cid] = inferred_distribution(model, probe)
        return dist

    def run_round(self, rnd: int, server: Server) -> dict:
        if rnd <= int(self.opts.encoder_rounds):
            return self._encoder_round(rnd, server)
        if self.concat is None:
            self.concat = self._concatenate()
        return self._classifier_round(rnd, server)

    def _encoder_round(self, rnd: int, server: Server) -> dict:
        """Stage 2: FedAvg in every cluster; all clusters' tasks are out before any is read."""
        cohort = server.select_clients(rnd)
        calls = []
        for k, model in enumerate(self.models):
            members = [c for c in cohort if self.cluster_of[c] == k]
            if members:
                calls.append((k, server.run_clients(rnd, members, {"stage": "encoder", "weights": cpu_state(model)})))
        loss, n = 0.0, 0.0
        for k, results in calls:
            mean = WeightedMean()
            for r in results:
                mean.add(r.update, r.num_samples)
                loss += r.metrics["loss"] * r.num_samples
            new = mean.result(self.models[k].state_dict())
            if new is not None:
                self.models[k].load_state_dict(new)
                n += mean.total
        return {"train_loss": loss / n, "clusters_trained": len(calls)} if n else {}

    def _concatenate(self) -> ConcatModel:
        """The K encoders side by side, frozen, and the classifier's starting point."""
        concat = ConcatModel([copy.deepcopy(m.encoder) for m in self.models], self.feature_dim, self.num_classes)
        for p in concat.encoders.parameters():
            p.requires_grad_(False)
        if self.opts.init_classifier:
            self._init_from_clusters(concat, self.opts.init_classifier)
        else:
            torch.manual_seed(int(self.cfg.seed) + 1)
            concat.head.reset_parameters()
        return concat

    def _init_from_clusters(self, concat: ConcatModel, how: str = "mean") -> None:
        """Head = the cluster classifiers side by side: the sum of their logits (`sum`, the
        official code) or their mean (`mean`)."""
        scale = 1.0 / len(self.models) if how == "mean" else 1.0
        with torch.no_grad():
            concat.head.weight.copy_(torch.cat([m.head.weight for m in self.models], dim=1) * scale)
            concat.head.bias.copy_(torch.stack([m.head.bias for m in self.models]).sum(0) * scale)

    def _classifier_round(self, rnd: int, server: Server) -> dict:
        """Stage 3: the selected clients without features get the encoders first (in the
        first classifier round: everyone), then the classifier trains on cached features."""
        cohort = server.select_clients(rnd)
        wanted = cohort if self.cached else range(self.num_clients)  # first classifier round: everyone
        missing = [c for c in wanted if c not in self.cached]
        if missing:
            encoders = [cpu_state(e) for e in self.concat.encoders]
            for r in server.run_clients(rnd, missing, {"encoders": encoders}, method="cache_features"):
                self.cached.add(r.cid)
        ready = [c for c in cohort if c in self.cached]
        mean, loss, n = WeightedMean(), 0.0, 0
        uniform = self.opts.classifier_weighting == "uniform"
        for r in server.run_clients(rnd, ready, {"stage": "classifier", "weights": cpu_state(self.concat.head)}):
            mean.add(r.update, 1.0 if uniform else r.num_samples)
            loss += r.metrics["loss"] * r.num_samples
            n += r.num_samples
        new = mean.result(self.concat.head.state_dict())
        if new is None:
            return {}
        self.concat.head.load_state_dict(new)
        return {"train_loss": loss / n, "features_cached": len(self.cached)}

    def eval_models(self) -> dict:
        if self.concat is not None:
            return {"concat": self.concat}
        ensemble = ConcatModel([m.encoder for m in self.models], self.feature_dim, self.num_classes)
        self._init_from_clusters(ensemble)
        return {"concat": ensemble}

    def state_dict(self) -> dict:
        return {"clusters": [m.state_dict() for m in self.models],
                "cluster_of": torch.as_tensor(self.cluster_of),
                "distributions": torch.as_tensor(self.distributions),
                "classifier": self.concat.head.state_dict() if self.concat is not None else None,
                "cached": sorted(self.cached)}

    def load_state_dict(self, state: dict) -> None:
        for m, s in zip(self.models, state["clusters"]):
            m.load_state_dict(s)
        self.cluster_of = state["cluster_of"].numpy()
        self.distributions = state["distributions"].numpy()
        self.cached = set(int(c) for c in state["cached"])
        self.concat = None
        if state["classifier"] is not None:
            self.concat = self._concatenate()
            self.concat.head.load_state_dict(state["classifier"])

    # ------------------------------------------------------------------ client
    def label_distribution(self, client: Client, payload: dict) -> ClientResult:
        counts = client.label_counts().astype(np.float64)
        return ClientResult(client.cid, client.num_samples, counts / counts.sum())

    def cache_features(self, client: Client, payload: dict) -> ClientResult:
        """Compute this client's concatenated features once and keep them (client state)."""
        concat = self._scratch_concat(client, len(payload["encoders"]))
        for enc, weights in zip(concat.encoders, payload["encoders"]):
            enc.load_state_dict(weights)
        concat.eval()
        with torch.no_grad():
            feats = torch.cat([concat.features(client.x[i:i + 1024]) for i in range(0, client.num_samples, 1024)])
        client.state["features"] = feats.cpu()
        return ClientResult(client.cid, client.num_samples, None, {"features": int(feats.shape[1])})

    def _scratch_concat(self, client: Client, k: int) -> ConcatModel:
        if getattr(self, "_concat_scratch", None) is None:
            shape = tuple(client.x.shape[1:])
            parts = [self.build_model(shape) for _ in range(k)]
            self._concat_scratch = ConcatModel([p.encoder for p in parts], parts[0].feature_dim,
                                               self.num_classes).to(client.device)
        return self._concat_scratch

    def client_update(self, client: Client, payload: dict) -> ClientResult:
        if payload["stage"] == "encoder":  # stage 1-B and 2: FedAvg's local training
            model = client.model
            model.load_state_dict(payload["weights"])
            stats = local_sgd(client, model)
            return ClientResult(client.cid, client.num_samples, cpu_state(model), stats)
        # stage 3: the linear classifier on the cached features, a few steps
        feats = client.state["features"].to(client.device)
        head = getattr(self, "_head_scratch", None)
        if head is None:
            head = self._head_scratch = nn.Linear(feats.shape[1], self.num_classes).to(client.device)
        head.load_state_dict(payload["weights"])
        on_features = dataclasses.replace(client, x=feats, model=head, transform=None)
        stats = local_sgd(on_features, head, steps=int(self.opts.classifier_steps))
        return ClientResult(client.cid, client.num_samples, cpu_state(head), stats)


@ALGORITHMS.register("fedconcat_id")
class FedConcatID(FedConcat):
    """FedConcat without label upload: clusters on label distributions inferred from models."""

    infer_labels = True
