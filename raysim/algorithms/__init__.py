"""Algorithm and selection plugins, one module each, registered by name on import."""
from raysim.algorithms import (  # noqa: F401  (registration)
    fedavg, fedavgm, fedconcat, fedentopt, fedgroup, fedlc, fednova, fedprox, fedrs, fesem, ifca, moon, scaffold,
    uniform,
)
