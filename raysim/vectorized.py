"""Vectorised cohorts (`local.vectorize=true`): local SGD of a group of clients as one
batched program, instead of one client after another.

Small models (MCLR, MLPs, the simple CNN) spend most of a client step in Python and
dispatch, not arithmetic; training G clients at once pays that once per step for all G.
`torch.func.vmap` over `torch.func.functional_call` runs the model with G stacked copies
of its weights (leading dimension: the client), each on its own batch; a model made only of
Flatten / Linear / ReLU (MCLR, the MLPs) skips vmap's per-call cost and runs as batched
matmuls (`stacked_forward`). Either way:

- every client starts from its own weights (`start`: one state dict, or one per client),
  draws its batches from its own generator exactly as `training.local_sgd` does (the same
  permutations, the same order), and takes its own number of steps (stragglers, unequal
  data): a client that has finished is masked (its weights stop changing) and a short last
  batch is padded with masked samples, never with made-up data;
- the optimizer is `training.SGD`'s arithmetic (weight decay, heavy-ball momentum) on the
  stacked tensors;
- gradients come from one backward pass over the sum of the clients' losses: client k's
  loss depends only on its own weights, so d(sum)/dw_k = dL_k/dw_k. (`torch.func.grad`
  would give the same, but it imports torch._dynamo: ~120 MB more in every actor.)

Results equal the sequential path up to float rounding (a batch's loss is a masked sum
over a count instead of a mean, and batched kernels add in another order); tested for
FedAvg, FedProx and SCAFFOLD. A group's result depends only on its clients, and groups
are cut from the sorted cohort by client id (`runtime.placement.plan`), never by actor, so any
number of actors gives the same bits.

Not supported, refused when the config is checked: models with buffers (BatchNorm's
running statistics are updated in place, which vmap cannot do per client) and batch
augmentation (its random draws interleave with the batch order).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from raysim.contract import Client
from raysim.training import round_lr

SampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> one loss per sample


def stacked_forward(model: torch.nn.Module) -> Optional[Callable[[dict, torch.Tensor], torch.Tensor]]:
    """For a model made only of Flatten, Linear and ReLU (in `nn.Sequential` / `EncoderHead`:
    MCLR, the MLPs), its forward on stacked weights as batched matmuls: inputs [G, B, ...] ->
    logits [G, B, C]. vmap's per-call cost is most of such a small model's step (0.37 ms of
    an MCLR step for 20 clients). None for any other model (it goes through vmap)."""
    from raysim.models.base import EncoderHead

    ops: list[tuple[str, str]] = []

    def walk(m: torch.nn.Module, prefix: str) -> bool:
        if type(m) is EncoderHead:
            return walk(m.encoder, prefix + "encoder.") and walk(m.head, prefix + "head.")
        if type(m) is torch.nn.Sequential:
            return all(walk(c, f"{prefix}{name}.") for name, c in m.named_children())
        if type(m) is torch.nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
            ops.append(("flatten", ""))
        elif type(m) is torch.nn.Linear:
            ops.append(("linear", prefix))
        elif type(m) is torch.nn.ReLU:
            ops.append(("relu", ""))
        else:
            return False
        return True

    if not walk(model, ""):
        return None

    def forward(params: dict, x: torch.Tensor) -> torch.Tensor:
        for op, prefix in ops:
            if op == "flatten":
                x = x.flatten(2)
            elif op == "relu":
                x = torch.relu(x)
            else:
                w, b = params[prefix + "weight"].transpose(1, 2), params.get(prefix + "bias")
                x = torch.bmm(x, w) if b is None else torch.baddbmm(b.unsqueeze(1), x, w)
        return x

    return forward


def batch_schedule(n: int, batch_size: int, epochs: int, steps: int, generator: torch.Generator) -> torch.Tensor:
    """The index batches `training.local_sgd` draws for a client with n samples (a new
    permutation per epoch; `steps` > 0 steps instead of `epochs` epochs), as a [steps,
    batch_size] tensor whose short last batches are padded with -1."""
    per_epoch = -(-n // batch_size)
    n_epochs = -(-steps // per_epoch) if steps else epochs
    pad = per_epoch * batch_size - n
    rows = [torch.nn.functional.pad(torch.randperm(n, generator=generator), (0, pad), value=-1).view(per_epoch, batch_size)
            for _ in range(n_epochs)]
    out = torch.cat(rows)
    return out[:steps] if steps else out


def cohort_sgd(clients: list[Client], model: torch.nn.Module, start: dict, sample_loss: SampleLoss,
               penalty: Optional[Callable[[dict], torch.Tensor]] = None,
               gradient_shift: Optional[dict[str, torch.Tensor]] = None,
               weight_shift: Optional[dict[str, torch.Tensor]] = None) -> tuple[list[dict], list[dict]]:
    """Local SGD per `cfg.local` for every client in `clients` at once, on copies of `model`'s
    structure, every client starting from the weights `start` (a state dict). `penalty(params)`: added to a client's batch loss (FedProx's proximal term; under
    vmap, `params` are that client's weights). `gradient_shift[name]` ([G, ...]) is added to
    client k's gradient before the optimizer's step; `weight_shift[name]` ([G, ...]) is
    subtracted, times lr, from its weights after each step (SCAFFOLD's two readings).
    Returns each client's final state dict (CPU) and stats {"loss", "steps", "lr"}, as
    `local_sgd` does."""
    from torch.func import functional_call, vmap

    loc = clients[0].cfg.local
    device, g = clients[0].device, len(clients)
    lr = round_lr(loc, clients[0].round)
    momentum, decay, bs, steps = float(loc.momentum), float(loc.weight_decay), int(loc.batch_size), int(loc.steps)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: start[n].to(device).expand(g, *start[n].shape).clone().requires_grad_() for n in trainable}

    # every client's batches, as rows of one tensor holding all the group's samples
    x = torch.cat([c.x for c in clients])
    y = torch.cat([c.y for c in clients])
    offsets = torch.tensor([0] + [c.num_samples for c in clients]).cumsum(0).tolist()
    schedules = [batch_schedule(c.num_samples, bs, c.epochs, steps, c.generator) for c in clients]
    n_steps = [len(s) for s in schedules]
    t_max = max(n_steps)
    index = torch.full((g, t_max, bs), -1, dtype=torch.long)
    for k, sched in enumerate(schedules):
        index[k, :len(sched)] = sched
    weight = (index >= 0).float()
    index = torch.where(index >= 0, index, 0) + torch.tensor(offsets[:-1])[:, None, None]  # padding: a real sample, weighted 0
    index, weight = index.transpose(0, 1).contiguous().to(device), weight.transpose(0, 1).contiguous().to(device)

    forward = stacked_forward(model) or vmap(lambda p, xb: functional_call(model, p, (xb,)))
    penalties = vmap(penalty) if penalty is not None else None

    def client_losses(xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each client's loss on its batch: [G]."""
        logits = forward(params, xb)
        per_sample = sample_loss(logits.flatten(0, 1), yb.flatten()).view(wb.shape)
        losses = (per_sample * wb).sum(1) / counts.clamp(min=1.0)
        return losses + penalties(params) if penalties is not None else losses

    buffers: dict[str, torch.Tensor] = {}
    total = torch.zeros(g, dtype=torch.float64, device=device)
    model.train()
    for t in range(t_max):
        wb = weight[t]
        counts = wb.sum(1)
        active = (counts > 0).to(wb.dtype)
        losses = client_losses(x[index[t]], y[index[t]], wb, counts)
        grads = torch.autograd.grad(losses.sum(), [params[n] for n in trainable])
        with torch.no_grad():
            total += losses.detach().double() * counts.double()
            for n, grad in zip(trainable, grads):
                p = params[n]
                shape = (g,) + (1,) * (p.dim() - 1)
                if gradient_shift is not None:
                    grad = grad + gradient_shift[n]
                if decay:
                    grad = grad.add(p, alpha=decay)
                if momentum:
                    buf = buffers.get(n)
                    buf = buffers[n] = torch.clone(grad) if buf is None else buf.mul_(momentum).add_(grad)
                    grad = buf
                p.add_(grad * active.view(shape), alpha=-lr)
                if weight_shift is not None:
                    p.add_(weight_shift[n] * active.view(shape), alpha=-lr)
    states, stats = [], []
    final = {n: p.detach().cpu() for n, p in params.items()}
    frozen = [n for n in model.state_dict() if n not in params]  # non-trainable: as they started
    for k in range(g):
        states.append({**{n: final[n][k].clone() for n in final}, **{n: start[n].to("cpu", copy=True) for n in frozen}})
        count = int(weight[:, k].sum())
        stats.append({"loss": float(total[k]) / max(count, 1), "steps": n_steps[k], "lr": lr})
    return states, stats
