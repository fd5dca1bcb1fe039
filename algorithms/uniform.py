"""`selection=random`: each round, k clients drawn uniformly without replacement."""
from __future__ import annotations

import numpy as np

from raysim.contract import Selection
from raysim.registry import SELECTIONS


@SELECTIONS.register("random")
class UniformSelection(Selection):
    uniform_draw = True

    def select(self, rnd: int, k: int, rng: np.random.Generator) -> list[int]:
        # with every client there, the same draw as rng.choice(num_clients, k)
        return sorted(rng.choice(np.asarray(self.available), size=k, replace=False).tolist())
