"""Typed run configuration: OmegaConf structured configs, layering and validation.

A config is `default.yaml` < the config groups of the chosen names (`dataset/<dataset>.yaml`,
`algorithm/<algorithm>.yaml`, `selection/<selection>.yaml`, as Hydra's config groups) < each
`--config FILE` < `key=value` overrides, merged onto a typed schema so that an unknown key
or a wrongly typed value is caught by name. The shipped YAML files are package data
(`configs/`, installed as `raysim.configs`), so an installed raysim reads the same defaults as a clone. Plugins
(algorithms, selections, datasets) add their own section, e.g. `fedprox.mu`, from the
`Config` dataclass they declare; a section the run does not use may not be set on the
command line. Every problem is raised as a `ConfigError` whose message is one line naming
the key or file and what is allowed.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from raysim import registry

# the shipped configs: the top-level configs/ folder, installed as the package raysim.configs
CONFIG_DIR = Path(str(importlib.resources.files("raysim.configs")))
DEFAULT_YAML = CONFIG_DIR / "default.yaml"
GROUPS = ("dataset", "algorithm", "selection")  # config groups: choosing a name applies <group>/<name>.yaml


class ConfigError(Exception):
    """A user-facing configuration or input problem; its message is one line."""


AUGMENTATIONS = ("none", "colour", "crop_flip")  # local.augment, see raysim/data/augment.py


def augmentation_name(value) -> str:
    """`local.augment` as one of AUGMENTATIONS (true means colour, false none); else ValueError."""
    if value is True:
        return "colour"
    if value is False or value is None:
        return "none"
    if isinstance(value, str) and value in AUGMENTATIONS:
        return value
    raise ValueError(value)


@dataclass
class PartitionConfig:
    name: str = "dirichlet"  # iid | dirichlet | classes | shards | quantity | power_law | classes_power_law | natural
    beta: float = 0.5  # Dirichlet concentration (dirichlet: over labels, quantity: over sizes)
    k: int = 2  # classes, classes_power_law: labels per client (#C=k)
    shards_per_client: int = 2  # shards: label-sorted shards per client
    sigma: float = 2.0  # power_law, classes_power_law: sigma of the log-normal client sizes
    min_size: int = 10  # fewest training samples a client may hold (NIID-Bench's rule for dirichlet / quantity)
    max_draws: int = 100  # dirichlet / quantity: redraws before the best draw is topped up to min_size
    test_fraction: float = 0.0  # share of each client's samples kept as its local test set


@dataclass
class LongTailConfig:
    imbalance: float = 1.0  # IF: the training set keeps n_max * IF^(-c/(C-1)) of class c (1: as it is)


@dataclass
class EvalConfig:
    # many / medium / few-shot class groups by training samples (after long_tail): a class
    # with more than shots[0] samples is many-shot, fewer than shots[1] few-shot (CReFF's
    # CIFAR-10-LT: > 1500, < 200)
    shots: List[int] = field(default_factory=lambda: [1500, 200])
    tau_norm: float = 0.0  # > 0: evaluate every model with classifier rows w_c / ||w_c||^tau (0: off)


@dataclass
class LogConfig:
    tensorboard: bool = False  # also log the per-round metrics to <run dir>/tensorboard (the `tensorboard` extra)


@dataclass
class LocalConfig:
    epochs: int = 1
    steps: int = 0  # > 0: this many SGD steps instead of `epochs` epochs
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-5
    lr_decay: float = 1.0  # lr in round r is lr * lr_decay ** (r - 1)
    augment: Any = False  # false | colour (= true; FedEntOpt's) | crop_flip (NIID-Bench's): see raysim/data/augment.py
    focal_gamma: float = 0.0  # > 0: the focal loss instead of cross-entropy (algorithms that train on the plain loss)
    vectorize: bool = False  # train groups of clients as one batched program (raysim/vectorized.py)
    vectorize_group: int = 64  # clients per group, cut from the sorted cohort by client id


@dataclass
class ResourcesConfig:
    clients_per_actor: Any = "auto"  # "auto" (one actor per CPU share) or an int; 1 = actor per client
    num_actors: Optional[int] = None  # this many client actors (wins over clients_per_actor); on an
    # autoscaling cluster the autoscaler adds nodes until they fit
    num_cpus_per_actor: Optional[float] = None  # None: 1 CPU each, or an equal share of the CPUs when
    # clients_per_actor asks for more actors than there are CPUs
    num_gpus_per_actor: float = 0.0
    torch_threads: int = 1  # torch intra-op threads in each client actor
    placement_timeout: float = 600.0  # seconds to wait for the client actors to be placed (a cluster
    # that autoscales adds nodes meanwhile); then the run stops with one line, nothing written


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: start a local Ray; "auto" or host:port: join a cluster
    dashboard: bool = False  # local Ray only: start the dashboard (costs ~1 GB RSS and ~1 s)
    num_cpus: Optional[int] = None  # local Ray only: CPUs to offer (default: all)
    object_store_gb: Optional[float] = None  # local Ray only: its object store, GB (default: Ray's, 30% of memory)
    # between runs in one Ray session (raysim.simulate in a notebook, a sweep, a test suite):
    # keep the server's and client actors' processes and reuse them (see runtime/pool.py)
    reuse_workers: bool = True


@dataclass
class SystemConfig:
    """System heterogeneity, for any algorithm (FedEntOpt's robustness runs). Stragglers
    vary the number of epochs, so they have no effect when `local.steps` is set."""

    dropout: float = 0.0  # probability that a selected client does not return its update
    stragglers: float = 0.0  # fraction of all clients that are stragglers (drawn once from the seed)
    straggler_epochs: List[int] = field(default_factory=lambda: [1, 5])  # a straggler's epochs: uniform in [lo, hi]


@dataclass
class FaultsConfig:
    """Fault injection for tests, drills and research on unreliable clients. Every death is
    a real one: the client actor's process exits (`os._exit`) and Ray restarts it."""

    crash_round: int = -1  # with crash_client: the actor training this client in this round dies
    crash_client: int = -1
    kill_fraction: float = 0.0  # this share of the client actors (at least one) dies in each of `kill_rounds`
    kill_rounds: List[int] = field(default_factory=list)


@dataclass
class JoinConfig:
    """Clients that join late (newcomers), for any algorithm and selection: see
    runtime/availability.py. Which clients are late is drawn once from the seed."""

    fraction: float = 0.0  # share of the clients (at least one when > 0) not there at the start
    round: int = 1  # the first round they can be selected
    over: int = 1  # they arrive in equal batches over this many rounds, from `round` on


@dataclass
class ClientsConfig:
    join: JoinConfig = field(default_factory=JoinConfig)


@dataclass
class Config:
    algorithm: str = "fedavg"
    selection: str = "random"
    dataset: str = "digits"
    model: str = "mlp"
    model_options: Dict[str, Any] = field(default_factory=dict)  # the model's own arguments, e.g. mlp's hidden
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    long_tail: LongTailConfig = field(default_factory=LongTailConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    num_clients: int = 20
    clients_per_round: Optional[int] = None  # overrides participation when set
    participation: float = 0.5
    rounds: int = 30
    local: LocalConfig = field(default_factory=LocalConfig)
    seed: int = 0
    eval_every: int = 1
    output_dir: str = "runs"
    run_name: Optional[str] = None  # default: <algorithm>-<dataset>-<timestamp>
    data_dir: str = "data"
    download: bool = True
    input_scale: str = "standardize"  # images: standardize (per-channel mean / std) | unit (pixels in [0, 1])
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    plugins: List[str] = field(default_factory=list)  # extra modules that register plugins
    checkpoint_every: int = 10  # write <run dir>/checkpoint.pt every N rounds and after the last (0: never)
    resume: Optional[str] = None  # a run directory: continue that run from its checkpoint


# Plugin kinds whose registered classes may declare a `Config` dataclass section, by the
# config key that chooses them.
_PLUGIN_KINDS = {"algorithm": registry.ALGORITHMS, "selection": registry.SELECTIONS, "dataset": registry.DATASETS}


def section_of(reg: registry.Registry, name: str) -> Optional[str]:
    """The config section a registered part reads (its name, or the `config_section` it
    shares with a sibling, as fedconcat_id reads `fedconcat.*`), or None if it has none."""
    part = reg.get(name)
    conf = getattr(part, "Config", None)
    if conf is None or not dataclasses.is_dataclass(conf):
        return None
    return getattr(part, "config_section", None) or name


def schema() -> DictConfig:
    """The full typed schema: the core `Config` plus one section per plugin with options."""
    base = OmegaConf.structured(Config)
    with open_dict(base):
        for reg in _PLUGIN_KINDS.values():
            for name in reg.names():
                section = section_of(reg, name)
                if section is not None and section not in base:
                    base[section] = OmegaConf.structured(reg.get(name).Config)
    OmegaConf.set_struct(base, True)
    OmegaConf.set_struct(base.model_options, False)  # the model's own arguments: checked in validate
    return base


def plugin_sections() -> dict:
    """{section: (choosing key, [names that read it])} for every plugin section."""
    out: dict = {}
    for key, reg in _PLUGIN_KINDS.items():
        for name in reg.names():
            section = section_of(reg, name)
            if section is not None:
                out.setdefault(section, (key, []))[1].append(name)
    return out


def used_sections(cfg) -> set:
    """The plugin sections the chosen algorithm, selection and dataset read."""
    return {s for key, reg in _PLUGIN_KINDS.items() if (s := section_of(reg, cfg[key])) is not None}


def unused_sections(layers: "Layers", cfg) -> list:
    """[(source, section, choosing key)] for each layer that sets a plugin section the run
    does not read (e.g. `fedprox.mu` with algorithm=fedavg)."""
    sections, used = plugin_sections(), used_sections(cfg)
    return [(source, name, sections[name][0]) for source, data in layers for name in data
            if name in sections and name not in used]


def check_sections(layers: "Layers", cfg) -> None:
    """A section set on the command line that the run does not read is an error: the user
    would run another experiment than the one asked for. (A --config file may carry sections
    for several algorithms, so that one file serves a comparison: `describe_layers` notes them.)"""
    for source, name, key in unused_sections(layers, cfg):
        if source == OVERRIDES:
            reads = sorted(used_sections(cfg))
            raise ConfigError(f"{name}.* is set but {key}={cfg[key]} does not read the {name} section (it is "
                              f"read by {key}={' or '.join(plugin_sections()[name][1])}); this run reads: "
                              f"{', '.join(reads) or 'no plugin section'}")


def _sugar(d: dict) -> dict:
    """`partition: dirichlet` is short for `partition: {name: dirichlet}`."""
    if isinstance(d.get("partition"), str):
        d = dict(d, partition={"name": d["partition"]})
    return d


def find_config(path: str) -> str:
    """A --config FILE as given, else the shipped file of that name (`configs/experiments/x.yaml`
    or `experiments/x.yaml` finds the package's `experiments/x.yaml`), so that an installed
    raysim runs the README's commands from any directory."""
    if Path(path).is_file():
        return path
    rel = Path(path).as_posix()
    for prefix in ("raysim/configs/", "configs/", "./configs/"):
        if rel.startswith(prefix):
            rel = rel[len(prefix):]
            break
    shipped = CONFIG_DIR / rel
    if shipped.is_file() and not Path(path).is_absolute():
        return str(shipped)
    raise ConfigError(f"config file {path!r} not found (looked in {Path.cwd()} and in the shipped configs, {CONFIG_DIR})")


# A config is a few kilobytes. These bounds refuse, before any expansion, files that are
# not configs: binary junk, and YAML alias bombs (a 290-byte file of nested anchors
# expands to a billion nodes: minutes and gigabytes for the plain loader).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 200_000


def load_yaml(text: str, source: str):
    """`yaml.safe_load(text)` after checking that the document expands to at most
    MAX_YAML_NODES nodes (aliases counted as often as they are used) and refers to no
    node inside itself; `source` names the file or key in the messages."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"malformed YAML in {source}{where}: {problem}") from None
    sizes: dict = {}

    def size(node) -> int:  # the node's size with every alias expanded, each shared node counted once
        if id(node) in sizes:
            if sizes[id(node)] is None:
                raise ConfigError(f"malformed YAML in {source}: an alias refers to a node that contains it")
            return sizes[id(node)]
        sizes[id(node)] = None
        n = 1
        if isinstance(node, yaml.SequenceNode):
            n += sum(size(c) for c in node.value)
        elif isinstance(node, yaml.MappingNode):
            n += sum(size(k) + size(v) for k, v in node.value)
        if n > MAX_YAML_NODES:
            raise ConfigError(f"{source} expands to more than {MAX_YAML_NODES:,} YAML nodes (anchors and aliases "
                              "nested in each other); a raysim config is a few hundred")
        sizes[id(node)] = n
        return n

    try:
        if root is not None:
            size(root)
        return yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"malformed YAML in {source}: nested too deeply") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"malformed YAML in {source}: {str(e).splitlines()[0]}") from None


def read_text_file(path: str, what: str = "config file") -> str:
    """A small UTF-8 text file's text, or one line saying why it is not one."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {path!r} not found")
    size = p.stat().st_size
    if size > MAX_YAML_BYTES:
        raise ConfigError(f"{what} {path} is {size:,} bytes; a YAML config is at most {MAX_YAML_BYTES:,}: is it "
                          "the right file?")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {e.start} is 0x{p.read_bytes()[e.start]:02x}): "
                          "is it a YAML file?") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read: {e.strerror or e}") from None


def _read_yaml(path: str) -> dict:
    data = load_yaml(read_text_file(path), path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    return _sugar(data)


def _parse_overrides(overrides: Iterable[str]) -> dict:
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has no key")
        try:
            value = load_yaml(raw, f"override {key}") if raw != "" else ""
        except ConfigError as e:
            if "expands to" in str(e) or "refers to a node" in str(e):
                raise
            value = raw  # not YAML: the text itself
        if key == "partition" and isinstance(value, str):
            key = "partition.name"
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier one")
        node[parts[-1]] = value
    return out


def _merge(cfg: DictConfig, data: dict, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(cfg, data)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        if isinstance(e, ConfigKeyError):
            parent = key.rsplit(".", 1)[0] if "." in key else None
            node = OmegaConf.select(cfg, parent) if parent else cfg
            allowed = ", ".join(sorted(node.keys())) if isinstance(node, DictConfig) else ""
            raise ConfigError(f"unknown config key {key!r} in {source}; allowed here: {allowed}") from None
        raise ConfigError(f"bad value for config key {key!r} in {source}: {msg}") from None


Layers = list  # [(source name, plain dict)], lowest priority first
OVERRIDES = "the overrides (key=value on the command line, keywords of raysim.simulate)"  # the key=value layer's source name


def read_layers(config_files: Iterable[str] = (), overrides: Iterable[str] = (), use_default: bool = True) -> Layers:
    """Read default.yaml, the config groups of the chosen names, the given files and the
    overrides into plain dicts, without the schema: the form the CLI sends to the driver,
    which resolves them (`resolve`). With `resume=RUN_DIR` the run's own config.yaml is the
    only file (see `resume_layers`)."""
    over = _parse_overrides(overrides)
    if over.get("resume") is not None:
        return resume_layers(str(over["resume"]), list(config_files), over)
    base = [(str(DEFAULT_YAML), _read_yaml(str(DEFAULT_YAML)))] if use_default else []
    user = [(path, _read_yaml(path)) for path in map(find_config, config_files)] + [(OVERRIDES, over)]
    return base + group_layers(base + user) + user


def group_layers(layers: Layers) -> Layers:
    """The config group files of the names the layers choose, last choice winning:
    `dataset=cifar10` applies `configs/dataset/cifar10.yaml` (model cnn), `algorithm=scaffold`
    applies `configs/algorithm/scaffold.yaml` (momentum 0). They sit above default.yaml and
    below every --config file and override, so anything the user sets wins."""
    out = []
    for group in GROUPS:
        choice = next((data[group] for _, data in reversed(layers) if group in data), None)
        path = CONFIG_DIR / group / f"{choice}.yaml"
        if not isinstance(choice, str) or "/" in choice or not path.is_file():
            continue  # an unknown name is reported by validate; a name without a group file has its defaults
        data = _read_yaml(str(path))
        for other in GROUPS:
            if other in data and data[other] != (choice if other == group else data[other]):
                raise ConfigError(f"config group file {path} sets {other}={data[other]!r}; it may only set {group}={choice}")
        out.append((str(path), data))
    return out


def describe_layers(layers: Layers, cfg) -> list[str]:
    """Lines for the user: which files were layered, and the sections of --config files that
    this run does not read."""
    def short(source: str) -> str:
        p = Path(source)
        return str(p.relative_to(CONFIG_DIR)) if p.is_relative_to(CONFIG_DIR) else source

    names = [short(s) if s != OVERRIDES else "overrides" for s, data in layers if data or s != OVERRIDES]
    lines = [f"config: {' < '.join(names)}"]
    for source, name, key in unused_sections(layers, cfg):
        if source != OVERRIDES and not cfg.get("resume"):  # a run's config.yaml holds every section: no news
            lines.append(f"note: {short(source)} sets {name}.*, which {key}={cfg[key]} does not read")
    return lines


# What may change when a run is resumed: how long it runs and where, not what it computes.
RESUMABLE_KEYS = ("rounds", "checkpoint_every", "ray", "resources", "resume", "log")


def resume_layers(run_dir: str, config_files: list, overrides: dict) -> Layers:
    """The layers of a resumed run: its saved config.yaml, then the overrides that may change.

    A run directory may come from anyone, so its config.yaml names no code on its own: the
    plugin modules it lists are imported only when the command line names them too."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"resume={run_dir!r}: no run there ({saved} not found)")
    if config_files:
        raise ConfigError("resume: --config files cannot be combined with resume; the run's own config.yaml is used")
    changed = sorted(k for k in overrides if k not in RESUMABLE_KEYS + ("plugins",))
    if changed:
        raise ConfigError(f"resume: {', '.join(changed)} cannot change when resuming (the run's config is {saved}); "
                          f"only rounds, checkpoint_every, ray.* and resources.* can")
    data = _read_yaml(str(saved))
    named, given = _names(data.get("plugins")), _names(overrides.get("plugins"))
    if named and sorted(given) != sorted(named):
        raise ConfigError(f"resume: {saved} lists plugins {named}; raysim imports no code named by a run directory: "
                          f"if you trust these modules, name them on the command line: plugins=[{','.join(named)}]")
    if sorted(given) != sorted(named):
        raise ConfigError(f"resume: plugins={given} differs from the run's plugins {named} ({saved})")
    return [(str(saved), data), (OVERRIDES, overrides)]


def _names(value) -> list[str]:
    """A `plugins` value (a module name or a list of them) as a list of names."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


# What a resumed run must share with the run that wrote its checkpoint: every key but where it
# runs, how long, and where it reads and writes.
NOT_COMPUTING = RESUMABLE_KEYS + ("data_dir", "output_dir", "run_name", "download", "plugins")


def run_record(cfg: DictConfig) -> dict:
    """The config as {dotted key: value} for the keys that decide what a run computes; kept in
    each checkpoint so that a resumed run with an edited config.yaml is refused by key."""
    out: dict = {}

    def walk(node, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            out[key] = node

    plain = OmegaConf.to_container(cfg, resolve=True)
    walk({k: v for k, v in plain.items() if k not in NOT_COMPUTING}, "")
    return out


def record_diff(record: dict, cfg: DictConfig) -> list[str]:
    """The dotted keys whose value in `record` (a `run_record`) differs from `cfg`'s; a key
    the record lacks at its default value (added to raysim since) is no difference."""
    now = run_record(cfg)
    missing = object()
    added = run_record(schema())  # the core keys and every plugin section's, at their defaults
    return [k for k in sorted(set(record) | set(now)) if record.get(k, missing) != now.get(k, missing)
            and not (k not in record and k in added and now.get(k) == added[k])]


def describe_diff(diff: list[str], record: dict, cfg: DictConfig) -> str:
    """'lr was 0.1, is 0.01 and 2 more (seed, rounds)': the first differing key in full."""
    now = run_record(cfg)
    k = diff[0]
    more = f" and {len(diff) - 1} more ({', '.join(diff[1:4])}{', ...' if len(diff) > 4 else ''})" if len(diff) > 1 else ""
    was = repr(record[k]) if k in record else "not in the checkpoint (an option added to raysim since)"
    return f"{k} was {was}, is {now.get(k)!r}{more}"


def check_resumable(record: Optional[dict], cfg: DictConfig, where: str) -> None:
    """Refuse to resume when the run's config.yaml no longer says what its checkpoint was made with."""
    if record is None:
        raise ConfigError(f"resume: the checkpoint in {where} has no record of the config it was made with "
                          "(written by an older raysim), so config.yaml cannot be checked against it")
    diff = record_diff(record, cfg)
    if diff:
        raise ConfigError(f"resume: {where}/config.yaml no longer matches the config its checkpoint was made with: "
                          f"{describe_diff(diff, record, cfg)}; restore config.yaml or start a new run")


def name_plugins_used(cfg: DictConfig) -> None:
    """Add to `plugins` the module of each chosen part that a plugin registered and
    `plugins` does not name (one imported by an earlier `raysim.simulate` in this process):
    the run's actors import it, and its config.yaml says which code it ran."""
    named = [str(m) for m in cfg.plugins]
    for reg, name in ((registry.DATASETS, cfg.dataset), (registry.PARTITIONS, cfg.partition.name),
                      (registry.MODELS, cfg.model), (registry.ALGORITHMS, cfg.algorithm),
                      (registry.SELECTIONS, cfg.selection)):
        module = registry.module_of(reg.get(name)) if name in reg else ""
        if module and not module.startswith("raysim.") and module != "__main__" and module not in named:
            named.append(module)
    if named != list(cfg.plugins):
        cfg.plugins = named


def resolve(layers: Layers, cwd: Optional[str] = None) -> DictConfig:
    """Merge the layers onto the full schema and validate. Relative `data_dir` and
    `output_dir` are taken relative to `cwd` (the CLI's directory) when given."""
    for _, data in layers:  # plugin modules first: they add sections to the schema
        plugins = data.get("plugins") or []
        registry.import_modules(plugins if isinstance(plugins, list) else [plugins])
    cfg = schema()
    for source, data in layers:
        cfg = _merge(cfg, data, source)
    validate(cfg)
    check_sections(layers, cfg)
    name_plugins_used(cfg)
    if cwd is not None:
        for key in ("data_dir", "output_dir", "resume"):
            if cfg[key] is not None:
                cfg[key] = str(Path(cwd, cfg[key]))
    return cfg


def load_config(config_files: Iterable[str] = (), overrides: Iterable[str] = (), use_default: bool = True) -> DictConfig:
    """Layer default.yaml, the given files and the overrides onto the schema, then validate."""
    return resolve(read_layers(config_files, overrides, use_default))


def _check_name(cfg: DictConfig, key: str, reg: registry.Registry) -> None:
    name = OmegaConf.select(cfg, key)
    if name not in reg:
        raise ConfigError(f"{key}={name!r} is not a known {reg.kind}; choose one of: {', '.join(reg.names())}")


def _non_finite(node, key: str = "") -> Optional[str]:
    """The first key (dotted, [i] for list items) whose value is a NaN or infinite number."""
    if isinstance(node, float):
        return None if math.isfinite(node) else key
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
        raise ConfigError(f"{bad}={OmegaConf.select(cfg, bad)} is not a finite number; give a finite value")
    _check_name(cfg, "algorithm", registry.ALGORITHMS)
    _check_name(cfg, "selection", registry.SELECTIONS)
    _check_name(cfg, "dataset", registry.DATASETS)
    _check_name(cfg, "model", registry.MODELS)
    _check_name(cfg, "partition.name", registry.PARTITIONS)

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    from raysim.models import MODEL_OPTION_CHOICES, model_option_defaults

    takes = model_option_defaults(cfg.model)
    for key, value in cfg.model_options.items():
        need(key in takes, f"model_options.{key}: model {cfg.model!r} takes "
                           f"{', '.join(takes) if takes else 'no options'}")
        if isinstance(takes[key], int):  # sizes and counts (width, vocab_size, layers, ...); 0 = off where 0 is the default
            least = 0 if takes[key] == 0 else 1
            need(isinstance(value, int) and not isinstance(value, bool) and value >= least,
                 f"model_options.{key} must be an integer >= {least}, got {value!r}")
        if key in MODEL_OPTION_CHOICES:
            need(value in MODEL_OPTION_CHOICES[key],
                 f"model_options.{key} must be one of {', '.join(MODEL_OPTION_CHOICES[key])}, got {value!r}")
    hidden = cfg.model_options.get("hidden")
    need(hidden is None or (isinstance(hidden, Iterable) and not isinstance(hidden, str)
                            and all(isinstance(h, int) and h >= 1 for h in hidden)),
         f"model_options.hidden must be a list of layer sizes >= 1, e.g. [128], got {hidden!r}")
    need(cfg.num_clients >= 1, f"num_clients must be >= 1, got {cfg.num_clients}")
    if cfg.log.tensorboard:
        import importlib.util

        need(importlib.util.find_spec("tensorboard") is not None,
             "log.tensorboard=true needs the tensorboard package: pip install 'raysim[tensorboard]' (or tensorboard)")
    need(0 < cfg.participation <= 1, f"participation must be in (0, 1], got {cfg.participation}")
    if cfg.clients_per_round is not None:
        need(1 <= cfg.clients_per_round <= cfg.num_clients,
             f"clients_per_round must be in [1, num_clients={cfg.num_clients}], got {cfg.clients_per_round}")
    need(cfg.rounds >= 1, f"rounds must be >= 1, got {cfg.rounds}")
    address = cfg.ray.address
    m = re.fullmatch(r"(ray://)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})", str(address))
    need(address is None or address == "auto" or (m is not None and 1 <= int(m.group(3)) <= 65535),
         f"ray.address={address!r} is not an address Ray can join: give auto (the cluster this machine is part "
         "of), HOST:PORT (the head node's GCS, e.g. 10.0.0.5:6379) or ray://HOST:PORT (Ray Client), or leave it "
         "unset for a local Ray")
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
    if loc.focal_gamma > 0 and not getattr(registry.ALGORITHMS.get(cfg.algorithm), "trains_on_base_loss", False):
        takes = [n for n in registry.ALGORITHMS.names() if getattr(registry.ALGORITHMS.get(n), "trains_on_base_loss", False)]
        raise ConfigError(f"local.focal_gamma: algorithm {cfg.algorithm!r} trains on its own loss, not the plain one; "
                          f"algorithms that take it: {', '.join(takes)}")
    try:
        augmentation_name(loc.augment)
    except ValueError:
        raise ConfigError(f"local.augment must be one of false, true, {', '.join(AUGMENTATIONS)}; "
                          f"got {loc.augment!r}") from None
    if loc.vectorize:
        need(loc.vectorize_group >= 1, f"local.vectorize_group must be >= 1, got {loc.vectorize_group}")
        if not registry.ALGORITHMS.get(cfg.algorithm).vectorizes():
            takes = [n for n in registry.ALGORITHMS.names() if registry.ALGORITHMS.get(n).vectorizes()]
            raise ConfigError(f"local.vectorize: algorithm {cfg.algorithm!r} trains its clients one at a time; "
                              f"vectorised: {', '.join(takes)}")
        need(augmentation_name(loc.augment) == "none",
             f"local.vectorize does not combine with local.augment={loc.augment} (its random draws interleave with "
             "the batch order): set local.augment=false or local.vectorize=false")
    sy = cfg.system
    need(0 <= sy.dropout < 1, f"system.dropout must be in [0, 1), got {sy.dropout}")
    need(0 <= sy.stragglers <= 1, f"system.stragglers must be in [0, 1], got {sy.stragglers}")
    se = list(sy.straggler_epochs)
    need(len(se) == 2 and 1 <= se[0] <= se[1],
         f"system.straggler_epochs must be [lo, hi] with 1 <= lo <= hi, got {se}")
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
    need(r.num_gpus_per_actor >= 0, f"resources.num_gpus_per_actor must be >= 0, got {r.num_gpus_per_actor}")
    need(r.torch_threads >= 1, f"resources.torch_threads must be >= 1, got {r.torch_threads}")
    need(r.placement_timeout > 0, f"resources.placement_timeout must be > 0 seconds, got {r.placement_timeout}")
    need(cfg.ray.object_store_gb is None or cfg.ray.object_store_gb > 0,
         f"ray.object_store_gb must be > 0, got {cfg.ray.object_store_gb}")
    need(cfg.ray.num_cpus is None or cfg.ray.num_cpus >= 1,
         f"ray.num_cpus must be >= 1 (the client actors need CPUs), got {cfg.ray.num_cpus}")
    for key, reg in _PLUGIN_KINDS.items():
        check = getattr(reg.get(cfg[key]), "validate_config", None)
        if check is not None:
            check(cfg)


def clients_per_round(cfg: DictConfig) -> int:
    if cfg.clients_per_round is not None:
        return int(cfg.clients_per_round)
    return max(1, int(round(cfg.participation * cfg.num_clients)))


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
