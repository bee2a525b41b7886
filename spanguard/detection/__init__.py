"""Detection: OTLP spans in, guard decisions out (rules, per-trace state, span conventions, replay)."""

from __future__ import annotations

__all__ = ["core_build"]


def core_build() -> str:
    """ "compiled" when the hot path runs as mypyc extension modules (setup.py, the worker
    image), else "pure Python" (a plain install): the same code, the compiled one faster
    (docs/performance.md, "Figures behind the code")."""
    from spanguard.detection import guard

    return "pure Python" if guard.__file__.endswith(".py") else "compiled"
