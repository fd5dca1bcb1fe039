"""raysim beside PFLlib's own clients (TsingZ0/PFLlib, system/flcore/clients/) on the same
problem, round by round (issue 71, item 8).

    python benchmarks/reference/pfllib.py --reference PATH --algorithm fedrep [--rounds 3] \\
        [--record tests/reference/pfllib_fedrep.json] [raysim overrides ...]

PATH is a checkout of PFLlib (the project ships no reference code). Each client is PFLlib's
own client object (clientper, clientrep, clientrod, clientditto, clientpFedMe), built once and kept across
rounds as PFLlib's server keeps them, on a model that is raysim's, split as PFLlib's
`BaseHeadSplit` splits it (`base` = raysim's encoder, `head` = its head). Its
`load_train_data` is replaced by raysim's batches for that client and round, in raysim's
order (a new permutation of its samples from the client's generator at every pass; raysim
keeps the last short batch, PFLlib's DataLoader drops it). The server's steps are PFLlib's
serverbase / serverX ones, restated here (they read their clients from files): send the
global model (or its base) with the client's `set_parameters`, run the client's training
calls in PFLlib's order, and average the uploaded models (or bases) by training samples.
raysim runs its InProcessServer on the same config; printed per round: the largest difference
between the two servers' models and between the clients' personal parts.

PFLlib trains with plain SGD: run with local.momentum=0 local.weight_decay=0 (the driver
sets both).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import PassBatches, commit_of, figures, max_difference, raysim_server, write_record  # noqa: E402

ALGORITHMS = {  # raysim's settings that are PFLlib's reading; PFLlib's client module and class
    "fedper": (["algorithm=fedper", "personal.buffers=local"], "clientper", "clientPer"),
    "fedrep": (["algorithm=fedrep", "fedrep.head_epochs=1", "personal.buffers=local"], "clientrep", "clientRep"),
    "fedrod": (["algorithm=fedrod"], "clientrod", "clientROD"),
    "ditto": (["algorithm=ditto", "ditto.lam=0.5", "ditto.personal_epochs=1"], "clientditto", "clientDitto"),
    "lg_fedavg": (["algorithm=lg_fedavg", "personal.buffers=local"], "clientlg", "clientLG"),
    "fedbabu": (["algorithm=fedbabu", "personal.buffers=local"], "clientbabu", "clientBABU"),
    "apfl": (["algorithm=apfl", "apfl.variant=pfllib", "apfl.alpha=0.5"], "clientapfl", "clientAPFL"),
    "fedbn": (["algorithm=fedbn", "model_options.norm=batch"], "clientbn", "clientBN"),
    "fedala": (["algorithm=fedala", "fedala.layer_idx=2", "fedala.eta=1.0", "fedala.rand_percent=80"], "clientala",
               "clientALA"),
    # PFLlib pools every epoch's z, the authors (and collect=training) the last epoch's: the same at one epoch
    "fedproto": (["algorithm=fedproto", "fedproto.collect=training", "fedproto.lam=1", "local.epochs=1"], "clientproto",
                 "clientProto"),
    # PFLlib's pFedMeOptimizer has mu = 0.001 (its default, never passed): raysim's pfedme.mu set alike
    "pfedme": (["algorithm=pfedme", "pfedme.mu=0.001", "pfedme.personal_lr=0.05", "pfedme.lam=15", "pfedme.k=5",
                "pfedme.beta=1.0"], "clientpFedMe", "clientpFedMe"),
}
PLAIN = ["local.momentum=0", "local.weight_decay=0"]


class BaseHead(torch.nn.Module):
    """raysim's model as PFLlib's BaseHeadSplit: `base` its encoder, `head` its head. The
    encoder's layers are named `bn<i>` (a BatchNorm layer: PFLlib's FedBN finds them by 'bn' in
    the name) or `m<i>` for raysim's position i."""

    def __init__(self, model: torch.nn.Module):
        from collections import OrderedDict

        super().__init__()
        self.base = torch.nn.Sequential(OrderedDict(
            (f"bn{i}" if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) else f"m{i}", m)
            for i, m in enumerate(copy.deepcopy(model.encoder))))
        self.head = copy.deepcopy(model.head)

    def forward(self, x):
        return self.head(self.base(x))


def raysim_keys(state: dict, prefix: str = "") -> dict:
    """A PFLlib model's state under raysim's names (base.m1.weight -> encoder.1.weight)."""
    import re

    out = {}
    for k, v in state.items():
        k = prefix + k
        out[re.sub(r"^base\.(?:bn|m)(\d+)\.", r"encoder.\1.", k)] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="a checkout of TsingZ0/PFLlib")
    ap.add_argument("--algorithm", choices=sorted(ALGORITHMS), required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--record", help="write the reference's figures per round to this JSON file")
    ap.add_argument("overrides", nargs="*", help="raysim overrides (dataset, model, clients, local.*)")
    a = ap.parse_args(argv)
    settings, module, cls = ALGORITHMS[a.algorithm]
    overrides = [*settings, *PLAIN, *a.overrides]
    server = raysim_server(overrides)
    cfg = server.cfg
    root = Path(a.reference).resolve() / "system"
    if not (root / "flcore" / "clients" / f"{module}.py").exists():
        raise SystemExit(f"--reference {a.reference}: no system/flcore/clients/{module}.py; point it at a PFLlib checkout")
    sys.path.insert(0, str(root))
    import importlib

    base_client = importlib.import_module("flcore.clients.clientbase").Client
    client_cls = getattr(importlib.import_module(f"flcore.clients.{module}"), cls)
    loaders: dict = {}  # cid -> the Batches of its current round (None: a pass in order)

    def load_train_data(self, batch_size=None):
        x, y = server.data[self.id]
        return PassBatches(x, y, int(batch_size or self.batch_size), loaders.get(self.id))

    base_client.load_train_data = load_train_data
    current, trained = [None], set()  # FedALA: the client whose ALA runs now; the clients that trained before
    if a.algorithm == "fedala":
        # ALA's window starts at random.randint(0, n - size): drawn here from the client's raysim generator
        # (first, before its training's permutations, as raysim draws it; not at all before the client has
        # trained, when ALA returns at once and raysim draws nothing); its data: the client's, in order
        class WindowStart:
            @staticmethod
            def randint(lo, hi):
                c = current[0]
                return int(torch.randint(lo, hi + 1, (1,), generator=loaders[c])) if c in trained else lo

        importlib.import_module("utils.ALA").random = WindowStart
        importlib.import_module(f"flcore.clients.{module}").read_client_data = \
            lambda dataset, idx, is_train=True, few_shot=0: list(zip(*server.data[idx]))
    torch.set_num_threads(1)
    initial = BaseHead(server.algorithm.model)
    args = SimpleNamespace(model=initial, algorithm=a.algorithm, dataset="raysim", device="cpu",
                           save_folder_name="/tmp", num_classes=server.num_classes,
                           batch_size=int(cfg.local.batch_size), local_learning_rate=float(cfg.local.lr),
                           local_epochs=int(cfg.local.epochs), few_shot=0, learning_rate_decay_gamma=1.0,
                           learning_rate_decay=False,
                           plocal_epochs=int(cfg.fedrep.head_epochs) if a.algorithm == "fedrep" else
                           int(cfg.ditto.personal_epochs) if a.algorithm == "ditto" else 1,
                           mu=float(cfg.ditto.lam) if a.algorithm == "ditto" else 0.0,
                           lamda=float(cfg.pfedme.lam) if a.algorithm == "pfedme" else 0.0,
                           K=int(cfg.pfedme.k) if a.algorithm == "pfedme" else 0,
                           p_learning_rate=float(cfg.pfedme.personal_lr) if a.algorithm == "pfedme" else 0.0,
                           alpha=float(cfg.apfl.alpha) if a.algorithm == "apfl" else 0.0, fine_tuning_epochs=0)
    if a.algorithm == "fedproto":
        args.lamda = float(cfg.fedproto.lam)
    if a.algorithm == "fedala":
        args.eta, args.rand_percent, args.layer_idx = (float(cfg.fedala.eta), int(cfg.fedala.rand_percent),
                                                       int(cfg.fedala.layer_idx))
    clients = {c: client_cls(args, id=c, train_samples=len(server.data[c][1]), test_samples=0,
                             train_slow=False, send_slow=False) for c in range(server.num_clients)}
    global_model = copy.deepcopy(initial)
    thetas: dict = {}  # pFedMe: theta as training leaves it, before update_parameters writes w over it
    if a.algorithm == "pfedme":
        # PFLlib's `personalized_params` are the model's own parameter objects, which train()'s last
        # line overwrites with w (the authors' issue #5: what they test as personalised is w)
        for c, client in clients.items():
            def snapshot(model, new_params, c=c, original=client.update_parameters):
                thetas[c] = [p.data.clone() for p in model.parameters()]
                original(model, new_params)
            client.update_parameters = snapshot
    # what PFLlib's server sends and averages: the base (serverper, serverrep, serverbabu), the head
    # (serverlg), or the whole model
    part = {"fedper": "base", "fedrep": "base", "fedbabu": "base", "lg_fedavg": "head"}.get(a.algorithm)

    def sent(model):
        return getattr(model, part) if part else model
    print(f"PFLlib {commit_of(a.reference)[:12]} vs raysim, {a.algorithm}: {' '.join(overrides)}")
    rounds = []
    for rnd in range(1, a.rounds + 1):
        cids = server.select_clients(rnd)
        for c in cids:  # the client's raysim generator for this round: every pass draws from it
            loaders[c] = server._client(rnd, c, False).generator
            if a.algorithm == "fedala":  # serverala.send_models: each client's ALA from the global model
                current[0] = c
                clients[c].local_initialization(global_model)
            elif a.algorithm != "fedproto":  # FedProto sends no weights, only the prototypes (set below)
                clients[c].set_parameters(sent(global_model))
            if a.algorithm == "ditto":
                clients[c].ptrain()
            clients[c].train()
            trained.add(c)
        if a.algorithm == "fedproto":  # serverproto's proto_aggregation (restated: serverbase needs h5py):
            protos = {}  # per class, the unweighted mean of the uploads holding it; sent to every client
            for c in cids:
                for label, proto in clients[c].protos.items():
                    protos.setdefault(label, []).append(proto.data)
            protos = {label: sum(ps[1:], ps[0]) / len(ps) if len(ps) > 1 else ps[0] for label, ps in protos.items()}
            for client in clients.values():
                client.set_protos(protos)
            server.round(rnd)
            algo = server.algorithm
            theirs_p = torch.stack([protos[j] if j in protos and not isinstance(protos[j], list)
                                    else torch.zeros_like(algo.protos[0]) for j in range(server.num_classes)])
            own = max(max_difference(server.states[c]["kept"], raysim_keys(clients[c].model.state_dict())) for c in cids)
            print(f"round {rnd}: max |raysim - PFLlib| global prototypes "
                  f"{float((algo.protos - theirs_p).abs().max()):.3g} (classes {sorted(protos)}), clients' models "
                  f"{own:.3g}", flush=True)
            rounds.append({"protos": figures({"protos": theirs_p})})
            continue
        total = sum(clients[c].train_samples for c in cids)
        uploads = [(clients[c].train_samples / total, sent(clients[c].model)) for c in cids]
        target = sent(global_model)  # serverbase.aggregate_parameters
        previous = [p.data.clone() for p in target.parameters()]
        for p in target.parameters():
            p.data.zero_()
        for w, m in uploads:
            for p, q in zip(target.parameters(), m.parameters()):
                p.data += q.data.clone() * w
        if a.algorithm == "pfedme":  # serverpFedMe.beta_aggregate_parameters
            beta = float(cfg.pfedme.beta)
            for pre, p in zip(previous, target.parameters()):
                p.data = (1 - beta) * pre + beta * p.data
        server.round(rnd)
        theirs = raysim_keys(global_model.state_dict())
        ours = server.algorithm.model.state_dict()
        prefix = {"base": "encoder.", "head": "head.", None: ""}[part]
        shared = {k: theirs[k] for k in ours if k in theirs and k.startswith(prefix)}
        if a.algorithm == "fedbn":  # the server's BatchNorm layer is no client's (PFLlib averages it; never sent)
            kept = server.states[cids[0]].get("kept", {})
            shared = {k: v for k, v in shared.items() if k not in kept}
        line = f"round {rnd}: max |raysim - PFLlib| server {max_difference({k: ours[k] for k in shared}, shared):.3g}"
        personal, rounds_personal, side = {}, {}, {}  # side: FedALA's W_i / APFL's alpha, |raysim - PFLlib|
        for c in cids:
            mine = server.states.get(c, {})
            if a.algorithm in ("fedper", "fedrep"):
                theirs_c = raysim_keys(clients[c].model.head.state_dict(), "head.")
                ours_c = mine.get("kept", {})
            elif a.algorithm == "lg_fedavg":
                theirs_c = raysim_keys(clients[c].model.base.state_dict(), "base.")
                ours_c = mine.get("kept", {})
            elif a.algorithm == "fedbn":  # its BatchNorm layers: weights, biases and statistics
                theirs_c = {k: v for k, v in raysim_keys(clients[c].model.state_dict()).items() if k in mine.get("kept", {})}
                ours_c = mine.get("kept", {})
            elif a.algorithm == "fedbabu":  # nothing of its own but buffers: the server's part says it all
                theirs_c, ours_c = {}, {}
            elif a.algorithm == "fedala":  # theta_i, its trained model (W_i compared beside it)
                theirs_c = raysim_keys(clients[c].model.state_dict())
                ours_c = mine.get("theta", {})
                if clients[c].ALA.weights is not None and "W" in mine:
                    side[c] = max(float((w - v).abs().max()) for w, v in zip(mine["W"], clients[c].ALA.weights))
            elif a.algorithm == "apfl":  # v, and alpha beside it
                theirs_c = raysim_keys(clients[c].model_per.state_dict())
                ours_c = mine.get("v", {})
                side[c] = abs(float(mine.get("alpha", float("nan"))) - float(clients[c].alpha))
            elif a.algorithm == "fedrod":
                theirs_c = {f"personal.{k}": v for k, v in clients[c].head.state_dict().items()}
                ours_c = mine.get("kept", {})
            elif a.algorithm == "pfedme":  # theta, the personalised model, as its training left it
                names = [n for n, _ in clients[c].model.named_parameters()]
                theirs_c = raysim_keys(dict(zip(names, thetas[c])))
                ours_c = mine.get("theta", {})
            else:  # ditto: v
                theirs_c = raysim_keys(clients[c].model_per.state_dict())
                ours_c = mine.get("v", {})
            common = [k for k in theirs_c if k in ours_c]
            if common:
                personal[c] = max_difference({k: ours_c[k] for k in common}, {k: theirs_c[k] for k in common})
                rounds_personal[str(c)] = figures({k: theirs_c[k] for k in common})
        if personal:
            line += f", clients' own parts {max(personal.values()):.3g} ({len(personal)} clients)"
        if side:
            line += f", {'W' if a.algorithm == 'fedala' else 'alpha'} {max(side.values()):.3g}"
        print(line, flush=True)
        rounds.append({"model": figures(shared), **({"personal": rounds_personal} if personal else {})})
    if a.record:  # the clients' own parts of the last round only (a model per client)
        for r in rounds[:-1]:
            r.pop("personal", None)
        write_record(a.record, f"TsingZ0/PFLlib system/flcore/clients/{module}.py", commit_of(a.reference), overrides,
                     rounds, personal_state={"ditto": "v", "pfedme": "theta", "apfl": "v", "fedala": "theta"}.get(a.algorithm, "kept"))
        print(f"recorded: {a.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
