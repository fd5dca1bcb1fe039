"""The CSV traces of the simulated world: devices (`system.trace`, clock.py) and online
intervals (`system.availability_trace`, online.py).

A trace may have millions of rows (FedScale's device and behaviour traces have hundreds of
thousands of clients). Each process that needs one reads it once, with pyarrow's C++ CSV
reader into one float64 array per column: memory is the numbers (8 bytes a cell), not a
Python object per row, and the checks are vectorised. A file that reader does not take (a
word for a number, a missing cell, a short row) or whose numbers break a rule is read again
row by row, streaming, only to name the first bad row in a one-line `ConfigError`.
"""
from __future__ import annotations

import csv
import functools
import os
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from raysim.errors import ConfigError

MBIT = 1e6 / 8  # bytes per second in a Mbit/s
DEVICE_COLUMNS = ("gflops", "down_mbps", "up_mbps", "latency_s")
INTERVAL_COLUMNS = ("client", "start_s", "end_s")


def _open(key: str, path: str):
    try:
        return open(Path(path).expanduser(), newline="")
    except OSError as e:
        raise ConfigError(f"{key}={path}: cannot read it ({e.strerror})") from None


def _check_header(key: str, path: str, header: tuple) -> None:
    with _open(key, path) as f:
        try:
            first = f.readline(1 << 16)
        except (OSError, UnicodeDecodeError):
            first = ""
    if [c.strip() for c in next(csv.reader([first]), [])] != list(header):
        raise ConfigError(f"{key}={path}: the first row must be the header {','.join(header)}")


def rows(key: str, path: str, header: tuple) -> Iterator[tuple[int, list[str]]]:
    """(row number, cells) after the header, blank rows skipped, streamed: the slow path
    that finds the first bad row."""
    _check_header(key, path, header)
    with _open(key, path) as f:
        try:
            for i, row in enumerate(csv.reader(f), start=1):
                if i > 1 and row and "".join(row).strip():
                    yield i, row
        except (csv.Error, UnicodeDecodeError) as e:
            raise ConfigError(f"{key}={path}: not a CSV file ({e})") from None


def _columns(key: str, path: str, header: tuple) -> Optional[np.ndarray]:
    """The trace as an (n, columns) float64 array, read by pyarrow; None when pyarrow
    cannot read every cell as a number (the row-by-row path then says where)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    _check_header(key, path, header)
    try:
        table = pcsv.read_csv(Path(path).expanduser(),
                              read_options=pcsv.ReadOptions(skip_rows=1, column_names=list(header)),
                              convert_options=pcsv.ConvertOptions(column_types=dict.fromkeys(header, pa.float64())))
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError):
        return None
    except OSError as e:
        raise ConfigError(f"{key}={path}: cannot read it ({e.strerror or e})") from None
    if any(table.column(c).null_count for c in header):
        return None
    out = np.empty((table.num_rows, len(header)))
    for j, c in enumerate(header):
        out[:, j] = table.column(c).to_numpy()
        table = table.drop_columns([c])  # each column freed once copied
    return out


def _first_bad(key: str, path: str, header: tuple, ok: Callable[[list[float]], bool], rule: str) -> None:
    """Raise a ConfigError naming the first row that is not `len(header)` numbers passing `ok`."""
    for i, row in rows(key, path, header):
        try:
            v = [float(x) for x in row]
        except ValueError:
            v = []
        if len(v) != len(header) or not ok(v):
            raise ConfigError(f"{key}={path}, row {i}: {','.join(row)[:80]!r} is not {','.join(header)} ({rule})")


def _stamp(path: str) -> tuple:
    """(the file, its modification time, its size): what says it is the one read before."""
    try:
        st = os.stat(Path(path).expanduser())
        return str(Path(path).expanduser().resolve()), st.st_mtime_ns, st.st_size
    except OSError:
        return None


def read_devices(path: str) -> dict[str, np.ndarray]:
    """A device trace (clock.py): {speed (FLOP/s), down, up (bytes/s), latency (s)}, one
    entry per row, or a ConfigError naming the file and the first bad row. Kept for the
    next call in this process while the file is unchanged (the run's checks and its clock
    read it once); the arrays are read-only."""
    return _devices(str(path), _stamp(path))


@functools.lru_cache(maxsize=1)
def _devices(path: str, stamp) -> dict[str, np.ndarray]:
    key = "system.trace"
    rule = ("gflops, down_mbps and up_mbps > 0: a device without compute or bandwidth never finishes an update; "
            "latency_s >= 0")

    def ok(v: list[float]) -> bool:
        return bool(np.isfinite(v).all()) and min(v[:3]) > 0 and v[3] >= 0

    a = _columns(key, path, DEVICE_COLUMNS)
    if a is None or not (np.isfinite(a).all() and (a[:, :3] > 0).all() and (a[:, 3] >= 0).all()):
        _first_bad(key, path, DEVICE_COLUMNS, ok, rule)
        a = np.array([[float(x) for x in row] for _, row in rows(key, path, DEVICE_COLUMNS)]).reshape(-1, 4)
    if not len(a):
        raise ConfigError(f"{key}={path}: no device rows after the header")
    out = {"speed": a[:, 0] * 1e9, "down": a[:, 1] * MBIT, "up": a[:, 2] * MBIT, "latency": a[:, 3].copy()}
    for v in out.values():
        v.flags.writeable = False
    return out


class Intervals:
    """Online intervals of the trace's clients, in one sorted block (not an array per
    client): client k's are `start[offset[k]:offset[k + 1]]` and `end[...]`, sorted and
    disjoint; `ids[k]` is its id in the file."""

    def __init__(self, ids: np.ndarray, offset: np.ndarray, start: np.ndarray, end: np.ndarray):
        self.ids, self.offset, self.start, self.end = ids, offset, start, end

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def period(self) -> float:
        return float(self.end.max())

    def around(self, k: int, t: float, shift: float = 0.0) -> Optional[float]:
        """`shift + end` of client k's interval, shifted by `shift`, that holds time `t`
        (`shift + start <= t < shift + end`, compared as written: the binary search on
        `t - shift` may be one off by rounding), or None."""
        lo, hi = int(self.offset[k]), int(self.offset[k + 1])
        i = lo + int(np.searchsorted(self.start[lo:hi], t - shift, side="right")) - 1
        for j in (i - 1, i, i + 1):
            if lo <= j < hi and shift + self.start[j] <= t < shift + self.end[j]:
                return float(shift + self.end[j])
        return None

    def first_start_after(self, k: int, t: float, shift: float = 0.0) -> Optional[float]:
        """The first `shift + start` of client k's intervals later than `t`, or None."""
        lo, hi = int(self.offset[k]), int(self.offset[k + 1])
        i = lo + int(np.searchsorted(self.start[lo:hi], t - shift, side="right"))
        while i > lo and shift + self.start[i - 1] > t:  # rounding: as written, `shift + start > t`
            i -= 1
        while i < hi and shift + self.start[i] <= t:
            i += 1
        return float(shift + self.start[i]) if i < hi else None

    @staticmethod
    def one_each(start: np.ndarray, end: np.ndarray) -> "Intervals":
        """One interval per client (diurnal availability)."""
        n = len(start)
        return Intervals(np.arange(n), np.arange(n + 1), np.asarray(start, float), np.asarray(end, float))


def read_intervals(path: str) -> Intervals:
    """An availability trace (online.py), or a ConfigError naming the file and the first bad
    row, or the client whose intervals overlap and where. Kept as `read_devices` keeps its."""
    return _intervals(str(path), _stamp(path))


@functools.lru_cache(maxsize=1)
def _intervals(path: str, stamp) -> Intervals:
    key = "system.availability_trace"
    rule = "a client id >= 0, then 0 <= start < end seconds"

    def ok(v: list[float]) -> bool:
        return float(v[0]).is_integer() and v[0] >= 0 and 0 <= v[1] < v[2] and np.isfinite(v[2])

    a = _columns(key, path, INTERVAL_COLUMNS)
    if a is None or not (np.isfinite(a).all() and (a[:, 0] >= 0).all() and (a[:, 0] == np.floor(a[:, 0])).all()
                         and (a[:, 1] >= 0).all() and (a[:, 1] < a[:, 2]).all()):
        _first_bad(key, path, INTERVAL_COLUMNS, ok, rule)
        a = np.array([[float(x) for x in row] for _, row in rows(key, path, INTERVAL_COLUMNS)]).reshape(-1, 3)
    if not len(a):
        raise ConfigError(f"{key}={path}: no intervals after the header")
    order = np.lexsort((a[:, 1], a[:, 0]))  # by client, then start
    client, start, end = a[order, 0].astype(np.int64), a[order, 1].copy(), a[order, 2].copy()
    del a, order
    same = client[1:] == client[:-1]
    clash = np.flatnonzero(same & (start[1:] < end[:-1]))
    if len(clash):
        i = int(clash[0])
        raise ConfigError(f"{key}={path}: client {client[i]}'s intervals overlap ([{start[i]:g}, {end[i]:g}) and "
                          f"[{start[i + 1]:g}, {end[i + 1]:g})); merge them into one row")
    first = np.flatnonzero(np.r_[True, ~same])
    out = Intervals(client[first], np.r_[first, len(client)], start, end)
    for v in (out.ids, out.offset, out.start, out.end):
        v.flags.writeable = False
    return out
