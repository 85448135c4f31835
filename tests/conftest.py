import sys
from pathlib import Path

# Tests import the flat top-level modules (model.py, attention.py, ...) and tests/reference.py.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
