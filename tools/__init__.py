"""Tools beside the core: benchmarks and baselines, profiling, the planner and its op trace, the
memory estimate, the rehearsal and scripts. Run each from the repository root as `python -m
tools.NAME`; nothing in the core imports them (train.py --dry-run reaches the rehearsal through one
lazy import)."""
