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
shuffles the rows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from chat import WholeRows, one_line, template_of
from files import read_json_object
from tokenizer import Tokenizer

# The Python Language Reference topics that CPython ships as pydoc_data/topics.py (see
# data/README.md).
EMBEDDED_CORPUS = Path(__file__).resolve().parent / "data" / "python_reference.jsonl"
SHARDS_FORMAT = "flint-token-shards-v1"
# v1 plus a loss mask per shard (mask_NNNNN.bin, uint8 per token)
MASKED_FORMAT = "flint-token-shards-v2"
# meta.json's "format_version" (absent: 1). Version 2 adds each shard's largest token id and the
# sha256 of its tokens file ("shard_max_token", "shard_sha256"), checked once at prepare time.
FORMAT_VERSION = 2
OVERLONG = ("truncate", "drop")  # data.overlong: what a conversation longer than seq_len becomes
SPLIT_SEED = 1234  # fixed, so the validation documents do not change with the training seed
# The settings that decide which rows a run reads (with the data's files): a resume continues the
# checkpoint's row position, which means the same rows only while none of them changed.
STREAM_KEYS = (
    "data.path",
    "data.tokenizer",
    "data.eos_token",
    "data.text_key",
    "data.seq_len",
    "data.val_fraction",
    "data.overlong",
    "training.seed",
)


class DataError(ValueError):
    """Bad or missing data: the message names the path and what was expected."""


# ============================================================================= reading shards


class TokenShards:
    """Prepared shards as one list of documents: document(i) is a memmap view, no copy; with
    conversations (`masked`), loss_mask(i) is its mask the same way."""

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
        self.tokens, self.masks, shard_of, starts, ends = [], [], [], [], []
        for index, name in enumerate(self.meta["shards"]):
            tokens, bounds = read_shard(directory, name, self.meta["dtype"])
            self.tokens.append(tokens)
            if self.masked:
                self.masks.append(read_mask(directory / f"mask_{name}.bin", len(tokens)))
            shard_of.append(np.full(len(bounds) - 1, index, dtype=np.int32))
            starts.append(bounds[:-1])
            ends.append(bounds[1:])
            check_token_range(
                directory / f"tokens_{name}.bin",
                tokens,
                tokenizer.vocab_size if tokenizer else int(self.meta["vocab_size"]),
            )
        self.doc_shard, self.doc_start = np.concatenate(shard_of), np.concatenate(starts)
        self.doc_len = np.concatenate(ends) - self.doc_start
        self.vocab_size = int(self.meta["vocab_size"])

    @property
    def num_docs(self) -> int:
        return len(self.doc_start)

    def document(self, i: int) -> np.ndarray:
        start = self.doc_start[i]
        return self.tokens[self.doc_shard[i]][start : start + self.doc_len[i]]

    def loss_mask(self, i: int) -> np.ndarray:
        """uint8 [doc_len[i]]: 1 where the token is a target (the assistant's); masked shards
        only."""
        start = self.doc_start[i]
        return self.masks[self.doc_shard[i]][start : start + self.doc_len[i]]


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
            f"prepare the data again"
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
        bounds = np.load(docs_file)
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
    if bounds[0] != 0 or not (np.diff(bounds) > 0).all():  # a document holds its end-of-text
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


def check_token_range(file: Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Every id of a shard must index the vocabulary: refused at load rather than failing (or, on
    a GPU, asserting) in the middle of a run. One pass over the shard, in chunks."""
    for start in range(0, len(tokens), 1 << 26):
        largest = int(tokens[start : start + (1 << 26)].max())
        if largest >= vocab_size:
            raise DataError(
                f"{file} holds token id {largest}, outside the vocabulary of "
                f"{vocab_size} tokens: it was "
                f"prepared with another tokenizer or is damaged; prepare the data again"
            )


def split_documents(
    num_docs: int, val_fraction: float, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """Hold out round(val_fraction * docs) whole documents (at least one), chosen by a fixed
    seed."""
    if val_fraction == 0:
        return np.arange(num_docs), np.arange(0)
    num_val = max(1, round(val_fraction * num_docs))
    if num_val >= num_docs:
        raise DataError(
            f"{where} has {num_docs} document(s): too few to hold out "
            f"{val_fraction:.0%} for "
            "validation and keep some for training; add documents or set "
            "data.val_fraction = 0"
        )
    order = np.random.default_rng(SPLIT_SEED).permutation(num_docs)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


# ============================================================================= the packed loader


class PackedLoader:
    """Fixed-length rows of packed documents for one data-parallel rank; deterministic and
    resumable.

    Rows are numbered globally: micro-batch m is rows [m*W*B, (m+1)*W*B) of the global row sequence
    and rank r takes the B rows starting at m*W*B + r*B, so the data order does not depend on the
    layout and a position saved by one world size is valid for another. Row g is row g % R of
    epoch g // R (R = rows_per_epoch); an epoch shuffles the document order with (seed, epoch).
    The state is one integer, the next global row, so a restart resumes at the exact token.

    Shards with conversations (masked) are packed whole instead (chat.WholeRows: rows packed once, a
    document longer than seq_len truncated or dropped by `overlong`), and an epoch shuffles the rows
    with (seed, epoch); a target is -100 where the loss mask says the token is not one.
    """

    def __init__(
        self,
        shards: TokenShards,
        doc_indices: np.ndarray,
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
    ):
        if len(doc_indices) == 0:
            raise DataError(f"the {name} split has no documents")
        self.shards, self.docs, self.seq_len, self.batch_size = (
            shards,
            doc_indices,
            seq_len,
            batch_size,
        )
        self.seed, self.shuffle, self.epochs, self.name = seed, shuffle, epochs, name
        self.rank, self.world_size = rank, world_size
        # The run's STREAM_KEYS (train.py passes them all): a refused resume names the changed.
        self.settings = settings or {
            "data.seq_len": seq_len,
            "data.overlong": overlong,
            "training.seed": seed,
        }
        self.num_tokens = int(shards.doc_len[doc_indices].sum())
        self.rows_per_epoch = math.ceil(self.num_tokens / seq_len)
        self.whole = None
        if shards.masked:
            self.whole = WholeRows(
                shards.doc_len[doc_indices],
                seq_len,
                overlong,
                lambda i: bool(shards.loss_mask(doc_indices[i])[1:seq_len].any()),
            )
            if self.whole.num_tokens == 0:
                raise DataError(
                    f"the {name} split keeps no document: all {len(doc_indices)} are "
                    "longer than "
                    f"data.seq_len = {seq_len} and data.overlong = {overlong!r}"
                )
            self.num_tokens, self.rows_per_epoch = self.whole.num_tokens, self.whole.num_rows
        self.next_row = 0
        self._epoch_cache: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

    def describe(self) -> str:
        """The split in a few words, for the run's log."""
        rows = (
            f"{self.name} {self.num_tokens:,} tokens ({self.rows_per_epoch} rows of {self.seq_len})"
        )
        return rows if self.whole is None else f"{rows}: {self.whole.report()}"

    def rows_available(self) -> int | None:
        return None if self.epochs is None else self.epochs * self.rows_per_epoch

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
        rows = [self.row(g) for g in range(first, first + self.batch_size)]
        return {key: torch.from_numpy(np.stack([row[key] for row in rows])) for key in rows[0]}

    def row(self, g: int) -> dict[str, np.ndarray]:
        """Global row g: tokens at stream positions [s, s + T] of its epoch (s = (g % R) * T); the
        extra token only serves as the last target. Packed whole: row order[g % R] of the
        packing."""
        epoch, start = divmod(g, self.rows_per_epoch)
        order, ends = self._epoch(epoch)
        if self.whole is not None:  # document i of the row is self.docs[i]
            tokens, docs, mask = self.whole.fill(
                int(order[start]),
                lambda i: self.shards.document(self.docs[i]),
                lambda i: self.shards.loss_mask(self.docs[i]),
            )
            return row_arrays(tokens, np.where(docs >= 0, self.docs[np.maximum(docs, 0)], -1), mask)
        stop = start * self.seq_len + self.seq_len + 1
        tokens = np.zeros(self.seq_len + 1, dtype=np.int64)
        docs = np.full(self.seq_len + 1, -1, dtype=np.int64)
        position = start * self.seq_len
        # first document ending after `position`
        k = int(np.searchsorted(ends, position, side="right"))
        while position < stop and k < len(order):
            doc = int(order[k])
            doc_start = ends[k] - self.shards.doc_len[doc]
            take = slice(position - doc_start, min(ends[k], stop) - doc_start)
            n = take.stop - take.start
            offset = position - start * self.seq_len
            tokens[offset : offset + n] = self.shards.document(doc)[take]
            docs[offset : offset + n] = doc
            position, k = position + n, k + 1
        return row_arrays(tokens, docs, None)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(document order [D], cumulative end of each in the epoch's stream [D]), two epochs
        cached; packed whole: (row order [R], None)."""
        if epoch not in self._epoch_cache:
            items = self.docs if self.whole is None else np.arange(self.rows_per_epoch)
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(items)
                if self.shuffle
                else items
            )
            self._epoch_cache = {e: v for e, v in self._epoch_cache.items() if e == epoch - 1}
            self._epoch_cache[epoch] = (
                order,
                np.cumsum(self.shards.doc_len[order]) if self.whole is None else None,
            )
        return self._epoch_cache[epoch]

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
