"""raysim beside NIID-Bench's own client and server code (Xtra-Computing/NIID-Bench,
experiments.py), on the same problem, round by round (issue 71, items 8 and 9).

    python benchmarks/reference/niid_bench.py --reference PATH --algorithm scaffold [--rounds 3] \\
        [--record tests/reference/niid_bench_scaffold.json] [raysim overrides ...]

PATH is a checkout of NIID-Bench (the project ships no reference code). Per round, both sides
start from the same global model; each selected client trains with NIID-Bench's
`train_net` / `train_net_fedprox` / `train_net_scaffold` / `train_net_fednova` (its own
torch.optim.SGD with `--rho` momentum and `--reg` weight decay, its own loss and corrections)
on the batches raysim's client draws, in raysim's order (harness.EpochLoader); the reference's
server step is its experiments.py main loop's, restated here line for line (it reads its data
loaders inline): the sample-weighted mean of the nets; SCAFFOLD's c += sum of the clients'
c deltas / n_parties; FedNova's x -= (sum p_i a_i) (sum p_i d_i). raysim runs its own
InProcessServer on the same config. Printed per round: the largest difference between the
two global models (and SCAFFOLD's c), and both test accuracies. `--record` writes the
reference's figures (harness.figures) for tests/test_reference_figures.py.

NIID-Bench's c variates start as a randomly initialised network's weights (c_global = every
c_local): with all clients in every round their differences cancel after round 1, and raysim
starts them at 0; with partial participation the two would part, so keep participation=1.0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (EpochLoader, client_batches, commit_of, copy_model, figures, import_reference,  # noqa: E402
                     max_difference, raysim_server, worst_key, write_record)

ALGORITHMS = {  # raysim's settings that are NIID-Bench's reading
    "fedavg": ["algorithm=fedavg"],
    "fedprox": ["algorithm=fedprox", "fedprox.mu=0.01"],
    "scaffold": ["algorithm=scaffold", "scaffold.correction=weights", "scaffold.weighting=samples"],
    "fednova": ["algorithm=fednova"],
    "moon": ["algorithm=moon", "moon.mu=1", "moon.temperature=0.5"],  # NIID-Bench's momentum is 0.9, fixed
}


class MoonView(torch.nn.Module):
    """raysim's MOON network as NIID-Bench's `ModelFedCon` answers: (features, projection z,
    logits), on the same parameters (raysim's classifier reads the encoder, `moon.classifier`)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        from raysim.algorithms.moon import representation_and_logits

        z, logits = representation_and_logits(self.net, x)
        return None, z, logits


def reference_round(niid, algorithm: str, server, rnd: int, state: dict, test_loader) -> dict:
    """One round of NIID-Bench's code from `state` (global model, SCAFFOLD's variates); returns
    the new state."""
    cfg = server.cfg
    global_model = state["model"]
    cids = server.select_clients(rnd)
    sizes = {c: len(server.data[c][1]) for c in cids}
    total = sum(sizes.values())
    nets, extra = {}, {}
    lr, epochs = float(cfg.local.lr), int(cfg.local.epochs)
    for c in cids:
        net = copy_model(global_model)
        loader = EpochLoader(client_batches(server, rnd, c))
        if algorithm == "fedavg":
            niid.train_net(c, net, loader, test_loader, epochs, lr, "sgd")
        elif algorithm == "fedprox":
            niid.train_net_fedprox(c, net, global_model, loader, test_loader, epochs, lr, "sgd", float(cfg.fedprox.mu))
        elif algorithm == "scaffold":
            c_local = state["c_local"].setdefault(c, copy_model(state["c_global"]))
            _, _, c_delta = niid.train_net_scaffold(c, net, global_model, c_local, state["c_global"], [loader],
                                                    test_loader, epochs, lr, "sgd")
            extra[c] = c_delta
        elif algorithm == "fednova":
            _, _, a_i, d_i = niid.train_net_fednova(c, net, global_model, [loader], test_loader, epochs, lr, "sgd")
            extra[c] = (a_i, d_i)
        elif algorithm == "moon":  # round 1: no previous model in the pool (old_nets_pool empty)
            previous = [MoonView(state["prev"][c])] if c in state.setdefault("prev", {}) else []
            niid.train_net_moon(c, MoonView(net), MoonView(global_model), previous, loader, test_loader, epochs, lr,
                                "sgd", float(cfg.moon.mu), float(cfg.moon.temperature), niid.args, rnd - 1)
            state["prev"][c] = copy_model(net)
        nets[c] = net
    if algorithm == "fednova":  # experiments.py's fednova branch
        d_total = {k: 0.0 for k in global_model.state_dict()}
        for c in cids:
            for k, v in extra[c][1].items():
                d_total[k] = d_total[k] + v * sizes[c] / total
        coeff = sum(extra[c][0] * sizes[c] / total for c in cids)
        updated = global_model.state_dict()
        for k in updated:
            updated[k] -= coeff * d_total[k]
        global_model.load_state_dict(updated)
        return state
    para = None  # the other branches: the sample-weighted mean of the nets (fed_avg_freqs)
    for c in cids:
        net_para = nets[c].state_dict()
        if para is None:
            para = {k: v * (sizes[c] / total) for k, v in net_para.items()}
        else:
            for k in para:
                para[k] += net_para[k] * (sizes[c] / total)
    global_model.load_state_dict(para)
    if algorithm == "scaffold":  # local_train_net_scaffold's tail
        c_para = state["c_global"].state_dict()
        for k in c_para:
            c_para[k] += sum(extra[c][k] for c in cids) / server.num_clients
        state["c_global"].load_state_dict(c_para)
    return state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="a checkout of Xtra-Computing/NIID-Bench")
    ap.add_argument("--algorithm", choices=sorted(ALGORITHMS), required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--record", help="write the reference's figures per round to this JSON file")
    ap.add_argument("--perturb", type=lambda v: [float(e) for e in v.split(",")], default=[],
                    help="comma-separated: also run the reference from the initial weights times (1 + each), e.g. "
                         "6e-8,-6e-8 (an ulp): how fast its own rounding differences grow, and where it goes")
    ap.add_argument("overrides", nargs="*", help="raysim overrides (dataset, model, clients, local.*)")
    a = ap.parse_args(argv)
    overrides = [*ALGORITHMS[a.algorithm], *a.overrides]
    server = raysim_server(overrides)
    cfg = server.cfg
    if float(cfg.participation) != 1.0:
        raise SystemExit("participation must be 1.0: NIID-Bench's variates start from a random network's weights")
    niid = import_reference(a.reference, "experiments")
    niid.args = SimpleNamespace(lr=float(cfg.local.lr), reg=float(cfg.local.weight_decay), rho=float(cfg.local.momentum),
                                loss="contrastive")
    if a.algorithm == "moon" and float(cfg.local.momentum) != 0.9:
        raise SystemExit("NIID-Bench's train_net_moon steps with momentum 0.9 whatever --rho: set local.momentum=0.9")
    torch.set_num_threads(1)  # the same reductions on both sides
    state = {"model": copy_model(server.algorithm.model)}
    if a.algorithm == "scaffold":
        zero = copy_model(server.algorithm.model)
        zero.load_state_dict({k: torch.zeros_like(v) for k, v in zero.state_dict().items()})
        state.update(c_global=zero, c_local={})
    twins = []
    for eps in a.perturb:
        twin = {k: (copy_model(v) if k != "c_local" else {}) for k, v in state.items()}
        twin["model"].load_state_dict({k: v * (1 + eps) if v.is_floating_point() else v
                                       for k, v in twin["model"].state_dict().items()})
        twins.append(twin)
    x_test, y_test = server.test
    test_loader = [[(x_test[:256], y_test[:256])]]
    from raysim.training import evaluate

    rounds = []
    print(f"NIID-Bench {commit_of(a.reference)[:12]} vs raysim, {a.algorithm}: {' '.join(overrides)}")
    for rnd in range(1, a.rounds + 1):
        state = reference_round(niid, a.algorithm, server, rnd, state, test_loader)
        server.round(rnd)
        ours = server.algorithm.model.state_dict()
        theirs = state["model"].state_dict()
        line = f"round {rnd}: max |raysim - NIID-Bench| model {max_difference(ours, theirs):.3g} ({worst_key(ours, theirs)})"
        twins = [reference_round(niid, a.algorithm, server, rnd, t, test_loader) for t in twins]
        if twins:
            line += (" (NIID-Bench vs itself perturbed " +
                     ", ".join(f"{max_difference(t['model'].state_dict(), theirs):.3g}" for t in twins) + ")")
        record = {"model": figures(theirs)}
        if a.algorithm == "scaffold":
            c_theirs = state["c_global"].state_dict()
            line += f", c {max_difference(server.algorithm.c, {k: c_theirs[k] for k in server.algorithm.c}):.3g}"
            record["c"] = figures({k: c_theirs[k] for k in server.algorithm.c})
        acc = [evaluate(m, x_test, y_test, server.num_classes)["accuracy"] for m in (server.algorithm.model, state["model"])]
        line += f"; accuracy raysim {acc[0]:.4f}, NIID-Bench {acc[1]:.4f}"
        if twins:
            line += " (perturbed: " + ", ".join(
                f"{evaluate(t['model'], x_test, y_test, server.num_classes)['accuracy']:.4f}" for t in twins) + ")"
        print(line, flush=True)
        rounds.append(record)
    if a.record:
        write_record(a.record, "Xtra-Computing/NIID-Bench experiments.py", commit_of(a.reference), overrides, rounds)
        print(f"recorded: {a.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
