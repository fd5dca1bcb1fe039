"""CCVR (Luo et al. 2021, "No Fear of Heterogeneity: Classifier Calibration for Federated
Learning with Non-IID Data"), a baseline of the CReFF paper: FedAvg, then classifier
calibration with virtual representations.

    rounds       FedAvg: every per-round metric is the FedAvg model's.
    calibration  once, after the last round (`calibrate: final`, the paper's post-hoc step):
                 every client computes, with the final global model's feature extractor,
                 per class c it holds: the count n_c, mean mu_c and (unbiased) covariance
                 Sigma_c of its features, and uploads them. The server pools them into each
                 class's global mean and covariance (the paper's Eq. 3-4, through the
                 sufficient statistics sum x and sum x x^T), draws `virtual_per_class`
                 features per class from N(mu_c, Sigma_c) and re-trains the global
                 classifier on them (`retrain_steps` of SGD at `retrain_lr`); the feature
                 extractor is not touched.
    result       (u, calibrated classifier): the run's `final_accuracy`; the FedAvg model's
                 last round is `final_round_accuracy` (`Algorithm.after_training`).

`calibrate: every_round` is a raysim variant (not the paper's): calibrate after every round
from every available client (one extra round trip a round), report the calibrated model as
the round's "accuracy" and the FedAvg model as "global_accuracy"; training still goes on
from the FedAvg model. The paper sets the virtual samples per class per dataset (100 / 500 /
1000 for CIFAR-10 / CIFAR-100 / CINIC-10): `virtual_per_class`, default 100.
Reference: the paper's Algorithm 1 (no official code was released; FL-bench's `ccvr` follows
the same steps). The re-training is `training.train_linear`, as CReFF's.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from raysim.contract import Client, ClientResult, Server
from raysim.algorithms.creff import Retrained
from raysim.algorithms.fedavg import FedAvg
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import cpu_state, seed_for, train_linear


@dataclass
class CCVROptions(Options):
    calibrate: str = option("final", choices=("final", "every_round"))  # final: once, post-hoc (the paper) | every_round (a raysim variant)
    virtual_per_class: int = option(100, at_least=1)  # virtual features drawn per class
    retrain_steps: int = option(300, at_least=0)
    retrain_lr: float = option(0.1, above=0)
    retrain_batch: int = option(32, at_least=1)


def pooled_gaussians(stats: list[dict], dim: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{c: (mean, covariance)} of the union of the clients' samples of each class, from each
    client's {c: (n, mean, covariance)} (unbiased covariances; a class seen once: zero covariance)."""
    acc: dict[int, list] = {}
    for client in stats:
        for c, (n, mu, cov) in client.items():
            n, mu, cov = int(n), np.asarray(mu, np.float64), np.asarray(cov, np.float64)
            a = acc.setdefault(int(c), [0, np.zeros(dim), np.zeros((dim, dim))])
            a[0] += n
            a[1] += n * mu
            a[2] += (n - 1) * cov + n * np.outer(mu, mu)
    out = {}
    for c, (n, s1, s2) in sorted(acc.items()):
        mu = s1 / n
        cov = (s2 - n * np.outer(mu, mu)) / (n - 1) if n > 1 else np.zeros((dim, dim))
        out[c] = (mu, cov)
    return out


def virtual_features(gaussians: dict, per_class: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, labels): `per_class` draws from each class's N(mean, covariance), classes in
    the dict's order (float32 features, as the classifier takes them)."""
    x = np.concatenate([rng.multivariate_normal(mu, cov, per_class, method="eigh") for mu, cov in gaussians.values()])
    y = np.repeat(np.asarray(list(gaussians), dtype=np.int64), per_class)
    return torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)


@ALGORITHMS.register("ccvr")
class CCVR(FedAvg):
    trains_privately = False  # privacy.mode=local refused: it uploads feature statistics DP-SGD does not cover
    Options = CCVROptions
    server_parts = ("aggregator", "optimizer")
    own_server_rule = ("its clients also upload their features' class means and covariances, which no noise "
                       "covers")

    def setup(self, server: Server) -> None:
        super().setup(server)
        self.calibrated = None  # the calibrated classifier, once there is one

    @property
    def every_round(self) -> bool:
        return self.cfg.ccvr.calibrate == "every_round"

    def run_round(self, rnd: int, server: Server) -> dict:
        metrics = super().run_round(rnd, server)
        if self.every_round:
            metrics["calibrated_classes"] = self.calibrate(rnd, server)
        return metrics

    def after_training(self, server: Server) -> dict:
        if self.every_round:  # the last round calibrated already
            return {}
        self.calibrate(int(self.cfg.rounds), server)
        return {"calibrated": self.calibrated_model()}

    def calibrate(self, rnd: int, server: Server) -> int:
        """Pool every available client's class statistics under the current global model,
        draw virtual features, re-train a copy of the global classifier on them; returns
        how many classes were calibrated."""
        o = self.cfg.ccvr
        stats = [r.update for r in server.run_clients(rnd, server.available_clients(rnd),
                                                      {"weights": cpu_state(self.model)}, method="feature_stats")]
        gaussians = pooled_gaussians(stats, self.model.feature_dim)
        x, y = virtual_features(gaussians, int(o.virtual_per_class), np.random.default_rng([int(self.cfg.seed), rnd, 47]))
        g = torch.Generator().manual_seed(seed_for(int(self.cfg.seed), rnd, 48))
        self.calibrated = train_linear(copy.deepcopy(self.model.head), x, y, int(o.retrain_steps),
                                       float(o.retrain_lr), int(o.retrain_batch), g)
        return len(gaussians)

    def calibrated_model(self) -> Retrained:
        return Retrained(self.model.encoder, self.calibrated)

    def eval_models(self) -> dict:
        if self.calibrated is None or not self.every_round:  # final: the rounds are FedAvg's
            return {"global": self.model}
        return {"calibrated": self.calibrated_model(), "global": self.model}

    def state_dict(self) -> dict:
        return {"global": self.model.state_dict(), **self.server_rule.state_dict(),
                "calibrated": None if self.calibrated is None else self.calibrated.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["global"])
        self.server_rule.load_state_dict(state)
        if state["calibrated"] is not None:
            self.calibrated = copy.deepcopy(self.model.head)
            self.calibrated.load_state_dict(state["calibrated"])

    # ---- client ----
    def feature_stats(self, client: Client, payload: dict) -> ClientResult:
        """{c: (n_c, mean, unbiased covariance)} of the global model's features of its samples."""
        model = client.model
        model.load_state_dict(payload["weights"])
        model.eval()
        with torch.no_grad():
            feats = torch.cat([model.encoder(client.x[i:i + 1024]) for i in range(0, client.num_samples, 1024)])
        feats = feats.double().cpu()
        y = client.y.cpu()
        out = {}
        for c in torch.unique(y).tolist():
            f = feats[y == c]
            cov = torch.cov(f.T) if len(f) > 1 else torch.zeros(f.shape[1], f.shape[1], dtype=torch.float64)
            out[int(c)] = (len(f), f.mean(0), cov)
        return ClientResult(client.cid, client.num_samples, out)
