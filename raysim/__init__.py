"""raysim: federated-learning simulation on Ray.

`raysim.simulate(...)` runs an experiment from Python and returns its results (see
`raysim.api`); `python -m raysim.run` is the command line."""
__version__ = "0.1.0"

_API = ("simulate", "load", "shutdown", "RunResult")


def __getattr__(name):  # the API imports on first use, so `import raysim` stays cheap
    if name in _API:
        from raysim import api

        return getattr(api, name)
    raise AttributeError(f"module 'raysim' has no attribute {name!r}")
