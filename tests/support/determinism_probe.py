"""A test plugin: FedAvg whose clients keep, in their persistent state, the determinism
settings in force in the client actor that trained them (so a test reads them from the
run's checkpoint: asserted from inside the actor, on the training path)."""
import torch

from raysim.algorithms.fedavg import FedAvg
from raysim.registry import ALGORITHMS
from raysim.runtime import determinism


@ALGORITHMS.register("test_determinism_probe")
class DeterminismProbe(FedAvg):
    client_state = True

    def client_update(self, client, payload):
        result = super().client_update(client, payload)
        s = determinism.settings()
        client.state["settings"] = torch.tensor([s["deterministic_algorithms"], s["cudnn_deterministic"],
                                                 s["cudnn_benchmark"], s["cublas_workspace"] == ":4096:8"])
        return result
