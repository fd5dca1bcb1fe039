"""Personalised evaluation (issue 44): each client's own model on its own test split.

Two things make a client's model its own: an algorithm that keeps part of the model (or a
whole model) on each client (`Algorithm.personal`: FedPer's head, Ditto's v, ...), and
fine-tuning the served model on the client's training data before testing it
(`eval.finetune_epochs`: FedAvg-FT for any algorithm, FedBABU's evaluation). Either way the
model is made where the client's data and state are: the client method `personalise` runs on
the client actors, from the model that serves the client (`Algorithm.serving`), and returns
the client's model; the server tests each on the client's split (runtime/local_eval.py).
Reported per evaluation round: `personal_accuracy` (total correct / total local test
samples, as `local_accuracy`) and its spread over clients (mean, 10th percentile, worst);
per client, a clients-table row (method `evaluate_personal`).

Evaluation is not training: its downloads and seconds stay off the round's books (the
`personalise` calls do appear in clients.parquet, with the fine-tuning's loss).
"""
from __future__ import annotations

import copy


def wanted(cfg, algorithm) -> bool:
    return algorithm.personal or int(cfg.eval.finetune_epochs) > 0


def evaluate(server, rnd: int, models: dict, cids: list[int]) -> tuple[dict, dict[int, float]]:
    """The round's personal metrics and each client's accuracy (`cids`: the clients with a
    local test split that are there)."""
    d, tests, algorithm = server.dispatch, server.local_tests, server.algorithm
    books = list(d.bytes), dict(d.seconds)
    hits: dict[int, int] = {}  # client -> its test samples its own model gets right
    stateful = bool(algorithm.client_state)
    scratch = copy.deepcopy(next(iter(models.values())))
    for name, group in algorithm.serving(cids).items():
        group = sorted(int(c) for c in group)
        if not group:
            continue
        payload = algorithm.personal_payload(name, models[name])
        for r in d.run(rnd, group, dict.fromkeys(group, 1), payload, "personalise", "algorithm", stateful):
            # tested as it arrives: holding every client's model first cost a whole model per
            # client (10,000 FedPer clients: 2 GB in the server)
            hits[r.cid] = tests.hits(scratch, r.cid, r.update)
    d.bytes[:], d.seconds = books[0], books[1]
    return tests.spread("personal_accuracy", hits)
