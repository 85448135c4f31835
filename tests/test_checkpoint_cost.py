"""tools/checkpoint_cost.py: it runs end to end on the debug model and reports both saving modes."""

import subprocess
import sys

from helpers import DEFAULT_FAMILY, ROOT, debug_configs


def test_it_times_synchronous_and_asynchronous_saves():
    config = str(debug_configs()[DEFAULT_FAMILY])
    result = subprocess.run([sys.executable, "-m", "tools.checkpoint_cost", "--config", config, "--steps", "4", "--every",
                             "2", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("sync:", "async:"))]
    assert len(lines) == 2 and all("ms per save" in line for line in lines), result.stdout
