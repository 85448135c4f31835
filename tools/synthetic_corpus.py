"""A synthetic corpus for benchmarks: N documents of random words, the same bytes for the same seed.

    python3 -m tools.synthetic_corpus --out /tmp/corpus --documents 100000 [--files 4]
        [--words 200] [--seed 0]

Writes --files JSONL files (corpus_00000.jsonl, ...), one {"text": ...} record per line, documents
spread over the files in order. Each document has between half and one and a half times --words
words, drawn from a vocabulary of 5,000 made-up lower-case words (Zipf-like frequencies, as in real
text, so a BPE tokenizer merges the frequent ones). Used by BENCHMARKS.md's prepare and loader
sections."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flags import OneLineParser, non_negative, positive

VOCABULARY = 5000
LETTERS = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))


def vocabulary(rng: np.random.Generator) -> np.ndarray:
    """VOCABULARY distinct made-up words of 1 to 10 letters."""
    words: dict[str, None] = {}
    while len(words) < VOCABULARY:
        length = int(rng.integers(1, 11))
        words.setdefault("".join(LETTERS[rng.integers(0, len(LETTERS), length)]))
    return np.array(list(words))


def documents(count: int, words: int, seed: int) -> list[str]:
    """`count` documents of random words from `vocabulary`, deterministic from `seed`."""
    rng = np.random.default_rng(seed)
    vocab = vocabulary(rng)
    weights = 1.0 / np.arange(1, VOCABULARY + 1)  # Zipf: the k-th word is k times rarer
    weights /= weights.sum()
    lengths = rng.integers(max(1, words // 2), words + words // 2 + 1, count)
    return [" ".join(vocab[rng.choice(VOCABULARY, int(n), p=weights)]) for n in lengths]


def write_corpus(out: Path, count: int, files: int, words: int, seed: int) -> list[Path]:
    """The corpus under `out` (a new directory) -> the files written."""
    out.mkdir(parents=True)
    texts = documents(count, words, seed)
    paths = []
    for index in range(files):
        path = out / f"corpus_{index:05d}.jsonl"
        share = texts[index * count // files : (index + 1) * count // files]
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in share))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description="Write N documents of random words as JSONL files.")
    parser.add_argument("--out", type=Path, required=True, help="a new directory")
    parser.add_argument("--documents", type=positive, required=True)
    parser.add_argument("--files", type=positive, default=1)
    parser.add_argument("--words", type=positive, default=200, help="mean words a document")
    parser.add_argument("--seed", type=non_negative, default=0)
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"argument --out: {args.out} exists; name a new directory")
    paths = write_corpus(args.out, args.documents, args.files, args.words, args.seed)
    size = sum(path.stat().st_size for path in paths)
    print(f"{args.out}: {args.documents:,} documents in {len(paths)} file(s), {size / 1e6:,.1f} MB")


if __name__ == "__main__":
    main()
