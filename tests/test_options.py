"""A plugin's options check themselves (raysim.options): ranges, choices and `check`."""
import dataclasses
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from raysim import registry
from raysim.config import ConfigError, load_config, section_of
from raysim.options import Options, admits, option


@dataclass
class ToyOptions(Options):
    rate: float = option(0.5, above=0, at_most=1)
    steps: int = option(3, at_least=1, why="local steps")
    mode: str = option("a", choices=("a", "b"))
    pick: object = option(False, choices=(False, "x"))
    free: float = 2.0  # no rule

    def check(self, cfg, section):
        if self.mode == "b" and self.steps > cfg.limit:
            raise ConfigError(f"{section}.steps must be <= limit={cfg.limit} with mode b")


def check(**values):
    cfg = OmegaConf.create({"toy": dataclasses.asdict(ToyOptions()) | values, "limit": 4})
    ToyOptions.check_section(cfg, "toy")


@pytest.mark.parametrize("values,message", [
    ({"rate": 0.0}, "toy.rate must be in (0, 1], got 0.0"),
    ({"rate": 1.5}, "toy.rate must be in (0, 1], got 1.5"),
    ({"steps": 0}, "toy.steps must be >= 1 (local steps), got 0"),
    ({"mode": "c"}, "toy.mode must be one of a, b, got 'c'"),
    ({"pick": "y"}, "toy.pick must be one of false, x, got 'y'"),
    ({"pick": True}, "toy.pick must be one of false, x, got True"),
    ({"mode": "b", "steps": 5}, "toy.steps must be <= limit=4 with mode b"),
])
def test_a_value_outside_its_range_or_choices_is_one_line_naming_the_key(values, message):
    with pytest.raises(ConfigError) as e:
        check(**values)
    assert str(e.value) == message


def test_values_inside_the_rules_pass():
    check(rate=1.0, steps=1, mode="b", pick="x", free=-7.0)
    check()


def test_every_registered_plugin_declares_options_whose_defaults_pass_their_own_rules():
    """The schema's sections come from `Options` subclasses, and each default is allowed."""
    seen = 0
    for reg in (registry.ALGORITHMS, registry.SELECTIONS, registry.DATASETS):
        for name in reg.names():
            if section_of(reg, name) is None:
                continue
            options = reg.get(name).Options
            assert issubclass(options, Options), (reg.kind, name)
            for f in dataclasses.fields(options):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                assert admits(f.metadata, default), (name, f.name, default)
            seen += 1
    assert seen >= 15


def test_a_plugins_rule_reaches_the_user_through_load_config():
    with pytest.raises(ConfigError, match=r"^fedprox.mu must be >= 0, got -1.0$"):
        load_config(overrides=["algorithm=fedprox", "fedprox.mu=-1"])
    with pytest.raises(ConfigError, match=r"^ifca.groups must be in \[1, num_clients=4\], got 5$"):
        load_config(overrides=["algorithm=ifca", "num_clients=4", "ifca.groups=5"])
