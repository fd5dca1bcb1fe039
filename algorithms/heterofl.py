"""HeteroFL (Diao, Ding, Tarokh 2021, "HeteroFL: Computation and Communication Efficient
Federated Learning for Heterogeneous Clients"): clients with models of different widths. A
client of model rate r trains the global model's sub-model whose every hidden layer keeps its
first ceil(r * size) units (the input and the classes whole): the model zoo's `width` option
builds it (`model_options.width`: mlp, cnn, the VGGs), and the sub-model's weights are the leading
slices of the global ones along every dimension (a Linear after Flatten reads the first
channels' positions first: channel-major). The server averages each element over the clients
whose sub-model holds it (`heterofl.weighting=clients`: each counts 1, the authors';
`samples`: by their samples) and keeps an element no one trained; with `heterofl.mask` (the
authors' default) a client's logits of the classes it does not hold are 0 in training and
only its classes' rows of the classifier are averaged from it.

Client rates: `heterofl.rates` (the paper's levels a-e: 1, 1/2, 1/4, 1/8, 1/16) in
`heterofl.proportions`, each client's level drawn once from (seed, client id) and kept (the
authors' "fix" mode). `heterofl.scaler` (theirs): a sub-model's hidden layers' outputs times
1/r in training only, so a narrow model's activations keep the whole one's scale. The global
model (width 1) is evaluated, and the global model cut to each smaller rate in use
(`width_<r>`), as the paper's per-level accuracies.

Compared with the authors' code (dem123456789/HeteroFL-Computation-and-Communication-Efficient-
Federated-Learning-for-Heterogeneous-Clients, fed.py `split_model` / `combine`; models/conv.py's
Scaler). Their static BatchNorm ("sBN": BatchNorm without running statistics in training, and
before each test the statistics of the training data passed through the global model,
train_classifier_fed.py `stats`) is `heterofl.norm=static` with `model_options.norm=batch`
(every client there passes its own data through each evaluated width and the server averages
the batches' statistics: `static_statistics`); the default `running` averages BatchNorm's
running statistics like the weights, and the zoo's cnn and mlp have no BatchNorm unless asked.
Every client downloads the whole global model here (bytes_down counts it), where theirs
receive the sub-model only.

`heterofl.variant=fjord` is FjORD (Horvath et al. 2021, "FjORD: Fair and Accurate Federated
Learning under heterogeneous targets with Ordered Dropout"): a client of rate r holds the
width-r model and, each local step, trains the width-p sub-model of it for p drawn uniformly
from the rates <= r (ordered dropout: the leading units), the same element-wise mean at the
server; no Scaler. Its optional self-distillation is not implemented. `variant=fedrolex` is
FedRolex (Alam, Liu, Yan, Zhang 2022, "FedRolex: Model-Heterogeneous Federated Learning with
Rolling Sub-Model Extraction"): in round t a client of rate r trains hidden units
(t + i) mod K, i < ceil(rK), of each layer (`rolled`): a window that rolls over the whole
model, so every unit is trained by narrow clients too (`heterofl.roll=code`: the authors' code's
window, units (i - t) mod K: the same window rolling the other way), with the authors' Scaler and masking
as HeteroFL's (AIoT-MLSys-Lab/FedRolex: config.yml `scale: '1'`, models/resnet.py's
`Scaler(rate)`; `heterofl.scaler=false` turns it off for both)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List

import torch
import torch.nn.functional as F
from torch.func import functional_call

from raysim.contract import Client, ClientResult, Server
from raysim.errors import ConfigError
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim.seeds import seed_for
from raysim.training import base_loss, cpu_state, local_sgd

from raysim.algorithms.fedavg import FedAvg

RATE_STREAM = 56  # the seed stream of a client's model rate


@dataclass
class HeteroFLOptions(Options):
    rates: List[float] = option([1.0, 0.5, 0.25, 0.125, 0.0625])  # the model rates (widths) clients may have
    proportions: List[float] = option([0.2, 0.2, 0.2, 0.2, 0.2])  # the share of clients at each rate
    weighting: str = option("clients", choices=("clients", "samples"))  # an element's mean over the clients holding it
    mask: bool = option(True)  # logits of classes the client lacks are 0 in training; only its classes' rows averaged
    scaler: bool = option(True)  # a sub-model's hidden layers' outputs times 1/rate in training (HeteroFL's and FedRolex's authors'; FjORD has none)
    variant: str = option("heterofl", choices=("heterofl", "fjord", "fedrolex"))  # fjord: each step a width <= the client's; fedrolex: rolling windows
    roll: str = option("paper", choices=("paper", "code"))  # fedrolex: round t's window units (t + i) mod K (the paper's Eq. 4) | (i - t) mod K (the authors' torch.roll)
    norm: str = option("running", choices=("running", "static"))  # BatchNorm statistics: running (averaged like weights) | static (the authors' sBN: recomputed from the clients' training data before each evaluation)

    def check(self, cfg, section: str) -> None:
        from raysim.models import model_option_defaults

        if len(self.rates) != len(self.proportions) or not self.rates:
            raise ConfigError(f"{section}.rates and {section}.proportions must be lists of the same length, got "
                              f"{len(self.rates)} and {len(self.proportions)}")
        if not all(0 < r <= 1 for r in self.rates):
            raise ConfigError(f"{section}.rates must be in (0, 1], got {list(self.rates)}")
        if any(p < 0 for p in self.proportions) or sum(self.proportions) <= 0:
            raise ConfigError(f"{section}.proportions must be >= 0 with a positive sum, got {list(self.proportions)}")
        def fractional(name: str) -> bool:  # resnet8's width is an integer multiple
            return isinstance(model_option_defaults(name).get("width"), float)

        if not fractional(cfg.model):
            from raysim.registry import MODELS

            raise ConfigError(f"algorithm=heterofl: model={cfg.model!r} has no width option (a fraction of its hidden "
                              f"sizes); models with one: {', '.join(m for m in MODELS.names() if fractional(m))}")
        norm = (cfg.get("model_options") or {}).get("norm", model_option_defaults(cfg.model).get("norm"))
        if self.norm == "static" and norm != "batch":
            raise ConfigError(f"{section}.norm=static recomputes BatchNorm statistics, but model={cfg.model!r} has "
                              f"model_options.norm={norm}; set model_options.norm=batch (the authors' sBN)")
        if norm == "group":  # gcd(32, channels) groups: a narrower layer is grouped differently
            raise ConfigError("algorithm=heterofl: model_options.norm=group normalises groups of channels whose "
                              "number changes with the width, so a sub-model would not be a slice of the whole "
                              "model; use norm=batch or none")


def client_rate(cfg, cid: int) -> float:
    """Client `cid`'s model rate: drawn once from (seed, cid) by `heterofl.proportions`."""
    o = cfg.heterofl
    g = torch.Generator().manual_seed(seed_for(int(cfg.seed), cid, RATE_STREAM))
    return float(o.rates[int(torch.multinomial(torch.tensor(list(o.proportions), dtype=torch.float64), 1,
                                               generator=g))])


def leading(full: torch.Tensor, shape) -> tuple:
    """The index of a tensor's leading block of `shape` (every dimension cut from 0; a
    0-dimensional tensor, e.g. a batch counter: itself)."""
    return tuple(slice(0, n) for n in shape)


def rolled(full: dict, shapes: dict, offset: int) -> dict:
    """FedRolex's sub-model of round `offset`: for each tensor of `full` (a chain of layers in
    state-dict order: each weight of 2+ dimensions starts a layer, the 1-dimensional tensors
    after it are that layer's), the index that picks the sub-model's `shapes`. A hidden layer
    of K units keeps units (offset + i) mod K, i < k (sorted); the next layer's inputs are the
    same units (after a Flatten, each unit's block of positions, channel-major); the classes
    and the inputs stay whole. Offset 0 is HeteroFL's leading block."""
    out, prev, cur = {}, None, None
    for key, t in full.items():
        shape = shapes[key]
        if t.dim() == 0:
            out[key] = ()
            continue
        if t.dim() >= 2 or cur is None or cur[0] != t.shape[0]:  # a new layer
            prev = cur
            k, n = t.shape[0], shape[0]
            cur = (k, torch.sort((offset + torch.arange(n)) % k).values if n < k else torch.arange(k))
        idx = [cur[1]]
        if t.dim() >= 2:
            k_in, n_in = t.shape[1], shape[1]
            if n_in == k_in or prev is None:
                idx.append(torch.arange(k_in))
            elif k_in == prev[0]:
                idx.append(prev[1])
            else:  # a Linear after Flatten: each unit's block of k_in / K positions
                block = k_in // prev[0]
                idx.append((prev[1][:, None] * block + torch.arange(block)).reshape(-1))
            idx += [torch.arange(d) for d in t.shape[2:]]
        out[key] = torch.meshgrid(*idx, indexing="ij")
    return out


@ALGORITHMS.register("heterofl")
class HeteroFL(FedAvg):
    Options = HeteroFLOptions
    server_parts = ()
    own_server_rule = "its server averages each element over the clients whose sub-model holds it"
    trains_on_base_loss = False  # masked logits (heterofl.mask); local.focal_gamma does not apply
    trains_privately = False
    returns_model = False  # sub-models of other shapes: model attacks replace whole models

    def setup(self, server: Server) -> None:
        super().setup(server)
        widths = sorted({float(r) for r in self.cfg.heterofl.rates if r < 1}, reverse=True)
        self.sub_models = {r: self.width_model(r) for r in widths}
        for sub in self.sub_models.values():
            sub.load_state_dict(self.cut(self.model.state_dict(), sub))

    def width_model(self, rate: float) -> torch.nn.Module:
        """The configured model at `rate` times its width (its weights are loaded, never its own)."""
        from omegaconf import OmegaConf

        from raysim.models import build_model

        options = OmegaConf.to_container(self.cfg.model_options)
        options["width"] = rate * float(options.get("width", 1.0))
        with torch.random.fork_rng(devices=[]):  # building draws initial weights: not from the run's stream
            return build_model(self.cfg.model, self.input_shape, self.num_classes, options)

    def aggregate(self, rnd: int, results: Iterator[ClientResult]) -> dict:
        state = self.model.state_dict()
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.items()}
        count = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.items()}
        samples = self.cfg.heterofl.weighting == "samples"
        loss_sum, n = 0.0, 0
        rolex = self.cfg.heterofl.variant == "fedrolex"
        for r in results:
            w = float(r.num_samples) if samples else 1.0
            rows = r.update.get("classes")
            windows = rolled(state, {k: v.shape for k, v in r.update.items()}, self.window_offset(self.cfg, rnd)) \
                if rolex else {}
            for k, v in r.update.items():
                if k == "classes":
                    continue
                at = windows[k] if rolex else leading(state[k], v.shape)
                if rows is not None and k.startswith("head."):  # only the client's classes' rows
                    keep = torch.zeros(v.shape[0], dtype=torch.float64)
                    keep[rows] = w
                    weight = keep.reshape(-1, *([1] * (v.dim() - 1)))
                    total[k][at] += v.double() * weight
                    count[k][at] += weight.expand_as(v)
                else:  # no mask tensor per entry: the weight alone
                    total[k][at] += v.double() * w
                    count[k][at] += w
            loss_sum += r.metrics["loss"] * r.num_samples
            n += r.num_samples
        if n == 0:  # every client dropped out: keep the model
            return {}
        new = {k: torch.where(count[k] > 0, total[k] / count[k].clamp(min=1e-300), state[k].double()).to(state[k].dtype)
               if state[k].is_floating_point() else state[k] for k in state}
        self.model.load_state_dict(new)
        for rate, sub in self.sub_models.items():
            sub.load_state_dict(self.cut(new, sub))
        return {"train_loss": loss_sum / n}

    def run_round(self, rnd: int, server: Server) -> dict:
        metrics = super().run_round(rnd, server)
        if self.cfg.heterofl.norm == "static" and server.evaluates(rnd):
            self.static_statistics(rnd, server)
        return metrics

    def static_statistics(self, rnd: int, server: Server) -> None:
        """The authors' sBN (train_classifier_fed.py `stats`): before an evaluation, each
        evaluated model's BatchNorm statistics are the cumulative average over batches of the
        training data, passed through it in training mode (their `momentum=None`): here every
        client there passes its own training data through each width and returns the sums of
        its batches' means and variances, which the server averages over all batches."""
        rates = [1.0, *self.sub_models]
        payload = {"weights": cpu_state(self.model), "rates": rates}
        sums: dict = {}
        for r in server.run_clients(rnd, server.available_clients(rnd), payload, method="bn_statistics"):
            for key, value in r.update.items():
                sums[key] = sums[key] + value if key in sums else value.clone()
        for rate in rates:
            model = self.model if rate == 1.0 else self.sub_models[rate]
            state = model.state_dict()
            for name, module in model.named_modules():
                key = f"{rate:g}|{name}|"
                if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and key + "n" in sums:
                    n = sums[key + "n"]
                    state[f"{name}.running_mean"].copy_((sums[key + "mean"] / n).to(state[f"{name}.running_mean"]))
                    state[f"{name}.running_var"].copy_((sums[key + "var"] / n).to(state[f"{name}.running_var"]))
                    state[f"{name}.num_batches_tracked"].fill_(int(n))

    @staticmethod
    def window_offset(cfg, rnd: int) -> int:
        """FedRolex's offset in round `rnd`: the paper's window starts at unit rnd mod K and
        rolls forward; the authors' code (resnet_server.py, `torch.roll(arange(K), rnd)[:k]`)
        takes units (i - rnd) mod K, the same window rolling backward (`heterofl.roll=code`)."""
        return -rnd if cfg.heterofl.roll == "code" else rnd

    @staticmethod
    def cut(full: dict, sub: torch.nn.Module, windows: dict | None = None) -> dict:
        """The global weights' leading slices in `sub`'s shapes (or at FedRolex's `windows`)."""
        return {k: full[k][windows[k] if windows else leading(full[k], v.shape)].clone()
                for k, v in sub.state_dict().items()}

    def eval_models(self) -> dict:
        return {"global": self.model, **{f"width_{r:g}": m for r, m in getattr(self, "sub_models", {}).items()}}

    def state_dict(self) -> dict:
        return {"global": self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["global"])
        for sub in self.sub_models.values():
            sub.load_state_dict(self.cut(self.model.state_dict(), sub))

    # ---- client ----
    def client_update(self, client: Client, payload: dict) -> ClientResult:
        rate = client_rate(client.cfg, client.cid)
        model = client.model if rate == 1 else self._scratch(client, rate)
        full = payload["weights"]
        windows = None
        if client.cfg.heterofl.variant == "fedrolex":  # this round's window of every hidden layer
            windows = rolled(full, {k: v.shape for k, v in model.state_dict().items()},
                             self.window_offset(client.cfg, client.round))
        model.load_state_dict(self.cut(full, model, windows))
        classes = torch.unique(client.y).cpu() if client.cfg.heterofl.mask else None
        loss = self.local_loss_for(client, classes)
        if client.cfg.heterofl.variant == "fjord":
            loss = self.ordered_dropout(client, rate, loss)
        stats = local_sgd(client, model, loss)
        update = cpu_state(model)
        if classes is not None:
            update["classes"] = classes
        return ClientResult(client.cid, client.num_samples, update, {**stats, "rate": rate})

    def bn_statistics(self, client: Client, payload: dict) -> ClientResult:
        """sBN's statistics pass (`static_statistics`) on this client: for each width, the
        model cut from the served weights (no Scaler: as it is evaluated), its BatchNorm
        statistics reset to a cumulative average, the client's training data passed through it
        in training mode in batches of local.batch_size (a last batch of one left out); returns
        {"<rate>|<layer>|mean" (| var | n): the sums over its batches} (float64)."""
        out = {}
        bs = int(client.cfg.local.batch_size)
        for rate in payload["rates"]:
            model = self._stats_model(client, rate)
            model.load_state_dict(self.cut(payload["weights"], model))
            norms = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
            for m in norms.values():
                m.momentum = None
                m.reset_running_stats()
            model.train()
            with torch.no_grad():
                for start in range(0, client.num_samples, bs):
                    if client.num_samples - start > 1:
                        model(client.x[start:start + bs])
            for name, m in norms.items():
                n = float(m.num_batches_tracked)
                out[f"{rate:g}|{name}|mean"] = m.running_mean.double().cpu() * n
                out[f"{rate:g}|{name}|var"] = m.running_var.double().cpu() * n
                out[f"{rate:g}|{name}|n"] = torch.tensor(n, dtype=torch.float64)
        return ClientResult(client.cid, client.num_samples, out)

    def _stats_model(self, client: Client, rate: float) -> torch.nn.Module:
        """The actor's model at `rate` for statistics: no Scaler hooks, built once per rate."""
        if not hasattr(self, "_stats_widths"):
            self._stats_widths = {}
        if rate not in self._stats_widths:
            self._stats_widths[rate] = self.width_model(rate).to(client.device)
        return self._stats_widths[rate]

    def local_loss_for(self, client: Client, classes):
        if classes is None:
            return base_loss(client.cfg.local)
        keep = torch.zeros(client.num_classes, dtype=torch.bool, device=client.device)
        keep[classes.to(client.device)] = True

        def loss(model, x, y):
            return F.cross_entropy(model(x).masked_fill(~keep, 0.0), y)

        return loss

    def ordered_dropout(self, client: Client, rate: float, loss_of):
        """FjORD: each step, a width p drawn uniformly from the rates <= the client's (from
        (seed, round, client)), and the loss of the width-p sub-model computed on the leading
        slices of the client's own model, so its step moves those slices only."""
        widths = sorted(float(r) for r in client.cfg.heterofl.rates if r <= rate)
        g = torch.Generator().manual_seed(seed_for(int(client.cfg.seed), client.round, client.cid, RATE_STREAM + 1))

        def loss(model, x, y):
            p = widths[int(torch.randint(len(widths), (1,), generator=g))]
            return loss_of(self.narrowed(client, model, p, rate), x, y)

        return loss

    def narrowed(self, client: Client, model: torch.nn.Module, p: float, rate: float):
        """`model` (the client's, at `rate`) as its width-p sub-model: a function of the
        leading slices of its own parameters (views: gradients flow back into them)."""
        if p == rate:
            return model
        sub = self._scratch(client, p)
        shapes = {n: q.shape for n, q in sub.named_parameters()}
        params = {n: q[leading(q, shapes[n])] for n, q in model.named_parameters()}
        return lambda x: functional_call(sub, params, (x,))

    def _scratch(self, client: Client, rate: float) -> torch.nn.Module:
        """The actor's model at `rate`, built once per rate."""
        if not hasattr(self, "_widths"):
            self._widths = {}
        if rate not in self._widths:
            model = self.width_model(rate).to(client.device)
            if client.cfg.heterofl.scaler and client.cfg.heterofl.variant != "fjord":  # HeteroFL's and FedRolex's
                scale(model, rate)
            self._widths[rate] = model
        return self._widths[rate]


def scale(model: torch.nn.Module, rate: float) -> None:
    """The authors' Scaler: every linear / convolutional layer of the encoder has its output
    divided by `rate` in training (in evaluation, as it is), so a narrow sub-model's
    activations keep the whole model's scale, as inverted dropout does."""
    def hook(module, inputs, output):
        return output / rate if module.training else output

    for m in model.encoder.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            m.register_forward_hook(hook)

