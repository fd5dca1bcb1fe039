"""Algorithm and selection plugins, one module each, registered by name on import.

Every module in this folder is imported (so adding an algorithm is adding its file); a
module whose name starts with `_` is not."""
import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")
