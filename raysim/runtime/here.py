"""Clients trained in the server's own process: one client "actor" that is no Ray actor.

A small run on the command's own machine spends most of its wall time starting Ray and
client actors that import torch (issue 58: the default experiment's 30 rounds train in ~3 s
in one process, after a ~13 s start on 2 cores). So a local command whose clients would
train here in less time than Ray's start gains (`worth_ray`), starts no Ray and hands
`Dispatch` a `HereActor`: the same `ClientRunner` a client actor runs, called in this
process. Everything else is `Dispatch`'s, unchanged: placement, waves, client states, the
clients table; `get`, `put`, `wait` and `kill` stand in for Ray's (a module, used as
`Dispatch.ray`).

Wire semantics are kept: a call's arguments and results go through pickle, as Ray's
would (the client half sees a copy of the payload, the server a copy of each update; the
runner reuses its model between clients). The runner works with `resources.torch_threads`
threads, and torch's default generator is put back after each call (the server draws from
it: `new_model`, checkpoints): so the models are those of a run on client actors, bit for
bit (tests/test_here.py). `faults.*` (actors' processes that exit) need real actors.
"""
from __future__ import annotations

import os
import pickle
import time
from typing import Any, Optional

import torch


class _Task:
    """One call of the runner, run when its first result is asked for (so the server folds
    each call's results before the next trains, as it takes them)."""

    def __init__(self, runner, method: str, args: tuple, kwargs: dict, n_returns: int):
        self.runner, self.method, self.args, self.kwargs, self.n = runner, method, args, kwargs, n_returns
        self.out: Optional[list] = None
        self.error: Optional[BaseException] = None

    def result(self, i: int):
        if self.out is None and self.error is None:
            self._run()
        if self.error is not None:
            raise self.error
        return self.out[i]

    def _run(self) -> None:
        # a copy of the arguments, as the wire's; but not the data (a run's first call): read-only
        # arrays, shared as a Ray node's actors share the object store's
        first, rest = (self.args[0], self.args[1:]) if self.method == "run" else (None, self.args)
        rest = pickle.loads(pickle.dumps(tuple(_value(a) for a in rest), protocol=5))
        args = (first, *rest) if self.method == "run" else rest
        threads, rng = torch.get_num_threads(), torch.random.default_generator.get_state()
        cfg = getattr(self.runner, "cfg", None)  # set by a run's first call (which sets the threads itself)
        if cfg is not None:
            torch.set_num_threads(int(cfg.resources.torch_threads))  # an actor's, whatever the server uses
        try:
            out = getattr(self.runner, self.method)(*args, **self.kwargs)
            # each result its own copy, as each of a task's objects in the store
            self.out = [pickle.loads(pickle.dumps(o, protocol=5)) for o in ([out] if self.n == 1 else out)]
        except Exception as e:  # noqa: BLE001  (raised where the result is asked for, as ray.get would)
            self.error = e
        finally:
            torch.random.default_generator.set_state(rng)
            torch.set_num_threads(threads)
        self.args = self.kwargs = None


class Ref:
    """Result `i` of a `_Task` (an object ref's stand-in)."""

    __slots__ = ("task", "i")

    def __init__(self, task: _Task, i: int):
        self.task, self.i = task, i


class Value:
    """`put`'s stand-in for an object in the store: the value itself."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _value(a):
    return a.value if isinstance(a, Value) else a.task.result(a.i) if isinstance(a, Ref) else a


class _Method:
    def __init__(self, runner, name: str, n_returns: int = 1):
        self.runner, self.name, self.n = runner, name, n_returns

    def options(self, num_returns: int = 1, **_):
        return _Method(self.runner, self.name, num_returns)

    def remote(self, *args, **kwargs):
        task = _Task(self.runner, self.name, args, kwargs, self.n)
        return Ref(task, 0) if self.n == 1 else [Ref(task, i) for i in range(self.n)]


class HereActor:
    """The client runner of this process, called as a client actor is (`.run.remote(...)`)."""

    def __init__(self):
        from raysim.runtime.client_actor import ClientRunner

        self.runner = ClientRunner(here=True)
        self.runner.fetch = get  # the data references are `put`'s stand-ins

    def __getattr__(self, name: str) -> _Method:
        if name not in ("run", "device_info", "die"):
            raise AttributeError(name)
        return _Method(self.runner, name)


# ---------------------------------------------------------------- Ray's calls, for Dispatch
def put(value) -> Value:
    return Value(value)


def get(refs, timeout: Optional[float] = None):
    return [_value(r) for r in refs] if isinstance(refs, list) else _value(refs)


def wait(refs: list, num_returns: int = 1, timeout: Optional[float] = None) -> tuple[list, list]:
    return list(refs), []  # a call here is ready when asked for: it runs then


def kill(actor) -> None:
    pass


def cluster_resources() -> dict:
    return {"CPU": float(os.cpu_count() or 1)}


# ---------------------------------------------------------------- whether a run trains here
def cannot(cfg, stored: bool) -> Optional[str]:
    """Why `cfg` needs Ray's client actors even on the command's own machine, or None."""
    from raysim.config.layers import asks_for_ray
    from raysim.registry import ALGORITHMS

    why = asks_for_ray(cfg.resources, cfg.faults, cfg.ray)
    if why is not None:
        return why
    if stored or cfg.data_store == "files":
        return "the training data are in files (data_store)"
    if getattr(ALGORITHMS.get(cfg.algorithm), "asynchronous", False):
        return f"algorithm={cfg.algorithm} keeps clients in flight on actors"
    return None


def training_seconds(cfg, rounds: int, model: torch.nn.Module, x, y, input_of) -> float:
    """This process's seconds for the client training of `rounds` rounds, judged by one
    epoch of plain SGD on one client's samples (`x`, `y`; `input_of` makes the model's
    inputs of a batch) with `resources.torch_threads` threads, times the epochs and the
    clients a round trains. Algorithms' extras (proximal terms, control variates) and
    evaluation are not counted: a rough figure, for `worth_ray`."""
    from raysim.config import clients_per_round

    threads, rng = torch.get_num_threads(), torch.random.default_generator.get_state()
    torch.set_num_threads(int(cfg.resources.torch_threads))
    try:
        from raysim.training import SGD  # not torch.optim's: its first use imports torch._dynamo (~2 s)

        opt = SGD(model.parameters(), lr=0.0, momentum=float(cfg.local.momentum))
        b = max(1, int(cfg.local.batch_size))
        t0 = time.perf_counter()
        for i in range(0, len(y), b):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(input_of(x[i:i + b])), y[i:i + b]).backward()
            opt.step()
        per_epoch = time.perf_counter() - t0
    finally:
        torch.random.default_generator.set_state(rng)
        torch.set_num_threads(threads)
    steps = int(cfg.local.steps)
    epochs = float(cfg.local.epochs) if not steps else steps * b / max(1, len(y))
    return per_epoch * epochs * clients_per_round(cfg) * rounds


def worth_ray(seconds: float, cfg) -> tuple[bool, str]:
    """Whether Ray's start pays for `seconds` of client training here: N client actors (one
    per CPU) train in ~seconds/N after `resources.ray_start_s`, so Ray wins when seconds >
    ray_start_s x N/(N-1). (worth it, the reason in words)."""
    n = os.cpu_count() or 1
    start = float(cfg.resources.ray_start_s)
    limit = float("inf") if n < 2 else start * n / (n - 1)
    words = (f"the clients' training would take this process ~{seconds:.1f} s, "
             f"{'more' if seconds > limit else 'less'} than Ray's start pays for on {n} CPUs "
             f"(resources.ray_start_s={start:g} x {n}/{max(1, n - 1)})")
    return seconds > limit, words
