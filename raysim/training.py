"""Local training, evaluation and weight averaging: the pieces algorithms share.

Nothing here knows an algorithm: `local_sgd` takes the loss as a function, so FedProx,
MOON, FedRS, ... change the loss, not the loop.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from raysim.contract import Client, ClientResult
from raysim.wire import Lines, Packed
from raysim.seeds import seed_for  # noqa: F401  (raysim.training.seed_for: where algorithms import it from)

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def cross_entropy_per_sample(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)_y per sample, as logsumexp - the label's logit: F.cross_entropy's
    value up to float rounding, 3x faster on CPU for few classes (its log_softmax over a last
    dimension of 10 took 0.8 ms for 5,000 samples, logsumexp 0.25 ms)."""
    return torch.logsumexp(logits, 1) - logits.gather(1, y[:, None]).squeeze(1)


def focal_per_sample(gamma: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """-(1 - p_y)^gamma log p_y for each sample (Lin et al. 2017); gamma = 0 is cross-entropy.
    Below gamma = 1 the derivative of x^gamma is infinite at x = 0, and float32 rounds p_y to
    exactly 1 for a sample fitted well enough: its gradient was inf x 0 = NaN and the run
    diverged (Fed-Focal at gamma 0.5, Dir(0.1) seed 1, round 18). There 1 - p_y is held at
    float32's smallest normal number, which changes no value (1 - p_y is 0 or >= 2^-24) and
    gives such a sample the zero gradient it has in the limit; gamma >= 1 is as before."""
    tiny = torch.finfo(torch.float32).tiny

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits, dim=1).gather(1, y[:, None]).squeeze(1)
        rest = 1 - logp.exp()
        if gamma < 1:
            rest = rest.clamp_min(tiny)
        return -rest ** gamma * logp

    return loss


def focal_loss(gamma: float) -> LossFn:
    """Focal loss: the batch mean of `focal_per_sample`. Any algorithm can train with it
    (`local_loss`); Fed-Focal is FedAvg with it."""
    per_sample = focal_per_sample(gamma)
    return lambda model, x, y: per_sample(model(x), y).mean()


def base_loss(local: DictConfig) -> LossFn:
    """The plain local loss: cross-entropy, or the focal loss with `local.focal_gamma > 0`."""
    gamma = float(local.get("focal_gamma", 0.0))
    return focal_loss(gamma) if gamma > 0 else cross_entropy


def base_sample_loss(local: DictConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`base_loss` per sample, from the logits (vectorised cohorts mask and sum it)."""
    gamma = float(local.get("focal_gamma", 0.0))
    return focal_per_sample(gamma) if gamma > 0 else cross_entropy_per_sample


def tau_normalised(model: torch.nn.Module, tau: float) -> torch.nn.Module:
    """A copy of `model` whose classifier rows are w_c / ||w_c||^tau (tau-normalisation, Kang
    et al. 2020: balances the class weights a long tail skews; the bias is kept). tau = 1:
    unit-norm rows; 0: the model itself."""
    import copy

    if not tau:
        return model
    out = copy.deepcopy(model)
    with torch.no_grad():
        w = out.head.weight
        w.div_(torch.linalg.vector_norm(w, dim=1, keepdim=True).clamp(min=1e-12) ** tau)
    return out


def round_lr(local: DictConfig, rnd: int) -> float:
    return float(local.lr) * float(local.lr_decay) ** (rnd - 1)


def _has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


class SGD:
    """SGD with momentum and weight decay, step for step the same arithmetic as
    `torch.optim.SGD` (dampening 0, no Nesterov) on CPU. Hand-written because the first
    `torch.optim` step imports torch._dynamo (and triton): ~150 MB more in every client
    actor, for nothing a client actor needs."""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list = [None] * len(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if self.weight_decay:
                g = g.add(p, alpha=self.weight_decay)
            if self.momentum:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = torch.clone(g).detach()
                else:
                    buf.mul_(self.momentum).add_(g)
                g = buf
            p.add_(g, alpha=-self.lr)


def clipped(grads: list, max_norm) -> list:
    """`grads` scaled as `torch.nn.utils.clip_grad_norm_` scales a model's (total norm at most
    `max_norm`; None: as they are), for a gradient that is no model's `.grad` (APFL's v,
    pFedMe's theta: `local.clip_grad_norm` clips every step a client takes)."""
    if max_norm is None:
        return grads
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    scale = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    return [g * scale for g in grads]


def local_sgd(client: Client, model: torch.nn.Module, loss_fn: LossFn = cross_entropy,
              epochs: Optional[int] = None, steps: Optional[int] = None,
              on_gradients: Optional[Callable[[], None]] = None,
              after_step: Optional[Callable[[], None]] = None, lr: Optional[float] = None,
              batch_size: Optional[int] = None, momentum: Optional[float] = None,
              weight_decay: Optional[float] = None) -> dict:
    """SGD on the client's data per `cfg.local` (lr with per-round decay, momentum, weight
    decay, batch size; `steps` > 0 replaces epochs; epochs default to `client.epochs`,
    which differs from `local.epochs` for stragglers). Batches come from the client's
    generator, so the result depends only on (seed, round, client id). `on_gradients`
    runs between backward and the step (SCAFFOLD corrects the gradients there),
    `after_step` after each step (NIID-Bench's SCAFFOLD corrects the weights there).
    `privacy.mode=local`: DP-SGD instead (dp_sgd.py; the config admits only
    algorithms whose loss is a per-sample mean and that pass neither hook). `lr` replaces
    the round's lr (FedBABU's fine-tuning), `batch_size` `local.batch_size` (Per-FedAvg
    splits each batch into its inner and outer ones), `momentum` and `weight_decay` the
    config's (Per-FedAvg's meta step is plain SGD). `local.clip_grad_norm`: each step's
    gradient (after `on_gradients`) clipped to that norm (FedDyn's authors clip every method at 10).
    Returns {"loss": mean training loss, "steps": number of SGD steps, "lr": the lr used}."""
    loc = client.cfg.local
    epochs = client.epochs if epochs is None else epochs
    steps = int(loc.steps) if steps is None else steps
    lr = round_lr(loc, client.round) if lr is None else lr
    if client.cfg.privacy.mode == "local":  # DP-SGD through Opacus (raysim/dp_sgd.py)
        from raysim.dp_sgd import private_sgd

        return private_sgd(client, model, loss_fn, epochs, steps, lr)
    opt = SGD(model.parameters(), lr=lr, momentum=float(loc.momentum if momentum is None else momentum),
              weight_decay=float(loc.weight_decay if weight_decay is None else weight_decay))
    n, bs = client.num_samples, int(loc.batch_size if batch_size is None else batch_size)
    clip = None if loc.get("clip_grad_norm") is None else float(loc.clip_grad_norm)
    skip_single = _has_batchnorm(model) and n > 1  # BatchNorm cannot train on a batch of one
    model.train()
    total, count, done = 0.0, 0, 0
    while True:
        perm = torch.randperm(n, generator=client.generator).to(client.x.device)
        for start in range(0, n, bs):
            idx = perm[start:start + bs]
            if skip_single and len(idx) == 1:
                continue
            opt.zero_grad()
            xb = client.x[idx]
            if client.transform is not None:
                xb = client.transform(xb, client.generator)
            loss = loss_fn(model, xb, client.y[idx])
            loss.backward()
            if on_gradients is not None:
                on_gradients()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if after_step is not None:
                after_step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
            done += 1
            if steps and done >= steps:
                return {"loss": total / max(count, 1), "steps": done, "lr": lr}
        epochs -= 1
        if not steps and epochs <= 0:
            return {"loss": total / max(count, 1), "steps": done, "lr": lr}


def train_linear(head: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, batch_size: int,
                 generator: torch.Generator) -> torch.nn.Linear:
    """`steps` steps of plain SGD on the mean cross-entropy of the linear layer `head` on
    (x, y), minibatches drawn without replacement from `generator` (a new permutation per
    pass, the last partial batch kept): a classifier re-trained on server-side features
    (CReFF's federated features, CCVR's virtual ones). The gradient in closed form,
    (softmax - one-hot)^T x / B and its column mean for the bias: autograd's up to float
    rounding, 2.5x faster for the reference's 9,600 steps a round."""
    w, b = head.weight.detach(), head.bias.detach()  # updated in place: the head's own tensors
    eye = torch.eye(w.shape[0], dtype=w.dtype, device=w.device)
    n = len(y)
    perm, at = torch.randperm(n, generator=generator), 0
    with torch.no_grad():
        for _ in range(steps):
            if at >= n:
                perm, at = torch.randperm(n, generator=generator), 0
            idx = perm[at:at + batch_size].to(x.device)
            at += batch_size
            xb = x[idx]
            delta = torch.softmax(torch.addmm(b, xb, w.T), dim=1)
            delta -= eye[y[idx]]
            delta /= len(idx)
            w.sub_(delta.T @ xb, alpha=lr)
            b.sub_(delta.sum(0), alpha=lr)
    return head


def effective_steps(steps: int, momentum: float) -> float:
    """How many plain-SGD steps `steps` heavy-ball steps amount to (FedNova's a_i):
    (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho); = tau when rho = 0. x - y is about
    lr * effective_steps * (mean gradient) after a run of local SGD."""
    if momentum == 0:
        return float(steps)
    rho = float(momentum)
    return (steps - rho * (1 - rho ** steps) / (1 - rho)) / (1 - rho)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
             batch_size: int = 1024) -> dict:
    """Accuracy, mean cross-entropy and per-class accuracy of `model` on (x, y)."""
    model.eval()
    correct = torch.zeros(num_classes, dtype=torch.long)
    seen = torch.zeros(num_classes, dtype=torch.long)
    loss = 0.0
    for start in range(0, len(y), batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        out = model(xb)
        loss += float(F.cross_entropy(out, yb, reduction="sum"))
        hit = (out.argmax(1) == yb).cpu()
        yb = yb.cpu()
        correct += torch.bincount(yb[hit], minlength=num_classes)
        seen += torch.bincount(yb, minlength=num_classes)
    n = max(int(seen.sum()), 1)
    per_class = (correct.double() / seen.clamp(min=1).double()).tolist()
    return {"accuracy": float(correct.sum()) / n, "loss": loss / n, "per_class_accuracy": per_class}


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the model's weights and buffers, for upload or broadcast."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class WeightedMean:
    """Running sample-weighted mean of state dicts, fed in a fixed order (client id), so the
    sum is bit-for-bit reproducible. Holds one accumulator: O(model) memory.
    Integer buffers (e.g. BatchNorm's num_batches_tracked) take the largest value."""

    def __init__(self):
        self.acc: Optional[dict[str, torch.Tensor]] = None
        self.total = 0.0
        self._term: Optional[torch.Tensor] = None  # float64 scratch for v.double() * weight

    def add(self, state: dict[str, torch.Tensor], weight: float) -> None:
        """acc += v.double() * weight, entry by entry. The term is made in a scratch buffer
        kept for the whole fold, not allocated per entry: the same bits, and on the server's
        CPU the fresh float64 buffers' page faults were most of a big model's fold."""
        if self.acc is None:
            self.acc = {k: (v.double() * weight if v.is_floating_point() else v.clone()) for k, v in state.items()}
        else:
            for k, v in state.items():
                if v.is_floating_point():
                    self.acc[k].add_(self._product(v, weight))
                else:
                    self.acc[k] = torch.maximum(self.acc[k], v)
        self.total += weight

    def _product(self, v: torch.Tensor, weight: float) -> torch.Tensor:
        """v.double() * weight, in the scratch buffer (valid until the next call)."""
        if self._term is None or self._term.numel() < v.numel() or self._term.device != v.device:
            self._term = torch.empty(max(v.numel(), max(t.numel() for t in self.acc.values())), dtype=torch.float64,
                                     device=v.device)
        return self._term[:v.numel()].view(v.shape).copy_(v).mul_(weight)

    def add_sum(self, sums: dict[str, torch.Tensor], weight: float) -> None:
        """Fold another running sum (`acc` of a WeightedMean over clients weighing `weight`
        in all): a partial sum made where the clients ran (`partial_sum`)."""
        if self.acc is None:
            self.acc = {k: v.clone() for k, v in sums.items()}
        else:
            for k, v in sums.items():
                self.acc[k] = self.acc[k] + v if v.is_floating_point() else torch.maximum(self.acc[k], v)
        self.total += weight

    def result(self, like: dict[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        """The mean, cast to the dtypes of `like`; None when nothing was added."""
        if self.acc is None or self.total <= 0:
            return None
        return {k: (v / self.total).to(like[k].dtype) if like[k].is_floating_point() else v.to(like[k].dtype)
                for k, v in self.acc.items()}


class GroupWeightedMean:
    """Running mean of state dicts with per-parameter-group weights: the rows (dim 0) of the
    entries in `row_groups` ({state key: group id of each row}) belong to parameter groups,
    and each client weighs each group by its own weight; every other entry is shared and
    weighted by the client's `shared` weight (FedAvg's sample count). A row no client
    weighs (total weight 0) keeps its value in `like`. Fed2's feature paired averaging is
    this with group weights = the client's samples of the group's classes; any algorithm
    that averages parts of a model over different clients (per-class heads, per-cluster
    blocks) can use it. Fed in client-id order: bit-for-bit reproducible."""

    def __init__(self, row_groups: dict[str, torch.Tensor]):
        self.row_groups = row_groups
        self.acc: dict[str, torch.Tensor] = {}
        self.den: dict[str, torch.Tensor] = {}
        self.total = 0.0  # summed shared weight

    def add(self, state: dict[str, torch.Tensor], shared: float, group_weights) -> None:
        gw = torch.as_tensor(np.asarray(group_weights, dtype=np.float64))
        for k, v in state.items():
            if not v.is_floating_point():  # counters: the largest, as WeightedMean
                self.acc[k] = torch.maximum(self.acc[k], v) if k in self.acc else v.clone()
                continue
            if k in self.row_groups:
                w = gw[self.row_groups[k]].reshape(-1, *[1] * (v.dim() - 1))
            else:
                w = torch.tensor(float(shared), dtype=torch.float64)
            term = v.double() * w
            self.acc[k] = self.acc[k] + term if k in self.acc else term
            self.den[k] = self.den[k] + w if k in self.den else w
        self.total += float(shared)

    def result(self, like: dict[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        """The mean, cast to `like`'s dtypes; None when nothing was added."""
        if not self.acc or self.total <= 0:
            return None
        out = {}
        for k, v in self.acc.items():
            if k not in self.den:
                out[k] = v.to(like[k].dtype)
                continue
            den = self.den[k].expand_as(v)
            mean = torch.where(den > 0, v / den.clamp_min(1e-300), like[k].double())
            out[k] = mean.to(like[k].dtype)
        return out


def client_lines(results: list[ClientResult]) -> Lines:
    """Each folded client's (cid, num_samples, metrics, state_changed), as the wire passes
    them unwalked."""
    return Lines((r.cid, r.num_samples, r.metrics, r.state_changed) for r in results)


def partial_sum(results: list[ClientResult]) -> ClientResult:
    """One block's results folded where they ran (`server.partial_sums`): the sample-weighted
    sum of their updates (float64), their samples' total, their sample-weighted mean loss,
    and each client's own line (`ClientResult.clients`). Folded in client-id order, like the
    server's running sum, so a block's sum does not depend on which actor made it."""
    mean, loss = WeightedMean(), 0.0
    for r in results:
        mean.add(r.update, r.num_samples)
        loss += r.metrics["loss"] * r.num_samples
    return ClientResult(results[0].cid, int(mean.total), mean.acc, {"loss": loss / mean.total if mean.total else 0.0},
                        clients=client_lines(results))


def pairwise_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 in one fixed order: adjacent pairs of rows added level by level (an
    odd last row carried up), in place in `t` (which it overwrites). Elementwise adds only, so
    the bits are the same on any device and any number of threads; log2(G) kernel launches
    instead of G, and no memory beyond `t`."""
    step = 1
    while step < t.shape[0]:
        live = t[::step]  # the partial sums of this level: rows 0, step, 2 step, ...
        even = live.shape[0] - live.shape[0] % 2
        live[0:even:2].add_(live[1:even:2])
        step *= 2
    return t[0]


def stack_updates(updates: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-client state dicts stacked into one ({key: [G, ...]}), for `stacked_sum`."""
    return {k: torch.stack([u[k] for u in updates]) for k in updates[0]}


SUM_CHUNK = 2**21  # float64 elements of scratch a group's sum works in (16 MB): bounded whatever the model


def stacked_sum(update: dict[str, torch.Tensor], results: list[ClientResult]) -> ClientResult:
    """A vectorised group's results folded where they trained: `update` holds the clients'
    models stacked ({key: [G, ...]}, on their device), `results` each client's line. The
    sample-weighted float64 sum (`pairwise_sum` of n_k w_k; integer entries: the largest, as
    `WeightedMean`), computed on the device and moved to the CPU once, with the clients'
    total samples, mean loss and lines: what `partial_sum` gives, in `pairwise_sum`'s order.

    It works through the columns in chunks of at most `SUM_CHUNK` float64 values, in one
    scratch buffer the process keeps (on CPU, filling a fresh 61 MB float64 buffer took 32 ms
    of page faults, a kept one 4.6 ms; the CNN's 1,000-client group sums fell from 0.17 s to
    0.035 s; CUDA's allocator caches by itself)."""
    first = next(iter(update.values()))
    g, device = first.shape[0], first.device
    n = torch.tensor([r.num_samples for r in results], dtype=torch.float64, device=device).view(-1, 1)
    width = max(1, SUM_CHUNK // g)
    scratch = _scratch(g * min(width, max(v[0].numel() for v in update.values())), device)
    sums = {}
    for k, v in update.items():
        if not v.is_floating_point():
            sums[k] = v.amax(0).cpu()
            continue
        flat, out = v.reshape(g, -1), torch.empty(v[0].numel(), dtype=torch.float64, device=device)
        for a in range(0, flat.shape[1], width):
            part = flat[:, a:a + width]
            buf = scratch[:part.numel()].view(g, -1)
            buf.copy_(part).mul_(n)  # v.double() * n, exactly
            out[a:a + part.shape[1]] = pairwise_sum(buf)
        sums[k] = out.view(v.shape[1:]).cpu()
    total = sum(r.num_samples for r in results)
    loss = sum(r.metrics["loss"] * r.num_samples for r in results)
    return ClientResult(results[0].cid, int(total), sums, {"loss": loss / total if total else 0.0},
                        clients=client_lines(results))


_SCRATCH: dict = {}


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    """A float64 buffer of at least `numel` values, kept between calls on the CPU."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=torch.float64, device=device)
    buf = _SCRATCH.get("cpu")
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH["cpu"] = torch.empty(numel, dtype=torch.float64)
    return buf


def parameter_names(model: torch.nn.Module) -> set[str]:
    """State-dict keys of the model's trainable parameters. Every other entry is a buffer
    (BatchNorm running statistics, counters): a server rule that is not a plain average
    (momentum, normalisation, control variates) applies to parameters only, and buffers
    take the plain sample-weighted mean (see `WeightedMean`), so that a running variance
    stays a variance."""
    return {name for name, p in model.named_parameters() if p.requires_grad}


def nbytes(obj) -> int:
    """Bytes of the tensors and arrays inside a (nested) payload: communication accounting."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, Packed):  # a tensor on the wire (raysim/wire.py)
        return obj.array.nbytes
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    size = getattr(obj, "nbytes", None)  # an encoded update (raysim/compression/uplink.py) says its own
    return size if isinstance(size, int) else 0


def new_client(cfg, rnd: int, cid: int, x: torch.Tensor, y: torch.Tensor, num_classes: int, state: dict,
               model: torch.nn.Module, epochs: int, transform=None, seed: Optional[int] = None,
               client_seed: Optional[int] = None, seed_torch: bool = True) -> Client:
    """Client `cid` in round `rnd` as its code sees it, wherever it runs (a client actor, or
    raysim.testing's in-process server): its data, its state, and every random draw seeded
    from (seed, round, cid): torch's default generator and the client's own generator.
    `seed`: the run's seed, if the caller has it at hand (reading cfg.seed costs ~25 us);
    `client_seed`: seed_for(seed, rnd, cid) when the caller made it already (a vectorised
    group's, `seeds.seeds_for`). `seed_torch` False: torch's default generator is left as it is
    (a vectorised group seeds it once, for its last client, as building its clients in turn would
    leave it)."""
    seed = seed_for(int(cfg.seed) if seed is None else seed, rnd, cid) if client_seed is None else int(client_seed)
    if seed_torch:
        torch.random.default_generator.manual_seed(seed)  # torch.manual_seed also walks CUDA: slow
        if x.device.type == "cuda":
            torch.cuda.manual_seed(seed)
    return Client(cid=cid, round=rnd, cfg=cfg, x=x, y=y, num_classes=num_classes, device=x.device,
                  generator=torch.Generator().manual_seed(seed), state=state, model=model, epochs=epochs,
                  transform=transform)


def personalise(algorithm, client: Client, payload, lr_scale: float = 1.0, steps: int = 0) -> ClientResult:
    """The client's own model for personalised evaluation (runtime/personal_eval.py), as a
    state dict of the served model's shape: the served model (`payload["weights"]`), made the
    client's by the algorithm's `make_personal`, then fine-tuned `finetune_epochs(cfg)` epochs
    on the client's training data with a random stream of its own, at `lr_scale` times the
    round's lr (`steps` > 0: that many steps instead, Per-FedAvg's one-step adaptation).
    `client.state` is left as it was: evaluation does not train the client. An algorithm may define its own
    `personalise` (contract.Algorithm)."""
    model = client.model
    model.load_state_dict(payload["weights"])
    algorithm.make_personal(client, model, payload)
    stats, epochs = {}, int(algorithm.finetune_epochs(client.cfg))
    if epochs > 0 or steps > 0:
        client.generator.manual_seed(seed_for(int(client.cfg.seed), client.round, client.cid, 44))
        stats = local_sgd(client, model, base_loss(client.cfg.local), epochs=epochs, steps=steps,
                          lr=round_lr(client.cfg.local, client.round) * lr_scale)
    return ClientResult(client.cid, client.num_samples, cpu_state(model), stats)


def client_method(plugin, method: str) -> Callable:
    """The plugin's client method `method` (what `server.run_clients(..., method=)` names);
    `personalise` falls back to `training.personalise`."""
    if method == "personalise" and not hasattr(plugin, "personalise"):
        return lambda client, payload: personalise(plugin, client, payload)
    return getattr(plugin, method)
