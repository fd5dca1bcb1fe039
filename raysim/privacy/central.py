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
"""
from __future__ import annotations

import torch

from raysim.training import seed_for

NOISE_STREAM = 0x44505F4E  # "DP_N": the noise's generator stream, apart from every other use of the seed


class CentralDP:
    def __init__(self, clip: float, noise_multiplier: float, clients_per_round: int, seed: int):
        self.clip_norm = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.clients_per_round = int(clients_per_round)
        self.seed = int(seed)

    @classmethod
    def from_config(cls, cfg):
        """The run's CentralDP, or None when `privacy.mode` is not central."""
        from raysim.config import clients_per_round

        if cfg.privacy.mode != "central":
            return None
        return cls(cfg.privacy.clip, cfg.privacy.noise_multiplier, clients_per_round(cfg), cfg.seed)

    def clip(self, update: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
        """`update` scaled to L2 norm at most `clip` (over all its tensors together), and
        whether it was scaled."""
        norm = torch.sqrt(sum(torch.sum(u.double() ** 2) for u in update.values())).item()
        if norm <= self.clip_norm:
            return update, False
        factor = self.clip_norm / norm
        return {k: u * factor for k, u in update.items()}, True

    def noise(self, like: dict[str, torch.Tensor], rnd: int) -> dict[str, torch.Tensor]:
        """Gaussian noise of standard deviation noise_multiplier * clip for each entry of
        `like`, from the generator of (seed, round)."""
        gen = torch.Generator().manual_seed(seed_for(self.seed, rnd, NOISE_STREAM))
        std = self.noise_multiplier * self.clip_norm
        return {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) * std for k, v in like.items()}
