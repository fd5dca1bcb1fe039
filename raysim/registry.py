"""Name -> object registries for the pluggable parts of a run.

Users pick parts by name in the config (`dataset=mnist`, `algorithm=fedprox`); each part
registers itself with a decorator in its own module. `load_plugins()` imports the modules
that hold the built-in parts so that every registry is full before a config is checked.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict


class Registry:
    """A named table of factories, with a clear error for unknown names."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: Dict[str, Any] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        def deco(obj: Any) -> Any:
            old = self._items.get(name)
            if old is not None and old is not obj and _origin(old) != _origin(obj):
                raise ValueError(f"{self.kind} {name!r} is registered twice: by {_origin(old)[0]} and by "
                                 f"{_origin(obj)[0]}; give one of them another name")
            # the same module and name again (a plugin re-imported or reloaded): the new one replaces
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> Any:
        load_plugins()
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return self._items[name]

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        load_plugins()
        return name in self._items


DATASETS = Registry("dataset")
PARTITIONS = Registry("partition")
MODELS = Registry("model")
ALGORITHMS = Registry("algorithm")
SELECTIONS = Registry("selection")
AGGREGATORS = Registry("aggregator")  # server.aggregator (raysim/aggregation/aggregators.py)
SERVER_OPTIMIZERS = Registry("server optimizer")  # server.optimizer (raysim/aggregation/optimizers.py)

# Modules whose import registers the built-in parts. An external plugin adds its module
# name here (or imports itself before the run starts).
PLUGIN_MODULES = [
    "raysim.data.datasets",
    "raysim.data.leaf",
    "raysim.data.hf",
    "raysim.data.partition",
    "raysim.models",
    "raysim.aggregation",
    "raysim.algorithms",
]

_loaded = False


def _origin(obj: Any) -> tuple:
    return getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)


def module_of(obj: Any) -> str:
    return getattr(obj, "__module__", "") or ""


def import_modules(names) -> None:
    """Import user plugin modules (config key `plugins`), which register themselves. Any
    error while importing one (not found, a SyntaxError, an exception its code raises) is
    one `ConfigError` line naming the module and its own file and line."""
    from raysim.errors import ConfigError

    for name in names:
        try:
            importlib.import_module(str(name))
        except ModuleNotFoundError as e:
            raise ConfigError(f"plugins: cannot import module {name!r}: {e}") from None
        except SyntaxError as e:
            raise ConfigError(f"plugins: module {name!r} has a syntax error: {e.msg} at {e.filename}:{e.lineno}") from None
        except Exception as e:  # noqa: BLE001  (the plugin's own code raised while importing)
            raise ConfigError(f"plugins: importing module {name!r} failed: {type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}{_where(e)}") from None


def _where(e: BaseException) -> str:
    """' at FILE:LINE' of the innermost frame outside Python's import machinery."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "importlib" not in f.filename
              and not f.filename.endswith("registry.py")]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def load_plugins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in PLUGIN_MODULES:
        importlib.import_module(mod)
