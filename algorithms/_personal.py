"""What the personalised algorithms share (issue 44): FedAvg over the part of the model every
client shares, while each client keeps a part of its own (FedPer, FedRep: the head; LG-FedAvg:
the encoder) or a whole model of its own (Ditto, APFL) in `client.state`, which the runtime
stores between rounds, checkpoints and resumes.

Which layers are which comes from the model zoo's split (every model is an `EncoderHead`:
`encoder.*` and `head.*` state-dict keys); no algorithm names a model's layers.

- The server holds one model; it broadcasts the shared part only (what the client downloads,
  and counts as bytes) and folds the shared part of the clients' uploads through the server
  parts (`server.aggregator`, `server.optimizer`; buffers: the plain weighted mean). The part
  it does not share stays at its initial value on the server, so the server's model is not
  any client's: its accuracy is reported as the server model's, never as the method's
  (run.py's last line), and these algorithms test each client's own model on its own test
  split, `partition.test_fraction` 0.2 when the user sets none (config/layers.py).
- `personal.buffers`: the non-trainable buffers (BatchNorm statistics) of the shared part.
  `shared` (the default): averaged by the server and broadcast, like the parameters.
  `local`: each client keeps its own (client state; FedBN's rule; the initial model's until
  it first trains), the server does not send them (it averages the uploaded ones for its
  own model's evaluation only). PFLlib's servers copy `.parameters()` only (clientbase.set_parameters),
  so its clients keep their own buffers: `local` is PFLlib's behaviour.
- A client starts from its own part as it left it, or, the first time, from the initial
  model (built from the run's seed on the actor: the same weights as the server's round-0
  model, as in PFLlib where every client starts with a copy of the initial model).
- Its personal model for evaluation (`personalise`, runtime/personal_eval.py) is the served
  global model with the client's own part loaded (`make_personal`).

Reference implementation compared: PFLlib (TsingZ0/PFLlib, system/flcore/clients/clientper.py,
clientrep.py, clientlg.py, clientditto.py, clientapfl.py, clientbabu.py and the matching
servers), where each client object holds its model in one process.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from raysim.aggregation import ServerRule
from raysim.contract import Client, ClientResult, Server
from raysim.training import cpu_state, local_sgd, parameter_names

from raysim.algorithms.fedavg import FedAvg


NORM_LAYERS = (torch.nn.modules.batchnorm._BatchNorm,)  # what part "norm" holds: BatchNorm1d/2d/3d, SyncBatchNorm


def part_keys(model: torch.nn.Module, part: str) -> set[str]:
    """The state-dict keys of a part of the model: "encoder", "head", "all" or "norm" (every
    BatchNorm layer's weight, bias and statistics: FedBN's local part)."""
    keys = set(model.state_dict())
    if part == "norm":
        layers = [name for name, m in model.named_modules() if isinstance(m, NORM_LAYERS)]
        return {k for k in keys if any(k.startswith(name + ".") for name in layers)}
    return keys if part == "all" else {k for k in keys if k.startswith(part + ".")}


def shared_part_keys(model: torch.nn.Module, shared: str, kept: Optional[str]) -> set[str]:
    """`shared`'s keys less the `kept` part's (FedBN: all but the BatchNorm layers; the
    encoder / head splits are disjoint already)."""
    return part_keys(model, shared) - (part_keys(model, kept) if kept else set())


def part_state(model: torch.nn.Module, keys: set[str]) -> dict:
    """A detached CPU copy of the entries `keys` of the model's state (`cpu_state` of a part)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if k in keys}


@contextmanager
def frozen(model: torch.nn.Module, part: str) -> Iterator[None]:
    """Train with `part`'s parameters fixed (FedRep's phases, FedBABU's head); the actor's
    scratch model gets its flags back afterwards."""
    params = [p for n, p in model.named_parameters() if part == "all" or n.startswith(part + ".")]
    was = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, w in zip(params, was):
            p.requires_grad_(w)


def buffer_keys(model: torch.nn.Module) -> set[str]:
    """The state-dict keys of the model's buffers (BatchNorm's running statistics, counters)."""
    return {k for k in model.state_dict()} - {n for n, _ in model.named_parameters()}


class Personal(FedAvg):
    """FedAvg over `shared` ("encoder", "head" or "all") less `kept`; each client keeps `kept`
    ("head", "encoder", "norm": the BatchNorm layers, or None: nothing of its own) in `client.state["kept"]`, and with
    `personal.buffers=local` the shared part's buffers in `client.state["buffers"]`.
    Subclasses change the client's training (`train`) and, for a whole personal model,
    `make_personal` / `keep`."""

    shared = "encoder"
    kept: Optional[str] = "head"
    personal = True
    client_state = True
    server_parts = ("aggregator", "optimizer")
    own_server_rule = "its clients keep part of the model (or a model) of their own: no DP reading is implemented"
    returns_model = False  # a part of the model: model attacks replace whole models
    trains_privately = False

    def __init__(self, cfg, num_classes: int, input_shape: tuple):
        super().__init__(cfg, num_classes, input_shape)
        self.local_buffers = cfg.personal.buffers == "local"
        if self.local_buffers:
            self.client_state = True  # the buffers live on the clients (FedBABU keeps nothing else)

    # ---- server ----
    def setup(self, server: Server) -> None:
        self.model = server.new_model()
        self.shared_keys = shared_part_keys(self.model, self.shared, self.kept)
        self.server_rule = ServerRule(self.cfg.server, parameter_names(self.model) & self.shared_keys,
                                      self.server_optimizer())
        # what goes down: the shared part, less its buffers when the clients keep their own
        self.sent_keys = self.shared_keys - (buffer_keys(self.model) if self.local_buffers else set())

    def broadcast(self, rnd: int) -> dict:
        return {"weights": part_state(self.model, self.sent_keys)}

    def folded(self, state: dict) -> dict:
        return {k: v for k, v in state.items() if k in self.shared_keys}

    # ---- client ----
    def client_update(self, client: Client, payload: dict) -> ClientResult:
        model = client.model
        self.load_global(client, model, payload)
        self.make_personal(client, model, payload)
        stats = self.train(client, model, payload)
        self.keep(client, model)
        self.keep_buffers(client, model)
        return ClientResult(client.cid, client.num_samples, self.upload(client, model), stats)

    def upload(self, client: Client, model: torch.nn.Module) -> dict:
        """What the client sends: the shared part (FedProto: its class prototypes instead)."""
        return part_state(model, self._keys(model, "shared"))

    def load_global(self, client: Client, model: torch.nn.Module, payload) -> None:
        """The model the client downloads: the initial model, the served weights on it, and,
        with `personal.buffers=local`, the shared part's buffers as the client left them."""
        model.load_state_dict({**self.initial(client), **payload["weights"], **self.own_buffers(client, model)})

    def own_buffers(self, client: Client, model: torch.nn.Module) -> dict:
        """`personal.buffers=local`: the shared part's buffers as the client left them (the
        initial model's before its first round); else nothing."""
        if not self.local_buffers:
            return {}
        keys = self._keys(model, "shared") & self._keys(model, "buffers")
        return {**{k: v for k, v in self.initial(client).items() if k in keys}, **client.state.get("buffers", {})}

    def keep_buffers(self, client: Client, model: torch.nn.Module) -> None:
        """`personal.buffers=local`: the shared part's buffers stay on the client."""
        if self.local_buffers:
            keys = self._keys(model, "shared") & self._keys(model, "buffers")
            if keys:
                client.state["buffers"] = part_state(model, keys)

    def train(self, client: Client, model: torch.nn.Module, payload: dict) -> dict:
        """Local training of the whole model (FedPer, LG-FedAvg): FedAvg's."""
        return local_sgd(client, model, self.local_loss(client, payload))

    def make_personal(self, client: Client, model: torch.nn.Module, payload) -> None:
        """The client's own part, as it kept it (none yet: the initial model's, loaded by
        `client_update`; in evaluation the served model's, which the server never changes),
        and its own buffers of the shared part (`personal.buffers=local`)."""
        if "kept" in client.state:
            model.load_state_dict(client.state["kept"], strict=False)
        model.load_state_dict(self.own_buffers(client, model), strict=False)

    def keep(self, client: Client, model: torch.nn.Module) -> None:
        if self.kept is not None:
            client.state["kept"] = part_state(model, self._keys(model, self.kept))

    def initial(self, client: Client) -> dict:
        """The run's initial model (the server's round-0 weights: the same seed, the same
        build), made once per actor without touching the actor's random state."""
        if getattr(self, "_initial", None) is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(client.cfg.seed))
                self._initial = cpu_state(self.build_model(self.input_shape))
        return self._initial

    def _keys(self, model: torch.nn.Module, part: str) -> set[str]:
        """`part_keys` of the actor's scratch model ("buffers": `buffer_keys`; "shared": the
        shared part less the kept, `shared_part_keys`), worked out once per part."""
        if not hasattr(self, "_parts"):
            self._parts = {}
        if part not in self._parts:
            self._parts[part] = (buffer_keys(model) if part == "buffers" else
                                 shared_part_keys(model, self.shared, self.kept) if part == "shared" else
                                 part_keys(model, part))
        return self._parts[part]

    @classmethod
    def vectorizes(cls) -> bool:
        return False  # each client trains its own part: one at a time
