"""raysim's FedConcat beside its authors' code (sjtudyq/FedConcat, experiments.py: the
`fedconcat` branch's `train_net_encoder_classifier` (stage 2) and `train_net_classifier`
(stage 3), their server lines restated), round by round (issue 71, item 8).

    python benchmarks/reference/fedconcat_authors.py --reference PATH [--record ...] [raysim overrides ...]

PATH is a checkout of sjtudyq/FedConcat (the project ships no reference code). Their K-means
is unseeded (`KMeans(n_clusters=K)`), so the clusters are raysim's (scikit-learn's on the
same label distributions, seeded); every cluster model starts from the same initial weights
(theirs: client 0's network; raysim's: the run's model). Stage 2: in each cluster the round's
members train with their function (SGD with `--rho` momentum and `--reg` weight decay on
encoder and classifier) on raysim's batches, and the cluster model is the sample-weighted
mean. Stage 3: the K encoders concatenated (their `CombineAllModel`), the classifier from
raysim's fresh head (theirs: a fresh `SimpleClassifier`, MNIST's default), each selected
client 3 steps of their `train_net_classifier` (one epoch's first 3 batches), the unweighted
mean. Compared: each cluster model after stage 2, then the classifier.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (PassBatches, commit_of, figures, import_reference, max_difference, raysim_server,  # noqa: E402
                     write_record)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="a checkout of sjtudyq/FedConcat")
    ap.add_argument("--record", help="write the reference's figures per round to this JSON file")
    ap.add_argument("overrides", nargs="*", help="raysim overrides (dataset, model, clients, local.*, fedconcat.*)")
    a = ap.parse_args(argv)
    overrides = ["algorithm=fedconcat", "fedconcat.classifier_steps=3", "fedconcat.classifier_weighting=uniform",
                 "local.epochs=1", *a.overrides]
    server = raysim_server(overrides)
    cfg, algo = server.cfg, server.algorithm
    if cfg.fedconcat.init_classifier:
        raise SystemExit("fedconcat.init_classifier: their MNIST run starts from a fresh classifier; leave it unset")
    ref = import_reference(a.reference, "experiments")
    ref.args = SimpleNamespace(reg=float(cfg.local.weight_decay), rho=float(cfg.local.momentum), dataset="mnist",
                               partition="noniid", beta=0.5)
    torch.set_num_threads(1)
    k, lr, bs = int(cfg.fedconcat.clusters), float(cfg.local.lr), int(cfg.local.batch_size)
    models = [copy.deepcopy(m) for m in algo.models]  # the same initial weights
    print(f"FedConcat (authors') {commit_of(a.reference)[:12]} vs raysim: {' '.join(overrides)}; clusters "
          f"{list(map(int, algo.cluster_of))}")
    rounds, concat, head = [], None, None
    for rnd in range(1, int(cfg.rounds) + 1):
        cohort = server.select_clients(rnd)
        if rnd <= int(cfg.fedconcat.encoder_rounds):  # stage 2: FedAvg in every cluster
            for j in range(k):
                members = [c for c in cohort if algo.cluster_of[c] == j]
                if not members:
                    continue
                trained = []
                for c in members:
                    enc, cls = copy.deepcopy(models[j].encoder), copy.deepcopy(models[j].head)
                    gen = server._client(rnd, c, False).generator
                    ref.train_net_encoder_classifier(c, enc, cls, PassBatches(*server.data[c], bs, gen), None,
                                                     int(cfg.local.epochs), lr, "sgd")
                    trained.append((len(server.data[c][1]), enc.state_dict(), cls.state_dict()))
                total = sum(n for n, _, _ in trained)
                models[j].encoder.load_state_dict({key: sum(e[key] * (n / total) for n, e, _ in trained)
                                                   for key in trained[0][1]})
                models[j].head.load_state_dict({key: sum(h[key] * (n / total) for n, _, h in trained)
                                                for key in trained[0][2]})
            server.round(rnd)
            diff = max(max_difference(algo.models[j].state_dict(), models[j].state_dict()) for j in range(k))
            print(f"round {rnd}: max |raysim - FedConcat| cluster models {diff:.3g}", flush=True)
            rounds.append({"clusters": [figures(m.state_dict()) for m in models]})
            continue
        if concat is None:  # stage 3 begins: their CombineAllModel of the cluster encoders, their SimpleClassifier
            from model import CombineAllModel, SimpleClassifier

            concat = CombineAllModel([copy.deepcopy(m.encoder) for m in models])
            start = algo._concatenate().head  # the fresh head raysim's first classifier round makes (seeded)
            head = SimpleClassifier(hidden_dim=start.in_features, output_dim=start.out_features)
            head.fc.load_state_dict(start.state_dict())
        server.round(rnd)
        heads = []
        for c in cohort:
            clf = copy.deepcopy(head)
            gen = server._client(rnd, c, False).generator
            ref.train_net_classifier(c, concat, clf, PassBatches(*server.data[c], bs, gen), None, 1, lr, "sgd")
            heads.append(clf.state_dict())
        head.load_state_dict({key: sum(h[key] for h in heads) / len(heads) for key in heads[0]})
        theirs = {k.replace("fc.", "", 1): v for k, v in head.state_dict().items()}
        diff = max_difference(algo.concat.head.state_dict(), theirs)
        print(f"round {rnd}: max |raysim - FedConcat| classifier {diff:.3g}", flush=True)
        rounds.append({"classifier": figures(theirs)})
    if a.record:
        write_record(a.record, "sjtudyq/FedConcat experiments.py (fedconcat branch)", commit_of(a.reference),
                     overrides, rounds)
        print(f"recorded: {a.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
