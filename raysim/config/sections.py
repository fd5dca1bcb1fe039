"""Plugin sections: the options of the chosen algorithm, selection and dataset.

A registered part that declares an `Options` dataclass (raysim.options) adds one section to
the schema, named after the part (or its `config_section`, which a sibling may share: as
fedconcat_id reads `fedconcat.*`). Which sections a run reads follows from its chosen names."""
from __future__ import annotations

import dataclasses
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from raysim import registry
from raysim.config.schema import Config

# Plugin kinds whose registered classes may declare an `Options` dataclass section, by the
# config key that chooses them.
PLUGIN_KINDS = {"algorithm": registry.ALGORITHMS, "selection": registry.SELECTIONS, "dataset": registry.DATASETS}


def section_of(reg: registry.Registry, name: str) -> Optional[str]:
    """The config section a registered part reads (its name, or the `config_section` it
    shares with a sibling, as fedconcat_id reads `fedconcat.*`), or None if it has none."""
    part = reg.get(name)
    options = getattr(part, "Options", None)
    if options is None or not dataclasses.is_dataclass(options):
        return None
    return getattr(part, "config_section", None) or name  # datasets are plain classes


_SCHEMAS: dict = {}


def schema() -> DictConfig:
    """The full typed schema: the core `Config` plus one section per plugin with options.
    Built once per set of registered parts (building it costs ~0.1 s, and a sweep resolves
    one config per point) and shared: merge onto it (OmegaConf.merge copies), never edit it."""
    key = tuple((kind, name, id(getattr(reg.get(name), "Options", None)))
                for kind, reg in PLUGIN_KINDS.items() for name in reg.names())
    if key not in _SCHEMAS:
        _SCHEMAS.clear()
        _SCHEMAS[key] = _build_schema()
    return _SCHEMAS[key]


def _build_schema() -> DictConfig:
    base = OmegaConf.structured(Config)
    with open_dict(base):
        for reg in PLUGIN_KINDS.values():
            for name in reg.names():
                section = section_of(reg, name)
                if section is not None and section not in base:
                    base[section] = OmegaConf.structured(reg.get(name).Options)
    OmegaConf.set_struct(base, True)
    OmegaConf.set_struct(base.model_options, False)  # the model's own arguments: checked in validate
    return base


def plugin_sections() -> dict:
    """{section: (choosing key, [names that read it])} for every plugin section."""
    out: dict = {}
    for key, reg in PLUGIN_KINDS.items():
        for name in reg.names():
            section = section_of(reg, name)
            if section is not None:
                out.setdefault(section, (key, []))[1].append(name)
    return out


def used_sections(cfg) -> set:
    """The plugin sections the chosen algorithm, selection and dataset read."""
    return {s for key, reg in PLUGIN_KINDS.items() if (s := section_of(reg, cfg[key])) is not None}


def foreign_sections(cfg) -> set:
    """The sections of parts a module outside raysim registered (a plugin imported earlier in
    this process, by another run or a notebook) that this run neither reads nor names in
    `plugins`: left out of what a run records (config.yaml, the checkpoint's record), which a
    fresh process, without that plugin, must be able to read back to resume it."""
    named, used = {str(m) for m in cfg.get("plugins") or []}, used_sections(cfg)
    out = set()
    for key, reg in PLUGIN_KINDS.items():
        for name in reg.names():
            section, module = section_of(reg, name), registry.module_of(reg.get(name))
            if section is not None and section not in used and not module.startswith("raysim.") and module not in named:
                out.add(section)
    return out


def unused_sections(layers: list, cfg) -> list:
    """[(source, section, choosing key)] for each layer that sets a plugin section the run
    does not read (e.g. `fedprox.mu` with algorithm=fedavg)."""
    sections, used = plugin_sections(), used_sections(cfg)
    return [(source, name, sections[name][0]) for source, data in layers for name in data
            if name in sections and name not in used]
