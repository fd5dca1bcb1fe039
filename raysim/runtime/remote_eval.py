"""Where the global test set is evaluated: on the server's CPU, or on a client actor's GPU.

Issue 59: on an H200 a VGG-9 round of 10 clients spent 1.6 s training on the GPU and then
5.1 s evaluating on the server actor's CPU, the GPU idle. The server actor reserves no GPU
(Ray hides the GPUs from a process that reserved none), but the client actors that train
on one can evaluate too: the test set goes to the object store once, each actor moves it
to its device on its first evaluation and keeps it for the run.

`eval.where`: `server` (the server's CPU, as before), `clients` (a client actor's device),
`auto` (clients when the client actors train on CUDA, else the server). Model i of a round
goes to live actor i mod the number of actors, whole: one actor evaluates one model in the
same batches as the server does, so the result depends on the device, not on how many
actors there are. Evaluation changes no model, so the model's bits (model.pt) are the same
wherever it runs; the loss's last bits, and rarely a tied prediction, follow the device's
arithmetic (a GPU run's and a CPU run's metrics are not bit-identical, as their training
is not). An evaluation an actor cannot make (lost, restarted without its data) is made on
the server, with a line in log.txt.
"""
from __future__ import annotations

from typing import Callable

import torch

from raysim.training import evaluate


class TestSet:
    def __init__(self, cfg, dispatch, x_test: torch.Tensor, y_test: torch.Tensor, num_classes: int,
                 log: Callable[[str], None]):
        self.x, self.y, self.num_classes = x_test, y_test, num_classes
        self.dispatch, self.log = dispatch, log
        self.asked = str(cfg.eval.where)
        self.where = None  # server | clients: decided on the first evaluation, the actors started by then
        self._ref = None

    def evaluate(self, models: list[torch.nn.Module]) -> list[dict]:
        """Each model's `training.evaluate` result, in order."""
        if self.where is None:
            self.where = where(self.asked, self.dispatch)
            self.log(f"evaluation: {'on a client actor' if self.where == 'clients' else 'on the server'} "
                     f"(eval.where={self.asked})")
        if self.where == "clients" and models:
            try:
                return self._on_actors(models)
            except Exception as e:  # noqa: BLE001  (a lost actor: the server's CPU does it this time)
                self.log(f"evaluation on a client actor failed ({type(e).__name__}): made on the server")
        return [evaluate(m, self.x, self.y, self.num_classes) for m in models]

    def _on_actors(self, models: list[torch.nn.Module]) -> list[dict]:
        d = self.dispatch
        if self._ref is None:
            self._ref = d.ray.put((self.x, self.y))
        live = d.live_actors()
        refs = [d.actors[live[i % len(live)]].evaluate.remote([self._ref], [m], self.num_classes)
                for i, m in enumerate(models)]
        return [r[0] for r in d.ray.get(refs)]


def where(asked: str, dispatch) -> str:
    """`server` or `clients`: `auto` is clients when the client actors train on CUDA. Clients
    that train in the server's own process (runtime/here.py) are the server's CPU."""
    if asked == "server" or dispatch.here:
        return "server"
    if asked == "clients":
        return "clients"
    return "clients" if dispatch.device().startswith("cuda") else "server"

