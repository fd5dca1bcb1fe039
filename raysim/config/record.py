"""What a checkpoint records of its config, and the check that a resumed run still matches it."""
from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig, OmegaConf

from raysim.config.sections import foreign_sections, schema
from raysim.errors import ConfigError

# What may change when a run is resumed: how long it runs and where, not what it computes.
RESUMABLE_KEYS = ("rounds", "checkpoint_every", "ray", "resources", "resume", "log", "data_store", "data_store_dir")


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
    skip = set(NOT_COMPUTING) | foreign_sections(cfg)
    walk({k: v for k, v in plain.items() if k not in skip}, "")
    return out


def record_diff(record: dict, cfg: DictConfig) -> list[str]:
    """The dotted keys whose value in `record` (a `run_record`) differs from `cfg`'s; a key
    the record lacks at its default value (added to raysim since) is no difference."""
    now = run_record(cfg)
    missing = object()
    added = run_record(schema())  # the core keys and every plugin section's, at their defaults
    derived = {k for k, source in DERIVED.items() if record.get(source) is not None and now.get(source) is not None}
    return [k for k in sorted(set(record) | set(now)) if record.get(k, missing) != now.get(k, missing)
            and not (k not in record and k in added and now.get(k) == added[k]) and k not in derived]


# keys a run sets itself from another key when that one is set: the run's record holds the
# value it chose, the config asking again does not (privacy.target_epsilon chooses the noise)
DERIVED = {"privacy.noise_multiplier": "privacy.target_epsilon"}


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
