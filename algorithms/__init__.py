"""Algorithm and selection plugins, one module each, registered by name on import."""
from algorithms import fedavg, fedavgm, fedentopt, fedprox, uniform  # noqa: F401  (registration)
