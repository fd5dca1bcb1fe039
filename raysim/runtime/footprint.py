"""What a run's server holds, part by part, in bytes: how `benchmarks/scale.py` shows the
state kept per idle client (what grows with the number of clients, apart from the data).

A deep size: numpy arrays and tensors by their buffers, containers and objects by their
contents, each object counted once; a config, a Ray handle or reference by its own size."""
from __future__ import annotations

import sys
import types
from typing import Optional

import numpy as np


def deep_bytes(obj, seen: set) -> int:
    """Bytes of `obj` and everything it holds that `seen` (ids) does not already count."""
    if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType)):
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return sys.getsizeof(obj) + (deep_bytes(obj.base, seen) if obj.base is not None else 0)
    if type(obj).__module__.startswith("torch"):
        import torch

        if isinstance(obj, torch.Tensor):
            return sys.getsizeof(obj) + obj.untyped_storage().nbytes()
        if isinstance(obj, torch.nn.Module):
            return sum(deep_bytes(t, seen) for t in obj.state_dict(keep_vars=True).values())
    if type(obj).__module__.split(".")[0] in ("omegaconf", "ray"):  # a config, a Ray handle or reference
        return sys.getsizeof(obj)
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        return size + sum(deep_bytes(k, seen) + deep_bytes(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return size + sum(deep_bytes(v, seen) for v in obj)
    held = getattr(obj, "__dict__", None)
    if held is not None:
        size += deep_bytes(held, seen)
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            size += deep_bytes(getattr(obj, slot), seen)
    return size


def parts_bytes(obj, expand: tuple = (), prefix: str = "", seen: Optional[set] = None) -> dict:
    """{attribute: deep bytes} of `obj`'s attributes; those named in `expand` (dotted for
    deeper ones) part by part, and first, so that what they hold is counted as theirs."""
    seen = set() if seen is None else seen
    attrs = vars(obj)
    out = {}
    for name in [n for n in expand if "." not in n and n in attrs] + [n for n in attrs if n not in expand]:
        if name in expand:
            inner = tuple(e[len(name) + 1:] for e in expand if e.startswith(name + "."))
            out.update(parts_bytes(attrs[name], inner, f"{prefix}{name}.", seen))
        else:
            out[prefix + name] = deep_bytes(attrs[name], seen)
    return out
