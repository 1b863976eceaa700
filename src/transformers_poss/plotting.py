"""Matplotlib for the PNG plots (`poss bench`, `poss plot-training`): an optional dependency (the `bench` extra),
checked up front."""

from __future__ import annotations

from .extras import require


def require_matplotlib(what: str) -> None:
    """Raise `ImportError` naming `what` needs it (call before any long work) when matplotlib is missing."""
    require("matplotlib", "bench", what)


def pyplot():
    """`matplotlib.pyplot` on the file-only Agg backend (no display needed)."""
    require("matplotlib", "bench", "plotting").use("Agg")
    return require("matplotlib.pyplot", "bench", "plotting")
