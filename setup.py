"""Build hook: the detection core compiled with mypyc when SPANGUARD_COMPILE=1.

Every span of every agent passes through the modules below. Compiled by mypyc (the compiler
mypy and black ship with) from the very same source, they run the guard faster (the figure:
docs/performance.md, "Figures behind the code"); the worker image builds them so (Dockerfile). A plain `pip install` and the editable
install of `make install` keep them pure Python and need no C compiler. Which one runs is
`spanguard.detection.core_build()`, and the worker logs it at start.

    pip install "mypy[mypyc]" && SPANGUARD_COMPILE=1 pip install --no-build-isolation .
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

# The hot path: the guard, the span conventions, argument hashing, the trace state, the rules.
COMPILED_MODULES = [
    "spanguard/detection/guard.py",
    # The span conventions, one module per concept (its __init__ holds no code).
    "spanguard/detection/conventions/keys.py",
    "spanguard/detection/conventions/values.py",
    "spanguard/detection/conventions/events.py",
    "spanguard/detection/conventions/decoding.py",
    "spanguard/detection/conventions/kinds.py",
    "spanguard/detection/conventions/turns.py",
    "spanguard/detection/conventions/gateway.py",
    "spanguard/detection/conventions/capture.py",
    "spanguard/detection/conventions/adapt.py",
    "spanguard/detection/canonical.py",
    "spanguard/detection/trace_state.py",
    "spanguard/detection/results.py",
    "spanguard/detection/rules/base.py",
    "spanguard/detection/rules/tool_loop.py",
    "spanguard/detection/rules/cycle.py",
    "spanguard/detection/rules/tool_polling.py",
    "spanguard/detection/rules/no_progress.py",
    "spanguard/detection/rules/token_budget.py",
    "spanguard/detection/rules/cost_budget.py",
    "spanguard/detection/rules/handoff_cycle.py",
    "spanguard/detection/rules/delegation_depth.py",
    "spanguard/detection/rules/agent_fan_out.py",
    "spanguard/detection/agent_tree.py",
    # Every inference span is priced.
    "spanguard/detection/pricing.py",
    # The conversation scope (its state extends the trace's).
    "spanguard/detection/conversation.py",
    # What the conversation scope shares with the agent scope (its base class).
    "spanguard/detection/scope.py",
    # The tool scope: every tool and inference span is read as a call, and the tool scope
    # agent counts each call row into its window.
    "spanguard/detection/fleet.py",
]
# Type-checked alone: the modules' imports outside this list are read, not compiled. No config
# file: pyproject.toml's [tool.mypy] is `make typecheck`'s (its link tree and per-module flags),
# and the compile must not change with it.
MYPY_OPTIONS = ["--ignore-missing-imports", "--follow-imports=silent", "--config-file="]


def ext_modules() -> list:
    choice = os.environ.get("SPANGUARD_COMPILE", "0")
    if choice not in ("0", "1"):
        sys.exit(f"SPANGUARD_COMPILE must be 0 or 1, not {choice!r}")
    if choice == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        sys.exit(
            'SPANGUARD_COMPILE=1 needs mypyc: pip install "mypy[mypyc]", then'
            " pip install --no-build-isolation ."
        )
    return mypycify([*MYPY_OPTIONS, *COMPILED_MODULES], opt_level="3", group_name="spanguard_core")


if __name__ == "__main__":  # setuptools runs this file as __main__
    setup(ext_modules=ext_modules())
