"""Why pFedMe's global model stays at chance in the results table's MNIST cells (docs/results.md):
its inner problem, theta <- theta - personal_lr (grad f(theta) + lam (theta - w)), contracts
only along directions whose curvature h keeps |1 - personal_lr (lam + h)| < 1, i.e. h below
2 / personal_lr - lam (7.2 at the authors' MNIST values 0.09 and 15). This prints, for a
results-table cell's config:

- the largest-magnitude Hessian eigenvalue of a client batch's loss (power iteration on
  Hessian-vector products) at the initial model and after `--rounds` FedAvg rounds, over ten
  clients (max, mean): the curvature training reaches;
- one client's local pass done by hand as pFedMe does it (K steps of theta per batch, then
  w <- w - eta lam (w - theta)): per batch f(theta), f(w), ||theta - w|| and ||grad||.

    python benchmarks/pfedme_inner.py --config docs/results/mnist_c2/pfedme.yaml
    python benchmarks/pfedme_inner.py --config docs/results/mnist_c2/pfedme.yaml model=mlp
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.func import functional_call

from raysim.config import load_config
from raysim.testing import InProcessServer


def top_eigenvalue(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, iters: int = 30) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
    v = [torch.randn_like(p) for p in params]
    value = 0.0
    for _ in range(iters):
        norm = torch.sqrt(sum((a * a).sum() for a in v))
        v = [a / norm for a in v]
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
        value = float(sum((a * b).sum() for a, b in zip(hv, v)))
        v = [h.detach() for h in hv]
    return value


def curvature(server: InProcessServer, batch: int) -> tuple[float, float]:
    model = next(iter(server.algorithm.eval_models().values()))
    values = [abs(top_eigenvalue(model, *(t[:batch] for t in server.data[c]))) for c in range(0, server.num_clients,
                                                                                          server.num_clients // 10)]
    return max(values), sum(values) / len(values)


def local_pass(server: InProcessServer, cfg, batches: int) -> None:
    o, eta = cfg.pfedme, float(cfg.local.lr)
    net = server.new_model()
    x, y = server.data[0]
    w = {n: p.detach().clone() for n, p in net.named_parameters()}
    theta = {n: v.clone() for n, v in w.items()}
    order = torch.Generator().manual_seed(0)
    for b in range(batches):
        idx = torch.randperm(len(y), generator=order)[: int(cfg.local.batch_size)]
        for _ in range(int(o.k)):
            t = {n: v.detach().requires_grad_(True) for n, v in theta.items()}
            f = F.cross_entropy(functional_call(net, t, (x[idx],)), y[idx])
            g = torch.autograd.grad(f, list(t.values()))
            theta = {n: (v - float(o.personal_lr) * (gi + float(o.lam) * (v - w[n]))).detach()
                     for (n, v), gi in zip(t.items(), g)}
        gap = float(torch.sqrt(sum(((theta[n] - w[n]) ** 2).sum() for n in w)))
        w = {n: w[n] - eta * float(o.lam) * (w[n] - theta[n]) for n in w}
        fw = float(F.cross_entropy(functional_call(net, w, (x[idx],)), y[idx]))
        print(f"  batch {b}: f(theta) {float(f.detach()):.3f}  f(w) {fw:.3f}  |theta - w| {gap:.3f}  "
              f"|grad| {float(torch.sqrt(sum((a * a).sum() for a in g))):.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--rounds", type=int, default=8, help="FedAvg rounds before the second curvature")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config([args.config], ["seed=0", *args.overrides])
    o = cfg.pfedme
    print(f"{cfg.model}: stable inner steps need curvature < 2/personal_lr - lam = "
          f"{2 / float(o.personal_lr) - float(o.lam):.1f}")
    fedavg = InProcessServer.from_config(load_config([args.config], ["seed=0", "algorithm=fedavg", *args.overrides]))
    fedavg.setup()
    at_init = curvature(fedavg, int(cfg.local.batch_size))
    for r in range(1, args.rounds + 1):
        fedavg.round(r)
    trained = curvature(fedavg, int(cfg.local.batch_size))
    print(f"top |Hessian eigenvalue| of a client batch (max, mean over 10 clients): at init {at_init[0]:.1f}, "
          f"{at_init[1]:.1f}; after {args.rounds} FedAvg rounds {trained[0]:.1f}, {trained[1]:.1f}")
    server = InProcessServer.from_config(cfg)
    print(f"client 0's first {args.batches} batches, by hand as pFedMe trains (eta = local.lr = {cfg.local.lr}):")
    local_pass(server, cfg, args.batches)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
