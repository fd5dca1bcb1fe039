"""The plugin contract between the runtime and an algorithm.

An algorithm is one class with a server half and a client half:

- server half (runs in the server actor): `setup(server)` once, then `run_round(rnd,
  server)` each round, then `after_training(server)` once (a post-hoc step; default none).
  The default `run_round` is the FedAvg shape:
  select -> `broadcast` -> `client_update` on each chosen client -> `aggregate`.
  An algorithm with stages, several models or extra uploads overrides `run_round` (or
  `setup`) and uses the same two runtime calls, `server.select_clients` and
  `server.run_clients`.
- client half (runs inside client actors): `client_update(client, payload)` and any other
  method that `server.run_clients(..., method=NAME)` names. It sees one `Client`: that
  client's data on the actor's device, its persistent `state` dict, and a generator seeded
  from (seed, round, client id).

A selection strategy (`Selection`) is a separate plugin so that any strategy composes with
any algorithm (`selection=fedentopt algorithm=scaffold`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch
from omegaconf import DictConfig


@dataclass
class ClientResult:
    """What one client sends back: `update` is algorithm-defined (weights, deltas, extra
    statistics); `num_samples` is its aggregation weight by default."""

    cid: int
    num_samples: int
    update: Any = None
    metrics: dict = field(default_factory=dict)
    state_changed: bool = True  # set by the runtime: False when the call left client.state as it was
    # set by the runtime for a partial sum (`server.partial_sums`): `update` is the sum of the
    # clients' updates weighted by their samples, `num_samples` their total, and this lists each
    # folded client's (cid, num_samples, metrics, state_changed); None: one client's result
    clients: Optional[list] = None


@dataclass
class CohortResult:
    """A vectorised group's results kept stacked (`client_update_cohort` may return it instead
    of a list of `ClientResult`s): `update` maps each state-dict key to a tensor whose leading
    dimension is the client, on the device the group trained on; `cids`, `num_samples` and
    `metrics` are per client. Where the run folds its clients' models by the plain weighted
    mean the runtime sends it as one float64 sum made there (`training.stacked_sum`);
    otherwise it is cut into one `ClientResult` per client (`split`)."""

    cids: list
    num_samples: list
    update: dict
    metrics: list

    def split(self, updates: bool = True) -> list[ClientResult]:
        """One `ClientResult` per client (its update on the CPU; None with `updates=False`)."""
        if not updates:
            return [ClientResult(c, n, None, m) for c, n, m in zip(self.cids, self.num_samples, self.metrics)]
        cpu = {k: v.cpu() for k, v in self.update.items()}
        return [ClientResult(c, n, {k: v[i].clone() for k, v in cpu.items()}, m)
                for i, (c, n, m) in enumerate(zip(self.cids, self.num_samples, self.metrics))]


@dataclass
class Client:
    """One simulated client as its client-side code sees it inside an actor."""

    cid: int
    round: int
    cfg: DictConfig
    x: torch.Tensor  # training inputs, on `device`
    y: torch.Tensor  # training labels, on `device`
    num_classes: int
    device: torch.device
    generator: torch.Generator  # seeded from (seed, round, cid): the only randomness to use
    state: dict  # persists between the rounds this client takes part in; assign to keys to change it
    model: torch.nn.Module  # the actor's scratch instance of the configured model
    epochs: int = 1  # local epochs this round: `local.epochs`, or a straggler's draw
    transform: Optional[Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = None  # batch augmentation

    @property
    def num_samples(self) -> int:
        return int(self.y.shape[0])

    def label_counts(self) -> np.ndarray:
        return torch.bincount(self.y, minlength=self.num_classes).cpu().numpy()


class Server(Protocol):
    """What the runtime offers an algorithm's server half (implemented by `FederatedServer` for a run, `raysim.testing.InProcessServer` in tests)."""

    cfg: DictConfig
    num_clients: int
    num_classes: int
    input_shape: tuple
    input_range: tuple  # (smallest, largest) input value in the test set, e.g. for probe inputs
    sizes: np.ndarray  # each client's number of training samples (FedDyn scales its alpha by them)

    def new_model(self) -> torch.nn.Module: ...  # the algorithm's `build_model`, seeded from the run's seed

    def select_clients(self, rnd: int, k: Optional[int] = None) -> list[int]: ...

    def available_clients(self, rnd: int) -> list[int]: ...  # the clients there in round rnd (clients.join)

    def run_clients(self, rnd: int, cids: list[int], payload: Any, method: str = "client_update",
                    on: str = "algorithm") -> Iterator[ClientResult]: ...

    def rng(self, rnd: int, stream: int = 0) -> np.random.Generator: ...

    def evaluates(self, rnd: int) -> bool: ...  # whether round rnd ends with an evaluation (eval_every, the last)

    # asynchronous algorithms (runtime/asynchronous.py; needs system.profile)
    # the next n updates in simulated time (cid, result, version, payload), `concurrency` clients
    # kept training from payload() = (payload, version), which must not change before the n-th
    def arrivals(self, rnd: int, n: int, concurrency: int, payload: Callable[[], tuple]) -> Iterator[Any]: ...

    # end the run in round rnd, which cannot go on: the rounds before are kept, the summary's status
    # says `status`; raises `error` (errors.RunDiverged or a subclass) with `why`
    def stop_early(self, rnd: int, status: str, error: type, why: str) -> None: ...


def ends_with_evaluation(cfg: DictConfig, rnd: int) -> bool:
    """The servers' rule: round `rnd` ends with an evaluation every `eval_every` rounds and
    in the last round (`Server.evaluates`)."""
    return rnd % int(cfg.eval_every) == 0 or rnd == int(cfg.rounds)


class Algorithm:
    """Base class of an algorithm plugin: register a subclass with
    `@ALGORITHMS.register("name")` and override the hooks it needs. Every hook the runtime
    reads is declared here with its default; `examples/my_algorithm.py` is a whole one."""

    # ---- declarations the runtime and the config read -------------------------------
    Options: ClassVar[Optional[type]] = None
    """The algorithm's own options: a dataclass subclassing `raysim.options.Options`; the
    config gains a section under the registered name (or `config_section`), checked by it."""
    config_section: ClassVar[Optional[str]] = None
    """Read another registered name's section instead (fedconcat_id reads `fedconcat.*`)."""
    client_state: ClassVar[bool] = False
    """True: each client keeps `client.state` between the rounds it takes part in (SCAFFOLD's
    c_i, MOON's previous model); the runtime stores and checkpoints it."""
    trains_on_base_loss: ClassVar[bool] = False
    """True: local training minimises `training.base_loss` (cross-entropy, or the focal loss
    with `local.focal_gamma`), possibly plus a penalty (FedProx); False: its own loss, and
    `local.focal_gamma` is refused."""
    trains_privately: ClassVar[bool] = False
    """True: its clients train with `training.local_sgd` (no gradient or weight hooks) on a
    loss that is the mean of per-sample losses computed through the model's modules, and
    upload nothing else about their data: `privacy.mode=local` (DP-SGD through Opacus,
    raysim/dp_sgd.py) applies. A penalty on the weights (FedProx), a loss that reads
    a layer's weights directly (FedRS) or extra uploads (CCVR's statistics) would escape
    Opacus' per-sample clipping."""
    server_parts: ClassVar[tuple] = ()
    """The server parts its aggregation takes, of "aggregator" and "optimizer"
    (`server.aggregator`, `server.optimizer`: raysim/aggregation/): an algorithm that folds
    its clients' models through `ServerRule` (FedAvg and those built on it) takes both; one
    with its own server step takes none, and `server.*` beyond plain FedAvg is refused."""
    own_server_rule: ClassVar[str] = ""
    """Why it takes no (or not every) server part, for that message."""
    returns_model: ClassVar[bool] = False
    """True: `client_update` returns the client's whole model (a state dict) for the
    payload's `weights`, so model attacks (`attack.kind`, raysim/attacks.py) apply."""
    sends_model: ClassVar[bool] = False
    """True: `client_update` returns the client's whole model, as `returns_model` says, but
    model attacks are refused it (FedBuff, FedAsync): `compress.up` still encodes its update."""

    @classmethod
    def compressible(cls) -> bool:
        """Whether `compress.up` can encode a client's update (raysim/compression/uplink.py)."""
        return cls.returns_model or cls.sends_model

    def __init__(self, cfg: DictConfig, num_classes: int, input_shape: tuple):
        self.cfg = cfg
        self.num_classes = num_classes
        self.input_shape = input_shape

    def build_model(self, input_shape: tuple) -> torch.nn.Module:
        """The network this algorithm trains, built the same way on the server
        (`server.new_model()`, seeded) and in every client actor (`client.model`, the
        actor's scratch instance). Default: the configured model (`model`,
        `model_options`). An algorithm that changes the network overrides this: MOON adds
        a projection head, Fed2 groups the last layers."""
        from raysim.models import model_from

        return model_from(self.cfg, input_shape, self.num_classes)

    # ---- server half -------------------------------------------------------------
    def setup(self, server: Server) -> None:
        """Once before round 1: build the global state (models, buffers)."""

    def run_round(self, rnd: int, server: Server) -> dict:
        """One round; returns extra metrics to record. Default: the FedAvg shape."""
        cids = server.select_clients(rnd)
        results = server.run_clients(rnd, cids, self.broadcast(rnd))
        return self.aggregate(rnd, results) or {}

    def broadcast(self, rnd: int) -> Any:
        """The payload every selected client receives (put in the object store once)."""
        raise NotImplementedError

    def aggregate(self, rnd: int, results: Iterator[ClientResult]) -> Optional[dict]:
        """Fold client results, which arrive in client-id order, into the global state."""
        raise NotImplementedError

    def eval_models(self) -> dict[str, torch.nn.Module]:
        """Models to evaluate on the global test set; the first one is 'the' accuracy."""
        return {}

    def after_training(self, server: Server) -> dict[str, torch.nn.Module]:
        """Once, after the last round: a post-hoc step on the final model (CCVR's classifier
        calibration), with the same `Server` calls as a round (its round number is the
        last one). Returns the models that are the run's result: the first one's test
        accuracy becomes the summary's `final_accuracy` (the last round's stays as
        `final_round_accuracy`); each is in `summary.json`'s `after_training`. Default: {}
        (the last round's models are the result)."""
        return {}

    def clients_joined(self, rnd: int, cids: list[int], server: Server) -> None:
        """Clients that join late (`clients.join`, world/availability.py) arrive at the start
        of round `rnd`, before selection: an algorithm that places clients (FedGroup's client
        cold start) does it here or when they are first selected. Default: nothing."""

    def serving(self, cids: list[int]) -> dict[str, list[int]]:
        """Per-client evaluation (`partition.test_fraction > 0`, runtime/local_eval.py):
        which of `eval_models()` serves which of the clients `cids` on their own test data.
        Default: the first model serves all; an algorithm with a model per group or per
        client says which (FedGroup: a client's group model)."""
        models = self.eval_models()
        return {next(iter(models)): list(cids)} if models else {}

    finetunes: ClassVar[bool] = True
    """False: its evaluated model is not the model its clients train (FedConcat's
    concatenation), so `eval.finetune_epochs` cannot fine-tune it on a client: refused."""
    personal: ClassVar[bool] = False
    """True: each client has a model of its own (FedPer's head, Ditto's v): evaluation on the
    clients' own test data (`partition.test_fraction`) also tests each client's model
    (`personalise`; runtime/personal_eval.py), as `eval.finetune_epochs` does for any algorithm.
    A personalised run tests its clients' own models on their own test splits:
    `partition.test_fraction` is 0.2 when no layer of the config sets it (config/layers.py)."""
    model_options_default: ClassVar[dict] = {}
    """Model options the method needs (FedBN: `{"norm": "batch"}`), given to a model that takes
    them when no layer of the config sets them (config/layers.py; said in the log)."""
    unshared: ClassVar[Optional[str]] = None
    """The part of the server's model no client uploads (FedPer's head, LG-FedAvg's encoder),
    which stays at its initial weights: the server's model is then no client's, its accuracy
    is never reported as the method's, and a run without the clients' own test splits is
    refused (there would be nothing meaningful to report)."""

    def personal_payload(self, name: str, model: torch.nn.Module) -> Any:
        """What `personalise` receives for the clients `model` (`eval_models()[name]`)
        serves. Default: its weights."""
        return {"weights": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}}

    def state_dict(self) -> dict:
        """Server state: saved as the run's final model and in its checkpoints. Override
        (with `load_state_dict`) when the server keeps more than its evaluated models, e.g.
        momentum buffers; tensors and plain containers keep checkpoints safe to load."""
        return {name: m.state_dict() for name, m in self.eval_models().items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (resuming a run from its checkpoint)."""
        for name, m in self.eval_models().items():
            m.load_state_dict(state[name])

    # ---- client half -------------------------------------------------------------
    def client_update(self, client: Client, payload: Any) -> ClientResult:
        """Train on one client (inside a client actor) from the round's `payload`; return
        what the server's `aggregate` folds. Any other method named by
        `server.run_clients(..., method=NAME)` has the same shape."""
        raise NotImplementedError

    @classmethod
    def divergence_hint(cls, cfg: DictConfig) -> str:
        """What to try when a run of it diverges (the runtime's stop message ends with it): the
        numbers the config sets 100 times or more past their defaults first (a `fedprox.mu`
        or `server.lr` of 1e300 is the likelier cause than the learning rate), then local.lr."""
        from raysim.config.hints import far_from_default

        lr = f"a smaller local.lr (now {cfg.local.lr}) or local.momentum (now {cfg.local.momentum})"
        far = far_from_default(cfg)
        if not far:
            return f"Try {lr}"
        named = ", ".join(f"{k}={v:g} " + (f"({ratio:.0e} times its default {d:g})" if d else
                                             f"(default {'unset' if d is None else 0})") for k, v, d, ratio in far[:3])
        return f"The config sets {named}: try it smaller; otherwise try {lr}"

    @classmethod
    def config_notes(cls, cfg: DictConfig) -> list:
        """Lines the config's log notes for this algorithm (settings that work against it)."""
        return []

    uploaded: ClassVar[Optional[Callable]] = None
    """Optional client-side hook `uploaded(client, payload, trained, received)`, called after
    `compress.up` encoded a `client_update`'s model: `trained` is the model it returned,
    `received` the model the server will decode from the message. A client whose state
    follows what it sent (FedDyn's lambda_k) keeps it from `received`, so the server's view
    of it and the client's agree under a lossy codec. None: not called (no decoding)."""

    # `personalise(client, payload) -> ClientResult`, the client method personalised evaluation
    # runs (runtime/personal_eval.py), is optional: without it the runtime runs
    # `training.personalise` (load the served weights, `make_personal`, fine-tune
    # `finetune_epochs` on the client's data with a stream of its own, return the model). It must
    # leave `client.state` as it was. FedBABU defines it (fine-tuning the head alone, if asked).

    def make_personal(self, client: Client, model: torch.nn.Module, payload: Any) -> None:
        """Turn the served model (loaded in `model`) into the client's own: a personalised
        algorithm loads the part it keeps in `client.state`. Default: nothing."""

    def finetune_epochs(self, cfg: DictConfig) -> int:
        """Epochs `personalise` fine-tunes for: `eval.finetune_epochs` (FedBABU: its own)."""
        return int(cfg.eval.finetune_epochs)

    def local_loss(self, client: Client, payload: Any) -> Callable:
        """The loss `loss(model, x, y)` that local SGD minimises, for client updates built
        on `training.local_sgd`. FedAvg's is `training.base_loss` (cross-entropy, or focal
        with `local.focal_gamma`); FedProx adds its proximal term, FedLC / FedRS / FedFocal
        replace it. Not needed by an algorithm whose `client_update` builds its own."""
        raise NotImplementedError

    def client_update_cohort(self, clients: list[Client], payload: Any) -> "list[ClientResult] | CohortResult":
        """`client_update` of a group of clients as one batched program (`local.vectorize`,
        raysim/vectorized.py): the same results up to float rounding, one per client or as a
        `CohortResult` (the models stacked; summed where they trained when the run folds by
        the plain mean). An algorithm that does not provide it trains one client at a time
        and refuses the option."""
        raise NotImplementedError

    @classmethod
    def vectorizes(cls) -> bool:
        """Whether this class's `client_update_cohort` stands for its client update: it must
        be defined at or below every class that defines `client_update` or `local_loss` (a
        subclass that changes the loss, e.g. MOON, does not inherit FedAvg's vectorised path)."""
        def definer(name: str):
            return next((k for k in cls.__mro__ if name in vars(k)), None)

        cohort = definer("client_update_cohort")
        return cohort is not Algorithm and all(
            d is None or issubclass(cohort, d) for d in map(definer, ("client_update", "local_loss")))


class Selection:
    """A client-selection strategy. `setup` may gather client information once (e.g. label
    counts via `server.run_clients(..., on="selection")`); `select` picks a cohort."""

    Options: ClassVar[Optional[type]] = None
    """As `Algorithm.Options`: the strategy's own section of the config."""
    config_section: ClassVar[Optional[str]] = None
    client_state: ClassVar[bool] = False
    """True: the client methods it runs (`on="selection"`) keep `client.state` between rounds."""
    reads_every_client: ClassVar[bool] = False
    """True: it learns something of every client before round 1 and scans them all at each
    pick (FedEntOpt's label counts): O(clients), refused for a population of millions made
    when picked (data/population.py)."""
    uniform_draw: ClassVar[bool] = False
    """True: `select(rnd, 1, rng)` is `available[rng.choice(len(available), 1, replace=False)[0]]`,
    so an asynchronous run may draw its index without listing `available` per arrival
    (runtime/asynchronous.py, `FreeClients`)."""

    def __init__(self, cfg: DictConfig, num_clients: int, num_classes: int):
        self.cfg = cfg
        self.num_clients = num_clients
        self.num_classes = num_classes
        # the clients there this round (clients that join late are not, before their round:
        # world/availability.py); the server sets it before each `select`
        self.available: Sequence[int] = range(num_clients)  # a range or a sorted list: read it, never change it

    def setup(self, server: Server) -> None:
        pass

    def select(self, rnd: int, k: int, rng: np.random.Generator) -> list[int]:
        """k clients from `self.available` (k is at most its length)."""
        raise NotImplementedError

    def clients_joined(self, rnd: int, cids: list[int], server: Server) -> None:
        """Clients that join late arrive at the start of round `rnd` (before the algorithm
        hears of them): a strategy that gathers client information in `setup` gathers
        theirs here. Default: nothing."""

    def round_metrics(self) -> dict:
        """Extra per-round metrics about the last selection (e.g. cohort entropy)."""
        return {}

    def state_dict(self) -> dict:
        """What the strategy carries from round to round (checkpointed); `setup` rebuilds the rest."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
