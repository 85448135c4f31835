import os
import sys
from pathlib import Path

# Tests import the flat top-level modules (model.py, attention.py, ...) and tests/reference.py.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# Idle OpenMP threads sleep instead of spinning: the multi-process tests share two cores, and
# threads spinning while a peer process is descheduled made steps up to 30x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
