"""This test's own Ray processes, never another Ray on the machine (a user's run, another
test session): the ones a command started under its own RAY_TMPDIR (`under`), or the
descendants of this test process with a given title (`descendants`: the `ray_local`
fixture's raylet is this process's child, the actors the raylet's)."""
from __future__ import annotations

import psutil


def command_line(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def under(ray_tmp: str) -> list:
    """The processes whose command line names `ray_tmp` (the RAY_TMPDIR their command got)."""
    return [p for p in psutil.process_iter(["cmdline"]) if any(ray_tmp in a for a in p.info["cmdline"] or ())]


def descendants(title: str) -> list:
    """This process's descendants whose command line starts with `title` (ray::ServerActor)."""
    return [q for q in psutil.Process().children(recursive=True) if command_line(q).startswith(title)]
