"""`selection=random`: each round, k clients drawn uniformly without replacement."""
from __future__ import annotations

import numpy as np

from raysim.algorithm import Selection
from raysim.registry import SELECTIONS


@SELECTIONS.register("random")
class UniformSelection(Selection):
    def select(self, rnd: int, k: int, rng: np.random.Generator) -> list[int]:
        return sorted(rng.choice(self.num_clients, size=k, replace=False).tolist())
