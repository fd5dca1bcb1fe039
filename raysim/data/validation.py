"""Validation mode (`eval.validation` > 0): the run is judged on samples carved from its
training clients' data, never on a test set, so that hyper-parameters chosen by it (the
results table's tuning, `python -m raysim.sweep` with a `tune:` section) never see the test
data they are then reported on (NIID-Bench's and PFLlib's practice).

Each client gives up `eval.validation` of its training samples (a seeded draw, after the
partition and its local test split). What the run calls its test data becomes validation
data: the global test set is the pooled validation samples of all clients, and where the
clients have test splits of their own (`partition.test_fraction`, or a dataset's natural
users' own test samples) each client's split is its validation samples. Every metric keeps
its name (`accuracy`, `local_accuracy`, ...); the run's config says `eval.validation`.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from omegaconf import DictConfig

from raysim.data.datasets import FederatedData
from raysim.data.partition import Partition
from raysim.errors import ConfigError


def carve_validation(data: FederatedData, part: Partition, cfg: DictConfig, own_test: bool) -> tuple:
    """(data, partition) with each client's validation samples taken out of its training
    samples and standing in for both test sets (module docstring). `own_test`: the clients
    had test samples of their own in `data` (natural users)."""
    share = float(cfg.eval.validation)
    rng = np.random.default_rng([int(cfg.seed), 12])
    train, val = [], []
    for cid, ix in enumerate(part.train):
        ix = rng.permutation(ix)
        n_val = int(len(ix) * share)
        if n_val < 1 or len(ix) - n_val < 1:
            raise ConfigError(f"eval.validation={share}: client {cid} has {len(ix)} training samples, which leaves it "
                              f"{'no validation sample' if n_val < 1 else 'no training sample'}; choose a share in "
                              "(0, 1) that leaves both, or fewer clients")
        train.append(np.sort(ix[n_val:]))
        val.append(np.sort(ix[:n_val]))
    pooled = np.concatenate(val)
    data = dataclasses.replace(data, x_test=data.x_train[pooled], y_test=data.y_train[pooled], users_test=None,
                               stored=None)
    has_local = part.test is not None or own_test
    return data, Partition(train, val if has_local else None)
