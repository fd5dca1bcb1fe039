"""Per-client evaluation: each client's model on the client's own test split, for every
algorithm (`partition.test_fraction > 0`; the split is carved from the client's samples by
`data.partition.make_partition`).

An algorithm with several models says which serves which client (`Algorithm.serving`:
FedGroup a client's group model, IFCA the model it picked); by default the first of
`eval_models()` serves everyone. Reported per evaluation round: the sample-weighted accuracy
(total correct / total local test samples, the clustered-FL papers' "weighted accuracy"),
and its spread over clients (mean, 10th percentile, worst); per client, a row in the clients
table (method `evaluate`).

Where: one central pass in the server, which holds the arrays already (it loaded the data),
over the concatenated test splits of the clients each model serves: one batched forward
pass per model instead of a Ray task per client (a client's split is tens of samples; a
task costs ~1 ms of dispatch and the model's broadcast).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from raysim.data.partition import split_by_owner


class LocalTests:
    def __init__(self, x: np.ndarray, y: np.ndarray, test_index: list, inputs, batch_size: int = 1024):
        sizes = np.array([len(ix) for ix in test_index], dtype=np.int64)
        self.sizes = sizes
        self.cids = np.flatnonzero(sizes)  # clients with a local test sample
        index = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in test_index])
        self.owner = np.repeat(np.arange(len(test_index)), sizes)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # client c's rows: starts[c]:starts[c + 1]
        self.x = inputs(np.ascontiguousarray(x[index]))  # what models take (images: decoded from uint8)
        self.y = torch.from_numpy(np.ascontiguousarray(y[index]))
        self.batch_size = batch_size

    def evaluate(self, models: dict, serving: dict) -> tuple[dict, dict[int, float]]:
        """`serving`: model name -> client ids. Returns the round's metrics and each served
        client's accuracy."""
        return self.spread("local_accuracy", self._served(models, serving, self.x, self.y, self.owner))

    def _served(self, models: dict, serving: dict, x: torch.Tensor, y: torch.Tensor, owner: np.ndarray) -> dict:
        """Each served client's correct count, from the test rows `x`, `y` of the clients `owner`
        (in client order): one pass per model over the rows of the clients it serves."""
        correct: dict[int, float] = {}
        for name, cids in serving.items():
            cids = np.asarray(list(cids), dtype=np.int64)
            mask = np.isin(owner, cids)
            if not mask.any():
                continue
            rows = torch.from_numpy(np.flatnonzero(mask))
            hit = self._hits(models[name], x[rows], y[rows])
            mine, where = np.unique(owner[mask], return_inverse=True)
            for c, n in zip(mine.tolist(), np.bincount(where, weights=hit, minlength=len(mine)).tolist()):
                correct[c] = correct.get(c, 0.0) + n
        return {c: correct[c] for c in sorted(correct) if self.sizes[c] > 0}

    def spread(self, name: str, correct: dict[int, float]) -> tuple[dict, dict[int, float]]:
        """From each client's correct count: the metrics `name` (total correct / total test
        samples) and its spread over clients (`name`_mean, _p10, _min), and each client's
        accuracy; ({}, {}) for no client."""
        mine = sorted(correct)
        if not mine:
            return {}, {}
        hits = np.array([correct[c] for c in mine], dtype=np.float64)
        acc = hits / self.sizes[mine]
        metrics = {
            name: float(hits.sum() / self.sizes[mine].sum()),
            f"{name}_mean": float(acc.mean()),
            f"{name}_p10": float(np.percentile(acc, 10)),
            f"{name}_min": float(acc.min()),
        }
        return metrics, dict(zip(mine, acc.tolist()))

    def hits(self, model: torch.nn.Module, cid: int, state: dict) -> int:
        """How many of client `cid`'s test samples `model`, loaded with `state`, gets right
        (personalised evaluation: runtime/personal_eval.py)."""
        model.load_state_dict(state)
        rows = slice(int(self.starts[cid]), int(self.starts[cid + 1]))
        return int(self._hits(model, self.x[rows], self.y[rows]).sum())

    def _hits(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        model.eval()
        out = []
        with torch.no_grad():
            for start in range(0, len(y), self.batch_size):
                pred = model(x[start:start + self.batch_size]).argmax(1)
                out.append((pred == y[start:start + self.batch_size]).numpy())
        return np.concatenate(out).astype(np.float64)


class MadeTests(LocalTests):
    """The users' own test splits of a population made when picked (data/population.py):
    made for the clients evaluated, when they are (`eval.local_clients` a round), never all
    at once. The same rows in the same order as `LocalTests` over the materialised users,
    so the same metrics, bit for bit."""

    def __init__(self, population, inputs, batch_size: int = 1024):
        self.population, self.inputs, self.batch_size = population, inputs, batch_size
        self.sizes = population.test_sizes
        every = bool((self.sizes > 0).all())
        self.cids = range(len(self.sizes)) if every else np.flatnonzero(self.sizes)

    def evaluate(self, models: dict, serving: dict) -> tuple[dict, dict[int, float]]:
        clients = sorted({int(c) for cids in serving.values() for c in cids})
        x, y, owner = self.population.tests(clients)
        return self.spread("local_accuracy", self._served(models, serving, self.inputs(x), torch.from_numpy(y), owner))

    def hits(self, model: torch.nn.Module, cid: int, state: dict) -> int:
        model.load_state_dict(state)
        x, y = self.population.test(cid)
        return int(self._hits(model, self.inputs(x), torch.from_numpy(y)).sum())


def local_tests(x: np.ndarray, y: np.ndarray, test_index: Optional[list], inputs) -> Optional[LocalTests]:
    """The clients' local test sets, or None when the partition made none."""
    if not test_index or not any(len(ix) for ix in test_index):
        return None
    return LocalTests(x, y, test_index, inputs)


def clients_test_data(data, part, cfg) -> Optional[LocalTests]:
    """Each client's own test data. Under `partition=natural` on a dataset whose users have
    their own test samples (FedProx's Synthetic, LEAF's FEMNIST and Sent140: the per-user
    splits the papers evaluate on), those, always (`partition.test_fraction` then carves
    nothing: experiment.prepare); else the split `partition.test_fraction` carves from each
    client's training samples. None when clients have no test data of their own."""
    if data.population is not None:
        return MadeTests(data.population, data.inputs)
    if cfg.partition.name == "natural" and data.users_test is not None:
        return local_tests(data.x_test, data.y_test, split_by_owner(data.users_test, int(cfg.num_clients)), data.inputs)
    if part.test is not None:
        return local_tests(data.x_train, data.y_train, part.test, data.inputs)
    return None
