"""Cheap transport of tensors between the server and the actors.

Ray pickles a torch tensor through its storage (about 75 us for a small state dict) but
ships a numpy array as an out-of-band buffer (about 17 us, and zero-copy from the object
store). On the per-client hot path that difference is most of the per-update overhead, so
payloads, results and client state cross process boundaries as `Packed` numpy arrays and
become tensors again on the other side. Plain numpy arrays pass through unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


class Packed:
    """A CPU tensor travelling as a numpy array."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __reduce__(self):
        return Packed, (self.array,)


class Lines(tuple):
    """Data holding no tensor (numbers, strings, numpy arrays, dicts and tuples of them): the
    wire passes it as it is, without walking it. A group's sum carries a line per client; walking 500 of them
    cost ~4 ms on each side of a call (issue 73)."""

    __slots__ = ()


_PLAIN = (int, float, str, bool, type(None), Lines)


def _map(obj: Any, leaf) -> Any:
    """Apply `leaf` to every leaf of a nest of dicts, lists, tuples and dataclasses (plain
    numbers and strings pass as they are, and `Lines` unwalked)."""
    if type(obj) in _PLAIN:
        return obj
    if isinstance(obj, dict):
        return {k: _map(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, leaf) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map(getattr(obj, f.name), leaf) for f in dataclasses.fields(obj)})
    return leaf(obj)


def _pack_leaf(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.dtype != torch.bfloat16:  # numpy has no bfloat16
        return Packed(obj.detach().cpu().numpy())
    return obj


def _unpack_leaf(obj: Any) -> Any:
    if isinstance(obj, Packed):
        a = obj.array
        return torch.from_numpy(a if a.flags.writeable else a.copy())
    return obj


def pack(obj: Any) -> Any:
    """Tensors -> `Packed` numpy arrays, anywhere in `obj`."""
    return _map(obj, _pack_leaf)


def unpack(obj: Any) -> Any:
    """`Packed` arrays -> tensors (copied when the received buffer is read-only)."""
    return _map(obj, _unpack_leaf)
