"""raysim's FedDyn beside the authors' own code (alpemreacar/FedDyn: utils_general.py
`train_feddyn_mdl`, the client; utils_methods.py `train_FedDyn`, the server), round by round
(issue 71, item 8).

    python benchmarks/reference/feddyn_authors.py --reference PATH [--rounds 3] \\
        [--record tests/reference/feddyn_authors.json] [raysim overrides ...]

PATH is a checkout of alpemreacar/FedDyn (the project ships no reference code). Their client
function trains on the batches raysim's client draws, in raysim's order (their DataLoader is
replaced by one that hands a new permutation from the client's raysim generator at every
pass), with their SGD (weight decay alpha_k + weight_decay: the quadratic term), their linear
term alpha_k <w, lambda_k - x>, and their adaptive alpha_k = alpha / (n_k / sum n * N). Their
gradient clipping (max_norm = 10, all their methods) is lifted here (`--clip` keeps it:
raysim's `local.clip_grad_norm=10` is not the same, as it clips the quadratic term's gradient
too, which their weight decay adds after the clip). Their server loop is restated: the mean of the selected models plus the
mean of every client's lambda, lambda_k += w_k - x.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import PassBatches, commit_of, figures, max_difference, raysim_server, worst_key, write_record  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="a checkout of alpemreacar/FedDyn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clip", action="store_true", help="keep the authors' gradient clipping (raysim's default has none)")
    ap.add_argument("--record", help="write the reference's figures per round to this JSON file")
    ap.add_argument("overrides", nargs="*", help="raysim overrides (dataset, model, clients, local.*)")
    a = ap.parse_args(argv)
    overrides = ["algorithm=feddyn", "feddyn.adaptive_alpha=true", "local.momentum=0", *a.overrides]
    server = raysim_server(overrides)
    cfg = server.cfg
    root = Path(a.reference).resolve()
    if not (root / "utils_general.py").exists():
        raise SystemExit(f"--reference {a.reference}: no utils_general.py; point it at a FedDyn checkout")
    sys.path.insert(0, str(root))
    import utils_general as ug

    if not a.clip:
        ug.max_norm = float("inf")
    current = {}  # the client being trained: its data and generator

    def loader(dataset, batch_size, shuffle):
        return PassBatches(*current["data"], batch_size, current["generator"])

    ug.Dataset = lambda x, y, train, dataset_name: None
    ug.data = SimpleNamespace(DataLoader=loader)
    torch.set_num_threads(1)
    n = server.num_clients
    sizes = np.asarray([len(y) for _, y in server.data], dtype=np.float64)
    weight_list = sizes / sizes.sum() * n  # train_FedDyn's
    alpha, lr, bs = float(cfg.feddyn.alpha), float(cfg.local.lr), int(cfg.local.batch_size)
    initial = copy.deepcopy(server.algorithm.model)
    trainable = [name for name, p in initial.named_parameters()]
    model_func = lambda: copy.deepcopy(initial)  # noqa: E731
    cld = torch.nn.utils.parameters_to_vector(initial.parameters()).detach().numpy().astype("float32")
    local_param_list = np.zeros((n, len(cld)), dtype="float32")
    clnt_params = np.tile(cld, (n, 1))

    def as_state(vector) -> dict:
        m = model_func()
        torch.nn.utils.vector_to_parameters(torch.tensor(vector, dtype=torch.float32), m.parameters())
        return {k: v for k, v in m.state_dict().items() if k in trainable}

    print(f"FedDyn (authors') {commit_of(a.reference)[:12]} vs raysim: {' '.join(overrides)}"
          f"{'' if a.clip else '; their clipping lifted'}")
    rounds = []
    for rnd in range(1, a.rounds + 1):
        cids = server.select_clients(rnd)
        x_tensor = torch.tensor(cld, dtype=torch.float32)
        for c in cids:
            current.update(data=server.data[c], generator=server._client(rnd, c, False).generator)
            model = model_func()
            torch.nn.utils.vector_to_parameters(x_tensor.clone(), model.parameters())
            model = ug.train_feddyn_mdl(model, model_func, alpha / weight_list[c], x_tensor,
                                        torch.tensor(local_param_list[c]), *server.data[c], lr, bs,
                                        int(cfg.local.epochs), 10 ** 9, float(cfg.local.weight_decay), "raysim")
            w = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
            local_param_list[c] += w - cld
            clnt_params[c] = w
        cld = np.mean(clnt_params[cids], axis=0) + np.mean(local_param_list, axis=0)
        server.round(rnd)
        ours = {k: v for k, v in server.algorithm.model.state_dict().items() if k in trainable}
        theirs = as_state(cld)
        lam = {k: v for k, v in server.algorithm.sum_lam.items()}
        their_lam = as_state(local_param_list.sum(axis=0))
        print(f"round {rnd}: max |raysim - FedDyn| model {max_difference(ours, theirs):.3g} ({worst_key(ours, theirs)}), "
              f"sum of lambdas {max_difference(lam, their_lam):.3g}", flush=True)
        rounds.append({"model": figures(theirs)})
    if a.record:
        write_record(a.record, "alpemreacar/FedDyn utils_general.py train_feddyn_mdl, utils_methods.py train_FedDyn",
                     commit_of(a.reference), overrides, rounds)
        print(f"recorded: {a.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
