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
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
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

# Modules whose import registers the built-in parts. An external plugin adds its module
# name here (or imports itself before the run starts).
PLUGIN_MODULES = [
    "raysim.data.datasets",
    "raysim.data.leaf",
    "raysim.data.partition",
    "raysim.models",
    "raysim.algorithms",
]

_loaded = False


def import_modules(names) -> None:
    """Import user plugin modules (config key `plugins`), which register themselves."""
    from raysim.config import ConfigError

    for name in names:
        try:
            importlib.import_module(str(name))
        except ImportError as e:
            raise ConfigError(f"plugins: cannot import module {name!r}: {e}") from None


def load_plugins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in PLUGIN_MODULES:
        importlib.import_module(mod)
