"""Vectorised cohorts (`local.vectorize=true`): local SGD of a group of clients as one
batched program, instead of one client after another.

Small models (MCLR, MLPs, the simple CNN) spend most of a client step in Python and
dispatch, not arithmetic; training G clients at once pays that once per step for all G.
`torch.func.vmap` over `torch.func.functional_call` runs the model with G stacked copies
of its weights (leading dimension: the client), each on its own batch; a model made only of
Flatten / Linear / ReLU (MCLR, the MLPs) skips vmap's per-call cost and runs as batched
matmuls (`stacked_forward`). Either way:

- every client starts from the weights `start` (a state dict), draws its batches from its own generator exactly as `training.local_sgd` does (the same
  permutations, the same order), and takes its own number of steps (stragglers, unequal
  data): a client that has finished is masked (its weights stop changing) and a short last
  batch is padded with masked samples, never with made-up data;
- the optimizer is `training.SGD`'s arithmetic (weight decay, heavy-ball momentum) on the
  stacked tensors;
- gradients come from one backward pass over the sum of the clients' losses: client k's
  loss depends only on its own weights, so d(sum)/dw_k = dL_k/dw_k. (`torch.func.grad`
  would give the same, but it imports torch._dynamo: ~120 MB more in every actor.)

Results equal the sequential path up to float rounding (a batch's loss is a masked sum
over a count instead of a mean, cross-entropy is taken through logsumexp, and batched
kernels add in another order); tested for FedAvg, FedProx and SCAFFOLD. Through ReLUs a
rounding difference can grow: a unit whose input is within rounding of 0 may be on one
side here and the other there, and the runs then part by its gradient (issue 86: ~5e-4 in
3 rounds; benchmarks/vectorized_drift.py), as the same run on two processors does. A Flatten/Linear/
ReLU model under plain cross-entropy takes its gradients by hand (`cross_entropy_grads`:
softmax minus one-hot, back through the layers), not through autograd: a third less time
a step for such small models (issue 73), equal to autograd's up to rounding (tested). A group's result
depends only on its clients, and groups are cut from the sorted cohort by client id
(`runtime.placement.plan`), never by actor, so any number of actors gives the same bits.

What is around the arithmetic is batched too (issue 41: on a GPU the per-client parts left
it mostly idle): the client actor gathers and decodes a group's samples once (`Cohort`),
the trained weights stay stacked (`CohortResult`, on the device), and when the run folds
its clients' models by the plain weighted mean the group is sent as one float64 sum made
where it trained (`training.stacked_sum`); per-client state dicts are cut only for an
algorithm or an attack that needs each one.

Not supported, refused when the config is checked: models with buffers (BatchNorm's
running statistics are updated in place, which vmap cannot do per client) and batch
augmentation (its random draws interleave with the batch order).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from raysim.contract import Client, ClientResult, CohortResult
from raysim.training import round_lr, stack_updates, stacked_sum

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

    def forward(params: dict, x: torch.Tensor, kept: Optional[list] = None) -> torch.Tensor:
        for op, prefix in ops:
            if kept is not None:
                kept.append(x)  # each op's input, for `cross_entropy_grads`
            if op == "flatten":
                x = x.flatten(2)
            elif op == "relu":
                x = torch.relu(x)
            else:
                w, b = params[prefix + "weight"].transpose(1, 2), params.get(prefix + "bias")
                x = torch.bmm(x, w) if b is None else torch.baddbmm(b.unsqueeze(1), x, w)
        return x

    forward.ops = ops
    return forward


def cross_entropy_grads(forward, params: dict, xb: torch.Tensor, yb: torch.Tensor,
                        scale: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """For a `stacked_forward` model under plain cross-entropy: each client's batch loss,
    sum_b scale[g, b] * CE(x[g, b], y[g, b]) ([G]), and its gradients ({name: [G, ...]}),
    by hand: d loss / d logits = scale * (softmax - onehot), then back through the Linear
    and ReLU layers. What autograd gives up to float rounding (tested), in 2/3 of the time
    for the small models this path serves (1,000 logistic-regression clients a round, issue
    73: autograd's graph and the softmax it builds cost more than the matmuls)."""
    kept: list = []
    logits = forward(params, xb, kept)
    # one exp for both the loss and the softmax: logsumexp and then exp(logits - lse) took 0.28 ms
    # of a 1.2 ms step for 500 clients, this 0.20 (torch's softmax / log_softmax over 10 classes: 0.8)
    top = logits.amax(2, keepdim=True)
    g = (logits - top).exp_()
    total = g.sum(2, keepdim=True)
    picked = logits.gather(2, yb.unsqueeze(2))
    scale = scale.unsqueeze(2)
    g.mul_(scale / total)  # scale * softmax
    losses = ((total.log_().add_(top) - picked) * scale).sum((1, 2))  # scale * (logsumexp - picked logit)
    g.scatter_add_(2, yb.unsqueeze(2), -scale)  # scale * (softmax - onehot)
    grads: dict = {}
    first = next(i for i, (op, _) in enumerate(forward.ops) if op == "linear")  # below it, no gradient is needed
    for i in range(len(forward.ops) - 1, first - 1, -1):
        (op, prefix), a = forward.ops[i], kept[i]
        if op == "flatten":
            g = g.reshape(a.shape)
        elif op == "relu":
            g = g * (a > 0)
        else:
            grads[prefix + "weight"] = torch.bmm(g.transpose(1, 2), a)
            if prefix + "bias" in params:
                grads[prefix + "bias"] = g.sum(1)
            if i > first:
                g = torch.bmm(g, params[prefix + "weight"])
    return losses, grads


class Cohort(list):
    """A vectorised group's clients in client-id order, with all their samples as one tensor
    each (`x`, `y`: client after client; each client's own `x` and `y` are views of them).
    The client actor builds it with one gather and one decode for the group instead of one
    per client; `cohort_sgd` takes a plain list too (it concatenates the clients' data)."""

    def __init__(self, clients: list[Client], x: torch.Tensor, y: torch.Tensor):
        super().__init__(clients)
        self.x, self.y = x, y


def batch_schedule(n: int, batch_size: int, epochs: int, steps: int, generator: torch.Generator,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The index batches `training.local_sgd` draws for a client with n samples (a new
    permutation per epoch; `steps` > 0 steps instead of `epochs` epochs), as a [steps,
    batch_size] tensor whose short last batches are padded with -1. `out`: a [>= steps,
    batch_size] tensor filled with -1 to write them into (rows past the client's steps stay -1)."""
    per_epoch = -(-n // batch_size)
    n_epochs = -(-steps // per_epoch) if steps else epochs
    n_steps = min(steps, n_epochs * per_epoch) if steps else n_epochs * per_epoch
    if out is None:
        out = torch.full((n_steps, batch_size), -1, dtype=torch.long)
    flat = out.view(-1)
    for e in range(n_epochs):
        at = e * per_epoch * batch_size
        room = n_steps * batch_size - at
        perm = torch.randperm(n, generator=generator)  # drawn whole, as local_sgd draws it, even where cut short
        flat[at:at + min(n, room)] = perm[:room]
    return out[:n_steps]


def stack_batches(clients: list[Client], batch_size: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every client's batches as rows into the group's samples: index [T, G, B] (padding points
    at a real sample) and weight [T, G, B] (1 a sample, 0 padding), on the clients' device;
    and each client's number of steps."""
    g = len(clients)
    per = [(c.num_samples, -(-c.num_samples // batch_size)) for c in clients]
    n_steps = [steps or c.epochs * pe for c, (_, pe) in zip(clients, per)]
    same = not steps and len({(n, c.epochs) for (n, _), c in zip(per, clients)}) == 1
    if same:  # every client the same size and epochs: its permutations drawn as batch_schedule draws them, stacked
        (n, per_epoch), epochs = per[0], clients[0].epochs
        perms = torch.stack([torch.randperm(n, generator=c.generator) for c in clients for _ in range(epochs)])
        if n == per_epoch * batch_size:  # no short batch: nothing to pad or mask
            index = (perms.view(g, -1) + torch.arange(0, g * n, n)[:, None]).view(g, n_steps[0], batch_size)
            device = clients[0].device
            return (index.transpose(0, 1).contiguous().to(device),
                    torch.ones(n_steps[0], g, batch_size, device=device), n_steps)
        index = torch.full((g * epochs, per_epoch * batch_size), -1, dtype=torch.long)
        index[:, :n] = perms
        index = index.view(g, epochs * per_epoch, batch_size)
    else:
        index = torch.full((g, max(n_steps), batch_size), -1, dtype=torch.long)
        for k, c in enumerate(clients):
            batch_schedule(c.num_samples, batch_size, c.epochs, steps, c.generator, out=index[k])
    weight = (index >= 0).float()
    offsets = torch.tensor([0] + [n for n, _ in per[:-1]]).cumsum(0)
    index = torch.where(index >= 0, index, 0) + offsets[:, None, None]
    device = clients[0].device
    return index.transpose(0, 1).contiguous().to(device), weight.transpose(0, 1).contiguous().to(device), n_steps


def stacked_sgd(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                index: torch.Tensor, weight: torch.Tensor, sample_loss: SampleLoss, lr: float, momentum: float = 0.0,
                weight_decay: float = 0.0, penalty: Optional[Callable[[dict], torch.Tensor]] = None,
                gradient_shift: Optional[dict[str, torch.Tensor]] = None,
                weight_shift: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
    """The arithmetic alone: SGD steps on G clients' stacked trainable weights `params`
    ({name: [G, ...]}, updated in place), step t of client k on the samples
    x[index[t, k]] weighted by weight[t, k]; a client with no sample in a step is masked.
    Returns each client's training loss summed over its samples (float64, [G])."""
    from torch.func import functional_call, vmap

    g, bs = index.shape[1], index.shape[2]
    names = list(params)
    by_hand = stacked_forward(model)
    forward = by_hand or vmap(lambda p, xb: functional_call(model, p, (xb,)))
    from raysim.training import cross_entropy_per_sample

    by_hand = by_hand if (by_hand is not None and sample_loss is cross_entropy_per_sample and penalty is None
                          and set(names) == {n for _, prefix in by_hand.ops if prefix for n in
                                             (prefix + "weight", prefix + "bias") if n in params}) else None
    penalties = vmap(penalty) if penalty is not None else None
    samples = weight.sum(2)  # [T, G]
    active = (samples > 0).to(weight.dtype)
    counts = samples.clamp(min=1.0)
    samples = samples.double()
    shapes = {n: (g,) + (1,) * (p.dim() - 1) for n, p in params.items()}
    buffers: dict[str, torch.Tensor] = {}
    total = torch.zeros(g, dtype=torch.float64, device=x.device)
    model.train()
    everyone = (active > 0).all(1).tolist()  # steps where no client is masked: no mask to multiply by
    for t in range(index.shape[0]):
        rows, wb = index[t].view(-1), weight[t]
        # index_select: ~5x x[rows]'s speed on CPU; numpy's take, faster alone on a warm cache, gave
        # no measurable gain in real rounds (issue 73: 5 alternating runs each, within the noise)
        xb = x.index_select(0, rows).view(g, bs, *x.shape[1:])
        if by_hand is not None:  # plain cross-entropy through Linear / ReLU layers: gradients by hand
            with torch.no_grad():
                losses, by_name = cross_entropy_grads(by_hand, params, xb, y.index_select(0, rows).view(g, bs),
                                                      wb / counts[t].unsqueeze(1))
            grads = [by_name[n] for n in names]
        else:
            logits = forward(params, xb)
            per_sample = sample_loss(logits.flatten(0, 1), y.index_select(0, rows)).view(g, bs)
            losses = (per_sample * wb).sum(1) / counts[t]
            if penalties is not None:
                losses = losses + penalties(params)
            grads = torch.autograd.grad(losses.sum(), [params[n] for n in names])
        with torch.no_grad():
            total += losses.detach().double() * samples[t]  # the penalty counts in the reported loss, as local_sgd's
            step = None if everyone[t] else active[t]
            for n, grad in zip(names, grads):
                p = params[n]
                if gradient_shift is not None:
                    grad = grad + gradient_shift[n]
                if weight_decay:
                    grad = grad.add(p, alpha=weight_decay)
                if momentum:
                    buf = buffers.get(n)
                    buf = buffers[n] = torch.clone(grad) if buf is None else buf.mul_(momentum).add_(grad)
                    grad = buf
                p.add_(grad if step is None else grad * step.view(shapes[n]), alpha=-lr)
                if weight_shift is not None:
                    p.add_(weight_shift[n] if step is None else weight_shift[n] * step.view(shapes[n]), alpha=-lr)
    return total


def cohort_sgd(clients: list[Client], model: torch.nn.Module, start: dict, sample_loss: SampleLoss,
               penalty: Optional[Callable[[dict], torch.Tensor]] = None,
               gradient_shift: Optional[dict[str, torch.Tensor]] = None,
               weight_shift: Optional[dict[str, torch.Tensor]] = None) -> tuple[dict, list[dict]]:
    """Local SGD per `cfg.local` for every client in `clients` at once, on copies of `model`'s
    structure, every client starting from the weights `start` (a state dict). `penalty(params)`: added to a client's batch loss (FedProx's proximal term; under
    vmap, `params` are that client's weights). `gradient_shift[name]` ([G, ...]) is added to
    client k's gradient before the optimizer's step; `weight_shift[name]` ([G, ...]) is
    subtracted, times lr, from its weights after each step (SCAFFOLD's two readings).
    Returns the clients' final state dicts stacked ({name: [G, ...]}, on the clients'
    device; entries that do not train as they started) and each client's stats {"loss",
    "steps", "lr"}, as `local_sgd` returns them."""
    loc = clients[0].cfg.local
    device, g = clients[0].device, len(clients)
    lr = round_lr(loc, clients[0].round)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: start[n].to(device).expand(g, *start[n].shape).clone().requires_grad_() for n in trainable}
    x, y = getattr(clients, "x", None), getattr(clients, "y", None)
    if x is None:  # a plain list: the group's samples, client after client
        x, y = torch.cat([c.x for c in clients]), torch.cat([c.y for c in clients])
    index, weight, n_steps = stack_batches(clients, int(loc.batch_size), int(loc.steps))
    total = stacked_sgd(model, params, x, y, index, weight, sample_loss, lr, float(loc.momentum),
                        float(loc.weight_decay), penalty, gradient_shift, weight_shift)
    state = {n: (params[n].detach() if n in params else v.to(device).expand(g, *v.shape))
             for n, v in start.items()}  # non-trainable entries: as they started
    counts = weight.sum((0, 2)).double().clamp(min=1.0)
    losses = (total / counts).tolist()
    return state, [{"loss": loss, "steps": s, "lr": lr} for loss, s in zip(losses, n_steps)]


def per_client(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Stacked state dicts ({name: [G, ...]}) cut into G state dicts on the CPU (one transfer
    per entry; each client's own copy)."""
    cpu = {n: v.cpu() for n, v in state.items()}
    g = next(iter(cpu.values())).shape[0]
    return [{n: v[k].clone() for n, v in cpu.items()} for k in range(g)]


def cohort_result(clients: list[Client], state: dict[str, torch.Tensor], stats: list[dict]) -> CohortResult:
    """A group's trained models, kept stacked (what FedAvg and the algorithms built on it return)."""
    return CohortResult([c.cid for c in clients], [c.num_samples for c in clients], state, stats)


def unstack(done, summed: bool, attacked: bool) -> tuple[list, Optional[dict]]:
    """A group's results as `client_update_cohort` gave them -> (one `ClientResult` per client,
    the stacked models when they stay stacked). A `CohortResult` keeps its models stacked
    where the group is `summed` and no attacker changes its model first; otherwise each
    client's model is cut out. A list passes as it is."""
    if not isinstance(done, CohortResult):
        return done, None
    each = not summed or attacked
    return done.split(updates=each), None if each else done.update


def group_sum(stacked: Optional[dict], results: list[ClientResult]) -> ClientResult:
    """The group's one result: `training.stacked_sum` of the stacked models, or of the
    clients' own (re-stacked: after an attack, or from an algorithm that returned a list)."""
    return stacked_sum(stacked if stacked is not None else stack_updates([r.update for r in results]), results)
