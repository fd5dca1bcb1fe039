"""Algorithm and selection plugins, one module each, registered by name on import."""
from raysim.algorithms import (  # noqa: F401  (registration)
    ccvr, creff, fed2, fedavg, fedavg_taunorm, fedavgm, fedconcat, fedentopt, fedfocal, fedgroup, fedlc, fednova, fedprox, fedrs, fesem,
    ifca, moon, scaffold, uniform,
)
