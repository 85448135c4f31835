r"""The loader's start-up cost and memory against the number of documents (issue 42).

    python -m tools.loader_bench --docs 10000000            # from the repository root
    python -m tools.loader_bench --docs 1000000 --docs 10000000 --dir /tmp/loader_bench
    python -m tools.loader_bench --cold --docs 1000000000  # the index read from the disk

Each size gets a synthetic prepared directory, written directly with numpy (no tokenizing):
documents of 8 to 23 tokens (15.5 on average) in shards of 2**28 tokens, a docs_NNNNN.npy per
shard, the coarse starts and meta.json (format version 3, as prepare writes). The token files are
sparse (all id 0): opening must not read them, and a row reads only its own tokens. Each size is
then measured in a fresh process: the seconds (wall and CPU) to open the directory (TokenShards),
split it (split_documents) and build the training loader, the seconds to its first batch, the peak
of Python-side allocations meanwhile (tracemalloc: numpy's arrays included, mapped files not), and
how much the process's resident memory grew: anonymous (its own) and file-backed (the pages of the
memory-mapped index it touched, which the kernel can drop).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

import data

SHARD_TOKENS = 1 << 28  # as data.prepare's default
SEQ_LEN, BATCH = 2048, 8


CHUNK_DOCS = 1 << 24  # documents drawn at a time: writing 1B documents holds 16M lengths, not 1B


def write_corpus(directory: Path, num_docs: int, seed: int = 0) -> int:
    """A prepared directory of `num_docs` documents (lengths 8..23, seeded) -> its token count.
    Kept when it exists with this many documents (meta.json is written last)."""
    meta_file = directory / "meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text())["num_docs"] == num_docs:
        return json.loads(meta_file.read_text())["num_tokens"]
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards: list[str] = []
    open_ends: list[np.ndarray] = []  # the open shard's document ends, from its first token
    filled = drawn = num_tokens = 0
    while drawn < num_docs:
        lengths = rng.integers(8, 24, size=min(CHUNK_DOCS, num_docs - drawn), dtype=np.int64)
        drawn, num_tokens = drawn + len(lengths), num_tokens + int(lengths.sum())
        ends = filled + np.cumsum(lengths)
        while len(ends):  # a shard takes whole documents up to SHARD_TOKENS tokens, at least one
            fits = int(np.searchsorted(ends, SHARD_TOKENS, side="right")) or int(not open_ends)
            open_ends.append(ends[:fits])
            if fits == len(ends):  # the open shard may take more of the next chunk
                filled = int(ends[-1])
                break
            shards.append(write_shard(directory, len(shards), open_ends))
            cut = int(ends[fits - 1]) if fits else filled
            open_ends, filled, ends = [], 0, ends[fits:] - cut
    shards.append(write_shard(directory, len(shards), open_ends))
    meta = {
        "format": "flint-token-shards-v1",
        "dtype": "uint16",
        "num_docs": num_docs,
        "num_tokens": num_tokens,
        "shards": shards,
        "tokenizer": "synthetic",
        "vocab_size": 257,
        "eos_id": 256,
        "sources": [],
        "skipped_binary": [],
        "skipped_by_extension": 0,
        "format_version": 3,  # as prepare writes: the coarse starts, each shard's largest id (0)
        "shard_max_token": [0] * len(shards),
    }
    np.save(directory / data.COARSE_FILE, data.coarse_starts(directory, shards))
    meta_file.write_text(json.dumps(meta))
    return num_tokens


def write_shard(directory: Path, index: int, ends: list[np.ndarray]) -> str:
    """A shard's document index (0, then each document's end) and its token file, sparse (all id
    0, no block written) -> its name."""
    name, bounds = f"{index:05d}", np.concatenate([[0], *ends]).astype(np.int64)
    np.save(directory / f"docs_{name}.npy", bounds)
    with open(directory / f"tokens_{name}.bin", "wb") as file:
        file.truncate(int(bounds[-1]) * 2)  # uint16
    return name


def evict(directory: Path) -> None:
    """The directory's files out of the page cache (posix_fadvise DONTNEED: these files only), so
    that opening reads the index from the disk, as a first start on a fresh host does."""
    for file in directory.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def resident_mib() -> dict[str, float]:
    """This process's resident memory now, from /proc/self/status (Linux): anonymous (its own
    allocations) and file-backed (pages of mapped files it touched, the page cache's to drop)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile")}


def measure(directory: Path) -> dict[str, float]:
    """Open `directory` as train.py does and read the first batch, in this process."""
    # data (and torch) imported at the top, before the baseline: no part of the loader's cost
    before = resident_mib()
    tracemalloc.start()
    wall, cpu = time.perf_counter(), time.process_time()
    shards = data.TokenShards(directory)
    train_docs, _ = data.split_documents(shards.num_docs, 0.05, str(directory))
    loader = data.PackedLoader(shards, train_docs, SEQ_LEN, BATCH, seed=0)
    opened = time.perf_counter() - wall, time.process_time() - cpu
    loader.next_batch()
    first = time.perf_counter() - wall, time.process_time() - cpu
    python_peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    after = resident_mib()
    return {
        "docs": shards.num_docs,
        "open_s": opened[0],
        "open_cpu_s": opened[1],
        "first_batch_s": first[0],
        "first_batch_cpu_s": first[1],
        "python_peak_mib": python_peak,
        "anon_mib": after["RssAnon"] - before["RssAnon"],
        "file_mib": after["RssFile"] - before["RssFile"],
    }


def row(result: dict[str, float]) -> str:
    return (
        f"| {result['docs']:,} | {result['open_s']:.2f} ({result['open_cpu_s']:.2f}) | "
        f"{result['first_batch_s']:.2f} ({result['first_batch_cpu_s']:.2f}) | "
        f"{result['python_peak_mib']:,.2f} | {result['anon_mib']:,.1f} | "
        f"{result['file_mib']:,.1f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, action="append", help="documents (repeatable)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path("/tmp/loader_bench"),
        help="where the synthetic directories are written (kept for reruns)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="evict each directory's files from the page cache before measuring",
    )
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    print(
        "| documents | open s (CPU s) | first batch s (CPU s) | Python peak MiB | "
        "anonymous RSS MiB | file-backed RSS MiB |"
    )
    print("|---|---|---|---|---|---|")
    for num_docs in args.docs or [1_000_000]:
        directory = args.dir / f"docs_{num_docs}"
        write_corpus(directory, num_docs)
        if args.cold:
            evict(directory)
        command = [sys.executable, "-m", "tools.loader_bench", "--measure", str(directory)]
        child = subprocess.run(command, capture_output=True, text=True, check=True)
        print(row(json.loads(child.stdout.splitlines()[-1])), flush=True)


if __name__ == "__main__":
    main()
