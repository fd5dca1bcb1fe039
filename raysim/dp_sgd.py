"""Local DP-SGD (sample-level DP per client; Abadi et al. 2016) through Opacus: each step
of a client's local training takes a Poisson-sampled batch (each of its n samples in with
probability q = batch_size / n, as Opacus' `DPDataLoader` draws), Opacus' `GradSampleModule`
computes the per-sample gradients, and its `DPOptimizer` clips each to L2 norm
`privacy.clip`, adds Gaussian noise of standard deviation `privacy.noise_multiplier * clip`
to their sum and divides by the expected batch size; then the SGD step (momentum and
weight decay act on the noised gradient: post-processing).

A client takes ceil(n / batch_size) steps an epoch (`local.steps` > 0: that many), so a
round is `steps` Poisson-sampled Gaussian mechanisms on its own data; its guarantee holds
whatever the server does with its update. The batches come from the client's generator
and the noise from one seeded by (seed, round, client): runs are deterministic, whatever
the packing of clients into actors. `privacy/accountant.py` (`LocalAccountant`) reports
the epsilon of the client that spent the most.

The reference is Opacus' own `PrivacyEngine.make_private` (opacus 1.6: Poisson sampling,
`GradSampleModule` hooks, `DPOptimizer`); raysim keeps its loop (its batches, its losses)
and hands Opacus the model and the optimiser, as `make_private` would.
"""
from __future__ import annotations

import math
import warnings

import torch

from raysim.seeds import seed_for

NOISE_STREAM = 0x4C44505F  # "LDP_": the local noise's generator stream


def model_problems(model: torch.nn.Module) -> list[str]:
    """Why Opacus cannot train `model` privately (BatchNorm mixes samples, layers with no
    per-sample gradient, ...): Opacus' `ModuleValidator`, one line each; [] when it can."""
    from opacus.validators import ModuleValidator

    return sorted({str(e).splitlines()[0] for e in ModuleValidator.validate(model, strict=False)})


def steps_per_round(n: int, batch_size: int, epochs: int, steps: int) -> int:
    """A client's DP-SGD steps in a round: `local.steps` when > 0, else ceil(n / batch_size)
    an epoch (Opacus' `DPDataLoader`: as many batches as the data in fixed-size batches)."""
    return steps if steps else epochs * math.ceil(n / batch_size)


def private_sgd(client, model: torch.nn.Module, loss_fn, epochs: int, steps: int, lr: float) -> dict:
    """`local_sgd` under `privacy.mode=local`: the same result keys ({"loss", "steps", "lr"})."""
    import logging

    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    logging.getLogger("opacus").setLevel(logging.ERROR)  # its note that secure_mode is off: raysim's noise is seeded
    cfg, loc = client.cfg, client.cfg.local
    n, bs = client.num_samples, int(loc.batch_size)
    q = min(1.0, bs / n)
    total_steps = steps_per_round(n, bs, epochs, steps)
    noise = torch.Generator(device=client.device).manual_seed(seed_for(cfg.seed, client.round, NOISE_STREAM, client.cid))
    wrapped = GradSampleModule(model, loss_reduction="mean")
    opt = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr,
                                      momentum=float(loc.momentum), weight_decay=float(loc.weight_decay)),
                      noise_multiplier=float(cfg.privacy.noise_multiplier), max_grad_norm=float(cfg.privacy.clip),
                      expected_batch_size=max(1, round(q * n)), loss_reduction="mean", generator=noise)
    model.train()
    total, count = 0.0, 0
    try:
        for _ in range(total_steps):
            take = torch.rand(n, generator=client.generator) < q
            idx = take.nonzero().squeeze(1).to(client.x.device)
            opt.zero_grad(set_to_none=True)
            if len(idx):
                xb = client.x[idx]
                if client.transform is not None:
                    xb = client.transform(xb, client.generator)
                loss = loss_fn(wrapped, xb, client.y[idx])
                with warnings.catch_warnings():  # Opacus' hooks on a first layer whose input needs no gradient: expected
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    loss.backward()
                total += float(loss.detach()) * len(idx)
                count += len(idx)
            else:  # an empty draw is still a step: the noise alone is released
                for p in opt.params:
                    p.grad_sample = p.new_zeros((0, *p.shape))
            opt.step()
    finally:
        wrapped._close()  # the model is the actor's, shared by the clients it runs: no hooks left on it
    return {"loss": total / max(count, 1), "steps": total_steps, "lr": lr}
