"""Which numbers of a resolved config sit far from raysim's defaults (a divergence's likely
cause, named by `Algorithm.divergence_hint`)."""
from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

FAR = 100.0  # a value this many times its default (or more) is named


def far_from_default(cfg: DictConfig, far: float = FAR) -> list[tuple]:
    """[(dotted key, value, default, ratio)] for every number of `cfg` at least `far` times
    its schema default in magnitude (a default of 0, or a float unset by default: a value of
    magnitude `far` or more), the largest ratio first."""
    from raysim.config.sections import schema

    base = OmegaConf.to_container(schema(), resolve=False, throw_on_missing=False)
    mine = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    out = []

    def walk(a, b, prefix: str) -> None:
        for k, v in a.items():
            d = b.get(k) if isinstance(b, dict) else None
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, d if isinstance(d, dict) else {}, key + ".")
            elif _number(v) and math.isfinite(v) and v != d and (_number(d) or (d is None and isinstance(v, float))):
                ratio = abs(v) / abs(d) if d else abs(v)  # unset (None) or 0 by default: the value itself
                if ratio >= far:
                    out.append((key, float(v), d, ratio))

    walk(mine, base, "")
    return sorted(out, key=lambda r: -r[3])


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
