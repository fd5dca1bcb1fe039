"""Checks that need no data: names exist, numbers are finite and in range, options combine.

Each chosen plugin checks its own section (`Options.check`, raysim.options) and the model
zoo its `model_options` (raysim.models.check_model_options); the core keys are checked here."""
from __future__ import annotations

import math
import re
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from raysim import registry
from raysim.config.schema import AUGMENTATIONS, augmentation_name, clients_per_round
from raysim.config.sections import PLUGIN_KINDS, section_of
from raysim.errors import ConfigError

def _check_name(cfg: DictConfig, key: str, reg: registry.Registry) -> None:
    name = OmegaConf.select(cfg, key)
    if name not in reg:
        raise ConfigError(f"{key}={name!r} is not a known {reg.kind}; choose one of: {', '.join(reg.names())}")


FLOAT32_MAX = 3.4028234663852886e38


def _non_finite(node, key: str = "") -> Optional[str]:
    """The first key (dotted, [i] for list items) whose value is a NaN or infinite number,
    or a float past float32's range (the precision the models train in: `local.lr=1e300`
    passed and the run died in its first step as a code failure)."""
    if isinstance(node, float):
        return None if math.isfinite(node) and abs(node) <= FLOAT32_MAX else key
    if isinstance(node, dict):
        children = ((f"{key}.{k}" if key else str(k), v) for k, v in node.items())
    elif isinstance(node, list):
        children = ((f"{key}[{i}]", v) for i, v in enumerate(node))
    else:
        return None
    for child_key, value in children:
        found = _non_finite(value, child_key)
        if found is not None:
            return found
    return None


def validate(cfg: DictConfig) -> None:
    """Checks that need no data: names exist, numbers are finite and in range."""
    bad = _non_finite(OmegaConf.to_container(cfg))
    if bad is not None:
        raise ConfigError(f"{bad}={OmegaConf.select(cfg, bad)} is not a finite number of float32's range (the "
                          f"models train in float32: at most {FLOAT32_MAX:.3g}); give a smaller value")
    _check_name(cfg, "algorithm", registry.ALGORITHMS)
    _check_name(cfg, "selection", registry.SELECTIONS)
    _check_name(cfg, "dataset", registry.DATASETS)
    _check_name(cfg, "model", registry.MODELS)
    _check_name(cfg, "partition.name", registry.PARTITIONS)

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    from raysim.models import check_model_options

    check_model_options(cfg.model, OmegaConf.to_container(cfg.model_options))
    need(cfg.num_clients >= 1, f"num_clients must be >= 1, got {cfg.num_clients}")
    missing = _missing_tracker(cfg)
    need(missing is None, missing or "")
    need(cfg.log.wandb_mode in ("online", "offline", "disabled"),
         f"log.wandb_mode must be online, offline or disabled, got {cfg.log.wandb_mode!r}")
    need(0 < cfg.participation <= 1, f"participation must be in (0, 1], got {cfg.participation}")
    if cfg.clients_per_round is not None:
        need(1 <= cfg.clients_per_round <= cfg.num_clients,
             f"clients_per_round must be in [1, num_clients={cfg.num_clients}], got {cfg.clients_per_round}")
    need(cfg.rounds >= 1, f"rounds must be >= 1, got {cfg.rounds}")
    check_ray(cfg.ray, need)
    need(0 <= cfg.seed < 2**32, f"seed must be in [0, 2**32), got {cfg.seed}")
    name = cfg.run_name
    need(name is None or (name not in ("", ".", "..") and "/" not in name and "\\" not in name),
         f"run_name={name!r} must be a plain folder name inside output_dir (no '/', '\\' or '..')")
    need(name is None or (len(str(name).encode("utf-8", "surrogateescape")) <= 200
                          and not any(ord(ch) < 32 or ord(ch) == 127 for ch in str(name))),
         f"run_name must be at most 200 bytes with no control characters (file systems take 255 for a name), "
         f"got {len(str(name).encode('utf-8', 'surrogateescape'))} bytes: {str(name)[:40]!r}...")
    need(cfg.input_scale in ("standardize", "unit"),
         f"input_scale must be standardize or unit, got {cfg.input_scale!r}")
    need(cfg.eval_every >= 1, f"eval_every must be >= 1, got {cfg.eval_every}")
    p = cfg.partition
    need(p.beta > 0, f"partition.beta must be > 0, got {p.beta}")
    need(p.k >= 1, f"partition.k must be >= 1, got {p.k}")
    need(p.shards_per_client >= 1, f"partition.shards_per_client must be >= 1, got {p.shards_per_client}")
    need(p.sigma > 0, f"partition.sigma must be > 0, got {p.sigma}")
    need(p.min_size >= 1, f"partition.min_size must be >= 1, got {p.min_size}")
    need(p.max_draws >= 1, f"partition.max_draws must be >= 1, got {p.max_draws}")
    need(0 <= p.test_fraction < 1, f"partition.test_fraction must be in [0, 1), got {p.test_fraction}")
    need(cfg.long_tail.imbalance >= 1, f"long_tail.imbalance must be >= 1 (1: no long tail), got {cfg.long_tail.imbalance}")
    need(0 <= cfg.eval.validation < 1, f"eval.validation must be in [0, 1) (0: off; a share of each client's training "
         f"samples to judge the run on), got {cfg.eval.validation}")
    need(cfg.eval.finetune_epochs >= 0, f"eval.finetune_epochs must be >= 0 (0: off), got {cfg.eval.finetune_epochs}")
    need(cfg.eval.where in ("auto", "server", "clients"),
         f"eval.where must be auto, server or clients (where the test set is evaluated), got {cfg.eval.where!r}")
    need(cfg.eval.tau_norm >= 0, f"eval.tau_norm must be >= 0 (0: off, 1: unit-norm classifier rows), got {cfg.eval.tau_norm}")
    shots = list(cfg.eval.shots)
    need(len(shots) == 2 and shots[0] >= shots[1] >= 0,
         f"eval.shots must be [many, few] with many >= few >= 0 (classes with more than many training samples are "
         f"many-shot, fewer than few few-shot), got {shots}")
    loc = cfg.local
    need(loc.epochs >= 1 or loc.steps >= 1, "local.epochs or local.steps must be >= 1")
    need(loc.steps >= 0, f"local.steps must be >= 0, got {loc.steps}")
    need(loc.batch_size >= 1, f"local.batch_size must be >= 1, got {loc.batch_size}")
    need(loc.lr > 0, f"local.lr must be > 0, got {loc.lr}")
    need(0 <= loc.momentum < 1, f"local.momentum must be in [0, 1), got {loc.momentum}")
    need(loc.weight_decay >= 0, f"local.weight_decay must be >= 0, got {loc.weight_decay}")
    need(0 < loc.lr_decay <= 1, f"local.lr_decay must be in (0, 1], got {loc.lr_decay}")
    need(loc.focal_gamma >= 0, f"local.focal_gamma must be >= 0 (0: cross-entropy), got {loc.focal_gamma}")
    if loc.focal_gamma > 0 and not registry.ALGORITHMS.get(cfg.algorithm).trains_on_base_loss:
        takes = [n for n in registry.ALGORITHMS.names() if registry.ALGORITHMS.get(n).trains_on_base_loss]
        raise ConfigError(f"local.focal_gamma: algorithm {cfg.algorithm!r} trains on its own loss, not the plain one; "
                          f"algorithms that take it: {', '.join(takes)}")
    need(cfg.personal.buffers in ("shared", "local"),
         f"personal.buffers must be shared or local, got {cfg.personal.buffers!r}")
    if cfg.personal.buffers != "shared" and not registry.ALGORITHMS.get(cfg.algorithm).personal:
        takes = [n for n in registry.ALGORITHMS.names() if registry.ALGORITHMS.get(n).personal]
        raise ConfigError(f"personal.buffers: algorithm {cfg.algorithm!r} keeps nothing on its clients; "
                          f"algorithms that read it: {', '.join(takes)}")
    unshared = registry.ALGORITHMS.get(cfg.algorithm).unshared
    if unshared and p.test_fraction == 0 and p.name != "natural":  # natural: LEAF's users have test data of their own
        raise ConfigError(f"partition.test_fraction=0: algorithm {cfg.algorithm!r} is judged by each client's own "
                          f"model on its own test split, and the server's model keeps the initial {unshared}, which "
                          f"no client shares; set partition.test_fraction > 0 (unset, it is 0.2)")
    if cfg.eval.finetune_epochs > 0 and not registry.ALGORITHMS.get(cfg.algorithm).finetunes:
        raise ConfigError(f"eval.finetune_epochs: algorithm {cfg.algorithm!r} evaluates a model its clients do not "
                          "train, so a client cannot fine-tune it; unset eval.finetune_epochs")
    if cfg.eval.finetune_epochs > 0 and p.test_fraction == 0 and p.name != "natural":  # the server checks natural's
        raise ConfigError("eval.finetune_epochs: fine-tuned models are tested on each client's own test data, and "
                          "these clients have none: set partition.test_fraction (e.g. 0.2)")
    try:
        augmentation_name(loc.augment)
    except ValueError:
        raise ConfigError(f"local.augment must be one of false, true, {', '.join(AUGMENTATIONS)}; "
                          f"got {loc.augment!r}") from None
    if loc.clip_grad_norm is not None:
        need(loc.clip_grad_norm > 0, f"local.clip_grad_norm must be > 0 (or null: no clipping), got {loc.clip_grad_norm}")
        need(not loc.vectorize, "local.clip_grad_norm with local.vectorize: the vectorised groups do not clip; "
             "set local.vectorize=false or local.clip_grad_norm=null")
        need(cfg.privacy.mode != "local", "local.clip_grad_norm with privacy.mode=local: DP-SGD clips each sample's "
             "gradient to privacy.clip instead; set local.clip_grad_norm=null")
    if loc.vectorize:
        need(loc.vectorize_group >= 1, f"local.vectorize_group must be >= 1, got {loc.vectorize_group}")
        if not registry.ALGORITHMS.get(cfg.algorithm).vectorizes():
            takes = [n for n in registry.ALGORITHMS.names() if registry.ALGORITHMS.get(n).vectorizes()]
            raise ConfigError(f"local.vectorize: algorithm {cfg.algorithm!r} trains its clients one at a time; "
                              f"vectorised: {', '.join(takes)}")
        need(augmentation_name(loc.augment) == "none",
             f"local.vectorize does not combine with local.augment={loc.augment} (its random draws interleave with "
             "the batch order): set local.augment=false or local.vectorize=false")
    check_server(cfg, need)
    check_attack(cfg, need)
    check_privacy(cfg, need)
    check_compress(cfg, need)
    sy = cfg.system
    need(0 <= sy.dropout < 1, f"system.dropout must be in [0, 1), got {sy.dropout}")
    need(0 <= sy.stragglers <= 1, f"system.stragglers must be in [0, 1], got {sy.stragglers}")
    se = list(sy.straggler_epochs)
    need(len(se) == 2 and 1 <= se[0] <= se[1],
         f"system.straggler_epochs must be [lo, hi] with 1 <= lo <= hi, got {se}")
    from raysim.world.clock import PROFILES

    profiles = ["none", *PROFILES, "trace"]
    need(sy.profile in profiles, f"system.profile must be one of {', '.join(profiles)}, got {sy.profile!r}")
    need((sy.profile == "trace") == bool(sy.trace), "system.trace (a CSV of devices) goes with system.profile=trace, "
                                                     f"got profile={sy.profile!r} and trace={sy.trace!r}")
    need(sy.deadline is None or (sy.deadline > 0 and sy.profile != "none"),
         f"system.deadline must be > 0 simulated seconds, with a system.profile (got deadline={sy.deadline}, "
         f"profile={sy.profile!r})")
    need(sy.availability in ("always", "diurnal", "trace"),
         f"system.availability must be always, diurnal or trace, got {sy.availability!r}")
    need(sy.availability == "always" or sy.profile != "none",
         f"system.availability={sy.availability} is in simulated time: set a system.profile (uniform, mobile, trace)")
    need((sy.availability == "trace") == bool(sy.availability_trace),
         "system.availability_trace (a CSV of online intervals) goes with system.availability=trace, got "
         f"availability={sy.availability!r} and availability_trace={sy.availability_trace!r}")
    need(0 < sy.online_hours <= 24, f"system.online_hours must be in (0, 24], got {sy.online_hours}")
    need(sy.target_accuracy is None or 0 < sy.target_accuracy <= 1,
         f"system.target_accuracy must be in (0, 1], got {sy.target_accuracy}")
    need(cfg.checkpoint_every >= 0, f"checkpoint_every must be >= 0 (0: never), got {cfg.checkpoint_every}")
    fa = cfg.faults
    need(0 <= fa.kill_fraction <= 1, f"faults.kill_fraction must be in [0, 1], got {fa.kill_fraction}")
    kr = list(fa.kill_rounds)
    need(all(1 <= r <= cfg.rounds for r in kr), f"faults.kill_rounds must be round numbers in [1, rounds={cfg.rounds}], got {kr}")
    need((fa.kill_fraction > 0) == bool(kr),
         f"faults.kill_fraction={fa.kill_fraction} and faults.kill_rounds={kr} go together: give both "
         "(a fraction > 0 and the rounds in which that share of the client actors dies) or neither")
    need((fa.crash_round == -1) == (fa.crash_client == -1),
         f"faults.crash_round={fa.crash_round} and faults.crash_client={fa.crash_client} go together: give both or neither")
    need(fa.crash_round == -1 or 1 <= fa.crash_round <= cfg.rounds,
         f"faults.crash_round must be in [1, rounds={cfg.rounds}], got {fa.crash_round}")
    need(fa.crash_client == -1 or 0 <= fa.crash_client < cfg.num_clients,
         f"faults.crash_client must be a client id in [0, num_clients={cfg.num_clients}), got {fa.crash_client}")
    j = cfg.clients.join
    need(0 <= j.fraction < 1, f"clients.join.fraction must be in [0, 1) (some clients must be there at the start), "
                              f"got {j.fraction}")
    need(j.over >= 1, f"clients.join.over must be >= 1 (rounds over which the newcomers arrive), got {j.over}")
    need(j.fraction == 0 or 2 <= j.round and j.round + j.over - 1 <= cfg.rounds,
         f"clients.join: newcomers arrive in rounds [round, round + over - 1] = [{j.round}, {j.round + j.over - 1}], "
         f"which must lie in [2, rounds={cfg.rounds}]")
    r = cfg.resources
    cpa = r.clients_per_actor
    need(cpa == "auto" or (isinstance(cpa, int) and not isinstance(cpa, bool) and cpa >= 1),
         f"resources.clients_per_actor must be 'auto' or an integer >= 1, got {cpa!r}")
    need(r.num_actors is None or r.num_actors >= 1, f"resources.num_actors must be >= 1, got {r.num_actors}")
    need(r.num_cpus_per_actor is None or r.num_cpus_per_actor >= 0,
         f"resources.num_cpus_per_actor must be >= 0, got {r.num_cpus_per_actor}")
    g = r.num_gpus_per_actor
    need(g == "auto" or (isinstance(g, (int, float)) and not isinstance(g, bool) and g >= 0),
         f"resources.num_gpus_per_actor must be a number >= 0 (a GPU fraction) or 'auto' (as many actors per GPU "
         f"as fit one client update's measured memory), got {g!r}")
    need(0 <= r.gpu_memory_headroom < 1,
         f"resources.gpu_memory_headroom must be in [0, 1) (the fraction of a GPU's memory kept free), got "
         f"{r.gpu_memory_headroom}")
    need(cfg.data_store_dir is None or str(cfg.data_store_dir).strip() != "",
         "data_store_dir must be a folder (or null: $RAYSIM_CACHE_DIR/arrays), got an empty string")
    need(cfg.data_store in ("auto", "memory", "files"), f"data_store must be auto, memory (Ray's object store) or "
                                                         f"files (raysim/data/store.py), got {cfg.data_store!r}")
    need(r.torch_threads >= 1, f"resources.torch_threads must be >= 1, got {r.torch_threads}")
    need(r.server_threads >= 0, f"resources.server_threads must be >= 0 (0: every CPU), got {r.server_threads}")
    need(cfg.eval.local_clients >= 0, f"eval.local_clients must be >= 0 (0: every client), got {cfg.eval.local_clients}")
    need(r.tasks_per_actor is None or r.tasks_per_actor >= 1,
         f"resources.tasks_per_actor must be >= 1 (or null: chosen by the model's size and the GPU), got {r.tasks_per_actor}")
    need(r.placement_timeout > 0, f"resources.placement_timeout must be > 0 seconds, got {r.placement_timeout}")
    need(r.client_state_gb is None or r.client_state_gb >= 0,
         f"resources.client_state_gb must be >= 0 GB (0: every state but the last on disk), got {r.client_state_gb}")
    need(r.lost_actor_wait > 0, f"resources.lost_actor_wait must be > 0 seconds, got {r.lost_actor_wait}")
    need(r.ray_start_s >= 0, f"resources.ray_start_s must be >= 0 seconds (0: always Ray), got {r.ray_start_s}")
    need(r.wave_mb > 0, f"resources.wave_mb must be > 0 MB, got {r.wave_mb}")
    for key, reg in PLUGIN_KINDS.items():  # each chosen part checks its own options
        section = section_of(reg, cfg[key])
        if section is not None:
            reg.get(cfg[key]).Options.check_section(cfg, section)


def check_ray(ray: DictConfig, need) -> None:
    """The `ray` section: all the command needs to start or join Ray while the rest is checked."""
    address = ray.address
    m = re.fullmatch(r"(ray://)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})", str(address))
    need(address is None or address == "auto" or (m is not None and 1 <= int(m.group(3)) <= 65535),
         f"ray.address={address!r} is not an address Ray can join: give auto (the cluster this machine is part "
         "of), HOST:PORT (the head node's GCS, e.g. 10.0.0.5:6379) or ray://HOST:PORT (Ray Client), or leave it "
         "unset for a local Ray")
    need(ray.object_store_gb is None or ray.object_store_gb > 0, f"ray.object_store_gb must be > 0, got {ray.object_store_gb}")
    need(ray.metrics_port is None or 1024 <= ray.metrics_port <= 65535,
         f"ray.metrics_port must be a port in 1024..65535 (or null: Ray picks one), got {ray.metrics_port}")
    need(ray.num_cpus is None or ray.num_cpus >= 1,
         f"ray.num_cpus must be >= 1 (the client actors need CPUs), got {ray.num_cpus}")


def check_server(cfg: DictConfig, need) -> None:
    """`server.*`: known names, ranges, and an algorithm that takes the parts asked for."""
    from raysim.aggregation import is_plain

    sv = cfg.server
    _check_name(cfg, "server.aggregator", registry.AGGREGATORS)
    _check_name(cfg, "server.optimizer", registry.SERVER_OPTIMIZERS)
    need(sv.lr > 0, f"server.lr must be > 0, got {sv.lr}")
    for key in ("momentum", "beta1", "beta2"):
        need(0 <= sv[key] < 1, f"server.{key} must be in [0, 1), got {sv[key]}")
    need(sv.tau > 0, f"server.tau must be > 0, got {sv.tau}")
    need(sv.fedopt in ("reddi", "flower"), f"server.fedopt must be reddi or flower, got {sv.fedopt!r}")
    need(0 <= sv.trim < 0.5, f"server.trim must be in [0, 0.5) (the share cut at each end), got {sv.trim}")
    need(sv.byzantine >= 0, f"server.byzantine must be >= 0, got {sv.byzantine}")
    need(sv.krum_m >= 1, f"server.krum_m must be >= 1, got {sv.krum_m}")
    if sv.aggregator in ("krum", "multi_krum"):
        n = clients_per_round(cfg)
        need(n > 2 * sv.byzantine + 2, f"server.aggregator={sv.aggregator} with server.byzantine={sv.byzantine} needs "
                                       f"more than {2 * sv.byzantine + 2} clients per round (Krum's n > 2f + 2); "
                                       f"this run has {n}")
        need(sv.aggregator == "krum" or sv.krum_m <= n,
             f"server.krum_m={sv.krum_m} is more than the {n} clients per round")
    algorithm = registry.ALGORITHMS.get(cfg.algorithm)
    if sv.partial_sums:
        need(sv.partial_sums >= 1, f"server.partial_sums must be >= 0 (0: off; a block size), got {sv.partial_sums}")
        why = why_not_summed(cfg)
        need(why is None, f"server.partial_sums: {why}")
        need(not cfg.local.vectorize or sv.partial_sums == cfg.local.vectorize_group,
             f"server.partial_sums={sv.partial_sums} with local.vectorize: the sums' blocks are the vectorised groups, "
             f"so set server.partial_sums=local.vectorize_group={cfg.local.vectorize_group}")
    takes = algorithm.server_parts
    asked = [] if is_plain(sv) else (["aggregator"] if sv.aggregator != "mean" else []) + \
        (["optimizer"] if sv.optimizer != "sgd" or sv.lr != 1.0 else [])
    for part in asked:
        if part not in takes:
            others = [n for n in registry.ALGORITHMS.names() if part in registry.ALGORITHMS.get(n).server_parts]
            why = algorithm.own_server_rule or "its server step is its own"
            value = f"server.{part}={sv[part]}" + (f" server.lr={sv.lr}" if part == "optimizer" and sv.lr != 1.0 else "")
            raise ConfigError(f"{value}: algorithm {cfg.algorithm!r} does not take a server {part} ({why}); "
                              f"algorithms that do: {', '.join(others)}")


def check_attack(cfg: DictConfig, need) -> None:
    """`attack.*`: a known kind, ranges, and an algorithm whose clients return their model
    for the model attacks."""
    from raysim.attacks import KINDS, MODEL_ATTACKS

    a = cfg.attack
    need(a.kind in KINDS, f"attack.kind must be one of {', '.join(KINDS)}, got {a.kind!r}")
    need(0 <= a.fraction < 1, f"attack.fraction must be in [0, 1) (some clients must be honest), got {a.fraction}")
    need(a.kind == "none" or a.fraction > 0, f"attack.kind={a.kind} needs attack.fraction > 0 (the share of clients "
                                             "that attack)")
    need(1 <= a.start <= cfg.rounds, f"attack.start must be a round in [1, rounds={cfg.rounds}], got {a.start}")
    need(a.boost > 0, f"attack.boost must be > 0, got {a.boost}")
    need(a.scale > 0, f"attack.scale must be > 0, got {a.scale}")
    if a.kind in MODEL_ATTACKS and not registry.ALGORITHMS.get(cfg.algorithm).returns_model:
        takes = [n for n in registry.ALGORITHMS.names() if registry.ALGORITHMS.get(n).returns_model]
        raise ConfigError(f"attack.kind={a.kind} changes the model a client returns, but algorithm {cfg.algorithm!r} "
                          f"returns something else; label_flip works with every algorithm; model attacks with: "
                          f"{', '.join(takes)}")


def why_not_summed(cfg: DictConfig) -> Optional[str]:
    """Why the clients' results cannot be sent as sums made where they ran (None: they can):
    only a run that folds its clients' models by the plain weighted mean can use them."""
    sv, algorithm = cfg.server, registry.ALGORITHMS.get(cfg.algorithm)
    if sv.aggregator != "mean":
        return (f"sums made where the clients ran can feed only the mean aggregator; server.aggregator={sv.aggregator} "
                "needs every model")
    if not (algorithm.returns_model and "aggregator" in algorithm.server_parts):
        return f"algorithm {cfg.algorithm!r} does not fold its clients' models by FedAvg's weighted mean; it needs each client's result"
    if cfg.privacy.mode == "central":
        return "privacy.mode=central clips each client's update, so it needs each one"
    if cfg.compress.up != "none":
        return f"compress.up={cfg.compress.up} encodes each client's update alone; a sum of several cannot be"
    return None


def sum_block(cfg: DictConfig) -> int:
    """How many clients' training results a client actor sends as one sample-weighted sum (0:
    each result): `server.partial_sums`, or, with `local.vectorize`, each vectorised group,
    summed on the device it trained on, wherever the run folds models by the plain mean."""
    if cfg.server.partial_sums:
        return int(cfg.server.partial_sums)
    if cfg.local.vectorize and why_not_summed(cfg) is None:
        return int(cfg.local.vectorize_group)
    return 0


def check_compress(cfg: DictConfig, need) -> None:
    """`compress.*` (raysim/compression/uplink.py): a known codec, ranges, an algorithm whose
    clients return their model, and the parts it cannot go with, refused in one line each."""
    from raysim.compression.uplink import CODECS

    c = cfg.compress
    need(c.up in CODECS, f"compress.up must be one of {', '.join(CODECS)}, got {c.up!r}")
    need(0 < c.ratio <= 1, f"compress.ratio must be in (0, 1] (the share of the update's entries sent), got {c.ratio}")
    need(2 <= c.bits <= 32, f"compress.bits must be in [2, 32] (a sign bit and at least one of level), got {c.bits}")
    need(c.bucket >= 1, f"compress.bucket must be >= 1, got {c.bucket}")
    need(c.sign_scale in ("update", "tensor"), f"compress.sign_scale must be update or tensor, got {c.sign_scale!r}")
    if c.up == "none":
        need(not c.error_feedback, "compress.error_feedback needs a codec: set compress.up (topk, randk, qsgd, sign)")
        return
    algorithm = registry.ALGORITHMS.get(cfg.algorithm)
    if not algorithm.compressible():
        takes = [n for n in registry.ALGORITHMS.names() if registry.ALGORITHMS.get(n).compressible()]
        raise ConfigError(f"compress.up={c.up} encodes the update of a client that returns its model, but algorithm "
                          f"{cfg.algorithm!r} returns something else; algorithms it takes: {', '.join(takes)}")
    need(cfg.privacy.secure_aggregation == "none",
         f"compress.up={c.up} with privacy.secure_aggregation: masks cancel only in a sum of dense integers on one "
         "scale, which sparse codecs' indices and per-client norms or scales break; use one or the other")
    need(not (c.error_feedback and getattr(algorithm, "asynchronous", False)),
         f"compress.error_feedback with algorithm={cfg.algorithm}: a client in flight at a checkpoint has already left "
         "its new residual, so a resumed run would differ; error feedback is for synchronous rounds")
    if c.error_feedback and cfg.server.aggregator == "majority_vote":
        need(c.up == "signsgd", f"compress.error_feedback with compress.up={c.up} and server.aggregator=majority_vote: "
                                "the vote steps server.lr x the sign, not the decoded update the residual subtracts; "
                                "use compress.up=signsgd (its residual is kept against server.lr x the sign)")
        need(cfg.server.optimizer == "sgd", "compress.error_feedback with majority_vote keeps its residual against a "
                                            f"step of server.lr x the sign (server.optimizer=sgd), got "
                                            f"server.optimizer={cfg.server.optimizer}")
    need(c.up != "signsgd" or cfg.server.aggregator == "majority_vote",
         "compress.up=signsgd sends bare signs, which only server.aggregator=majority_vote reads (Bernstein et al. "
         "2018); compress.up=sign sends scaled signs any aggregator averages")


def check_secure_aggregation(cfg: DictConfig, need) -> None:
    """`privacy.secure_aggregation`: the server reads only the round's sum, so it needs an
    algorithm whose server reads nothing but its clients' models, folded by the mean
    (raysim/privacy/secagg.py)."""
    pv = cfg.privacy
    need(pv.secure_aggregation in ("none", "secagg", "secagg_plus"),
         f"privacy.secure_aggregation must be none, secagg or secagg_plus, got {pv.secure_aggregation!r}")
    if pv.secure_aggregation == "none":
        return
    need(8 <= pv.secagg_bits <= 64, f"privacy.secagg_bits must be in [8, 64], got {pv.secagg_bits}")
    need(0 < pv.secagg_threshold <= 1, f"privacy.secagg_threshold must be in (0, 1], got {pv.secagg_threshold}")
    need(pv.secagg_neighbours is None or pv.secagg_neighbours >= 1,
         f"privacy.secagg_neighbours must be >= 1, got {pv.secagg_neighbours}")
    algorithm = registry.ALGORITHMS.get(cfg.algorithm)
    if not (algorithm.returns_model and "privacy" in algorithm.server_parts):
        takes = [n for n in registry.ALGORITHMS.names()
                 if registry.ALGORITHMS.get(n).returns_model and "privacy" in registry.ALGORITHMS.get(n).server_parts]
        raise ConfigError(f"privacy.secure_aggregation: algorithm {cfg.algorithm!r} needs more than the sum of its "
                          f"clients' models; algorithms that need only that: {', '.join(takes)}")
    need(cfg.server.aggregator == "mean", f"privacy.secure_aggregation: the server sees only the sum of the models, "
                                          f"so server.aggregator must be mean, got {cfg.server.aggregator}")
    need(pv.mode != "central", "privacy.secure_aggregation with privacy.mode=central: central DP clips each update "
                               "on the server, which sees only their sum; use privacy.mode=local (or none)")


def check_privacy(cfg: DictConfig, need) -> None:
    """`privacy.*`: ranges, the libraries it needs, and (central) a run whose server sees
    nothing but the clipped, noised sum of the updates, with clients sampled the way the
    accountant assumes, or (local) an algorithm whose clients' training DP-SGD covers
    (raysim/privacy/)."""
    pv = cfg.privacy
    need(pv.mode in ("none", "central", "local"), f"privacy.mode must be none, central or local, got {pv.mode!r}")
    check_secure_aggregation(cfg, need)
    if pv.mode == "none":
        return
    bound = "a client's update" if pv.mode == "central" else "a sample's gradient"
    need(pv.clip > 0, f"privacy.clip must be > 0 (the L2 bound on {bound}), got {pv.clip}")
    need(pv.noise_multiplier >= 0, f"privacy.noise_multiplier must be >= 0, got {pv.noise_multiplier}")
    need(pv.target_epsilon is None or pv.target_epsilon > 0, f"privacy.target_epsilon must be > 0, got {pv.target_epsilon}")
    need(pv.delta is None or 0 < pv.delta < 1, f"privacy.delta must be in (0, 1), got {pv.delta}")
    need(0 < pv.target_quantile < 1, f"privacy.target_quantile must be in (0, 1), got {pv.target_quantile}")
    need(pv.clip_lr > 0, f"privacy.clip_lr must be > 0, got {pv.clip_lr}")
    need(pv.clip_count_stddev is None or pv.clip_count_stddev >= 0,
         f"privacy.clip_count_stddev must be >= 0, got {pv.clip_count_stddev}")
    import importlib.util

    for module, what in (("dp_accounting", "reports the (epsilon, delta) spent with Google's dp-accounting"),
                         ("opacus", "trains each client with Opacus' DP-SGD")):
        if module == "dp_accounting" or pv.mode == "local":
            need(importlib.util.find_spec(module) is not None,
                 f"privacy.mode={pv.mode} {what}: pip install 'raysim[privacy]' (or {module.replace('_', '-')})")
    algorithm = registry.ALGORITHMS.get(cfg.algorithm)
    if pv.mode == "local":
        if not algorithm.trains_privately:
            takes = [n for n in registry.ALGORITHMS.names() if registry.ALGORITHMS.get(n).trains_privately]
            raise ConfigError(f"privacy.mode=local: algorithm {cfg.algorithm!r} trains or uploads in ways DP-SGD's "
                              f"per-sample clipping does not cover (see its trains_privately); algorithms it covers: "
                              f"{', '.join(takes)}")
        need(not pv.adaptive_clip, "privacy.adaptive_clip is central's (a quantile of the clients' update norms); "
                                   "privacy.mode=local clips each sample's gradient at privacy.clip")
        need(not cfg.local.vectorize, "privacy.mode=local trains each client with Opacus, one at a time: "
                                      "set local.vectorize=false")
        need(cfg.selection == "random", f"privacy.mode=local: selection={cfg.selection} reads the clients' data "
                                        "(their label counts) outside DP-SGD; use selection=random")
        return
    if "privacy" not in algorithm.server_parts:
        takes = [n for n in registry.ALGORITHMS.names() if "privacy" in registry.ALGORITHMS.get(n).server_parts]
        why = algorithm.own_server_rule or "its server step is its own"
        raise ConfigError(f"privacy.mode={pv.mode}: algorithm {cfg.algorithm!r} does not fold its clients' updates "
                          f"through raysim's server parts ({why}), so none could be clipped and noised; algorithms "
                          f"that do: {', '.join(takes)}")
    sv = cfg.server
    need(sv.aggregator == "mean", f"privacy.mode={pv.mode} adds noise to the sum of the clipped updates: it needs "
                                  f"server.aggregator=mean, got {sv.aggregator}")
    need(not sv.partial_sums, f"privacy.mode={pv.mode} clips each client's update: server.partial_sums (sums made "
                              "where the clients ran) must be 0")
    need(cfg.selection == "random", f"privacy.mode={pv.mode}: the accountant assumes the random selection (a fixed "
                                    f"number of clients drawn uniformly each round), got selection={cfg.selection}")
    need(cfg.clients.join.fraction == 0, f"privacy.mode={pv.mode}: clients.join changes the population the "
                                         "accountant samples from; set clients.join.fraction=0")


def _missing_tracker(cfg) -> Optional[str]:
    """The first tracker `log.*` asks for whose package is missing (raysim/runtime/trackers.py
    uses them), as the message to say."""
    import importlib.util

    for key, module, extra in (("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb"),
                               ("mlflow", "mlflow", "mlflow")):
        if cfg.log.get(key) and importlib.util.find_spec(module) is None:
            return f"log.{key}=true needs the {module} package: pip install 'raysim[{extra}]' (or {module})"
    return None
