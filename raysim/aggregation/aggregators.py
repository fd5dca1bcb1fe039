"""Aggregators: how the clients' models combine into one, coordinate by coordinate or by
choosing among them (`server.aggregator`). They see the trainable parameters only, in
client-id order; buffers take the plain weighted mean (raysim.aggregation.ServerRule).

- `mean`: the sample-weighted mean (FedAvg), kept as a running sum: O(model) memory.
- `median`: the coordinate-wise median, unweighted; with an even count, the mean of the two
  middle values (Yin et al. 2018; numpy's `median` convention).
- `trimmed_mean`: per coordinate, drop the floor(`server.trim` * n) largest and smallest
  values and average the rest, unweighted (Yin et al. 2018; Flower's `FedTrimmedAvg`).
- `krum`: the client model whose summed squared distance to its n - f - 2 nearest others is
  smallest (Blanchard et al. 2017; f = `server.byzantine`); ties go to the lowest client id.
  `multi_krum`: the unweighted mean of the `server.krum_m` best-scored models.
- `geometric_median`: the sample-weighted geometric median by smoothed Weiszfeld
  iterations (RFA, Pillutla et al. 2022: ν = 1e-6, at most 100 iterations, stopping when
  the point moves less than 1e-7 of its norm).
- `majority_vote`: signSGD's server (Bernstein et al. 2018, "signSGD with Majority Vote"):
  per coordinate the sign of the sum of the clients' update signs, unweighted (a tie: 0);
  the server steps `server.lr` along it: x + lr x sign(sum_i sign(m_i - x)). With
  `compress.up=signsgd` only the signs travel (raysim/compression/uplink.py).

Reference: Flower's `FedMedian`, `FedTrimmedAvg` and `Krum` strategies
(adap/flower, flwr/server/strategy/) and the papers' definitions. All but `mean` keep every
client's parameters for the round (n x model).
"""
from __future__ import annotations

import math

import torch

from raysim.registry import AGGREGATORS
from raysim.training import WeightedMean


class Aggregator:
    """Base: `add(params, weight)` per client in client-id order, then `result(like)`."""

    def __init__(self, server_cfg):
        self.cfg = server_cfg
        self.models: list[dict[str, torch.Tensor]] = []
        self.weights: list[float] = []

    def add(self, params: dict[str, torch.Tensor], weight: float) -> None:
        self.models.append(params)
        self.weights.append(float(weight))

    def result(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The combination, cast to `like`'s dtypes (only called when a client was added)."""
        raise NotImplementedError

    def stacked(self, k: str) -> torch.Tensor:
        """Entry k of every model, stacked along a new first dimension, in float64."""
        return torch.stack([m[k].double() for m in self.models])


@AGGREGATORS.register("mean")
class Mean(Aggregator):
    def __init__(self, server_cfg):
        super().__init__(server_cfg)
        self.mean = WeightedMean()

    def add(self, params, weight):
        self.mean.add(params, weight)

    def result(self, like):
        return self.mean.result(like)


def coordinatewise(aggregator: Aggregator, like: dict, combine) -> dict:
    return {k: combine(torch.sort(aggregator.stacked(k), dim=0).values).to(like[k].dtype) for k in like}


@AGGREGATORS.register("median")
class Median(Aggregator):
    def result(self, like):
        def median(s: torch.Tensor) -> torch.Tensor:
            n = s.shape[0]
            return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
        return coordinatewise(self, like, median)


@AGGREGATORS.register("trimmed_mean")
class TrimmedMean(Aggregator):
    def result(self, like):
        n = len(self.models)
        cut = int(math.floor(float(self.cfg.trim) * n))
        return coordinatewise(self, like, lambda s: s[cut:n - cut].mean(dim=0))


@AGGREGATORS.register("majority_vote")
class MajorityVote(Aggregator):
    def result(self, like):
        return {k: (like[k].double() + torch.sign(torch.sign(self.stacked(k) - like[k].double()).sum(dim=0)))
                .to(like[k].dtype) for k in like}


def flat(models: list[dict], keys: list[str]) -> torch.Tensor:
    """(n, d) float64: each model's entries `keys`, flattened and concatenated."""
    return torch.stack([torch.cat([m[k].double().reshape(-1) for k in keys]) for m in models])


@AGGREGATORS.register("krum")
class Krum(Aggregator):
    chosen_count = 1

    def scores(self, keys: list[str]) -> torch.Tensor:
        """Krum's score of each model: the summed squared distances to its n - f - 2 nearest."""
        x = flat(self.models, keys)
        sq = (x * x).sum(dim=1)
        d2 = (sq[:, None] + sq[None, :] - 2 * (x @ x.T)).clamp_min(0)  # squared distances, float64
        n, f = x.shape[0], int(self.cfg.byzantine)
        near = max(1, n - f - 2)
        d2.fill_diagonal_(float("inf"))
        return torch.sort(d2, dim=1).values[:, :min(near, n - 1)].sum(dim=1) if n > 1 else torch.zeros(1)

    def result(self, like):
        keys = sorted(like)
        scores = self.scores(keys)
        order = sorted(range(len(scores)), key=lambda i: (float(scores[i]), i))  # ties: lowest client id
        best = order[:min(self.chosen_count, len(order))]
        return {k: torch.stack([self.models[i][k].double() for i in best]).mean(dim=0).to(like[k].dtype) for k in like}


@AGGREGATORS.register("multi_krum")
class MultiKrum(Krum):
    @property
    def chosen_count(self) -> int:
        return int(self.cfg.krum_m)


@AGGREGATORS.register("geometric_median")
class GeometricMedian(Aggregator):
    NU, ITERATIONS, TOLERANCE = 1e-6, 100, 1e-7

    def result(self, like):
        keys = sorted(like)
        x = flat(self.models, keys)
        alpha = torch.tensor(self.weights, dtype=torch.float64)
        alpha = alpha / alpha.sum()
        z = (alpha[:, None] * x).sum(dim=0)  # the weighted mean: the starting point
        for _ in range(self.ITERATIONS):
            beta = alpha / torch.clamp(torch.linalg.vector_norm(x - z, dim=1), min=self.NU)
            new = (beta[:, None] * x).sum(dim=0) / beta.sum()
            moved = float(torch.linalg.vector_norm(new - z))
            z = new
            if moved <= self.TOLERANCE * max(float(torch.linalg.vector_norm(z)), 1.0):
                break
        out, start = {}, 0
        for k in keys:
            size = like[k].numel()
            out[k] = z[start:start + size].reshape(like[k].shape).to(like[k].dtype)
            start += size
        return out
