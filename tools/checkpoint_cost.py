"""The step-time cost of a checkpoint, synchronous against [checkpoint].async_save:

    python3 -m tools.checkpoint_cost --config configs/debug.toml --steps 40 --every 5 --rounds 3

train.py's main on the config, saving every `every` steps, in rotation: saving only at the end, then
synchronously, then asynchronously, `rounds` times. Each Checkpointer.save is timed on the main
thread (what the training loop waits for: the staging copy, and any wait for the save before it; the
last save, which the run waits for anyway, is left out), and each whole run against the one that
saves only at the end. Everything is written under a temporary directory."""

import statistics
import tempfile
import time

import checkpoint
import train
from config import ConfigError, load_config
from flags import OneLineParser, positive

MODES = {"at the end only": ("0", "false"), "sync": (None, "false"), "async": (None, "true")}


def timed_run(
    config: str, steps: int, every: str, async_save: str, directory: str
) -> tuple[list[float], float]:
    """-> (seconds in each save but the last, seconds of the whole run)."""
    blocked, real_save = [], checkpoint.Checkpointer.save

    def save(self, *args):
        start = time.perf_counter()
        real_save(self, *args)
        blocked.append(time.perf_counter() - start)

    checkpoint.Checkpointer.save = save
    start = time.perf_counter()
    try:
        train.main(
            [
                "--config",
                config,
                f"--training.steps={steps}",
                f"--checkpoint.every={every}",
                f"--checkpoint.async_save={async_save}",
                f"--checkpoint.dir={directory}/ckpt",
                f"--logging.jsonl={directory}/metrics.jsonl",
                f"--data.cache_dir={directory}/cache",
                "--checkpoint.resume=never",
                "--training.sample_tokens=0",
                "--training.eval_every=0",
                "--logging.every=1000000",
                "--logging.peak_tflops=0.1",
            ]
        )
    finally:
        checkpoint.Checkpointer.save = real_save
    return blocked[:-1], time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="a training config, e.g. configs/debug.toml"
    )
    parser.add_argument("--steps", type=positive, default=40)
    parser.add_argument("--every", type=positive, default=5)
    parser.add_argument("--rounds", type=positive, default=3)
    args = parser.parse_args(argv)
    load_config(args.config)  # a missing or broken config stops here, before the first of many runs
    if args.steps < 2 * args.every:  # the last save is left out: one must remain to time
        raise ConfigError(
            f"--steps must be at least twice --every (two saves, the last one not timed), "
            f"got --steps {args.steps} --every {args.every}"
        )
    results: dict[str, list[tuple[list[float], float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for mode, (every, async_save) in MODES.items():
                directory = f"{scratch}/{round_}-{async_save}-{every}"
                results[mode].append(
                    timed_run(
                        args.config, args.steps, every or str(args.every), async_save, directory
                    )
                )
    base = statistics.median(wall for _, wall in results["at the end only"])
    for mode in ("sync", "async"):
        saves = len(results[mode][0][0])
        blocked = ", ".join(f"{statistics.median(b) * 1000:.0f}" for b, _ in results[mode])
        extra = ", ".join(f"{(wall - base) / saves * 1000:.0f}" for _, wall in results[mode])
        print(
            f"{mode}: the loop waits {blocked} ms per save (median of {saves} saves, each round); "
            "the whole run "
            f"takes {extra} ms per save longer than saving only at the end ({base:.2f} s)"
        )


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:
        raise SystemExit(f"error: {error}")
