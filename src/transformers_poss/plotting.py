"""Matplotlib for the PNG plots (`poss bench`, `poss plot-training`): an optional dependency, checked up front."""

from __future__ import annotations

INSTALL_HINT = "install matplotlib (`pip install 'transformers-poss[bench]'`)"


def require_matplotlib(what: str) -> None:
    """Raise `ImportError` naming `what` needs it (call before any long work) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(f"{what} needs matplotlib: {INSTALL_HINT}") from error


def pyplot():
    """`matplotlib.pyplot` on the file-only Agg backend (no display needed)."""
    require_matplotlib("plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
