"""Secure aggregation, simulated (`privacy.secure_aggregation`): the server sees only the
sum of a round's updates, and the round is charged what a real protocol would cost. Not
cryptographically executed: no keys, masks or shares are made; the simulation computes the
same sum the masks would cancel to and records the protocol's bytes and its failures.

What the server reads: the round's results reach the algorithm as one sample-weighted sum
(`training.partial_sum`, folded in client-id order: FedAvg's result is bit for bit the one
without it) with each client's sample count and metrics (its training loss), which real
deployments send beside the secure sum. Algorithms that need each update (a robust
aggregator, central DP's per-update clipping) are refused by the config.

The protocols (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving
Machine Learning", the semi-honest version; Bell et al. 2020, "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead", SecAgg+): each client of a cohort of n masks
its update with pairwise masks shared with its k neighbours (SecAgg: everyone, k = n - 1;
SecAgg+: a random Harary graph of degree k = `privacy.secagg_neighbours`, default
2 * ceil(log2 n / 2), O(log n)) plus a self mask, and Shamir-shares the two seeds with its
neighbours. Per client and round, with public keys and shares of 32 bytes (X25519,
256-bit secrets) and authenticated encryption adding 24 bytes a message:

    up   = 2 * 32                      advertise its two public keys
         + k * (2 * 32 + 24)           its two seeds' shares, encrypted to each neighbour
         + ceil(m * R / 8)             the masked update: m entries in a field of R bits
         + k * 32                      to unmask, a share for each neighbour (its self-mask
                                        seed's for a survivor, its mask key's for a dropped one)
    down = k * 2 * 32 + k * (2 * 32 + 24) + 4 * n   the neighbours' keys and shares, the survivors

against 4 * m bytes for a plain float32 update. A dropped client (it did not return) leaves
its pairwise masks in the sum: the server rebuilds them from its surviving neighbours'
shares, one PRG expansion of m entries per (dropped client, surviving neighbour), besides one
per survivor's self mask (`secagg_prg_expansions`). Every client needs at least
t = ceil(`privacy.secagg_threshold` * k) surviving neighbours for its seed to be rebuilt;
otherwise the round fails: the server learns nothing and the model stays
(`secagg_failed`). Which neighbours a client has is drawn from (seed, round).
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np

from raysim.contract import ClientResult
from raysim.training import WeightedMean, seed_for

KEY_BYTES = SHARE_BYTES = 32
SEAL_BYTES = 24  # authenticated encryption's tag and nonce, a message
GRAPH_STREAM = 0x53414747  # "SAGG": the neighbours' draw


class SecureAggregation:
    def __init__(self, protocol: str, bits: int, threshold: float, neighbours: Optional[int], seed: int):
        self.protocol, self.bits, self.threshold = protocol, int(bits), float(threshold)
        self.k_asked = neighbours
        self.seed = int(seed)
        self.metrics: dict = {}

    @classmethod
    def from_config(cls, cfg) -> Optional["SecureAggregation"]:
        pv = cfg.privacy
        if pv.secure_aggregation == "none":
            return None
        return cls(pv.secure_aggregation, pv.secagg_bits, pv.secagg_threshold, pv.secagg_neighbours, cfg.seed)

    def degree(self, n: int) -> int:
        """k, each client's neighbours in a cohort of n."""
        if self.protocol == "secagg" or n <= 2:
            return max(n - 1, 0)
        k = self.k_asked if self.k_asked is not None else 2 * math.ceil(math.log2(n) / 2)
        return min(n - 1, int(k))

    def neighbours(self, rnd: int, n: int) -> list[np.ndarray]:
        """Each cohort member's neighbours (positions in the cohort): the complete graph, or a
        Harary graph of degree k (k / 2 nearest on each side of a cycle, odd k: also the one
        opposite) over an order drawn from (seed, round)."""
        k = self.degree(n)
        if k >= n - 1:
            return [np.array([j for j in range(n) if j != i]) for i in range(n)]
        order = np.random.default_rng(seed_for(self.seed, rnd, GRAPH_STREAM)).permutation(n)
        at = np.empty(n, dtype=np.int64)
        at[order] = np.arange(n)
        steps = list(range(1, k // 2 + 1))
        out = []
        for i in range(n):
            ring = {int(order[(at[i] + s) % n]) for s in steps} | {int(order[(at[i] - s) % n]) for s in steps}
            if k % 2:
                ring.add(int(order[(at[i] + n // 2) % n]))
            out.append(np.array(sorted(ring)))
        return out

    def round(self, rnd: int, cohort: list[int], results: Iterator[ClientResult]) -> Iterator[ClientResult]:
        """The round's results as the server may read them: one summed result (none if every
        client dropped or the protocol failed). Sets `metrics` for the round's row. Lazy, as
        the runtime's results are: the clients' tasks run while the caller prepares."""
        mean, loss, clients = WeightedMean(), 0.0, []
        for r in results:
            if r.clients is None:
                mean.add(r.update, r.num_samples)
                clients.append((r.cid, r.num_samples, r.metrics, r.state_changed))
            else:  # a block summed where it ran (server.partial_sums)
                mean.add_sum(r.update, r.num_samples)
                clients.extend(r.clients)
            loss += r.metrics["loss"] * r.num_samples
        alive = {int(c[0]) for c in clients}
        m = sum(int(v.numel()) for v in mean.acc.values()) if mean.acc is not None else 0
        failed = self.account(rnd, list(cohort), alive, m)
        if failed or mean.acc is None:
            return
        yield ClientResult(clients[0][0], int(mean.total), mean.acc, {"loss": loss / mean.total if mean.total else 0.0},
                           clients=clients)

    def account(self, rnd: int, cohort: list[int], alive: set, m: int) -> bool:
        """The protocol's cost this round and whether it failed (module docstring)."""
        n = len(cohort)
        if n == 0:
            self.metrics = {}
            return True
        k = self.degree(n)
        graph = self.neighbours(rnd, n)
        up_alive = [int(sum(cohort[j] in alive for j in graph[i])) for i in range(n)]
        need = max(1, math.ceil(self.threshold * k)) if k else 0
        failed = any(u < need for u in up_alive) or not alive
        masked = math.ceil(m * self.bits / 8)
        up = 2 * KEY_BYTES + k * (2 * SHARE_BYTES + SEAL_BYTES) + masked + k * SHARE_BYTES  # a survivor's
        down = k * 2 * KEY_BYTES + k * (2 * SHARE_BYTES + SEAL_BYTES) + 4 * n
        dropped = [i for i in range(n) if cohort[i] not in alive]
        self.metrics = {
            "secagg_neighbours": k,
            "secagg_survivors": len(alive),
            "secagg_failed": int(failed),
            "secagg_bytes_up_per_client": float(up),
            "secagg_bytes_down_per_client": float(down),
            "secagg_upload_vs_plain": up / (4 * m) if m else None,
            "secagg_prg_expansions": len(alive) + sum(up_alive[i] for i in dropped),
        }
        return failed
