"""FedBN (Li, Jiang, Zhang, Kamp, Dou 2021, "FedBN: Federated Learning on Non-IID Features via
Local Batch Normalization", Algorithm 1): FedAvg, except that every BatchNorm layer (its
weight and bias and its running statistics) stays on its client; the rest of the model is
averaged. Its personal model: the global model with its own BatchNorm layers. A model with
a `norm` option gets `norm=batch` unless the config sets it (said in the log); on a model
with no BatchNorm it would be FedAvg, so such a model is refused (experiment.py).

Compared with the authors' code (med-air/FedBN, federated/fed_digits.py `communication`:
every state-dict key without "bn" in its name is averaged, the rest never leaves the
client) and PFLlib's serverbn.py / clientbn.py (the same rule by name). Here the BatchNorm
layers are found by module type (`_personal.part_keys(model, "norm")`), so a model's layer
names do not matter. The authors weigh clients uniformly; their clients hold equal numbers
of samples (each domain cut to the smallest), where uniform and by-sample weights are the
same; here the weights are the samples', as FedAvg's and PFLlib's. See _personal.py."""
from __future__ import annotations

from raysim.registry import ALGORITHMS

from raysim.algorithms._personal import Personal


@ALGORITHMS.register("fedbn")
class FedBN(Personal):
    shared = "all"  # less the kept BatchNorm layers
    unshared = "BatchNorm layers"  # on the server: the initial ones, no client's
    kept = "norm"
    model_options_default = {"norm": "batch"}  # mlp / cnn / the VGGs: with BatchNorm unless the config says
