"""raysim's FedGroup beside its authors' server code (morningD/FlexCFL, flearn/trainer/fedgroup.py:
`clustering_clients`, `_calculate_data_driven_measure`, `client_cold_start`; groupbase.py:
`inter_group_aggregation`; flearn/group.py: `weighted_aggregate`, the groups' FedAvg), round
by round (issue 71, item 8).

    python benchmarks/reference/fedgroup_authors.py --reference PATH [--record ...] [raysim overrides ...]

PATH is a checkout of morningD/FlexCFL (the project ships no reference code). Their clients
train TensorFlow models, which cannot take raysim's weights and batches step for step: their
client training is not run (`tensorflow` is stubbed for the import; their server code is
numpy and scikit-learn). Each of their clients hands their server raysim's trained model for
the same round, start and client (its `pretrain` from w0 for `fedgroup.pretrain_steps`
steps, their `solve_iters(50)`; its group training from *their* group model); the local
solver itself is FedAvg's SGD, checked against NIID-Bench (niid_bench.py). What is compared:
who is clustered with whom (EDC: their TruncatedSVD + cosine + KMeans, or MADC: their
measure + complete linkage), the group models and directions after the group cold start,
each cold client's group (against the groups' initial directions, their `redo=False`), the
group models after each round's FedAvg (their `weighted_aggregate`: sample weights over
sum + 1e-5) and, with `fedgroup.eta_g` > 0 and `inter_group=normalised`, their inter-group
aggregation. The pre-training clients and each round's cohort are raysim's (theirs:
`random.sample` and a round-robin start). Library drift, set back to their era: KMeans's
n_init is 10 (scikit-learn's default before 1.4; raysim passes 10), AgglomerativeClustering's
`affinity=` is today's `metric=`, and `np.float` (gone in numpy 1.24) is `float`.
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import commit_of, import_reference, max_difference, raysim_server, summary, write_record  # noqa: E402


def their_era(module) -> None:
    """Their module's scikit-learn and numpy as of their code (module docstring)."""
    from sklearn.cluster import AgglomerativeClustering, KMeans

    module.KMeans = lambda *a, **k: KMeans(*a, **{"n_init": 10, **k})
    module.AgglomerativeClustering = lambda *a, affinity="euclidean", **k: AgglomerativeClustering(*a, metric=affinity,
                                                                                                   **k)
    if not hasattr(np, "float"):
        np.float = float


def import_flexcfl(path: str):
    sys.modules.setdefault("tensorflow", types.ModuleType("tensorflow"))  # their client code: not run
    colour = types.ModuleType("termcolor")
    colour.colored = lambda text, *a, **k: text
    sys.modules.setdefault("termcolor", colour)
    fedgroup = import_reference(path, "flearn.trainer.fedgroup")
    their_era(fedgroup)
    from flearn.group import Group

    return fedgroup.FedGroup, Group


class TheirGroup:
    """What their FedGroup server reads and writes of a `flearn.group.Group`."""

    def __init__(self, gid: int):
        self.id, self.latest_params, self.opt_updates, self.latest_updates, self.members = gid, None, None, None, []

    def add_downlink(self, clients):
        self.members += list(clients)


class TheirClient:
    """A `flearn.client.Client` as their server uses it, whose `pretrain` returns raysim's
    pre-trained model (float32 arrays in the model's parameter order, as TF's weights)."""

    max_temp = None

    def __init__(self, cid: int, n: int, soln: list, start: list):
        self.id, self.n, self.soln, self.uplink = cid, n, soln, []
        self.update = [w1 - w0 for w0, w1 in zip(start, soln)]

    def pretrain(self, model_params, iterations=20):
        return self.n, None, None, self.soln, self.update

    def has_uplink(self):
        return bool(self.uplink)

    def set_uplink(self, groups):
        self.uplink = list(groups)


def arrays(state: dict, names: list[str]) -> list[np.ndarray]:
    return [state[n].detach().float().numpy().copy() for n in names]


def tensors(params: list, names: list[str], like: dict) -> dict:
    return {**{k: v.clone() for k, v in like.items()}, **{n: torch.as_tensor(np.asarray(p, dtype=np.float32))
                                                          for n, p in zip(names, params)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="a checkout of morningD/FlexCFL")
    ap.add_argument("--record", help="write the reference's figures per round to this JSON file")
    ap.add_argument("overrides", nargs="*", help="raysim overrides (dataset, model, clients, local.*, fedgroup.*)")
    a = ap.parse_args(argv)
    overrides = ["algorithm=fedgroup", *a.overrides]
    server = raysim_server(overrides)
    cfg, algo = server.cfg, server.algorithm
    o = cfg.fedgroup
    if o.centres != "cluster" or o.cold_clients != "closest" or o.direction != "initial":
        raise SystemExit("driven: fedgroup.centres=cluster cold_clients=closest direction=initial (their defaults)")
    if float(o.eta_g) and o.inter_group != "normalised":
        raise SystemExit("fedgroup.eta_g > 0: their code's rule is fedgroup.inter_group=normalised")
    TheirFedGroup, Group = import_flexcfl(a.reference)
    torch.set_num_threads(1)
    names, w0 = algo.names, algo.w0.state_dict()
    m, seed = int(o.groups), int(cfg.seed)
    fg = object.__new__(TheirFedGroup)  # their server, as __init__ leaves it for these functions
    fg.num_group, fg.seed, fg.measure = m, seed, o.measure.upper()
    fg.groups = [TheirGroup(g) for g in range(m)]
    fg.init_params = arrays(w0, names)
    aggregate = object.__new__(Group)  # their Group's FedAvg (weighted_aggregate reads nothing of self)
    print(f"FedGroup (FlexCFL) {commit_of(a.reference)[:12]} vs raysim: {' '.join(overrides)}")

    def trained(rnd: int, cids: list[int], payload: dict, start: list) -> dict[int, TheirClient]:
        return {r.cid: TheirClient(r.cid, r.num_samples, arrays(r.update, names), start)
                for r in server.run_clients(rnd, cids, payload)}

    group_of, rounds = {}, []
    for rnd in range(1, int(cfg.rounds) + 1):
        out = {}
        if rnd == 1:  # the group cold start: raysim's pre-training clients, their clustering
            there = server.available_clients(rnd)
            k = min(int(o.alpha) * m, len(there))
            chosen = sorted(int(c) for c in server.rng(rnd, 6).choice(there, k, replace=False))
            pre = trained(0, chosen, algo.pretraining(), fg.init_params)
            cluster = fg.clustering_clients([pre[c] for c in chosen])
            for g, gid in zip(fg.groups, cluster.keys()):  # their group_cold_start's lines
                g.latest_params, g.opt_updates = cluster[gid][0], cluster[gid][1]
                g.latest_updates = g.opt_updates
                for c in cluster[gid][2]:
                    c.set_uplink([g])
                    group_of[c.id] = g.id
            if o.measure == "madc":  # their measure on the same updates, beside raysim's
                from sklearn.metrics.pairwise import cosine_similarity

                from raysim.algorithms.fedgroup import madc

                dw = np.vstack([np.concatenate([u.reshape(-1) for u in pre[c].update]) for c in chosen])
                theirs = fg._calculate_data_driven_measure(cosine_similarity(dw), correction=True)
                print(f"  MADC: max |raysim - FlexCFL| {np.abs(madc(dw.astype(np.float64)) - theirs).max():.3g}")
        cohort = server.select_clients(rnd)
        cold = [c for c in cohort if c not in group_of]
        if cold:
            for c, client in trained(rnd, cold, algo.pretraining(), fg.init_params).items():
                group_of[c] = fg.client_cold_start(client).id
        results = []
        for g in fg.groups:
            members = [c for c in cohort if group_of[c] == g.id]
            if not members:
                continue
            start = [p.copy() for p in g.latest_params]
            mine = trained(rnd, members, {"weights": tensors(start, names, w0)}, start)
            agg = aggregate.weighted_aggregate([mine[c].update for c in members], [mine[c].n for c in members])
            g.latest_params = [w + u for w, u in zip(start, agg)]
            g.latest_updates = agg
            results.append([g])
        if float(o.eta_g) and results:
            fg.inter_group_aggregation(results, float(o.eta_g))
        server.round(rnd)
        ours = [int(algo.group_of[c]) for c in sorted(group_of)]
        same = ours == [group_of[c] for c in sorted(group_of)]
        diff = max(max_difference(algo.models[g.id].state_dict(), tensors(g.latest_params, names, w0))
                   for g in fg.groups)
        print(f"round {rnd}: {len(group_of)} clients placed, groups {'the same' if same else 'DIFFER'}; "
              f"max |raysim - FlexCFL| group models {diff:.3g}", flush=True)
        out["group_of"] = {str(c): g for c, g in sorted(group_of.items())}
        out["groups"] = [{k: summary(v) for k, v in tensors(g.latest_params, names, w0).items()} for g in fg.groups]
        rounds.append(out)
    if a.record:
        write_record(a.record, "morningD/FlexCFL flearn/trainer/fedgroup.py, groupbase.py, group.py (server code)",
                     commit_of(a.reference), overrides, rounds)
        print(f"recorded: {a.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
