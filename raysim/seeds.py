"""Seeds derived from integer keys: every random draw in raysim is seeded from (seed, round,
client, stream), so a run is the same whatever runs where. Its own module so that modules
`training` imports (privacy/local.py) can use it too."""
from __future__ import annotations

import numpy as np


def seed_for(*keys: int) -> int:
    """A 63-bit seed derived from integer keys, e.g. (seed, round, client id)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> np.uint64(1))
