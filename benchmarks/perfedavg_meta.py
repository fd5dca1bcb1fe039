"""Why Per-FedAvg trails FedAvg in the results table's mnist_c2 cell (issue 72): a plain torch
loop, independent of raysim's training code (raysim only makes the data, the #C=2 partition and
the initial CNN), runs FedAvg or first-order Per-FedAvg (Fallah et al. 2020, Algorithm 1: per
meta step a batch of 2 x 32 split into D, D'; w_tmp = w - alpha grad f(w; D); then
w <- w - beta grad f(w_tmp; D')) over the table's mnist_c2 set-up (100 clients, 10 a round,
5 epochs, samples-weighted mean), and every 5 rounds prints, over 20 clients' own test splits:
the served model's accuracy, the accuracy after one SGD step at alpha on a training batch
(Per-FedAvg's personal model; FedAvg's model given the same step), and the meta-training loss
(f(w_tmp; D') for Per-FedAvg, the batch loss for FedAvg).

    python benchmarks/perfedavg_meta.py --algorithm fedavg --alpha 0.1 --rounds 30
    python benchmarks/perfedavg_meta.py --alpha 0.1 --beta 0.1 --rounds 30     # the default grid's alpha = beta = lr
    python benchmarks/perfedavg_meta.py --alpha 0.1 --beta 0.1 --rounds 40 --warm 20   # FedAvg's first 20 rounds
    python benchmarks/perfedavg_meta.py --alpha 0.01 --beta 0.1 --rounds 150   # alpha below beta

Needs the MNIST split (python benchmarks/accuracy_mnist.py --write-split runs/data/mnist-split).
Results: benchmarks/results-perfedavg-mnist-c2.txt.
"""
from __future__ import annotations

import argparse
import copy
import statistics

import numpy as np
import torch
import torch.nn.functional as F

from raysim.config import load_config
from raysim.experiment import prepare
from raysim.models import build_model

SETTING = ("dataset=mnist download=false model=cnn input_scale=unit num_clients=100 participation=0.1 "
           "partition=classes partition.k=2 partition.test_fraction=0.2").split()


def batches(n: int, size: int, generator: torch.Generator) -> list:
    order = torch.randperm(n, generator=generator)
    return [order[i:i + size] for i in range(0, n, size)]


def sgd_step(model, x, y, lr: float) -> float:
    loss = F.cross_entropy(model(x), y)
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return loss.item()


def meta_step(model, x, y, d, d_prime, alpha: float, beta: float) -> float:
    """First-order Per-FedAvg: the gradient at w_tmp = w - alpha grad f(w; D), on D', applied to w."""
    kept = copy.deepcopy(model.state_dict())
    sgd_step(model, x[d], y[d], alpha)
    loss = F.cross_entropy(model(x[d_prime]), y[d_prime])
    model.zero_grad()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.load_state_dict(kept)
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= beta * g
    return loss.item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", choices=("perfedavg", "fedavg"), default="perfedavg")
    ap.add_argument("--alpha", type=float, default=0.1, help="the adaptation step's lr (FedAvg: its lr)")
    ap.add_argument("--beta", type=float, default=0.1, help="the meta step's lr")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warm", type=int, default=0, help="rounds of FedAvg at beta first")
    ap.add_argument("--data-dir", default="runs/data/mnist-split")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(overrides=SETTING + [f"data_dir={args.data_dir}"])
    data, part, classes = prepare(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, data.input_shape, classes)
    x_all = data.inputs(data.x_train) if hasattr(data, "inputs") else torch.from_numpy(data.x_train)
    y_all = torch.from_numpy(data.y_train)
    rng = np.random.default_rng(0)

    def evaluate(weights, clients) -> tuple:
        served, adapted, probe = [], [], copy.deepcopy(model)
        for c in clients:
            probe.load_state_dict(weights)
            train, test = part.train[c], part.test[c]
            with torch.no_grad():
                served.append((probe(x_all[test]).argmax(1) == y_all[test]).float().mean().item())
            b = batches(len(train), 32, torch.Generator().manual_seed(1000 + c))[0]
            sgd_step(probe, x_all[train][b], y_all[train][b], args.alpha)
            with torch.no_grad():
                adapted.append((probe(x_all[test]).argmax(1) == y_all[test]).float().mean().item())
        return statistics.mean(served), statistics.mean(adapted)

    weights = copy.deepcopy(model.state_dict())
    for r in range(1, args.rounds + 1):
        picked = rng.choice(100, 10, replace=False)
        states, sizes, losses = [], [], []
        for c in picked:
            local = copy.deepcopy(model)
            local.load_state_dict(weights)
            x, y = x_all[part.train[c]], y_all[part.train[c]]
            g = torch.Generator().manual_seed(r * 1000 + int(c))
            for _ in range(5):
                if args.algorithm == "fedavg" or r <= args.warm:
                    lr = args.beta if r <= args.warm else args.alpha
                    losses += [sgd_step(local, x[b], y[b], lr) for b in batches(len(y), 32, g)]
                else:
                    for b in batches(len(y), 64, g):
                        d, d_prime = b[:(len(b) + 1) // 2], b[(len(b) + 1) // 2:]
                        losses.append(meta_step(local, x, y, d, d_prime if len(d_prime) >= 2 else d,
                                                args.alpha, args.beta))
            states.append(local.state_dict())
            sizes.append(len(y))
        weights = {k: sum(n * s[k] for n, s in zip(sizes, states)) / sum(sizes) for k in weights}
        if r % 5 == 0:
            served, adapted = evaluate(weights, range(0, 100, 5))
            print(f"{args.algorithm} alpha={args.alpha} beta={args.beta} warm={args.warm} round {r}: "
                  f"training loss {statistics.mean(losses):.3f}, clients' tests: served {served:.3f}, "
                  f"one step {adapted:.3f}", flush=True)


if __name__ == "__main__":
    main()
