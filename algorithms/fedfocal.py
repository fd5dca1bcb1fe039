"""Fed-Focal (a baseline of the CReFF paper): FedAvg whose clients train with the focal loss
-(1 - p_y)^gamma log p_y (Lin et al. 2017), which down-weights the samples a model already
gets right, so the rare classes of a long-tailed client weigh more. The loss itself is
`training.focal_loss`, usable by any algorithm's `local_loss`."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.contract import Client
from raysim.algorithms.fedavg import FedAvg
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import focal_loss, focal_per_sample


@dataclass
class FedFocalOptions(Options):
    gamma: float = option(2.0, at_least=0)  # focusing parameter (Lin et al.'s default); 0 is FedAvg


@ALGORITHMS.register("fedfocal")
class FedFocal(FedAvg):
    Options = FedFocalOptions
    trains_on_base_loss = False  # its own loss (local.focal_gamma does not apply)

    def local_loss(self, client: Client, payload: dict):
        return focal_loss(float(self.cfg.fedfocal.gamma))

    def client_update_cohort(self, clients: list[Client], payload: dict):
        return self.train_cohort(clients, payload, sample_loss=focal_per_sample(float(self.cfg.fedfocal.gamma)))
