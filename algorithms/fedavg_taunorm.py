"""FedAvg + tau-norm (a baseline of the CReFF paper): FedAvg, evaluated with its classifier
rows normalised, w_c / ||w_c||^tau (Kang et al. 2020, "Decoupling representation and
classifier"), a post-hoc fix of the bias a long tail puts into the classifier's norms.
The same for any algorithm: `eval.tau_norm` (training.tau_normalised)."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.algorithms.fedavg import FedAvg
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.training import tau_normalised


@dataclass
class TauNormOptions(Options):
    tau: float = option(1.0, at_least=0)  # 1: unit-norm rows


@ALGORITHMS.register("fedavg_taunorm")
class FedAvgTauNorm(FedAvg):
    Options = TauNormOptions

    def eval_models(self) -> dict:
        return {"global": tau_normalised(self.model, float(self.cfg.fedavg_taunorm.tau))}

    def state_dict(self) -> dict:  # the trained model, not its normalised copy
        return {"global": self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["global"])
