"""raysim: federated-learning simulation on Ray.

`raysim.simulate(...)` runs an experiment from Python and returns its results (see
`raysim.api`); `python -m raysim.run` is the command line."""
__version__ = "0.1.0"


def _pair_with_this_checkout() -> None:
    """In a source checkout, `raysim.algorithms` and `raysim.configs` are the top-level
    `algorithms/` and `configs/` beside this `raysim/`. An editable install maps them with
    one finder for the whole environment, to the checkout pip installed last; without this,
    running from a second clone would pair its raysim with the other clone's algorithms.
    An installed wheel has them inside raysim/ and needs nothing."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folders = {"raysim.algorithms": root / "algorithms", "raysim.configs": root / "configs"}
    if not (root / "pyproject.toml").is_file() or not all((d / "__init__.py").is_file() for d in folders.values()):
        return

    class CheckoutFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            folder = folders.get(name)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])

    sys.meta_path.insert(0, CheckoutFinder)


_pair_with_this_checkout()

_API = ("simulate", "load", "shutdown", "RunResult")


def __getattr__(name):  # the API imports on first use, so `import raysim` stays cheap
    if name in _API:
        from raysim import api

        return getattr(api, name)
    raise AttributeError(f"module 'raysim' has no attribute {name!r}")
