"""raysim: federated-learning simulation on Ray."""
__version__ = "0.1.0"
