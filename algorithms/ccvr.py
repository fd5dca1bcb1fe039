"""CCVR (Luo et al. 2021, "No Fear of Heterogeneity: Classifier Calibration for Federated
Learning with Non-IID Data"), a baseline of the CReFF paper: FedAvg, then classifier
calibration with virtual representations.

    calibration  every client (all those there) computes, with the global model's feature
                 extractor, per class c it holds: the count n_c, mean mu_c and (unbiased)
                 covariance Sigma_c of its features, and uploads them. The server pools them
                 into each class's global mean and covariance (the paper's Eq. 3-4, through
                 the sufficient statistics sum x and sum x x^T), draws `virtual_per_class`
                 features per class from N(mu_c, Sigma_c) and re-trains the classifier on
                 them (`retrain_steps` of SGD at `retrain_lr`, from the global classifier).
    evaluated    (u, calibrated classifier) ("accuracy") and the FedAvg model ("global_accuracy");
                 training goes on from the FedAvg model: calibration is post-hoc.

The paper calibrates once, after training (`calibrate_every: 0`: in the last round only);
CReFF's table reports it per round like the others, so by default it calibrates every round
(`calibrate_every: 1`). Reference: the paper's Algorithm 1 (no official code was released;
FL-bench's `ccvr` follows the same steps). The re-training is `training.train_linear`, as
CReFF's.
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
    calibrate_every: int = option(1, at_least=0)  # rounds between calibrations; 0: only after the last round (the paper)
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

    def run_round(self, rnd: int, server: Server) -> dict:
        metrics = super().run_round(rnd, server)
        every = int(self.cfg.ccvr.calibrate_every)
        if (every and rnd % every == 0) or rnd == int(self.cfg.rounds):
            metrics["calibrated_classes"] = self.calibrate(rnd, server)
        return metrics

    def calibrate(self, rnd: int, server: Server) -> int:
        o = self.cfg.ccvr
        stats = [r.update for r in server.run_clients(rnd, server.available_clients(rnd),
                                                      {"weights": cpu_state(self.model)}, method="feature_stats")]
        gaussians = pooled_gaussians(stats, self.model.feature_dim)
        rng = np.random.default_rng([int(self.cfg.seed), rnd, 47])
        m = int(o.virtual_per_class)
        x = np.concatenate([rng.multivariate_normal(mu, cov, m, method="eigh") for mu, cov in gaussians.values()])
        y = np.repeat(list(gaussians), m)
        g = torch.Generator().manual_seed(seed_for(int(self.cfg.seed), rnd, 48))
        self.calibrated = train_linear(copy.deepcopy(self.model.head), torch.as_tensor(x, dtype=torch.float32),
                                       torch.as_tensor(y), int(o.retrain_steps), float(o.retrain_lr),
                                       int(o.retrain_batch), g)
        return len(gaussians)

    def eval_models(self) -> dict:
        if self.calibrated is None:
            return {"global": self.model}
        return {"calibrated": Retrained(self.model.encoder, self.calibrated), "global": self.model}

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
