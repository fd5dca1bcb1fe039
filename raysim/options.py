"""A plugin's own options: one typed dataclass that checks itself.

An algorithm, selection or dataset with options declares them as a dataclass subclassing
`Options`, each field made with `option(default, ...)` saying its range or its allowed
values, and sets it as the class attribute `Options`:

    @dataclass
    class FedProxOptions(Options):
        mu: float = option(0.01, at_least=0)   # weight of the proximal term

    @ALGORITHMS.register("fedprox")
    class FedProx(FedAvg):
        Options = FedProxOptions

The config gains the section `fedprox` (typed by OmegaConf from the dataclass), and a run
that chooses the plugin gets each field checked with a one-line message naming the key
(`fedprox.mu must be >= 0, got -1.0`). Rules that read more than one field, or the rest of
the run's config, go in `check` (as pfl-research's frozen `...Params` and Flower's typed
strategy arguments keep a part's settings with the part).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf

from raysim.errors import ConfigError


def option(default: Any, *, at_least: Optional[float] = None, above: Optional[float] = None,
           at_most: Optional[float] = None, below: Optional[float] = None,
           choices: Optional[Sequence[Any]] = None, why: str = "") -> Any:
    """A dataclass field with its default and what values it allows: a range (`at_least` /
    `above` a lower bound, `at_most` / `below` an upper one) or `choices`; `why` is added to
    the message in parentheses."""
    meta = {"at_least": at_least, "above": above, "at_most": at_most, "below": below,
            "choices": tuple(choices) if choices is not None else None, "why": why}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _shown(value: Any) -> str:
    """A value as YAML writes it: false, true, null, 0.5, name."""
    return {True: "true", False: "false", None: "null"}.get(value, str(value)) if isinstance(value, (bool, type(None))) \
        else str(value)


def allowed(meta: dict) -> Optional[str]:
    """What a field allows, as the message says it ('>= 0', 'in (0, 1]', 'one of a, b'), or None."""
    if meta.get("choices") is not None:
        return "one of " + ", ".join(_shown(c) for c in meta["choices"])
    lo = ("[", meta["at_least"]) if meta.get("at_least") is not None else \
        ("(", meta["above"]) if meta.get("above") is not None else None
    hi = ("]", meta["at_most"]) if meta.get("at_most") is not None else \
        (")", meta["below"]) if meta.get("below") is not None else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {lo[1]}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {hi[1]}"
    return None


def admits(meta: dict, value: Any) -> bool:
    """Whether `value` is in the field's range / choices."""
    if meta.get("choices") is not None:
        return any(value is c or (type(value) is type(c) and value == c) for c in meta["choices"])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return all(meta.get(k) is None for k in ("at_least", "above", "at_most", "below"))
    return ((meta.get("at_least") is None or value >= meta["at_least"])
            and (meta.get("above") is None or value > meta["above"])
            and (meta.get("at_most") is None or value <= meta["at_most"])
            and (meta.get("below") is None or value < meta["below"]))


@dataclasses.dataclass
class Options:
    """Base of a plugin's options dataclass (module docstring)."""

    def check(self, cfg, section: str) -> None:
        """Rules beyond one field's range: fields that go together, or the run's other keys
        (`cfg`, the whole resolved config). `section` is this options' name in the config,
        for messages. Raise `ConfigError` with one line naming the key. Default: none."""

    @classmethod
    def check_section(cls, cfg, section: str) -> None:
        """Check `cfg[section]` against every field's range and choices, then `check`."""
        values = OmegaConf.to_container(cfg[section], resolve=True)
        for f in dataclasses.fields(cls):
            what = allowed(f.metadata)
            if what is not None and not admits(f.metadata, values[f.name]):
                why = f" ({f.metadata['why']})" if f.metadata.get("why") else ""
                raise ConfigError(f"{section}.{f.name} must be {what}{why}, got {values[f.name]!r}")
        cls(**values).check(cfg, section)
