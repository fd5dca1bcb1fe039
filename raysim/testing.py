"""An in-process `Server`, for unit-testing an algorithm or a selection without Ray.

    cfg = load_config(overrides=["algorithm=my_algorithm", "num_clients=4"])
    server = InProcessServer(cfg, clients=[(x0, y0), (x1, y1), (x2, y2), (x3, y3)], test=(x_test, y_test))
    server.setup()                  # the selection's and the algorithm's `setup`
    metrics = server.round(1)       # `run_round`, then accuracy of the first of `eval_models()`
    final = server.finish()         # `after_training` after the last round (CCVR's calibration)

or `InProcessServer.from_config(cfg)` for the config's own dataset and partition.

It implements the calls a run's server offers (`raysim.contract.Server`) the way a run
does: clients run one after another in this process, each built as a client actor builds
it (`training.new_client`: seeded from (seed, round, client id)), on separate instances of
the algorithm and selection (the client half sees nothing of the server's state but the
payload, which it gets as a copy, as over the wire); results come back in client-id order
and as copies; stateful clients keep `client.state` between rounds; `local.vectorize`
trains consecutive groups with `client_update_cohort` (summed per group where the run folds by
the plain mean, as client actors do); `server.partial_sums` folds blocks of results as client
actors do. What a run adds on top, the
runtime's and not an algorithm's business, is left out: dropout, stragglers, faults,
checkpoints, augmentation and the run directory. `calls` lists every call made, for tests.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from raysim.contract import ClientResult
from raysim.attacks import Adversaries
from raysim.compression.uplink import Uplink
from raysim.config import clients_per_round, sum_block
from raysim.registry import ALGORITHMS, SELECTIONS
from raysim.world.availability import Availability
from raysim.wire import pack, unpack
from raysim.training import client_method, evaluate, nbytes, new_client, partial_sum
from raysim.vectorized import group_sum, unstack


class InProcessServer:
    def __init__(self, cfg, clients: list, num_classes: Optional[int] = None, test: Optional[tuple] = None,
                 model: Optional[Callable[[], torch.nn.Module]] = None):
        """`clients`: one (inputs, labels) pair per client, as the model takes them;
        `test`: (inputs, labels) for `round`'s accuracy; `model`: a factory for the network
        instead of the algorithm's `build_model` (hand-set weights in a test)."""
        if int(cfg.num_clients) != len(clients):
            raise ValueError(f"cfg.num_clients={cfg.num_clients} but {len(clients)} clients were given")
        self.cfg = cfg
        self.data = [(torch.as_tensor(x), torch.as_tensor(y).long()) for x, y in clients]
        self.num_clients = len(self.data)
        self.sizes = np.array([len(y) for _, y in self.data])
        self.num_classes = int(num_classes if num_classes is not None
                               else 1 + max(int(y.max()) for _, y in self.data if len(y)))
        self.input_shape = tuple(self.data[0][0].shape[1:])
        self.test = test
        inputs = test[0] if test is not None else torch.cat([x for x, _ in self.data])
        self.input_range = (float(inputs.min()), float(inputs.max()))
        self._model = model
        self.availability = Availability(cfg, self.num_clients)
        self.adversaries = Adversaries(cfg, self.num_clients)
        self.algorithm, self.selection = self._plugins()
        self._client_side = dict(zip(("algorithm", "selection"), self._plugins()))  # as in a client actor
        self._client_model: Optional[torch.nn.Module] = None
        self.states: dict[int, dict] = {}  # client id -> its state (stateful plugins)
        self.uplink = None  # compress.up (raysim/compression/uplink.py), made with the first client model
        self.calls: list[tuple] = []  # (round, method, client ids) of every run_clients call

    @classmethod
    def from_config(cls, cfg) -> "InProcessServer":
        """The config's dataset and partition, prepared as a run prepares them."""
        from raysim.experiment import prepare

        data, part, num_classes = prepare(cfg)
        clients = [(data.inputs(data.x_train[idx]), torch.as_tensor(data.y_train[idx])) for idx in part.train]
        return cls(cfg, clients, num_classes, test=(data.inputs(data.x_test), torch.as_tensor(data.y_test)))

    def _plugins(self) -> tuple:
        cfg = self.cfg
        return (ALGORITHMS.get(cfg.algorithm)(cfg, self.num_classes, self.input_shape),
                SELECTIONS.get(cfg.selection)(cfg, self.num_clients, self.num_classes))

    # ------------------------------------------------------------------ the Server calls
    def new_model(self) -> torch.nn.Module:
        torch.manual_seed(int(self.cfg.seed))
        return self._model() if self._model is not None else self.algorithm.build_model(self.input_shape)

    def rng(self, rnd: int, stream: int = 0) -> np.random.Generator:
        return np.random.default_rng([int(self.cfg.seed), rnd, stream])

    def evaluates(self, rnd: int) -> bool:
        from raysim.contract import ends_with_evaluation

        return ends_with_evaluation(self.cfg, rnd)

    def available_clients(self, rnd: int) -> list[int]:
        return self.availability.available(rnd)

    def select_clients(self, rnd: int, k: Optional[int] = None) -> list[int]:
        k = min(clients_per_round(self.cfg) if k is None else k, len(self.selection.available))
        return sorted(int(c) for c in self.selection.select(rnd, k, self.rng(rnd, 1)))

    def run_clients(self, rnd: int, cids: list[int], payload: Any, method: str = "client_update",
                    on: str = "algorithm") -> Iterator[ClientResult]:
        """Run every call now, in client-id order; return an iterator over the results."""
        plugin = self._client_side[on]
        cids = sorted(int(c) for c in cids)
        self.calls.append((rnd, method, cids))
        wire = pack(payload)
        vector = int(self.cfg.local.vectorize_group) if method == "client_update" and self.cfg.local.vectorize else 0
        block = sum_block(self.cfg) if method == "client_update" else 0  # results summed per block, as actors do
        groups = [cids[i:i + vector] for i in range(0, len(cids), vector)] if vector else [[c] for c in cids]
        results = []
        self._ready_client_side()
        for group in groups:
            stateful = plugin.client_state or (self.uplink is not None and self.uplink.keeps_state(method, on))
            clients = [self._client(rnd, c, stateful) for c in group]
            uplink = self.uplink if self.uplink is not None and self.uplink.applies(method, on) else None
            residuals = [uplink.hide(c) if uplink else None for c in clients]
            for client in clients:
                self.adversaries.before(client, rnd, method)
            received = unpack(wire)  # this group's own copy, as a client actor's task gets
            if vector:
                done = plugin.client_update_cohort(clients, received)
            else:
                done = [client_method(plugin, method)(clients[0], received)]
            done, stacked = unstack(done, bool(block), any(self.adversaries.changes_model(c.cid, rnd, method)
                                                           for c in clients))
            mine = []
            for client, result, residual in zip(clients, done, residuals):
                result = self.adversaries.after(client, received, result, rnd, method)
                if uplink is not None:
                    result = uplink.send(client, received, result, rnd, residual, plugin)
                if stateful:
                    self.states[client.cid] = unpack(pack(client.state))
                elif client.state:
                    raise RuntimeError(f"{type(plugin).__name__} wrote client.state but does not declare "
                                       "client_state = True, so the state would be lost")
                mine.append(result)
            if block and vector:  # a vectorised group's sum, as a client actor makes it
                mine = [group_sum(stacked, mine)]
            results.extend(mine)
        if block and not vector:  # server.partial_sums: one sum per block of consecutive clients, as client actors make
            results = [partial_sum(results[i:i + block]) for i in range(0, len(results), block)]
        results = [unpack(pack(r)) for r in results]  # copies, as over the wire
        if self.uplink is not None and self.uplink.applies(method, on):
            for r in results:
                r.metrics["bytes_up"] = nbytes(r.update)
                r.update = self.uplink.receive(r.update, payload, rnd, r.cid)
        return iter(results)

    def _ready_client_side(self) -> None:
        if self._client_model is None:  # the client side's scratch model, as a client actor's
            torch.manual_seed(int(self.cfg.seed))
            side = self._client_side["algorithm"]
            self._client_model = self._model() if self._model is not None else side.build_model(self.input_shape)
            self.uplink = Uplink.from_config(self.cfg, self._client_model)

    def _client(self, rnd: int, cid: int, stateful: bool):
        self._ready_client_side()
        x, y = self.data[cid]
        state = unpack(pack(self.states[cid])) if stateful and cid in self.states else {}
        return new_client(self.cfg, rnd, cid, x, y, self.num_classes, state, self._client_model,
                          int(self.cfg.local.epochs))

    # ------------------------------------------------------------------ driving it
    def setup(self) -> None:
        """The selection's and the algorithm's `setup`, as before a run's round 1."""
        self.selection.available = self.availability.available(1)
        self.selection.setup(self)
        self.algorithm.setup(self)

    def round(self, rnd: int) -> dict:
        """Round `rnd`: the algorithm's `run_round` and, given a test set, the accuracy and
        loss of the first of its `eval_models()`; returns the metrics."""
        self.selection.available = self.availability.available(rnd)
        joining = self.availability.joining(rnd)
        if joining:
            self.selection.clients_joined(rnd, joining, self)
            self.algorithm.clients_joined(rnd, joining, self)
        metrics = dict(self.algorithm.run_round(rnd, self) or {})
        models = self.algorithm.eval_models()
        if self.test is not None and models:
            ev = evaluate(next(iter(models.values())), self.test[0], self.test[1], self.num_classes)
            metrics.update(accuracy=ev["accuracy"], loss=ev["loss"])
        return metrics

    def finish(self) -> dict:
        """The algorithm's `after_training` and, given a test set, {name: accuracy} of the
        models it returns ({} when it returns none)."""
        models = self.algorithm.after_training(self) or {}
        if self.test is None:
            return {name: None for name in models}
        return {name: evaluate(m, self.test[0], self.test[1], self.num_classes)["accuracy"] for name, m in models.items()}

    def run(self, rounds: Optional[int] = None) -> list[dict]:
        """`setup`, then rounds 1..`rounds` (default: the config's); the metrics of each."""
        self.setup()
        return [self.round(r) for r in range(1, int(rounds or self.cfg.rounds) + 1)]


def set_up(cfg, model: Optional[Callable[[], torch.nn.Module]] = None, input_shape: tuple = (2,),
           num_classes: int = 2):
    """`cfg.algorithm` after its `setup` by an `InProcessServer` whose `cfg.num_clients`
    clients hold one blank sample of `input_shape` each: for tests that feed `aggregate`
    hand-made results and check the numbers (`model`: the network, e.g. hand-set weights)."""
    blank = [(torch.zeros(1, *input_shape), torch.zeros(1, dtype=torch.long))] * int(cfg.num_clients)
    server = InProcessServer(cfg, blank, num_classes, model=model)
    server.setup()
    return server.algorithm
