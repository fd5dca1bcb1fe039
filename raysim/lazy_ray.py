"""`ray`, imported when first used: `from raysim.lazy_ray import ray`.

Importing Ray costs ~0.6 s of CPU on 2 cores. A command whose clients train in its own
process (runtime/here.py) never needs it, yet the server's modules name Ray everywhere (in
`except` clauses too, evaluated only when something is raised there). This stand-in
imports Ray at the first attribute asked of it; one instance, so `is` comparisons hold.
"""
from __future__ import annotations


class _Ray:
    def __getattr__(self, name: str):
        import ray

        return getattr(ray, name)

    def __repr__(self) -> str:
        return "<ray, imported when first used>"


ray = _Ray()


def imported() -> bool:
    """Whether Ray has been imported (by anyone)."""
    import sys

    return "ray" in sys.modules


def initialized() -> bool:
    """`ray.is_initialized()`, without importing Ray to learn that it is not."""
    return imported() and ray.is_initialized()
