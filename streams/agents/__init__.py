"""The worker's Faust agents, one module each; `streams/app.py` wires them to their topics."""
