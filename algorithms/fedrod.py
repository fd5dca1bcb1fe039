"""FedRoD (Chen & Chao 2022, "On Bridging Generic and Personalized Federated Learning for
Image Classification"): one model, two heads on the same features z = encoder(x). The
generic head g and the encoder are FedAvg's, trained on the balanced softmax loss
(cross-entropy of g(z) + log n_c^gamma, n_c the client's count of class c: a classifier that
does not learn the client's label skew); the personal head p never leaves its client and is
trained on the cross-entropy of g(z) + p(z) with g and z held fixed (gradients stopped). The
server's model (the encoder and g) is the generic model, evaluated as the global one; a
client's personal model predicts g(z) + p(z), which for two linear heads on the same z is one
linear head with weights W_g + W_p and bias b_g + b_p: that is the model `personalise`
returns, so personal evaluation needs nothing of its own.

Compared with PFLlib's clientrod.py (BSM on the generic output, `out_g.detach() + head(rep.detach())`
for the personal loss, p starting as a copy of the initial head), the same here, p as
`model.personal` beside the head (its state-dict keys `personal.*`, kept in client state by
`_personal.Personal`). FL-bench's fedrod.py trains p on p(z) alone with z not stopped (the
encoder learns from both losses) and adds an optional hypernetwork: not followed. The
authors' code (hongyouc/FedRoD) was not in the reference store. `fedrod.gamma` is FL-bench's
exponent on the counts (1: the paper's BSM; 0: plain cross-entropy), FL-bench's
`(counts ** gamma).log()` taken as `gamma * counts.log()` (the same bits at gamma 1; no overflow
of n_c ** gamma past float32 at a large gamma)."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysim.contract import Client, ClientResult
from raysim.errors import ConfigError
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim import training

from raysim.algorithms._personal import Personal


@dataclass
class FedRoDOptions(Options):
    gamma: float = option(1.0, at_least=0)  # balanced softmax: logits + gamma log n_c (1: the paper's)


@ALGORITHMS.register("fedrod")
class FedRoD(Personal):
    Options = FedRoDOptions
    shared = "all"  # less the personal head
    kept = "personal"
    trains_on_base_loss = False  # its own two losses (local.focal_gamma does not apply)

    def build_model(self, input_shape: tuple) -> torch.nn.Module:
        """The configured model with `personal`, a copy of its initial head, beside the head."""
        model = super().build_model(input_shape)
        if not isinstance(model.head, torch.nn.Linear):
            raise ConfigError(f"algorithm=fedrod: model={self.cfg.model!r} has a head that is not one linear layer "
                              f"({type(model.head).__name__}); FedRoD's personal model sums two linear heads")
        model.personal = copy.deepcopy(model.head)
        return model

    def local_loss(self, client: Client, payload):
        gamma = float(client.cfg.fedrod.gamma)
        counts = torch.bincount(client.y, minlength=client.num_classes).to(client.device, torch.float32)
        # log(n_c ** gamma), as FL-bench, taken as gamma x log n_c: n_c ** gamma overflowed float32 from
        # gamma ~23 on digits (issue 85), the product does not. -inf for a class the client lacks (out of
        # its softmax) when gamma > 0; at gamma 0 every shift is 0, plain cross-entropy (0 x log 0 is NaN)
        shift = gamma * counts.log() if gamma > 0 else torch.zeros_like(counts)

        def loss(model, x, y):
            z = model.encoder(x)
            generic = model.head(z)
            bsm = F.cross_entropy(generic + shift, y)
            personal = F.cross_entropy(generic.detach() + model.personal(z.detach()), y)
            return bsm + personal

        return loss

    def personalise(self, client: Client, payload) -> ClientResult:
        """The served model with the client's p merged into the head (W_g + W_p, b_g + b_p);
        `eval.finetune_epochs` fine-tunes before the merge."""
        result = training.personalise(self, client, payload)
        own = client.state.get("kept", self.initial(client))
        w = result.update
        w["head.weight"] = w["head.weight"] + own["personal.weight"]
        w["head.bias"] = w["head.bias"] + own["personal.bias"]
        return result
