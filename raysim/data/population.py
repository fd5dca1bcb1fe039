"""A population made when it is picked (issue 73): user k's samples come from a function of
(seed, k) alone, so a client that is never selected costs nothing but its size, and a run of
millions of users holds a few arrays of a few bytes per user.

`Population` is what the dataset gives (today FedProx's Synthetic with
`synthetic.generate=lazy`): each user's sample count (`sizes`), how many of them are its own
test split (`test_sizes`: the user's last samples, as `Synthetic._split` makes them), and
`make(k)`, the user's samples in order. The training rows of every user, concatenated in user
order, are the rows the rest of raysim indexes (`Shards.contiguous`: client k's rows are
`offsets[k]:offsets[k + 1]`, no index array); `rows(ix)` makes the users those rows belong to
and gathers them. `LazyRows` shows that as the `x_train` / `y_train` arrays a loader returns,
so code that gathers a client's rows (`x[rows]`) works unchanged, and code that would read all
of them (`np.asarray(x)`) stops with a message instead of making millions of users.

The same users made all at once (`synthetic.generate=per_user`) give the same samples bit for
bit: the equivalence the tests check.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


class Population:
    """Users made on demand. `dataset`, `cfg`: the registered dataset whose `user(cfg, k, size)`
    makes user k's `size` samples (a plain config dict: this object travels to the client
    actors); `sizes`, `test_sizes`: per user."""

    def __init__(self, dataset: str, cfg: dict, sizes: np.ndarray, test_sizes: np.ndarray, num_classes: int,
                 input_shape: tuple, dtype: str = "float32"):
        self.dataset, self.cfg = dataset, cfg
        self.sizes = np.asarray(sizes, dtype=np.int32)  # 4 bytes a user (15 million: 60 MB)
        self.test_sizes = np.asarray(test_sizes, dtype=np.int32)
        self.num_classes = int(num_classes)
        self.input_shape = tuple(input_shape)
        self.dtype = np.dtype(dtype)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes - self.test_sizes, dtype=np.int64)])
        self._user = None

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def n_train(self) -> int:
        return int(self.offsets[-1])

    def make(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """User k's samples, all of them (training rows first, its test split last)."""
        if self._user is None:
            from omegaconf import OmegaConf

            from raysim.registry import DATASETS

            conf = OmegaConf.create(self.cfg)
            maker = DATASETS.get(self.dataset).user
            self._user = lambda k, n: maker(conf, k, n)
        return self._user(int(k), int(self.sizes[k]))

    def train(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.make(k)
        cut = int(self.sizes[k] - self.test_sizes[k])
        return x[:cut], y[:cut]

    def test(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.make(k)
        cut = int(self.sizes[k] - self.test_sizes[k])
        return x[cut:], y[cut:]

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Training rows `rows` (into the users' training rows in user order): each user they
        touch is made once."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        x = np.empty((len(rows), *self.input_shape), self.dtype)
        y = np.empty(len(rows), np.int64)
        if len(rows) == 0:
            return x, y
        if rows.min() < 0 or rows.max() >= self.n_train:
            raise IndexError(f"training rows {int(rows.min())}..{int(rows.max())} of {self.n_train:,}")
        owner = np.searchsorted(self.offsets, rows, side="right") - 1
        order = np.argsort(owner, kind="stable")
        users, starts = np.unique(owner[order], return_index=True)
        for k, lo, hi in zip(users.tolist(), starts.tolist(), [*starts[1:].tolist(), len(rows)]):
            ux, uy = self.train(k)
            at = order[lo:hi]
            local = rows[at] - self.offsets[k]
            x[at], y[at] = ux[local], uy[local]
        return x, y

    def label_counts(self, cids) -> np.ndarray:
        """(len(cids), num_classes): the training-label counts of these users, made now."""
        out = np.zeros((len(cids), self.num_classes), np.int64)
        for i, k in enumerate(cids):
            out[i] = np.bincount(self.train(int(k))[1], minlength=self.num_classes)
        return out

    def tests(self, users) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The test splits of `users` (in the order given), concatenated, with each row's owner."""
        made = [self.test(int(k)) for k in users]
        x = (np.concatenate([m[0] for m in made]) if made else np.zeros((0, *self.input_shape), self.dtype))
        y = np.concatenate([m[1] for m in made]) if made else np.zeros(0, np.int64)
        owner = np.repeat(np.asarray(users, dtype=np.int64), [len(m[1]) for m in made]) if made else y.copy()
        return x, y, owner

    def nbytes(self) -> int:
        """What the population itself holds (its per-user arrays), not the samples it makes."""
        return int(self.sizes.nbytes + self.test_sizes.nbytes + self.offsets.nbytes)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_user"] = None
        return state


class LazyRows:
    """The training inputs (`part="x"`) or labels (`"y"`) of a `Population`, as the array a
    loader returns: gathering rows makes their users; reading every row is refused."""

    def __init__(self, population: Population, part: str):
        self.population, self.part = population, part
        n = population.n_train
        self.shape = (n, *population.input_shape) if part == "x" else (n,)
        self.dtype = population.dtype if part == "x" else np.dtype(np.int64)
        self.nbytes = 0  # nothing is held: made when gathered

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows):
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(len(self)))
        elif np.ndim(rows) == 0:
            return self[np.asarray([rows])][0]
        rows = np.asarray(rows)
        if rows.dtype == bool:
            rows = np.flatnonzero(rows)
        x, y = self.population.rows(rows)
        return x if self.part == "x" else y

    def __array__(self, dtype=None, copy=None):
        raise MadeOnDemand(f"the {len(self.population):,} users' training samples are made when a user is picked "
                           "(synthetic.generate=lazy); this needs every one of them at once: use "
                           "synthetic.generate=per_user")


class MadeOnDemand(RuntimeError):
    """Something asked for every sample of a population made on demand."""


def is_lazy(array) -> Optional[Population]:
    """The population behind a loader's array, or None for a plain array."""
    return array.population if isinstance(array, LazyRows) else None
