"""spanguard: runtime guards for fleets of LLM agents, placed in the trace pipeline."""

__version__ = "0.1.0"
