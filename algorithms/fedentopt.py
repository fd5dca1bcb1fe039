"""FedEntOpt (paper 001): entropy-maximising client selection, and the KL baseline.

Before round 1 every client uploads its label-count vector once, optionally with
Laplace(0, 1/epsilon) noise added on the client (counts have sensitivity 1) and negative
noisy counts clipped to 0. Each round, FedEntOpt picks K clients among those not in a FIFO
buffer of the last B picks: the first uniformly at random, then greedily the candidate
that maximises the Shannon entropy of the summed counts. The KL baseline greedily
minimises the KL divergence of the summed label distribution to uniform, with no buffer
and no random start; since KL(p || uniform) = log C - H(p), it is the same greedy step.

Choices the paper leaves open (docs/algorithms.md): ties go to the lowest client
id; when fewer than K candidates remain, all of them are taken and the rest are the
buffer's oldest entries; a client picked again moves to the buffer's newest end.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from raysim.contract import Client, ClientResult, Selection
from raysim.data.partition import label_entropy
from raysim.options import Options, option
from raysim.registry import SELECTIONS


def greedy_max_entropy(counts: np.ndarray, candidates: list[int], k: int, start: list[int] = ()) -> list[int]:
    """Add, k - len(start) times, the candidate maximising the entropy of the summed counts
    of the clients chosen so far plus that candidate (ties: lowest id)."""
    chosen = list(start)
    total = counts[chosen].sum(0) if chosen else np.zeros(counts.shape[1])
    pool = sorted(set(candidates) - set(chosen))
    while len(chosen) < k and pool:
        gains = label_entropy(total + counts[pool])
        best = pool[int(np.argmax(gains))]  # argmax returns the first maximum: the lowest id
        chosen.append(best)
        total = total + counts[best]
        pool.remove(best)
    return chosen


def noisy_counts(counts: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """The DP upload: counts + Laplace(0, 1/epsilon) noise, clipped at 0 (epsilon <= 0: exact)."""
    counts = np.asarray(counts, dtype=np.float64)
    if epsilon <= 0:
        return counts
    return np.maximum(counts + rng.laplace(0.0, 1.0 / epsilon, counts.shape), 0.0)


class LabelCountSelection(Selection):
    """A selection strategy that learns each client's (possibly noisy) label counts once."""

    epsilon = 0.0  # Laplace DP budget for the upload; 0 = no noise
    reads_every_client = True  # every client's counts before round 1, all scanned at each pick

    def setup(self, server) -> None:
        """The counts of the clients there (all of them unless some join late)."""
        self.counts = np.zeros((self.num_clients, self.num_classes))
        self.gather(server, list(self.available))

    def clients_joined(self, rnd: int, cids: list[int], server) -> None:
        self.gather(server, cids)

    def gather(self, server, cids: list[int]) -> None:
        """Each client uploads its counts once: a round-0 call whenever it happens (its noise
        is drawn from (seed, 0, client id)), so a resumed run gathers the same counts."""
        results = server.run_clients(0, cids, {"epsilon": self.epsilon}, method="label_counts", on="selection")
        for r in results:
            self.counts[r.cid] = r.update

    # client side
    def label_counts(self, client: Client, payload: dict) -> ClientResult:
        rng = np.random.default_rng(client.generator.initial_seed())
        counts = noisy_counts(client.label_counts(), float(payload["epsilon"]), rng)
        return ClientResult(client.cid, client.num_samples, counts)


@dataclass
class FedEntOptOptions(Options):
    buffer: float = option(0.3, at_least=0, below=1, why="a fraction of num_clients")  # FIFO buffer size B
    epsilon: float = option(0.0, at_least=0, why="0 = no DP noise")  # Laplace DP on the uploaded counts


@SELECTIONS.register("fedentopt")
class FedEntOpt(LabelCountSelection):
    Options = FedEntOptOptions

    def __init__(self, cfg, num_clients: int, num_classes: int):
        super().__init__(cfg, num_clients, num_classes)
        self.epsilon = float(cfg.fedentopt.epsilon)
        self.buffer_size = int(cfg.fedentopt.buffer * num_clients)
        self.buffer: deque[int] = deque()
        self._last: list[int] = []

    def select(self, rnd: int, k: int, rng: np.random.Generator) -> list[int]:
        buffered = set(self.buffer)
        candidates = [c for c in self.available if c not in buffered]
        if len(candidates) < k:  # take every candidate, fill up with the buffer's oldest
            chosen = candidates + [c for c in self.buffer][: k - len(candidates)]
        else:
            first = int(rng.choice(candidates))
            chosen = greedy_max_entropy(self.counts, candidates, k, start=[first])
        for c in chosen:
            if c in buffered:
                self.buffer.remove(c)
            self.buffer.append(c)
        while len(self.buffer) > self.buffer_size:
            self.buffer.popleft()
        self._last = chosen
        return chosen

    def state_dict(self) -> dict:
        return {"buffer": list(self.buffer), "last": list(self._last)}

    def load_state_dict(self, state: dict) -> None:
        self.buffer, self._last = deque(state["buffer"]), list(state["last"])

    def round_metrics(self) -> dict:
        """Entropy of the cohort's summed counts as the server sees them (noisy under DP)."""
        return {"selection_entropy": float(label_entropy(self.counts[self._last].sum(0)))} if self._last else {}


@SELECTIONS.register("kl")
class KLSelection(LabelCountSelection):
    """Greedy minimum KL divergence to uniform from the empty cohort, no buffer."""

    def select(self, rnd: int, k: int, rng: np.random.Generator) -> list[int]:
        return greedy_max_entropy(self.counts, list(self.available), k)
