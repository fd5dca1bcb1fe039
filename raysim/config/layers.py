"""Layering: default.yaml < config groups < --config files < key=value overrides, merged
onto the typed schema (Hydra's config groups: `dataset=cifar10` applies
`configs/dataset/cifar10.yaml`). `resume=RUN_DIR` layers the run's own config.yaml instead.
`resolve` is the one entry: merge, validate, refuse sections the run does not read."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from raysim import registry
from raysim.config.files import CONFIG_DIR, DEFAULT_YAML, find_config, load_yaml, read_yaml
from raysim.config.record import RESUMABLE_KEYS
from raysim.config.sections import plugin_sections, schema, unused_sections, used_sections
from raysim.config.unread import unread_keys
from raysim.config.validate import check_ray, validate
from raysim.errors import ConfigError

GROUPS = ("dataset", "algorithm", "selection")  # config groups: choosing a name applies <group>/<name>.yaml


Layers = list  # [(source name, plain dict)], lowest priority first


OVERRIDES = "the overrides (key=value on the command line, keywords of raysim.simulate)"  # the key=value layer's source name


def parse_overrides(overrides: Iterable[str]) -> dict:
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
        if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
            value = raw  # YAML 1.1's yes / no / on / off: a text key keeps its text (run_name=off), a bool key converts it
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


def read_layers(config_files: Iterable[str] = (), overrides: Iterable[str] = (), use_default: bool = True) -> Layers:
    """Read default.yaml, the config groups of the chosen names, the given files and the
    overrides into plain dicts, without the schema: the form the CLI sends to the server,
    which resolves them (`resolve`). With `resume=RUN_DIR` the run's own config.yaml is the
    only file (see `resume_layers`)."""
    over = parse_overrides(overrides)
    if over.get("resume") is not None:
        return resume_layers(str(over["resume"]), list(config_files), over)
    base = [(str(DEFAULT_YAML), read_yaml(str(DEFAULT_YAML)))] if use_default else []
    user = [(path, read_yaml(path)) for path in map(find_config, config_files)] + [(OVERRIDES, over)]
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
        data = read_yaml(str(path))
        for other in GROUPS:
            if other in data and data[other] != (choice if other == group else data[other]):
                raise ConfigError(f"config group file {path} sets {other}={data[other]!r}; it may only set {group}={choice}")
        out.append((str(path), data))
    return out


PERSONAL_TEST_FRACTION = 0.2  # a personalised run's local test splits when the user sets none


def defaulted_test_split(layers: Layers, cfg) -> bool:
    """A personalised algorithm (contract.Algorithm.personal) is judged by each client's own
    model on its own test split: with `partition.test_fraction` set by no layer, it gets
    PERSONAL_TEST_FRACTION (said in the log: `describe_layers`)."""
    if cfg.algorithm not in registry.ALGORITHMS or not registry.ALGORITHMS.get(cfg.algorithm).personal:
        return False
    return not any(isinstance(data.get("partition"), dict) and "test_fraction" in data["partition"]
                   for _, data in layers)


def defaulted_model_options(layers: Layers, cfg) -> dict:
    """What the algorithm needs of the model (contract.Algorithm.model_options_default, FedBN's
    `norm: batch`) that the run's model takes and no layer of the config sets (said in the
    log: `describe_layers`)."""
    if cfg.algorithm not in registry.ALGORITHMS:
        return {}
    wanted = registry.ALGORITHMS.get(cfg.algorithm).model_options_default
    if not wanted or cfg.model not in registry.MODELS:
        return {}
    from raysim.models import model_option_defaults

    takes = model_option_defaults(cfg.model)
    set_by_a_layer = {k for _, data in layers if isinstance(data.get("model_options"), dict)
                      for k in data["model_options"]}
    return {k: v for k, v in wanted.items() if k in takes and k not in set_by_a_layer}


def describe_layers(layers: Layers, cfg) -> list[str]:
    """Lines for the user: which files were layered, and the sections of --config files that
    this run does not read."""
    def short(source: str) -> str:
        p = Path(source)
        return str(p.relative_to(CONFIG_DIR)) if p.is_relative_to(CONFIG_DIR) else source

    names = [short(s) if s != OVERRIDES else "overrides" for s, data in layers if data or s != OVERRIDES]
    lines = [f"config: {' < '.join(names)}"]
    from omegaconf import OmegaConf

    from raysim.config.sections import plugin_sections, schema

    every, data_of = set(plugin_sections()), dict(layers)
    whole = {source for source, data in layers if every <= set(data)}  # a run's config.yaml: every section

    def news(source: str, name: str) -> bool:
        """A run's config.yaml (resumed, or given to --config to run it again) holds every
        section, each unread one at its schema defaults: news only where it differs from them."""
        if source not in whole:
            return True
        defaults, values = OmegaConf.to_container(schema()[name]), data_of[source][name]
        return not isinstance(values, dict) or any(values[k] != defaults.get(k) for k in values)

    for source, name, key in unused_sections(layers, cfg):
        if source != OVERRIDES and not cfg.get("resume") and news(source, name):
            lines.append(f"note: {short(source)} sets {name}.*, which {key}={cfg[key]} does not read")
    for source, key, reader in unread_keys(layers, cfg):
        if source != OVERRIDES and not cfg.get("resume") and source not in whole:
            lines.append(f"note: {short(source)} sets {key}, which this run does not read (it is read only with "
                         f"{reader})")
    if defaulted_test_split(layers, cfg):
        lines.append(f"note: algorithm={cfg.algorithm} tests each client's own model on its own test split: "
                     f"partition.test_fraction={PERSONAL_TEST_FRACTION} of each client's samples (set "
                     "partition.test_fraction to choose)")
    for key, value in defaulted_model_options(layers, cfg).items():
        lines.append(f"note: algorithm={cfg.algorithm} needs model_options.{key}={value} of model={cfg.model} "
                     f"(set model_options.{key} to choose)")
    lines += [f"note: {line}" for line in registry.ALGORITHMS.get(cfg.algorithm).config_notes(cfg)]
    return lines


def _current(cfg, key: str) -> str:
    """The choices beside `key` that decide whether it is read, as this run has them."""
    deciding = {"compress": ["compress.up"], "heterofl": ["heterofl.variant"],
                "eval": ["partition.name", "partition.test_fraction"]}[key.split(".")[0]]
    return ", ".join(f"{k}={OmegaConf.select(cfg, k)}" for k in deciding)


def check_sections(layers: "Layers", cfg) -> None:
    """A section set on the command line that the run does not read is an error: the user
    would run another experiment than the one asked for. (A --config file may carry sections
    for several algorithms, so that one file serves a comparison: `describe_layers` notes them.)"""
    for source, key, reader in unread_keys(layers, cfg):
        if source == OVERRIDES:
            raise ConfigError(f"{key} is set but this run does not read it: it is read only with {reader} "
                              f"(here {_current(cfg, key)}); unset {key}")
    for source, name, key in unused_sections(layers, cfg):
        if source == OVERRIDES:
            reads = sorted(used_sections(cfg))
            raise ConfigError(f"{name}.* is set but {key}={cfg[key]} does not read the {name} section (it is "
                              f"read by {key}={' or '.join(plugin_sections()[name][1])}); this run reads: "
                              f"{', '.join(reads) or 'no plugin section'}")


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
    data = read_yaml(str(saved))
    named, given = plugin_names(data.get("plugins")), plugin_names(overrides.get("plugins"))
    if named and sorted(given) != sorted(named):
        raise ConfigError(f"resume: {saved} lists plugins {named}; raysim imports no code named by a run directory: "
                          f"if you trust these modules, name them on the command line: plugins=[{','.join(named)}]")
    if sorted(given) != sorted(named):
        raise ConfigError(f"resume: plugins={given} differs from the run's plugins {named} ({saved})")
    return [(str(saved), data), (OVERRIDES, overrides)]


def plugin_names(value) -> list[str]:
    """A `plugins` value (a module name or a list of them) as a list of names."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


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
    """Merge the layers onto the full schema and validate. Relative `data_dir`, `output_dir`,
    `resume`, `data_store_dir`, `system.trace` and `system.availability_trace` are taken relative to `cwd` (the CLI's directory) when given."""
    for _, data in layers:  # plugin modules first: they add sections to the schema
        plugins = data.get("plugins") or []
        registry.import_modules(plugins if isinstance(plugins, list) else [plugins])
    try:  # one merge (one copy of the schema) for all layers; on an error, find its layer
        cfg = OmegaConf.merge(schema(), *(data for _, data in layers))
    except OmegaConfBaseException:
        cfg = schema()
        for source, data in layers:  # again one at a time: _merge names the layer at fault
            cfg = _merge(cfg, data, source)
        raise
    if defaulted_test_split(layers, cfg):
        cfg.partition.test_fraction = PERSONAL_TEST_FRACTION
    for key, value in defaulted_model_options(layers, cfg).items():
        cfg.model_options[key] = value
    validate(cfg)
    check_sections(layers, cfg)
    name_plugins_used(cfg)
    if cwd is not None:
        for key in ("data_dir", "output_dir", "resume", "data_store_dir", "system.trace", "system.availability_trace"):
            if OmegaConf.select(cfg, key) is not None:
                OmegaConf.update(cfg, key, str(Path(cwd, Path(OmegaConf.select(cfg, key)).expanduser())))
    return cfg


def ray_section(layers: Layers) -> Optional[DictConfig]:
    """The `ray` section alone, merged and checked without the rest of the schema (so without
    importing any plugin, nor torch): what the command needs to start Ray while the whole
    config is checked apart (`launch.CheckApart`). None where it cannot be read on its own:
    the whole check then says why, before Ray starts."""
    from raysim.config.schema import RayConfig

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    try:
        ray = OmegaConf.merge(OmegaConf.structured(RayConfig),
                              *(data["ray"] for _, data in layers if isinstance(data.get("ray"), dict)))
        check_ray(ray, need)
    except (OmegaConfBaseException, ConfigError, TypeError, ValueError):
        return None
    return ray


def asks_for_ray(resources, faults, ray) -> Optional[str]:
    """Why these config sections need Ray's client actors even on the command's own machine
    (a key asking for actors, faults that kill their processes, Ray's own views, a cluster),
    or None: the one list both `may_train_here` and the server's `here.cannot` read."""
    if ray.address:
        return "ray.address: a Ray cluster"
    if float(resources.ray_start_s) <= 0:
        return "resources.ray_start_s=0"
    if resources.num_actors is not None or resources.clients_per_actor != "auto":
        return "resources.num_actors / clients_per_actor ask for client actors"
    if resources.num_gpus_per_actor == "auto" or resources.num_gpus_per_actor > 0:
        return "resources.num_gpus_per_actor: client actors on GPUs"
    if faults.kill_rounds or faults.kill_fraction or int(faults.crash_round) >= 0:
        return "faults.* kill client actors' processes"
    if ray.dashboard or ray.metrics_port:
        return "ray.dashboard / ray.metrics_port show Ray's actors and metrics"
    return None


def may_train_here(layers: Layers) -> bool:
    """Whether the layers leave a command on its own machine free to train its clients in
    its own process, with no Ray (runtime/here.py): `asks_for_ray` of the `resources`,
    `faults` and `ray` sections alone, merged on their schema (no plugin, no torch). A value
    that cannot be read says so in the whole check; the server decides after the data."""
    from raysim.config.schema import FaultsConfig, RayConfig, ResourcesConfig

    try:
        sections = [OmegaConf.merge(OmegaConf.structured(kind),
                                    *(data[name] for _, data in layers if isinstance(data.get(name), dict)))
                    for name, kind in (("resources", ResourcesConfig), ("faults", FaultsConfig), ("ray", RayConfig))]
        return asks_for_ray(*sections) is None
    except (OmegaConfBaseException, TypeError, ValueError):
        return False


def load_config(config_files: Iterable[str] = (), overrides: Iterable[str] = (), use_default: bool = True) -> DictConfig:
    """Layer default.yaml, the given files and the overrides onto the schema, then validate."""
    return resolve(read_layers(config_files, overrides, use_default))
