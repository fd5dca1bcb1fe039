"""From a resolved config to what a run needs, with every data-dependent check done
before anything is written: the dataset, its partition, the model's fit (the run
directory's name and checks: preflight.run_dir_for)."""
from __future__ import annotations

import dataclasses

import numpy as np

import torch
from omegaconf import DictConfig

from raysim.config import ConfigError, augmentation_name, clients_per_round
from raysim.data.datasets import FederatedData, load_dataset
from raysim.data.partition import Partition, make_partition
from raysim.models import build_model


def prepare(cfg: DictConfig) -> tuple[FederatedData, Partition, int]:
    """Load the dataset, partition it and check that the model accepts its inputs."""
    data = load_dataset(cfg)
    aug = augmentation_name(cfg.local.augment)
    if aug == "colour" and (data.norm is None or len(data.input_shape) != 3 or data.input_shape[0] != 3):
        raise ConfigError(f"local.augment={cfg.local.augment} (colour) needs colour images (cifar10, cifar100, svhn, "
                          f"cinic10); dataset {cfg.dataset!r} has inputs {data.input_shape}")
    if aug == "crop_flip" and (len(data.input_shape) != 3 or min(data.input_shape[1:]) <= 4):
        raise ConfigError(f"local.augment=crop_flip needs images larger than 4x4; dataset {cfg.dataset!r} has "
                          f"inputs {data.input_shape}")
    n_classes = data.num_classes
    if cfg.long_tail.imbalance > 1:  # shape the training set before partitioning it (data/long_tail.py)
        from raysim.data.long_tail import long_tail_index

        keep = long_tail_index(data.y_train, n_classes, float(cfg.long_tail.imbalance),
                               np.random.default_rng([int(cfg.seed), 9]))
        data = dataclasses.replace(data, x_train=data.x_train[keep], y_train=data.y_train[keep],
                                   users_train=None if data.users_train is None else data.users_train[keep],
                                   stored=None)  # a subset: no longer the stored files' arrays
    own_test = cfg.partition.name == "natural" and data.users_test is not None  # LEAF's, Synthetic's users
    if data.population is not None:  # users made when picked: each its own consecutive rows (data/population.py)
        from raysim.data.partition import Shards

        part = Partition(Shards.contiguous(data.population.offsets))  # never empty: a user's test split is < all
    else:
        part = make_partition(data.y_train, cfg, n_classes, data.users_train, own_test)
    if cfg.eval.validation > 0:  # tuning: judged on held-out training samples, never a test set
        from raysim.data.validation import carve_validation

        data, part = carve_validation(data, part, cfg, own_test)
    from raysim.contract import Algorithm
    from raysim.registry import ALGORITHMS, MODELS

    algorithm = ALGORITHMS.get(cfg.algorithm)(cfg, n_classes, data.input_shape)  # it may change the network (Fed2)
    problem = _misfit(lambda: algorithm.build_model(data.input_shape), data.input_shape)
    if problem is not None:
        fit = [m for m in MODELS.names()
               if m != cfg.model and _misfit(lambda: build_model(m, data.input_shape, n_classes), data.input_shape) is None]
        own = type(algorithm).build_model is not Algorithm.build_model
        raise ConfigError(f"model={cfg.model!r}{f' ({cfg.algorithm} adapts it)' if own else ''} does not fit dataset "
                          f"{cfg.dataset!r} with inputs {data.input_shape} ({problem}); models that fit: "
                          f"{', '.join(fit) or 'none'}")
    if algorithm.unshared:  # a personalised method that keeps one part of the model on its clients
        _check_split(cfg, algorithm, data.input_shape, n_classes)
    if cfg.system.deadline:
        _check_deadline(cfg, algorithm.build_model(data.input_shape), data.inputs(data.x_test[:1].copy()),
                        part.sizes())
    if cfg.local.vectorize or cfg.privacy.mode != "none":
        buffers = [n for n, _ in algorithm.build_model(data.input_shape).named_buffers()]
        if buffers and cfg.local.vectorize:
            raise ConfigError(f"local.vectorize: model={cfg.model!r} keeps buffers ({buffers[0]}, ...: BatchNorm "
                              "statistics), which a vectorised group cannot update per client; use a model without "
                              "BatchNorm (model_options.norm=group where the model has it) or local.vectorize=false")
        if buffers:
            raise ConfigError(f"privacy.mode={cfg.privacy.mode}: model={cfg.model!r} keeps buffers ({buffers[0]}, ...: "
                              "BatchNorm statistics), which would be averaged without clipping or noise; use a model "
                              "without BatchNorm (model_options.norm=group where the model has it)")
        if cfg.privacy.mode == "local":  # what Opacus cannot train with per-sample gradients
            from raysim.dp_sgd import model_problems

            problems = model_problems(algorithm.build_model(data.input_shape))
            if problems:
                raise ConfigError(f"privacy.mode=local: Opacus cannot train model={cfg.model!r} privately: "
                                  f"{'; '.join(problems)}")
    return data, part, n_classes


def _weightless_part(model) -> str | None:
    """'encoder' or 'head' when that part of the model has no weights (mclr's encoder only
    flattens), else None."""
    return next((part for part in ("encoder", "head")
                 if not any(p.numel() for p in getattr(model, part).parameters())), None)


def _check_split(cfg: DictConfig, algorithm, input_shape: tuple, n_classes: int) -> None:
    """A method that shares one part of the model and keeps the other on each client needs a
    model whose two parts both have weights; else one line naming the models that do."""
    from raysim.registry import MODELS

    if algorithm.kept == "all":  # FedProto: each client keeps its whole model, nothing of it shared
        return
    if algorithm.kept == "norm":  # FedBN: its clients keep the BatchNorm layers
        from raysim.algorithms._personal import part_keys

        if part_keys(algorithm.build_model(input_shape), "norm"):
            return
        norm = [m for m in MODELS.names() if m != cfg.model and _misfit(
            lambda: build_model(m, input_shape, n_classes), input_shape) is None
            and part_keys(build_model(m, input_shape, n_classes), "norm")]
        raise ConfigError(f"algorithm={cfg.algorithm} keeps each client's BatchNorm layers, but model={cfg.model!r} "
                          f"has none{' with these model_options' if cfg.model_options else ''} (it would be FedAvg); "
                          f"models with BatchNorm that fit dataset {cfg.dataset!r}: {', '.join(norm) or 'none'} "
                          "(or model_options.norm=batch: mlp, cnn, vgg9)")
    empty = _weightless_part(algorithm.build_model(input_shape))
    if empty is None:
        return
    kept = algorithm.unshared
    shared = "head" if kept == "encoder" else "encoder"
    split = [m for m in MODELS.names() if m != cfg.model and _misfit(
        lambda: build_model(m, input_shape, n_classes), input_shape) is None
        and _weightless_part(build_model(m, input_shape, n_classes)) is None]
    raise ConfigError(f"algorithm={cfg.algorithm} shares the model's {shared} and keeps its {kept} on each client, "
                      f"but model={cfg.model!r} has no {empty} weights (its encoder / head split is all "
                      f"{'head' if empty == 'encoder' else 'encoder'}): nothing would be "
                      f"{'shared' if empty == shared else 'kept'}; models with weights in both parts that fit dataset "
                      f"{cfg.dataset!r}: {', '.join(split) or 'none'}")


def _check_deadline(cfg: DictConfig, model, sample, sizes) -> None:
    """`system.deadline` against the fastest client's simulated seconds for one update (the
    fewest epochs a client trains, the model's weights as the payload, both ways): a
    deadline no client can meet is one line, before anything runs."""
    from raysim.world.clock import Clock, flops_per_sample

    sy, loc = cfg.system, cfg.local
    clock = Clock(cfg, len(sizes), sizes, flops_per_sample(model, sample))
    epochs = min(int(loc.epochs), int(sy.straggler_epochs[0]) if sy.stragglers > 0 else int(loc.epochs))
    payload = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    cid, seconds = clock.fastest(epochs, payload)
    if seconds > float(sy.deadline):
        work = (f"{loc.steps} steps of {loc.batch_size} samples" if loc.steps else
                f"{epochs} epoch{'s' if epochs != 1 else ''} of {int(sizes[cid])} samples")
        raise ConfigError(f"system.deadline={sy.deadline:g}: no client can send an update back in time; the fastest "
                          f"(system.profile={sy.profile}), client {cid}, needs {seconds:.3g} simulated seconds for one "
                          f"({work}, {payload / 1e6:.3g} MB each way); set system.deadline above that")


def _misfit(build, input_shape: tuple):
    """None if the network `build()` makes takes these inputs, else the first line of what went wrong."""
    try:
        model = build()
        with torch.no_grad():
            model.eval()(torch.zeros(2, *input_shape))
    except (RuntimeError, ValueError) as e:
        return str(e).splitlines()[0]
    return None


def describe_partition(cfg: DictConfig) -> str:
    """The partition and the settings it reads, e.g. 'dirichlet beta=0.5'."""
    p = cfg.partition
    return {"dirichlet": f"dirichlet beta={p.beta}", "quantity": f"quantity beta={p.beta}", "classes": f"classes k={p.k}",
            "classes_power_law": f"classes_power_law k={p.k} sigma={p.sigma}",
            "shards": f"shards {p.shards_per_client} per client", "power_law": f"power_law sigma={p.sigma}"}.get(p.name, p.name)


def describe(cfg: DictConfig, num_clients: int) -> str:
    """The run in one paragraph: what is trained on what, and every setting that changes the
    experiment from plain synchronous rounds (selection, system heterogeneity, faults)."""
    part = describe_partition(cfg)
    parts = [f"{cfg.algorithm} with {cfg.selection} selection, model {cfg.model} on {cfg.dataset} ({part}), "
             f"{num_clients} clients, {clients_per_round(cfg)} per round, {cfg.rounds} rounds, seed {cfg.seed}"
             + (f", long-tailed training set IF={cfg.long_tail.imbalance:g}" if cfg.long_tail.imbalance > 1 else "")]
    sy, fa = cfg.system, cfg.faults
    system = []
    if sy.dropout > 0:
        system.append(f"dropout {sy.dropout}")
    if sy.stragglers > 0:
        lo, hi = sy.straggler_epochs
        system.append(f"stragglers {sy.stragglers} ({lo}-{hi} epochs)" + (" (no effect: local.steps is set)" if cfg.local.steps else ""))
    if sy.profile != "none":  # simulated time (world/clock.py)
        system.append(f"devices {sy.profile}" + (f", round deadline {sy.deadline:g} s" if sy.deadline else "")
                      + (f", availability {sy.availability}" if sy.availability != "always" else ""))
    parts.append(f"system: {', '.join(system) or 'none'}")
    faults = []
    if fa.kill_fraction > 0:
        faults.append(f"kill {fa.kill_fraction} of the client actors in rounds {list(fa.kill_rounds)}")
    if fa.crash_round >= 1:
        faults.append(f"crash client {fa.crash_client}'s actor in round {fa.crash_round}")
    parts.append(f"faults: {', '.join(faults) or 'none'}")
    return "; ".join(parts)
