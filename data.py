"""Data for train.py: the token shards' format and the packed, resumable loader (prepare.py writes
the shards; tokenizers: tokenizer.py).

    text files, JSONL, parquet  --prepare (prepare.py)-->  token shards (memmaps + document index)
    token shards  --PackedLoader-->  batches of input_ids, targets, doc_ids, each [B, T]

Each epoch, the loader concatenates the training documents in a seeded order and cuts that stream
into rows of seq_len tokens, so every training token is an input exactly once per epoch (the last
row is padded). A document cut by a row boundary continues in the next row. doc_ids tell the model
where documents begin, so attention never crosses them, and a target that belongs to the next
document is -100: no token is predicted from another document's context.

Conversations and prompt/completion pairs (JSONL lines with "messages", or "prompt" and
"completion": chat.py) are stored with a loss mask beside their tokens, and only the assistant's
tokens are targets (-100 elsewhere, so they are neither trained on nor counted). Data with
conversations is packed whole: each row holds whole documents (best-fit, chat.pack_rows, fixed for
the data), a document longer than seq_len is truncated or dropped (data.overlong), and each epoch
shuffles the rows block-wise (PackedLoader)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from chat import (
    WholeRows,
    one_line,
    template_of,
)
from files import read_json_object
from tokenizer import Tokenizer

# The Python Language Reference topics that CPython ships as pydoc_data/topics.py (see
# data/README.md).
EMBEDDED_CORPUS = Path(__file__).resolve().parent / "data" / "python_reference.jsonl"
SHARDS_FORMAT = "flint-token-shards-v1"
# v1 plus a loss mask per shard (mask_NNNNN.bin, uint8 per token)
MASKED_FORMAT = "flint-token-shards-v2"
OVERLONG = ("truncate", "drop")  # data.overlong: what a conversation longer than seq_len becomes
SPLIT_SEED = 1234  # fixed, so the validation documents do not change with the training seed
# The settings that decide which rows a run reads (with the data's files): a resume continues the
# checkpoint's row position, which means the same rows only while none of them changed.
STREAM_KEYS = (
    "data.path",
    "data.sources",
    "data.exhausted",
    "data.tokenizer",
    "data.eos_token",
    "data.text_key",
    "data.seq_len",
    "data.val_fraction",
    "data.overlong",
    "training.seed",
)


# meta.json's "format_version" (absent: 1). Version 2 adds each shard's largest token id and the
# sha256 of its tokens file ("shard_max_token", "shard_sha256"), checked once at prepare time.
# Version 3 adds COARSE_FILE: where every COARSE_DOCS-th document starts, so that opening reads
# 8 bytes per 4,096 documents in one file instead of touching the whole document index.
FORMAT_VERSION = 3
COARSE_DOCS = 1 << 12  # as BLOCK_DOCS: a block of the shuffled order starts on this grid
COARSE_FILE = "coarse_starts.npy"


class DataError(ValueError):
    """Bad or missing data: the message names the path and what was expected."""


# ============================================================================= reading shards


class TokenShards:
    """Prepared shards as one list of documents: document(i) is a memmap view, no copy; with
    conversations (`masked`), loss_mask(i) is its mask the same way.

    Each shard's document index (docs_NNNNN.npy) is memory-mapped too, so opening costs O(shards)
    whatever the number of documents, and only the index pages of documents read are touched."""

    def __init__(self, directory: Path, tokenizer: Tokenizer | None = None):
        self.meta = read_meta(directory / "meta.json")
        self.masked = self.meta["format"] == MASKED_FORMAT
        if tokenizer is not None and self.meta["tokenizer"] != tokenizer.fingerprint:
            raise DataError(
                f"{directory} was prepared with tokenizer {self.meta['tokenizer']}, but "
                "this run "
                f"uses {tokenizer.fingerprint}; prepare it again or change "
                "data.tokenizer"
            )
        if (
            tokenizer is not None
            and self.masked
            and self.meta.get("chat_template_digest") != template_of(tokenizer).digest
        ):
            raise DataError(
                f"{directory} holds conversations rendered with the chat template of "
                f"{self.meta.get('chat_template')}, but this run's tokenizer has "
                "another one "
                f"({template_of(tokenizer).origin}); prepare the data again"
            )
        self.tokens, self.masks, self.bounds = [], [], []
        first_doc, token_offset = [0], [0]
        for name in self.meta["shards"]:
            tokens, bounds = read_shard(directory, name, self.meta["dtype"])
            # plain views of the maps: a memmap's slices cost a Python object each, these do not
            self.tokens.append(tokens.view(np.ndarray))
            self.bounds.append(bounds.view(np.ndarray))
            if self.masked:
                mask = read_mask(directory / f"mask_{name}.bin", len(tokens))
                self.masks.append(mask.view(np.ndarray))
            first_doc.append(first_doc[-1] + len(bounds) - 1)
            token_offset.append(token_offset[-1] + len(tokens))
        # [shards]: each shard's first document and first token in the corpus's order
        self._first_doc = first_doc[:-1]
        self.first_doc, self.token_offset = np.array(first_doc[:-1]), np.array(token_offset[:-1])
        self.num_docs, self.num_tokens = first_doc[-1], token_offset[-1]
        self.coarse = read_coarse(directory, self.meta, self.num_docs, self.num_tokens)
        self.vocab_size = int(self.meta["vocab_size"])
        self.files = [directory / f"tokens_{name}.bin" for name in self.meta["shards"]]
        self.index_files = [directory / f"docs_{name}.npy" for name in self.meta["shards"]]
        self.vocab_limit = tokenizer.vocab_size if tokenizer else self.vocab_size
        # Ranges recorded at prepare time are checked now; without them each document read is.
        self.checked_at_open = check_recorded_ranges(
            directory / "meta.json", self.meta, self.vocab_limit
        )

    def _span(self, i: int) -> tuple[int, int, int]:
        """Document i -> (its shard, its first token and its end in that shard)."""
        shard = bisect.bisect_right(self._first_doc, i) - 1
        local = i - self._first_doc[shard]
        start, end = int(self.bounds[shard][local]), int(self.bounds[shard][local + 1])
        if end <= start:
            raise self._disorder(shard, local)
        return shard, start, end

    def document(self, i: int, part: slice = slice(None)) -> np.ndarray:
        """Document i's tokens (a memmap view), or `part` of them: only those are read."""
        shard, start, end = self._span(i)
        tokens = self.tokens[shard][start:end][part]
        if not self.checked_at_open:
            check_token_range(self.files[shard], tokens, self.vocab_limit)
        return tokens

    def loss_mask(self, i: int) -> np.ndarray:
        """uint8 [document length]: 1 where the token is a target (the assistant's); masked shards
        only."""
        shard, start, end = self._span(i)
        return self.masks[shard][start:end]

    def starts(self, docs: np.ndarray) -> np.ndarray:
        """Where each document starts in the corpus's tokens back to back; num_docs -> the end.
        [n] int in [0, num_docs] -> [n] int64, reading n entries of the memory-mapped index."""
        docs = np.asarray(docs, dtype=np.int64)
        if self.coarse is not None:  # those on the grid from the coarse starts, without the index
            on_grid = (docs % COARSE_DOCS == 0) | (docs == self.num_docs)
            if on_grid.any():
                result = np.empty(len(docs), dtype=np.int64)
                coarse = np.where(docs == self.num_docs, len(self.coarse) - 1, docs // COARSE_DOCS)
                result[on_grid] = self.coarse[coarse[on_grid]]
                result[~on_grid] = self._indexed_starts(docs[~on_grid])
                return result
        return self._indexed_starts(docs)

    def _indexed_starts(self, docs: np.ndarray) -> np.ndarray:
        shard = np.searchsorted(self.first_doc, docs, side="right") - 1
        order = np.argsort(shard, kind="stable")  # one gather per shard
        cuts = np.searchsorted(shard[order], np.arange(len(self.bounds) + 1))
        result = np.empty(len(docs), dtype=np.int64)
        for s in np.flatnonzero(np.diff(cuts)):
            take = order[cuts[s] : cuts[s + 1]]
            local = docs[take] - self.first_doc[s]
            result[take] = self.token_offset[s] + self.bounds[s][local]
        return result

    def lengths(self, docs: np.ndarray) -> np.ndarray:
        """[n] document indices -> [n] int64 token counts, each checked to be positive."""
        docs = np.asarray(docs, dtype=np.int64)
        lengths = self.starts(docs + 1) - self.starts(docs)
        bad = np.flatnonzero(lengths <= 0)
        if len(bad):
            shard = bisect.bisect_right(self._first_doc, int(docs[bad[0]])) - 1
            raise self._disorder(shard, int(docs[bad[0]]) - self._first_doc[shard])
        return lengths

    def _disorder(self, shard: int, local: int) -> DataError:
        window = self.bounds[shard][max(local - 1, 0) : local + 3].tolist()
        return DataError(
            f"{self.index_files[shard]}: document starts must rise from 0, got "
            f"{window}... (document {local}): the shard is damaged, prepare again"
        )


# meta.json's keys that reading shards needs, with the type each must have.
META_KEYS = {"tokenizer": str, "dtype": str, "vocab_size": int, "shards": list}
MASKED_META_KEYS = {"chat_template": str, "chat_template_digest": str}  # the template used


def read_meta(path: Path) -> dict:
    """A prepared directory's meta.json, with every key the loader reads, or a DataError naming
    it."""
    try:
        meta = read_json_object(path)
    except ValueError as error:
        raise DataError(f"{error}: not a prepared data directory; prepare the data again") from None
    if meta.get("format") not in (SHARDS_FORMAT, MASKED_FORMAT):
        raise DataError(
            f"{path}: format {meta.get('format')!r}, expected {SHARDS_FORMAT!r} or "
            f"{MASKED_FORMAT!r}: prepared by another version of this code, or damaged; "
            f"prepare the data again"
        )
    if meta.get("format_version", 1) not in range(1, FORMAT_VERSION + 1):
        raise DataError(
            f"{path}: format_version {meta['format_version']!r}, expected 1 to "
            f"{FORMAT_VERSION}: prepared by a newer version of this code, or damaged; "
            "prepare the data again"
        )
    kinds = {**META_KEYS, **(MASKED_META_KEYS if meta["format"] == MASKED_FORMAT else {})}
    for key, kind in kinds.items():
        if not isinstance(meta.get(key), kind):
            found = f"has {key!r} = {meta[key]!r:.40}" if key in meta else f"lacks key {key!r}"
            raise DataError(
                f"{path} {found}, expected a {kind.__name__}: the file is damaged, "
                "prepare the data again"
            )
    if (
        meta["dtype"] not in ("uint16", "uint32")
        or not meta["shards"]
        or not all(
            isinstance(name, str) and name.isdigit() and name.isascii() for name in meta["shards"]
        )
    ):
        raise DataError(
            f"{path}: expected dtype uint16 or uint32 and a non-empty list of shard "
            "names, got "
            f"dtype {meta['dtype']!r}, shards {meta['shards']!r:.60}; prepare the data "
            "again"
        )
    return meta


def read_shard(directory: Path, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """One shard's tokens (a memmap) and document bounds, checked against each other."""
    tokens_file, docs_file = directory / f"tokens_{name}.bin", directory / f"docs_{name}.npy"
    for file in (tokens_file, docs_file):
        if not file.is_file() or file.stat().st_size == 0:
            raise DataError(
                f"{file}: {'empty' if file.is_file() else 'missing'}; the prepared "
                "directory is "
                f"damaged, prepare the data again"
            )
    try:
        tokens = np.memmap(tokens_file, dtype=dtype, mode="r")
    except (OSError, ValueError) as error:
        raise DataError(
            f"{tokens_file}: not a shard of {dtype} tokens ({one_line(error)}); "
            f"prepare the data again"
        ) from error
    try:
        bounds = np.load(docs_file, mmap_mode="r")  # read where documents are read, not here
    except (OSError, ValueError, EOFError) as error:
        raise DataError(
            f"{docs_file}: not a document index ({one_line(error)}); prepare the data again"
        ) from error
    if bounds.ndim != 1 or len(bounds) < 2 or bounds.dtype.kind not in "iu":
        raise DataError(
            f"{docs_file}: expected the integer start of each document then the end, "
            f"got an array of {bounds.dtype} {list(bounds.shape)}: the shard is "
            f"damaged, prepare again"
        )
    # Only the ends here (O(1)): each document's own bounds are checked as it is read, since a
    # document holds at least its end-of-text token.
    if bounds[0] != 0:
        raise DataError(
            f"{docs_file}: document starts must rise from 0, got "
            f"{bounds[:4].tolist()}...: the shard is damaged, prepare again"
        )
    if bounds[-1] != len(tokens):
        raise DataError(
            f"{tokens_file} holds {len(tokens)} tokens but {docs_file.name} ends at "
            f"{bounds[-1]}: the shard is damaged, prepare again"
        )
    return tokens, bounds


def read_mask(file: Path, num_tokens: int) -> np.ndarray:
    """A shard's loss mask (a memmap), one byte per token of the shard."""
    size = file.stat().st_size if file.is_file() else None
    if size != num_tokens:
        found = "missing" if size is None else f"{size} bytes for the shard's {num_tokens} tokens"
        raise DataError(
            f"{file}: {found}; the prepared directory is damaged, prepare the data again"
        )
    return np.memmap(file, dtype=np.uint8, mode="r")


def coarse_starts(directory: Path, names: list[str]) -> np.ndarray:
    """Where every COARSE_DOCS-th document of the shards `names` starts in their tokens back to
    back, then the end [ceil(docs / COARSE_DOCS) + 1]: written at prepare time (COARSE_FILE)."""
    starts, first_doc, offset = [], 0, 0
    for name in names:
        bounds = np.load(directory / f"docs_{name}.npy", mmap_mode="r")
        count = len(bounds) - 1
        starts.append(offset + bounds[np.arange(-first_doc % COARSE_DOCS, count, COARSE_DOCS)])
        first_doc, offset = first_doc + count, offset + int(bounds[-1])
    return np.concatenate([*starts, [offset]]).astype(np.int64)


def read_coarse(directory: Path, meta: dict, num_docs: int, num_tokens: int) -> np.ndarray | None:
    """A directory's COARSE_FILE, checked against its shards; None before format version 3 (then
    opening reads the document index where the coarse starts would have been)."""
    if meta.get("format_version", 1) < 3:
        return None
    file = directory / COARSE_FILE
    try:
        coarse = np.load(file)
    except (OSError, ValueError, EOFError) as error:
        raise DataError(
            f"{file}: not the coarse document starts ({one_line(error)}); prepare the data again"
        ) from None
    expected = (-(-num_docs // COARSE_DOCS) + 1,)
    if coarse.shape != expected or coarse.dtype.kind not in "iu" or coarse[-1] != num_tokens:
        raise DataError(
            f"{file}: expected {expected[0]} integer starts ending at the shards' {num_tokens} "
            f"tokens, got {coarse.dtype} {list(coarse.shape)}: the directory is damaged, prepare "
            "the data again"
        )
    return coarse


def check_recorded_ranges(path: Path, meta: dict, vocab_size: int) -> bool:
    """meta.json's largest token id of each shard ("shard_max_token", written at prepare time)
    against the vocabulary; False when the directory records none (then each document is checked as
    read)."""
    largest = meta.get("shard_max_token")
    if largest is None:
        return False
    if (
        not isinstance(largest, list)
        or len(largest) != len(meta["shards"])
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in largest)
    ):
        raise DataError(
            f"{path}: shard_max_token must list one whole number per shard "
            f"({len(meta['shards'])}), got {largest!r:.60}; prepare the data again"
        )
    for name, value in zip(meta["shards"], largest):
        if value >= vocab_size:
            shard = path.parent / f"tokens_{name}.bin"
            raise DataError(
                f"{shard} holds token id {value}, outside the vocabulary of "
                f"{vocab_size} tokens: it was prepared with another tokenizer or is "
                f"damaged; prepare the data again"
            )
    return True


def check_token_range(file: Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Every id read from a shard must index the vocabulary: refused when read rather than failing
    (or, on a GPU, asserting) inside the model. `tokens` is the part of `file` about to be used."""
    largest = int(tokens.max()) if len(tokens) else 0
    if largest >= vocab_size:
        raise DataError(
            f"{file} holds token id {largest}, outside the vocabulary of {vocab_size} "
            f"tokens: it was prepared with another tokenizer or is damaged; prepare "
            f"the data again"
        )


# The split holds out whole groups of consecutive documents, at most SPLIT_GROUPS of them: one
# document a group up to 65,536 documents (the split of every smaller corpus is the one a
# permutation of its documents gives), 15,259 a group at 1B. A rank keeps the groups of its split
# (at most 512 KiB), never a list of documents, and finds member j in O(log groups).
SPLIT_GROUPS = 1 << 16


class Split:
    """Some of a corpus's documents [0, num_docs), as whole groups of `group_docs` consecutive
    documents (the last group may be shorter), in index order: member j is select(j, j + 1)."""

    def __init__(self, num_docs: int, group_docs: int, groups: np.ndarray):
        self.num_docs, self.group_docs = num_docs, group_docs
        self.groups = np.asarray(groups, dtype=np.int64)  # [g], sorted
        sizes = np.minimum(num_docs - self.groups * group_docs, group_docs)
        self.before = np.concatenate([[0], np.cumsum(sizes)])  # [g + 1]: members before each group

    @classmethod
    def whole(cls, num_docs: int) -> Split:
        """Every document of a corpus of num_docs (one group)."""
        return cls(num_docs, max(num_docs, 1), np.arange(1 if num_docs else 0))

    def __len__(self) -> int:
        return int(self.before[-1])

    def select(self, first: int, stop: int) -> np.ndarray:
        """Members first, ..., stop - 1 -> their document indices [stop - first], rising."""
        ranks = np.arange(first, stop, dtype=np.int64)
        group = np.searchsorted(self.before, ranks, side="right") - 1
        return self.groups[group] * self.group_docs + ranks - self.before[group]

    def indices(self) -> np.ndarray:
        """Every member's document index [len]: O(members), for what packs all of them at once."""
        return self.select(0, len(self))

    def tokens_before(self, shards: TokenShards, ranks: np.ndarray) -> np.ndarray:
        """Tokens of members [0, j) for each j of `ranks` [n] (0 <= j <= len) -> [n] int64: where
        member j starts in the corpus, less the tokens of the groups left out before it, or plus
        those of the member groups before it, whichever groups are fewer (the training split's:
        the few held out). Reads n + 2 * min(groups, others) entries of the index."""
        ranks = np.asarray(ranks, dtype=np.int64)
        group = np.minimum(
            np.searchsorted(self.before, ranks, side="right") - 1, len(self.groups) - 1
        )
        firsts = self.groups[group] * self.group_docs
        starts = shards.starts(firsts + ranks - self.before[group])  # the end of the last for len
        num_groups = math.ceil(self.num_docs / self.group_docs)
        if 2 * len(self.groups) <= num_groups:
            return self._prefix(shards, self.groups)[group] + starts - shards.starts(firsts)
        left_out = np.ones(num_groups, dtype=bool)
        left_out[self.groups] = False
        others = np.flatnonzero(left_out)
        return starts - self._prefix(shards, others)[np.searchsorted(others, self.groups[group])]

    def _prefix(self, shards: TokenShards, groups: np.ndarray) -> np.ndarray:
        """[g] groups -> the tokens of the groups before each, then of all [g + 1]."""
        firsts = groups * self.group_docs
        ends = np.minimum(firsts + self.group_docs, self.num_docs)
        return np.concatenate([[0], np.cumsum(shards.starts(ends) - shards.starts(firsts))])


def split_documents(num_docs: int, val_fraction: float, where: str) -> tuple[Split, Split]:
    """Hold out round(val_fraction * groups) whole groups of documents (at least one), chosen by a
    fixed seed; the groups are single documents up to SPLIT_GROUPS documents. -> (train, val)."""
    if val_fraction == 0:
        return Split.whole(num_docs), Split(num_docs, max(num_docs, 1), np.arange(0))
    group_docs = math.ceil(num_docs / SPLIT_GROUPS)
    if group_docs > COARSE_DOCS:  # whole blocks, so that the blocks' ends stay on the coarse grid
        group_docs = math.ceil(group_docs / COARSE_DOCS) * COARSE_DOCS
    num_groups = math.ceil(num_docs / group_docs)
    num_val = max(1, round(val_fraction * num_groups))
    if num_val >= num_groups:
        raise DataError(
            f"{where} has {num_docs} document(s): too few to hold out "
            f"{val_fraction:.0%} for "
            "validation and keep some for training; add documents or set "
            "data.val_fraction = 0"
        )
    order = np.random.default_rng(SPLIT_SEED).permutation(num_groups)
    return (
        Split(num_docs, group_docs, np.sort(order[num_val:])),
        Split(num_docs, group_docs, np.sort(order[:num_val])),
    )


# ============================================================================= the packed loader

# Documents per block of the shuffled order: an epoch permutes the blocks, then the documents within
# each block it reaches, so a rank holds one block's order, not the epoch's (O(rows read)). Packed
# whole (conversations), the blocks are of rows of the packing, shuffled the same way.
BLOCK_DOCS = COARSE_DOCS


class PackedLoader:
    """Fixed-length rows of packed documents for one data-parallel rank; deterministic and
    resumable.

    Rows are numbered globally: micro-batch m is rows [m*W*B, (m+1)*W*B) of the global row sequence
    and rank r takes the B rows starting at m*W*B + r*B, so the data order does not depend on the
    layout and a position saved by one world size is valid for another. Row g is row g % R of
    epoch g // R (R = rows_per_epoch). An epoch's document order is computed block-wise from
    (seed, stream, epoch): the blocks of `block_docs` consecutive members of the split are permuted,
    then the documents within each block, so no rank stores or recomputes a permutation of every
    document; a block's token count comes from the index at its two ends. What a rank keeps is
    O(documents / block_docs): each block's token count and an epoch's order of the blocks.
    The state is one integer, the next global row, so a restart resumes at the exact token.

    Shards with conversations (masked) are packed whole instead (chat.WholeRows: rows packed once, a
    document longer than seq_len truncated or dropped by `overlong`), and an epoch shuffles the rows
    block-wise the same way: blocks of `block_docs` rows of the packing, then the rows within each.
    A target is -100 where the loss mask says the token is not one.
    `stream` tells the sources of a mixture apart (MixedLoader): each shuffles its own way.
    """

    def __init__(
        self,
        shards: TokenShards,
        split: Split,
        seq_len: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        epochs: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        name: str = "train",
        overlong: str = "truncate",
        settings: dict[str, object] | None = None,
        stream: int = 0,
        block_docs: int = BLOCK_DOCS,
    ):
        if len(split) == 0:
            raise DataError(f"the {name} split has no documents")
        self.shards, self.split, self.seq_len, self.batch_size = shards, split, seq_len, batch_size
        self.seed, self.shuffle, self.epochs, self.name = seed, shuffle, epochs, name
        self.rank, self.world_size, self.stream = rank, world_size, stream
        # The run's STREAM_KEYS (train.py passes them all): a refused resume names the changed.
        self.settings = settings or {
            "data.seq_len": seq_len,
            "data.overlong": overlong,
            "training.seed": seed,
        }
        self.block_docs = block_docs
        self.whole = None
        if shards.masked:
            self._pack_whole(overlong)
        else:
            edges = np.append(np.arange(0, len(split), block_docs), len(split))  # [blocks + 1]
            self.block_sizes = np.diff(split.tokens_before(shards, edges))  # [blocks]: tokens
            self.num_tokens = int(self.block_sizes.sum())
            self.rows_per_epoch = math.ceil(self.num_tokens / seq_len)
        self.next_row = 0
        self._epoch_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._block_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _pack_whole(self, overlong: str) -> None:
        """Conversations: the split's documents packed into rows once (O(documents), as packing
        whole needs every length); the epochs' orders are block-wise, as the documents' are."""
        self.docs = self.split.indices()  # document i of the packing is self.docs[i]
        self.whole = WholeRows(
            self.shards.lengths(self.docs),
            self.seq_len,
            overlong,
            lambda i: bool(self.shards.loss_mask(self.docs[i])[1 : self.seq_len].any()),
        )
        if self.whole.num_tokens == 0:
            raise DataError(
                f"the {self.name} split keeps no document: all {len(self.docs)} are "
                "longer than "
                f"data.seq_len = {self.seq_len} and data.overlong = {overlong!r}"
            )
        self.num_tokens, self.rows_per_epoch = self.whole.num_tokens, self.whole.num_rows
        rows = self.rows_per_epoch
        self.block_sizes = np.diff(np.append(np.arange(0, rows, self.block_docs), rows))  # rows

    def describe(self) -> str:
        """The split in a few words, for the run's log."""
        rows = (
            f"{self.name} {self.num_tokens:,} tokens ({self.rows_per_epoch} rows of {self.seq_len})"
        )
        return rows if self.whole is None else f"{rows}: {self.whole.report()}"

    def rows_available(self) -> int | None:
        return None if self.epochs is None else self.epochs * self.rows_per_epoch

    def rewind(self) -> None:
        """Back to the first row (evaluation reads the same validation rows each time)."""
        self.next_row = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        """-> input_ids, targets, doc_ids: int64 [B, T]; doc_ids -1 and targets -100 on padding."""
        global_rows = self.world_size * self.batch_size
        available = self.rows_available()
        if available is not None and self.next_row + global_rows > available:
            raise DataError(
                f"ran out of data: the {self.name} split has {self.rows_per_epoch} rows "
                "of "
                f"{self.seq_len} tokens per epoch and data.epochs = {self.epochs} "
                "allows "
                f"{available} rows; raise data.epochs, add data, or train fewer steps"
            )
        batch = self.peek()
        self.next_row += global_rows
        return batch

    def peek(self) -> dict[str, torch.Tensor]:
        """This rank's batch at the current position, without moving on."""
        first = self.next_row + self.rank * self.batch_size
        return stack_rows([self.row(g) for g in range(first, first + self.batch_size)])

    def row(self, g: int) -> dict[str, np.ndarray]:
        """Global row g: tokens at stream positions [s, s + T] of its epoch (s = (g % R) * T); the
        extra token only serves as the last target. Packed whole: the packing's row that the
        epoch's block-wise order puts at g % R."""
        epoch, start = divmod(g, self.rows_per_epoch)
        if self.whole is not None:  # document i of the row is self.docs[i]
            tokens, docs, mask = self.whole.fill(
                self._packed_row(epoch, start),
                lambda i: self.shards.document(self.docs[i]),
                lambda i: self.shards.loss_mask(self.docs[i]),
            )
            return row_arrays(tokens, np.where(docs >= 0, self.docs[np.maximum(docs, 0)], -1), mask)
        stop = start * self.seq_len + self.seq_len + 1
        tokens = np.zeros(self.seq_len + 1, dtype=np.int64)
        docs = np.full(self.seq_len + 1, -1, dtype=np.int64)
        position = start * self.seq_len
        _, block_ends = self._blocks(epoch)
        slot = int(np.searchsorted(block_ends, position, side="right"))  # the block of `position`
        order, bounds = self._block(epoch, slot)
        # first document ending after `position`
        k = int(np.searchsorted(bounds[1:], position, side="right"))
        while position < stop:
            if k == len(order):  # the row goes on in the next block, or the epoch ends (padding)
                slot, k = slot + 1, 0
                if slot == len(block_ends):
                    break
                order, bounds = self._block(epoch, slot)
                continue  # a block of the validation split may hold no document
            doc = int(order[k])
            take = slice(position - bounds[k], min(bounds[k + 1], stop) - bounds[k])
            n = take.stop - take.start
            offset = position - start * self.seq_len
            tokens[offset : offset + n] = self.shards.document(doc, take)
            docs[offset : offset + n] = doc
            position, k = position + n, k + 1
        return row_arrays(tokens, docs, None)

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.stream, *key])

    def _blocks(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block order [blocks], cumulative end of each in the epoch's stream [blocks]: tokens, or
        rows packed whole), two epochs cached: O(documents / block_docs) each."""
        if epoch not in self._epoch_cache:
            count = len(self.block_sizes)
            order = self._rng(epoch, 0).permutation(count) if self.shuffle else np.arange(count)
            self._epoch_cache = {e: v for e, v in self._epoch_cache.items() if e == epoch - 1}
            self._epoch_cache[epoch] = (order, np.cumsum(self.block_sizes[order]))
        return self._epoch_cache[epoch]

    def _block(self, epoch: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The members of the epoch's `slot`-th block in their order [n] (documents, or rows packed
        whole), and where each starts in the epoch's stream, then where the last ends [n + 1]; the
        last few blocks read are cached."""
        if (epoch, slot) not in self._block_cache:
            order, block_ends = self._blocks(epoch)
            block = int(order[slot])
            first = block * self.block_docs
            whole = self.whole is not None
            stop = min(first + self.block_docs, self.rows_per_epoch if whole else len(self.split))
            members = np.arange(first, stop) if whole else self.split.select(first, stop)
            if self.shuffle:
                members = members[self._rng(epoch, 1, block).permutation(len(members))]
            sizes = np.ones(len(members), np.int64) if whole else self.shards.lengths(members)
            start = block_ends[slot] - self.block_sizes[block]
            if len(self._block_cache) >= 4:
                self._block_cache.pop(next(iter(self._block_cache)))
            self._block_cache[epoch, slot] = (members, start + np.cumsum(np.append(0, sizes)))
        return self._block_cache[epoch, slot]

    def _packed_row(self, epoch: int, position: int) -> int:
        """Packed whole: the row of the packing at `position` of the epoch's order."""
        _, block_ends = self._blocks(epoch)
        slot = int(np.searchsorted(block_ends, position, side="right"))
        members, starts = self._block(epoch, slot)
        return int(members[position - starts[0]])

    def state_dict(self) -> dict[str, int]:
        return {
            "next_row": self.next_row,
            "rows_per_epoch": self.rows_per_epoch,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, int], checkpoint: Path | None = None) -> None:
        """The saved position, refused when this run's rows are not the saved run's; the refusal
        names each setting that changed since `checkpoint` (its train_config.json)."""
        saved = (int(state["rows_per_epoch"]), int(state["seq_len"]))
        if saved != (self.rows_per_epoch, self.seq_len):
            raise DataError(
                f"the checkpoint's {self.name} data position was saved for {saved[0]} "
                "rows of "
                f"{saved[1]} tokens per epoch, but this run has {self.rows_per_epoch} "
                "rows of "
                f"{self.seq_len}: {self.what_changed(saved[1], checkpoint)}; resume "
                f"with the checkpoint's data settings, or start from its weights in a "
                f"fresh run"
            )
        self.next_row = int(state["next_row"])

    def what_changed(self, saved_seq_len: int, checkpoint: Path | None) -> str:
        saved = {"data.seq_len": saved_seq_len, **saved_stream_settings(checkpoint)}
        changed = changed_settings(saved, self.settings)
        if changed:
            return f"changed since the checkpoint: {', '.join(changed)}"
        if len(saved) == 1:  # no train_config.json to compare
            return (
                "the data or a data setting changed since the checkpoint (it records only "
                "data.seq_len)"
            )
        return "the data's files changed since the checkpoint; its settings did not"


def stack_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Rows of equal length -> one batch, [len(rows), T] per key."""
    return {key: torch.from_numpy(np.stack([row[key] for row in rows])) for key in rows[0]}


GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio: splitmix64's step


def splitmix64(values: np.ndarray) -> np.ndarray:
    """A bijective 64-bit hash (Steele et al.'s splitmix64 finalizer), elementwise on uint64."""
    z = values.astype(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_sources(seed: int, rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The source of each global row: a uniform draw hashed from (seed, row), so the schedule is
    computed from the row index and never stored; source s is drawn with probability
    weights[s] / sum(weights). [rows] int -> [rows] int."""
    key = splitmix64(np.array([seed % 2**64], dtype=np.uint64))
    counter = key + (rows.astype(np.uint64) + np.uint64(1)) * np.uint64(GOLDEN)  # wraps mod 2**64
    uniform = (splitmix64(counter) >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    bounds = np.cumsum(weights) / np.sum(weights)
    bounds[-1] = 1.0  # rounding must not leave a draw past the last source
    return np.searchsorted(bounds, uniform, side="right")


class MixedLoader:
    """A weighted mixture of PackedLoaders (one per source, sharing seq_len, batch size and layout).

    Global row g comes from the source that row_sources draws for (seed, g); a source's rows are
    its own loader's rows 0, 1, 2, ... in the order the mixture draws them. The state is the next
    global row and how many rows each source has given (S + 1 integers), so the rows are those of
    any other layout, as PackedLoader's are: each rank draws the whole global batch's sources and
    takes its own B rows. A source read data.epochs times stops the run (exhausted "stop") or goes
    on with a new epoch, shuffled from the seed (exhausted "repeat").
    """

    def __init__(
        self,
        sources: list[PackedLoader],
        names: list[str],
        weights: list[float],
        seed: int,
        exhausted: str = "stop",
        name: str = "train",
    ):
        first = sources[0]
        self.sources, self.names, self.seed, self.exhausted = sources, names, seed, exhausted
        self.weights = np.asarray(weights, dtype=np.float64)
        self.seq_len, self.batch_size, self.name = first.seq_len, first.batch_size, name
        self.rank, self.world_size = first.rank, first.world_size
        self.num_tokens = sum(source.num_tokens for source in sources)
        self.rows_per_epoch = sum(source.rows_per_epoch for source in sources)
        self.next_row = 0
        self.positions = [0] * len(sources)

    def describe(self) -> str:
        share = self.weights / self.weights.sum()
        parts = [
            f"{n} ({100 * w:.1f} %): {s.describe()}"
            for n, w, s in zip(self.names, share, self.sources)
        ]
        return f"{self.name} mixture of {len(parts)} sources, {'; '.join(parts)}"

    def rows_available(self) -> None:
        return None  # the draws decide when a source runs out: next_batch says so at that step

    def tokens_drawn(self) -> dict[str, int]:
        """Tokens (rows * seq_len) each source has given the run so far, over every rank."""
        return {n: p * self.seq_len for n, p in zip(self.names, self.positions)}

    def rewind(self) -> None:
        self.next_row, self.positions = 0, [0] * len(self.sources)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """-> input_ids, targets, doc_ids: int64 [B, T], as PackedLoader's."""
        drawn, _ = self._plan()
        batch = self.peek()
        self.positions = [p + int((drawn == s).sum()) for s, p in enumerate(self.positions)]
        self.next_row += self.world_size * self.batch_size
        return batch

    def peek(self) -> dict[str, torch.Tensor]:
        drawn, positions = self._plan()
        self._check_exhausted(drawn, positions)
        mine = range(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return stack_rows([self.sources[drawn[i]].row(int(positions[i])) for i in mine])

    def _plan(self) -> tuple[np.ndarray, np.ndarray]:
        """The global batch's source of each row and the row's index within that source, [W * B]."""
        rows = np.arange(self.next_row, self.next_row + self.world_size * self.batch_size)
        drawn = row_sources(self.seed, rows, self.weights)
        positions = np.empty(len(rows), dtype=np.int64)
        for s, start in enumerate(self.positions):
            mask = drawn == s
            positions[mask] = start + np.arange(int(mask.sum()))
        return drawn, positions

    def _check_exhausted(self, drawn: np.ndarray, positions: np.ndarray) -> None:
        if self.exhausted == "repeat":
            return
        for s, source in enumerate(self.sources):
            available = source.rows_available()
            late = positions[(drawn == s) & (positions >= (available or math.inf))]
            if len(late):
                batch = self.next_row // (self.world_size * self.batch_size)
                raise DataError(
                    f"source {self.names[s]} ran out of data at micro-batch {batch}: "
                    f"its {source.rows_per_epoch} rows of {self.seq_len} tokens per "
                    f"epoch were all drawn data.epochs = {source.epochs} time(s) and "
                    f'data.exhausted = "stop"; set data.exhausted = "repeat", raise '
                    f"data.epochs, add data, or train fewer steps"
                )

    def state_dict(self) -> dict[str, int]:
        """Whole numbers under flat keys, as checkpoint.py stores a loader's state: the next global
        row, and each source's position and rows per epoch (source_S_position, source_S_rows)."""
        state = {"next_row": self.next_row, "seq_len": self.seq_len}
        for s, (source, position) in enumerate(zip(self.sources, self.positions)):
            state |= {f"source_{s}_position": position, f"source_{s}_rows": source.rows_per_epoch}
        return state

    def load_state_dict(self, state: dict[str, int], checkpoint: Path | None = None) -> None:
        """The saved position, refused when a source's rows are not the saved run's."""
        count = sum(key.endswith("_rows") for key in state)
        saved = [int(state[f"source_{s}_rows"]) for s in range(count)]
        ours = [s.rows_per_epoch for s in self.sources]
        if saved != ours or int(state["seq_len"]) != self.seq_len:
            changed = self.sources[0].what_changed(int(state["seq_len"]), checkpoint)
            raise DataError(
                f"the checkpoint's {self.name} data position was saved for sources of "
                f"{saved} rows of {int(state['seq_len'])} tokens per epoch, but this "
                f"run's have {ours} rows of {self.seq_len}: {changed}; resume with the "
                f"checkpoint's data settings, or start from its weights in a fresh run"
            )
        self.next_row = int(state["next_row"])
        self.positions = [int(state[f"source_{s}_position"]) for s in range(count)]


def check_saved_sources(
    saved_keys: Iterable[str], data: PackedLoader | MixedLoader, checkpoint: Path
) -> str | None:
    """A checkpoint's data position (its "train.data.*" entries) must be that of this run's
    sources: one source (data.path) or a mixture of as many as [data] sources lists now. Checked
    before the position is loaded, so that another number of sources is one line naming
    data.sources rather than a key missing inside torch.distributed.checkpoint. The same number
    with other weights (or paths) resumes: each source goes on from its saved position and the rows
    from here on are drawn with this run's weights, as deterministic as any other position. ->
    what the resume changed, for its line (None: nothing)."""
    saved = {key.removeprefix("train.data.") for key in saved_keys if key.startswith("train.data.")}
    then = saved_stream_settings(checkpoint)
    now = (data.sources[0] if isinstance(data, MixedLoader) else data).settings
    changed = [
        f"{key} {then.get(key)!r} -> {now.get(key)!r}"
        for key in ("data.path", "data.sources")
        if key in then and key in now and then.get(key) != now.get(key)
    ]
    if not saved or saved == set(data.state_dict()):
        return (
            f"{'; '.join(changed)}: each source goes on from its position, the rows from here on "
            "drawn with these weights"
            if changed and isinstance(data, MixedLoader)
            else None
        )
    raise DataError(
        f"{checkpoint} saved the data position of {sources_read(saved)}, but this run reads "
        f"{sources_read(set(data.state_dict()))}"
        + (f" ({'; '.join(changed)})" if changed else "")
        + ": a resume continues the checkpoint's [data] sources (the same list, in the same "
        "order); resume with them, or start a fresh run from its weights (model.init_from)"
    )


def sources_read(keys: set[str]) -> str:
    """A loader's state keys -> "one source (data.path)" or "a mixture of 3 [data] sources"."""
    count = sum(key.endswith("_rows") and key.startswith("source_") for key in keys)
    return f"a mixture of {count} [data] sources" if count else "one source (data.path)"


def stream_settings(config: dict) -> dict[str, object]:
    """A run's STREAM_KEYS -> values, from its configuration as a dict (TrainConfig.to_dict(), or a
    checkpoint's train_config.json); keys the dict lacks are left out."""
    settings = {}
    for key in STREAM_KEYS:
        section, name = key.split(".")
        if isinstance(config.get(section), dict) and name in config[section]:
            settings[key] = config[section][name]
    return settings


def changed_settings(saved: dict[str, object], now: dict[str, object]) -> list[str]:
    """ "data.overlong 'truncate' -> 'drop'" for each key whose value differs between the two."""
    return [
        f"{key} {saved[key]!r} -> {now[key]!r}"
        for key in now
        if key in saved and saved[key] != now[key]
    ]


def saved_stream_settings(checkpoint: Path | None) -> dict[str, object]:
    """The stream settings of the run that wrote `checkpoint` (its train_config.json), or {}."""
    if checkpoint is None:
        return {}
    try:
        return stream_settings(read_json_object(checkpoint / "train_config.json"))
    except ValueError:  # a checkpoint written without a readable one: nothing to compare
        return {}


def row_arrays(
    tokens: np.ndarray, docs: np.ndarray, mask: np.ndarray | None
) -> dict[str, np.ndarray]:
    """[T + 1] tokens, document ids (-1: padding) and loss mask (None: every token) -> a row's
    input_ids, targets (the next token of the same document where the mask allows it, else -100) and
    doc_ids, [T] each."""
    targeted = (docs[1:] == docs[:-1]) & (docs[:-1] >= 0)
    if mask is not None:
        targeted &= mask[1:]
    return {
        "input_ids": tokens[:-1],
        "targets": np.where(targeted, tokens[1:], -100),
        "doc_ids": docs[:-1],
    }
