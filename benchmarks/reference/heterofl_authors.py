"""raysim's HeteroFL beside its authors' server code (diaoenmao/HeteroFL-Computation-and-
Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients, src/fed.py
`Federation.distribute` / `split_model` / `combine`, the `conv` branch, which reads any chain
of layers), round by round (issue 71, item 8).

    python benchmarks/reference/heterofl_authors.py --reference PATH [--rounds 3] \\
        [--record tests/reference/heterofl_authors.json] [raysim overrides ...]

PATH is a checkout of the authors' repository (the project ships no reference code). Their
`Federation` cuts each selected client's sub-model out of the global parameters (leading
units, `fix` mode: a client's rate is raysim's `client_rate`) and combines the trained
sub-models back (each element the mean over the clients holding it; the output layer's rows
only from the clients holding those labels, `label_split`: a client's labels). Their client
step needs their own networks and data loaders, so it is restated here on raysim's
sub-model: their masked loss (the logits of labels the client lacks set to 0, models/conv.py)
with raysim's Scaler (outputs / rate in training, their `Scaler`), plain SGD at
`local.lr` on the batches raysim's client draws. What this checks is the server's cut and
combination and the label mask against theirs; the Scaler and the masked loss are checked by
hand in tests/test_heterofl.py. Models: `mlp` (their `conv` branch treats a weight of two or
more dimensions as a layer whose inputs are the previous layer's outputs, which a Flatten of
channels, as raysim's cnn has, breaks).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from harness import client_batches, commit_of, figures, max_difference, raysim_server, worst_key, write_record  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="a checkout of the HeteroFL authors' repository")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--record", help="write the reference's figures per round to this JSON file")
    ap.add_argument("overrides", nargs="*", help="raysim overrides (dataset, model, clients, local.*)")
    a = ap.parse_args(argv)
    overrides = ["algorithm=heterofl", "heterofl.variant=heterofl", "heterofl.weighting=clients", "heterofl.mask=true",
                 "heterofl.scaler=true", "local.momentum=0", "local.weight_decay=0", *a.overrides]
    server = raysim_server(overrides)
    cfg = server.cfg
    if cfg.model != "mlp":
        raise SystemExit("model=mlp only: the authors' conv branch cannot cut a Flatten of channels")
    src = Path(a.reference).resolve() / "src"
    if not (src / "fed.py").exists():
        raise SystemExit(f"--reference {a.reference}: no src/fed.py; point it at the HeteroFL authors' checkout")
    from raysim.algorithms.heterofl import client_rate, scale

    n = server.num_clients
    config = ModuleType("config")  # their config.py reads config.yml from the working folder: its keys here
    config.cfg = {"model_name": "conv", "model_split_mode": "fix", "global_model_rate": 1.0, "num_users": n}
    sys.modules["config"] = config
    sys.path.insert(0, str(src))
    from fed import Federation

    torch.set_num_threads(1)
    algo = server.algorithm
    rates = [client_rate(cfg, c) for c in range(n)]
    labels = [torch.unique(server.data[c][1]) for c in range(n)]
    global_parameters = copy.deepcopy(algo.model.state_dict())
    federation = Federation(global_parameters, rates, labels)
    print(f"HeteroFL (authors') {commit_of(a.reference)[:12]} vs raysim: {' '.join(overrides)}; rates {rates}")
    rounds = []
    for rnd in range(1, a.rounds + 1):
        cids = server.select_clients(rnd)
        local_parameters, param_idx = federation.distribute(cids)
        for m, c in enumerate(cids):
            model = algo.width_model(rates[c]) if rates[c] < 1 else copy.deepcopy(algo.model)
            if rates[c] < 1:
                scale(model, rates[c])
            model.load_state_dict(local_parameters[m])
            keep = torch.zeros(server.num_classes, dtype=torch.bool)
            keep[labels[c]] = True
            opt = torch.optim.SGD(model.parameters(), lr=float(cfg.local.lr))
            model.train()
            for epoch in client_batches(server, rnd, c):
                for x, y in epoch:
                    loss = F.cross_entropy(model(x).masked_fill(~keep, 0.0), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            local_parameters[m] = copy.deepcopy(model.state_dict())
        federation.combine(local_parameters, param_idx, cids)
        server.round(rnd)
        ours, theirs = algo.model.state_dict(), federation.global_parameters
        print(f"round {rnd}: max |raysim - HeteroFL| model {max_difference(ours, theirs):.3g} ({worst_key(ours, theirs)})",
              flush=True)
        rounds.append({"model": figures(theirs)})
    if a.record:
        write_record(a.record, "diaoenmao/HeteroFL src/fed.py Federation (distribute, combine); client step restated",
                     commit_of(a.reference), overrides, rounds)
        print(f"recorded: {a.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
