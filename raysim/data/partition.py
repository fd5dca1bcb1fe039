"""Partitioners: who holds which training sample (NIID-Bench vocabulary).

Each partitioner maps the training labels to one index array per client, drawn only from
the given `numpy.random.Generator`, so a partition is a function of (labels, config, seed).
`make_partition` adds the guards every partition gets (no client below `min_size`) and the
optional local test split; `label_table` prints the per-client label counts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
from omegaconf import DictConfig

from raysim.errors import ConfigError
from raysim.registry import PARTITIONS


class Shards(Sequence):
    """Per-client index arrays held as two arrays: client c's indices are
    `order[offsets[c]:offsets[c + 1]]` (a view). 8 bytes per client and 8 per sample, and no
    Python object per client, so a partition of millions of clients is two arrays to hold and
    to send to the client actors (a list of one array per client: ~100 bytes each, and as
    many objects to pickle; issue 73). `order` None: each client's rows are consecutive, in
    client order (`contiguous`: a population made when picked, data/population.py), and only
    the offsets are held."""

    __slots__ = ("_order", "offsets")

    def __init__(self, order: Optional[np.ndarray], offsets: np.ndarray):
        self._order, self.offsets = order, offsets

    @classmethod
    def contiguous(cls, offsets: np.ndarray) -> "Shards":
        """Client c's rows are offsets[c]:offsets[c + 1]: no index array at all."""
        return cls(None, np.asarray(offsets, dtype=np.int64))

    @property
    def order(self) -> np.ndarray:
        """Every client's rows, client after client (made, for contiguous shards)."""
        return np.arange(int(self.offsets[-1]), dtype=np.int64) if self._order is None else self._order

    @classmethod
    def of(cls, parts) -> "Shards":
        """From one index array per client (a Shards is kept as it is)."""
        if isinstance(parts, Shards):
            return parts
        sizes = np.fromiter((len(ix) for ix in parts), np.int64, len(parts))
        order = (np.concatenate([np.asarray(ix, dtype=np.int64) for ix in parts]) if len(parts)
                 else np.zeros(0, np.int64))
        return cls(order, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, c):
        if isinstance(c, slice):
            return [self[i] for i in range(*c.indices(len(self)))]
        c = int(c)
        if c < 0:
            c += len(self)
        if not 0 <= c < len(self):
            raise IndexError(f"client {c} of {len(self)}")
        if self._order is None:
            return np.arange(self.offsets[c], self.offsets[c + 1], dtype=np.int64)
        return self._order[self.offsets[c]:self.offsets[c + 1]]

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sizes_of(self, cids) -> np.ndarray:
        """The sizes of clients `cids` (without the N sizes `sizes()` makes)."""
        cids = np.asarray(cids, dtype=np.int64)
        return self.offsets[cids + 1] - self.offsets[cids]

    def rows(self, cids) -> np.ndarray:
        """The indices of clients `cids`, one client's after another's: `np.concatenate([self[c]
        for c in cids])` without a Python step per client (a vectorised group of 500: 0.1 ms
        instead of 3)."""
        cids = np.asarray(cids, dtype=np.int64)
        starts, lens = self.offsets[cids], self.sizes_of(cids)
        at = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()), dtype=np.int64)
        return at if self._order is None else self._order[at]

    def owners(self) -> np.ndarray:
        """The client of each entry of `order`."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.sizes())

    def __reduce__(self):
        return Shards, (self._order, self.offsets)


@dataclass
class Partition:
    """Per-client index arrays into the training arrays (`train`) and, optionally, a local
    test split taken from each client's own samples (`test`, also into the training arrays),
    each held as `Shards` (lists of arrays given are converted)."""

    train: Shards
    test: Optional[Shards] = None

    def __post_init__(self) -> None:
        self.train = Shards.of(self.train)
        self.test = None if self.test is None else Shards.of(self.test)

    def sizes(self) -> np.ndarray:
        return self.train.sizes()


@PARTITIONS.register("iid")
def iid(y, n, p, rng, num_classes, users=None):
    """Uniformly shuffled, equal-sized shards."""
    return [np.sort(ix) for ix in np.array_split(rng.permutation(len(y)), n)]


@PARTITIONS.register("contiguous")
def contiguous(y, n, p, rng, num_classes, users=None):
    """Equal consecutive runs of the stored order: each client's shard is one sequential read
    from `data_store=files` (a dataset larger than memory reads iid shards, which lie all over
    the file, a sample at a time: 50x slower, measured). IID only where the stored order is
    random already, as in generated data; a class-sorted dataset would give each client a
    class or two."""
    return np.array_split(np.arange(len(y)), n)


def _redraw(draw, p, name: str, n: int, total: int, rng) -> list[np.ndarray]:
    """NIID-Bench's rule: redraw until every client holds at least `partition.min_size`
    samples (default 10). NIID-Bench redraws forever; we stop after `partition.max_draws`
    draws, or as soon as the draws so far leave on average 10 or more clients short (a
    redraw then succeeds with probability about e^-10: 100,000 clients of 20 samples leave
    thousands short, and each draw costs 0.5 s), and repair the draw whose smallest client
    is largest: the clients still short take random samples from the largest ones."""
    if n * p.min_size > total:
        raise ConfigError(f"partition {name!r}: {n} clients x partition.min_size={p.min_size} exceeds the "
                          f"{total} training samples; use fewer clients or a smaller min_size")
    best, best_smallest, short = None, -1, 0
    for draws in range(1, int(p.max_draws) + 1):
        parts = draw()
        sizes = np.fromiter((len(ix) for ix in parts), np.int64, len(parts))
        if sizes.min() >= p.min_size:
            return parts
        if sizes.min() > best_smallest:
            best, best_smallest = parts, int(sizes.min())
        short += int((sizes < p.min_size).sum())
        if short >= 10 * draws:
            break
    return _top_up(best, int(p.min_size), rng)


def _top_up(parts: list[np.ndarray], min_size: int, rng) -> list[np.ndarray]:
    """Bring every client to `min_size` with random samples of the largest clients, taken
    down to a common level (water-filling from the top, never below min_size); the pooled
    samples go to the short clients in client order. Vectorised: 100,000 clients take
    well under a second."""
    parts = [np.asarray(ix) for ix in parts]
    sizes = np.fromiter((len(ix) for ix in parts), np.int64, len(parts))
    need = np.maximum(0, min_size - sizes)
    total = int(need.sum())
    if total == 0:
        return parts
    over = lambda level: int(np.maximum(0, sizes - level).sum())  # noqa: E731  samples above a level
    lo, hi = min_size, int(sizes.max())  # largest level whose surplus covers the need: over(lo) >= total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if over(mid) >= total else (lo, mid - 1)
    give = np.maximum(0, sizes - (lo + 1))
    extra = total - int(give.sum())  # one more from each of the first `extra` clients above the level
    above = np.flatnonzero(sizes > lo)
    give[above[np.argsort(-sizes[above], kind="stable")][:extra]] += 1
    pool = []
    for d in np.flatnonzero(give):
        take = rng.choice(len(parts[d]), int(give[d]), replace=False)
        pool.append(parts[d][take])
        parts[d] = np.delete(parts[d], take)
    pool = np.concatenate(pool)
    starts = np.concatenate([[0], np.cumsum(need)])
    for i in np.flatnonzero(need):
        parts[i] = np.sort(np.concatenate([parts[i], pool[starts[i]:starts[i + 1]]]))
    return parts


@PARTITIONS.register("dirichlet")
def dirichlet(y, n, p, rng, num_classes, users=None):
    """Label skew dir(beta), NIID-Bench's `noniid-labeldir`: for each class, its samples are
    split among the clients in proportions ~ Dirichlet(beta); clients already above the mean
    size get no more (NIID-Bench's balancing); redrawn until every client has min_size."""
    by_class = [np.flatnonzero(y == c) for c in range(num_classes)]

    def draw():
        owner = np.empty(len(y), dtype=np.int64)
        sizes = np.zeros(n, dtype=np.int64)
        for c in range(num_classes):
            ids = rng.permutation(by_class[c])
            prop = rng.dirichlet(np.full(n, p.beta))
            prop = prop * (sizes < len(y) / n)
            prop = prop / prop.sum() if prop.sum() > 0 else np.full(n, 1.0 / n)
            cuts = (np.cumsum(prop) * len(ids)).astype(int)[:-1]
            counts = np.diff(np.concatenate([[0], cuts, [len(ids)]]))
            owner[ids] = np.repeat(np.arange(n), counts)
            sizes += counts
        return split_by_owner(owner, n)

    return _redraw(draw, p, "dirichlet", n, len(y), rng)


def split_by_owner(owner: np.ndarray, n: int) -> list[np.ndarray]:
    """Sorted index arrays of the samples each client owns (owner[i] = client of sample i)."""
    order = np.argsort(owner, kind="stable")
    return np.split(order, np.cumsum(np.bincount(owner, minlength=n))[:-1])


@PARTITIONS.register("classes")
def classes(y, n, p, rng, num_classes, users=None):
    """Quantity label skew #C=k: each client holds exactly k distinct labels; the samples of
    a label are split evenly among the clients holding it. Client i's first label is
    i mod C so every label is held when there are at least C clients; labels nobody holds
    are left out (NIID-Bench does the same)."""
    if p.k > num_classes:
        raise ConfigError(f"partition.k={p.k} is more than the dataset's {num_classes} classes; allowed: 1..{num_classes}")
    held = []
    for i in range(n):
        first = i % num_classes
        others = rng.permutation([c for c in range(num_classes) if c != first])[: p.k - 1]
        held.append([first, *others.tolist()])
    idx = [[] for _ in range(n)]
    for c in range(num_classes):
        owners = [i for i in range(n) if c in held[i]]
        if not owners:
            continue
        for i, part in zip(owners, np.array_split(rng.permutation(np.flatnonzero(y == c)), len(owners))):
            idx[i].extend(part.tolist())
    return [np.sort(np.asarray(i, dtype=np.int64)) for i in idx]


@PARTITIONS.register("shards")
def shards(y, n, p, rng, num_classes, users=None):
    """FedAvg's pathological split: sort by label, cut into n * shards_per_client shards,
    give each client shards_per_client random shards."""
    order = np.argsort(y, kind="stable")
    pieces = np.array_split(order, n * p.shards_per_client)
    perm = rng.permutation(len(pieces))
    s = p.shards_per_client
    return [np.sort(np.concatenate([pieces[j] for j in perm[i * s:(i + 1) * s]])) for i in range(n)]


def _by_sizes(y, sizes_prop, rng):
    perm = rng.permutation(len(y))
    cuts = (np.cumsum(sizes_prop) * len(y)).astype(int)[:-1]
    return [np.sort(part) for part in np.split(perm, cuts)]


@PARTITIONS.register("quantity")
def quantity(y, n, p, rng, num_classes, users=None):
    """Quantity skew: IID labels, client sizes in proportions ~ Dirichlet(beta)."""
    return _redraw(lambda: _by_sizes(y, rng.dirichlet(np.full(n, p.beta)), rng), p, "quantity", n, len(y), rng)


@PARTITIONS.register("power_law")
def power_law(y, n, p, rng, num_classes, users=None):
    """Heavy-tailed sizes with IID labels: client sizes ~ log-normal(0, sigma), each client
    guaranteed min_size samples. FedProx's MNIST recipe, which also skews the labels (each
    client 2 digits), is `classes_power_law`."""
    extra = len(y) - n * p.min_size
    if extra < 0:
        raise ConfigError(f"partition 'power_law': {n} clients x partition.min_size={p.min_size} exceeds the {len(y)} samples")
    w = rng.lognormal(0, p.sigma, n)
    sizes = p.min_size + np.floor(w / w.sum() * extra).astype(int)
    sizes[np.argmax(w)] += len(y) - sizes.sum()
    perm = rng.permutation(len(y))
    return [np.sort(part) for part in np.split(perm, np.cumsum(sizes)[:-1])]  # exact sizes, no float cuts


@PARTITIONS.register("classes_power_law")
def classes_power_law(y, n, p, rng, num_classes, users=None):
    """FedProx's MNIST recipe (Li et al. 2020, data/mnist/generate_niid.py; the FedGroup
    paper's MNIST): client i holds the k consecutive labels i, i+1, ..., i+k-1 (mod C), each
    of its (client, label) slots first gets ceil(min_size / k) samples, then a log-normal(0,
    sigma) share of what is left of that label: heavy-tailed sizes and exactly k labels."""
    if p.k > num_classes:
        raise ConfigError(f"partition.k={p.k} is more than the dataset's {num_classes} classes; allowed: 1..{num_classes}")
    base = -(-int(p.min_size) // int(p.k))
    idx = [[] for _ in range(n)]
    for c in range(num_classes):
        holders = [i for i in range(n) for j in range(p.k) if (i + j) % num_classes == c]
        if not holders:
            continue
        pool = rng.permutation(np.flatnonzero(y == c))
        left = len(pool) - base * len(holders)
        if left < 0:
            raise ConfigError(f"partition 'classes_power_law': label {c} has {len(pool)} samples, fewer than "
                              f"{len(holders)} clients x {base} (partition.min_size={p.min_size} over k={p.k} labels); "
                              "use fewer clients or a smaller partition.min_size")
        w = rng.lognormal(0, p.sigma, len(holders))
        extra = np.floor(w / w.sum() * left).astype(int)
        extra[np.argmax(w)] += left - extra.sum()
        for i, part in zip(holders, np.split(pool, np.cumsum(base + extra)[:-1])):
            idx[i].extend(part.tolist())
    return [np.sort(np.asarray(i, dtype=np.int64)) for i in idx]


@PARTITIONS.register("natural")
def natural(y, n, p, rng, num_classes, users=None):
    """The dataset's own users (e.g. FedProx Synthetic's), one per client."""
    if users is None:
        raise ConfigError("partition 'natural' needs a dataset with natural users (synthetic, femnist, sent140); "
                          "choose another partition for this dataset")
    n_users = int(users.max()) + 1
    if n != n_users:
        raise ConfigError(f"partition 'natural': the dataset has {n_users} users but num_clients={n}")
    if len(users) < 2 or bool((users[1:] >= users[:-1]).all()):  # stored user after user (LEAF's, Synthetic's):
        counts = np.bincount(users, minlength=n)  # an offset per user, no index array
        return Shards.contiguous(np.concatenate([[0], np.cumsum(counts)]))
    return split_by_owner(users, n)


def make_partition(y: np.ndarray, cfg: DictConfig, num_classes: int, users: Optional[np.ndarray] = None,
                   own_test: bool = False) -> Partition:
    """Partition `y` per `cfg.partition`, seeded by `cfg.seed`, and check every client has data.
    `own_test`: the clients have test data of their own already (natural users with their own
    test samples, runtime/local_eval.py), so `partition.test_fraction` carves nothing."""
    p, n = cfg.partition, int(cfg.num_clients)
    if n > len(y):
        raise ConfigError(f"num_clients={n} is more than the {len(y)} training samples of dataset {cfg.dataset!r}")
    rng = np.random.default_rng([int(cfg.seed), 1])
    parts = PARTITIONS.get(p.name)(y, n, p, rng, num_classes, users)
    sizes = parts.sizes().tolist() if isinstance(parts, Shards) else [len(ix) for ix in parts]
    # the dataset's own users are what they are (a LEAF user may hold 5 samples): never empty
    floor = 1 if p.name == "natural" else int(p.min_size)
    small = [i for i, s in enumerate(sizes) if s < floor]
    if small:
        rule = "no samples" if p.name == "natural" else f"below partition.min_size={p.min_size}"
        raise ConfigError(
            f"partition {p.name!r} leaves client {small[0]} with {sizes[small[0]]} samples "
            f"({len(small)} clients {rule}); use fewer clients or other partition settings"
        )
    test = None
    if p.test_fraction > 0 and not own_test:
        train, test = [], []
        for ix in parts:
            ix = rng.permutation(ix)
            n_test = int(len(ix) * p.test_fraction)
            if len(ix) - n_test < 1:
                raise ConfigError(f"partition.test_fraction={p.test_fraction} leaves a client no training samples")
            train.append(np.sort(ix[n_test:]))
            test.append(np.sort(ix[:n_test]))
        parts = train
    return Partition(parts, test)


def label_counts(y: np.ndarray, part: Partition, num_classes: int) -> np.ndarray:
    """(num_clients, num_classes) matrix of training-label counts (one bincount over every
    sample, not one per client; a population made when picked makes its users for it)."""
    from raysim.data.population import is_lazy

    if is_lazy(y) is not None:
        return is_lazy(y).label_counts(range(len(part.train)))
    shards = part.train
    flat = shards.owners() * num_classes + np.asarray(y)[shards.order]
    return np.bincount(flat, minlength=len(shards) * num_classes).reshape(len(shards), num_classes)


def label_entropy(counts: np.ndarray) -> np.ndarray:
    """Shannon entropy (nats) of the label distribution(s) given by count vector(s) along the
    last axis; 0 log 0 = 0, and an all-zero vector has entropy 0."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(-1, keepdims=True)
    p = counts / np.where(total > 0, total, 1)
    return -(p * np.log(np.where(p > 0, p, 1))).sum(-1)


def label_table(y: np.ndarray, part: Partition, num_classes: int, max_rows: int = 0) -> str:
    """Human-readable per-client label-count table (a population made when picked: its first
    `max_rows` users only, made for it, and no total over the users not made)."""
    from raysim.data.population import is_lazy

    pop = is_lazy(y)
    partial = pop is not None and 0 < max_rows < len(pop)
    counts = pop.label_counts(range(max_rows)) if partial else label_counts(y, part, num_classes)
    w = max(5, len(str(counts.max())) + 1)
    head = "client" + "".join(f"{c:>{w}}" for c in range(num_classes)) + f"{'total':>8}"
    rows = [head]
    shown = counts if max_rows <= 0 else counts[:max_rows]
    for i, row in enumerate(shown):
        rows.append(f"{i:>6}" + "".join(f"{v:>{w}}" for v in row) + f"{row.sum():>8}")
    if partial:
        return "\n".join(rows + [f"... ({len(pop) - max_rows:,} more users, made when picked: not listed)"])
    if len(shown) < len(counts):
        rows.append(f"... ({len(counts) - len(shown)} more clients)")
    rows.append(f"{'all':>6}" + "".join(f"{v:>{w}}" for v in counts.sum(0)) + f"{counts.sum():>8}")
    return "\n".join(rows)
