"""DP-FedAvg's server side (McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially
Private Recurrent Language Models", Algorithm 1 with the fixed-denominator estimator), the
way TensorFlow Federated's `DifferentiallyPrivateFactory.gaussian_fixed` and Flower's
`DifferentialPrivacyServerSideFixedClipping` apply it:

    delta_k  = w_k - w                    (client k's update: its trainable parameters only)
    clipped  = delta_k * min(1, C / ||delta_k||_2)
    w'       = w + (sum_k clipped + N(0, (z C)^2 I)) / K

with C = `privacy.clip`, z = `privacy.noise_multiplier` and K the clients drawn per round
(fixed, not the number that returned: a denominator that depended on who returned would
leak). Every client counts once whatever its sample count (the reference's uniform
weights: a weighted mean's sensitivity would grow with the largest client). The noise
comes from a generator seeded by (seed, round): runs are deterministic, whatever the
packing of clients into actors. The result is then the server optimiser's target
(`server.optimizer`), which is post-processing and costs no privacy.

Adaptive clipping (`privacy.adaptive_clip`; Andrew, Thakkar, McMahan, Ramaswamy 2021,
"Differentially Private Learning with Adaptive Clipping", Algorithm 1, geometric update; TFF's
`DifferentiallyPrivateFactory.gaussian_adaptive`): each round the server also sums
b_k = 1[||delta_k|| <= C], adds N(0, sigma_b^2) (sigma_b = `privacy.clip_count_stddev`,
default K / 20, the paper's), and moves the clip toward the `target_quantile` of the norms:

    C <- C * exp(-clip_lr * ((sum_k b_k + noise) / K - target_quantile))

The two releases together are as private as one Gaussian mechanism of multiplier z when the
updates' noise uses z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) (the paper's Theorem 1), so the
accountant is unchanged; it needs 2 sigma_b > z.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from raysim.errors import ConfigError

from raysim.training import seed_for

NOISE_STREAM = 0x44505F4E  # "DP_N": the noise's generator stream, apart from every other use of the seed
COUNT_STREAM = 0x44505F43  # "DP_C": the adaptive clip's count noise


class CentralDP:
    def __init__(self, clip: float, noise_multiplier: float, clients_per_round: int, seed: int,
                 adaptive: bool = False, target_quantile: float = 0.5, clip_lr: float = 0.2,
                 count_stddev: Optional[float] = None):
        self.clip_norm = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.clients_per_round = int(clients_per_round)
        self.seed = int(seed)
        self.adaptive = bool(adaptive)
        self.target_quantile, self.clip_lr = float(target_quantile), float(clip_lr)
        self.count_stddev = float(count_stddev) if count_stddev is not None else self.clients_per_round / 20
        self.update_noise_multiplier = self.noise_multiplier  # z_delta: the updates' share of z
        if self.adaptive and self.noise_multiplier > 0:
            if 2 * self.count_stddev <= self.noise_multiplier:
                raise ConfigError(f"privacy.adaptive_clip: the count's noise (privacy.clip_count_stddev="
                                  f"{self.count_stddev:g}) must be more than half the noise multiplier "
                                  f"({self.noise_multiplier:.4g}); raise it (default: clients per round / 20)")
            self.update_noise_multiplier = (self.noise_multiplier ** -2 - (2 * self.count_stddev) ** -2) ** -0.5

    @classmethod
    def from_config(cls, cfg):
        """The run's CentralDP, or None when `privacy.mode` is not central."""
        from raysim.config import clients_per_round

        pv = cfg.privacy
        if pv.mode != "central":
            return None
        return cls(pv.clip, pv.noise_multiplier, clients_per_round(cfg), cfg.seed, pv.adaptive_clip,
                   pv.target_quantile, pv.clip_lr, pv.clip_count_stddev)

    def clip(self, update: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
        """`update` scaled to L2 norm at most the clip (over all its tensors together), and
        whether it was scaled."""
        norm = torch.sqrt(sum(torch.sum(u.double() ** 2) for u in update.values())).item()
        if norm <= self.clip_norm:
            return update, False
        factor = self.clip_norm / norm
        return {k: u * factor for k, u in update.items()}, True

    def noise(self, like: dict[str, torch.Tensor], rnd: int) -> dict[str, torch.Tensor]:
        """Gaussian noise of standard deviation z_delta * clip for each entry of `like`, from
        the generator of (seed, round)."""
        gen = torch.Generator().manual_seed(seed_for(self.seed, rnd, NOISE_STREAM))
        std = self.update_noise_multiplier * self.clip_norm
        return {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) * std for k, v in like.items()}

    def adapt(self, unscaled: int, rnd: int) -> None:
        """Adaptive clipping's step, after the round's noise: `unscaled` of the round's
        updates were within the clip."""
        if not self.adaptive:
            return
        gen = torch.Generator().manual_seed(seed_for(self.seed, rnd, COUNT_STREAM))
        noisy = unscaled + float(torch.randn((), generator=gen, dtype=torch.float64)) * self.count_stddev
        self.clip_norm *= math.exp(-self.clip_lr * (noisy / self.clients_per_round - self.target_quantile))

    def state_dict(self) -> dict:
        """The adaptive clip, kept in checkpoints (a tensor, as every part of one)."""
        return {"dp_clip": torch.tensor(self.clip_norm, dtype=torch.float64)} if self.adaptive else {}

    def load_state_dict(self, state: dict) -> None:
        if self.adaptive and "dp_clip" in state:
            self.clip_norm = float(state["dp_clip"])
