import sys
from pathlib import Path

# tests/ helpers (spans.py) are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
