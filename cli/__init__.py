"""The entry points: the `spanguard` command (main.py, its `replay` file reader replay.py, the
HTML pages of replay and backtest report.py) and the demo agents (demo.py)."""

# Installed as spanguard.cli; loaded by its folder name (from the repository root) each of its
# modules would exist twice, with two copies of every class.
if __name__ != "spanguard.cli":
    raise ImportError(f"import spanguard.cli, not {__name__}")
