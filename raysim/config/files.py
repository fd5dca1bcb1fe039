"""Reading config files: the shipped configs, YAML bounded against alias bombs, text checks.

The shipped YAML files are the top-level `configs/` folder, installed as the package
`raysim.configs` and read with importlib.resources, so an installed raysim reads the same
defaults as a clone and finds `configs/experiments/x.yaml` from any directory."""
from __future__ import annotations

import importlib.resources
from pathlib import Path

import yaml

from raysim.errors import ConfigError

# the shipped configs: the top-level configs/ folder, installed as the package raysim.configs
CONFIG_DIR = Path(str(importlib.resources.files("raysim.configs")))


DEFAULT_YAML = CONFIG_DIR / "default.yaml"


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
    loader = _LOADER(text)  # composed once, checked, then constructed from the same nodes
    try:
        return _load_checked(loader, source)
    finally:
        loader.dispose()


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's when PyYAML has it: ~10x faster


def _load_checked(loader, source: str):
    try:
        root = loader.get_single_node()
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
        if root is None:
            return None
        size(root)
        _unique_keys(root, source)
        return loader.construct_document(root)
    except RecursionError:
        raise ConfigError(f"malformed YAML in {source}: nested too deeply") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"malformed YAML in {source}: {str(e).splitlines()[0]}") from None


def _unique_keys(root, source: str) -> None:
    """YAML requires a mapping's keys to be unique; PyYAML keeps the last of a repeated key
    silently. A repeated key is almost always a merge or copy mistake: ConfigError naming
    the key's path and both lines."""
    seen_nodes: set = set()
    todo = [(root, "")]
    while todo:
        node, path = todo.pop()
        if id(node) in seen_nodes:  # an alias: checked where its anchor is
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines: dict = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value != "<<":
                    if k.value in lines:
                        raise ConfigError(f"{source}: key {path}{k.value} appears twice (lines {lines[k.value]} and "
                                          f"{k.start_mark.line + 1}); YAML keys must be unique: keep one")
                    lines[k.value] = k.start_mark.line + 1
                    todo.append((v, f"{path}{k.value}."))
                else:
                    todo.append((v, path))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((c, path) for c in node.value)


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


def read_yaml(path: str) -> dict:
    data = load_yaml(read_text_file(path), path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    return _sugar(data)


def _sugar(d: dict) -> dict:
    """`partition: dirichlet` is short for `partition: {name: dirichlet}`."""
    if isinstance(d.get("partition"), str):
        d = dict(d, partition={"name": d["partition"]})
    return d
