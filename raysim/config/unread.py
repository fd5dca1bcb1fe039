"""Options that only some choices read: set where nothing reads them, they would leave the
user believing they changed the run (issue 85: `compress.sign_scale=tensor` with
`compress.up=qsgd`, `heterofl.roll=code` with `heterofl.variant=heterofl`, the same bits,
accepted silently). The rule, as for a whole plugin section (`layers.check_sections`): set on
the command line, an option the run does not read is refused in one line naming what reads
it; set in a --config file (which may serve several runs of a comparison), it is a note."""
from __future__ import annotations

from typing import Callable


def local_tests(cfg) -> bool:
    """Whether the clients have test data of their own (a test split, or a natural
    partition's users' own test files)."""
    return float(cfg.partition.test_fraction) > 0 or cfg.partition.name == "natural"


# (key, read when, what reads it)
READ_WHEN: list[tuple[str, Callable, str]] = [
    ("compress.ratio", lambda c: c.compress.up in ("topk", "randk"), "compress.up=topk or randk"),
    ("compress.bits", lambda c: c.compress.up == "qsgd", "compress.up=qsgd"),
    ("compress.bucket", lambda c: c.compress.up == "qsgd", "compress.up=qsgd"),
    ("compress.sign_scale", lambda c: c.compress.up == "sign", "compress.up=sign"),
    ("heterofl.roll", lambda c: c.heterofl.variant == "fedrolex", "heterofl.variant=fedrolex"),
    ("eval.local_clients", local_tests, "clients' own test data (partition.test_fraction > 0, or "
                                        "partition.name=natural)"),
]


def _set_in(data: dict, dotted: str) -> bool:
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def unread_keys(layers: list, cfg) -> list[tuple[str, str, str]]:
    """[(source, key, what reads it)] for each layer that sets an option this run does not
    read (its section read: a section nothing reads is `sections.unused_sections`'s)."""
    from raysim.config.sections import plugin_sections, used_sections

    plugin, used = plugin_sections(), used_sections(cfg)
    out = []
    for key, read, reader in READ_WHEN:
        section = key.split(".")[0]
        if (section in plugin and section not in used) or read(cfg):
            continue
        out += [(source, key, reader) for source, data in layers if _set_in(data, key)]
    return out
