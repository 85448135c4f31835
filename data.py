"""Data for train.py: the prepare step and the packed, resumable loader (tokenizers: tokenizer.py).

    text files, directories, JSONL  --prepare-->  token shards (numpy memmaps + document index)
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
shuffles the rows.

Command line: `python data.py prepare INPUT... --out DIR [--tokenizer byte] [--extensions
txt,md,jsonl] [--seq-len N --overlong truncate|drop]` (the last two only report what a run would
fit); a bad flag or input stops with one line naming it."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from chat import (
    ChatEncoder,
    ChatError,
    Conversation,
    Pair,
    WholeRows,
    chat_summary,
    one_line,
    read_example,
    template_of,
)
from files import read_json_object, remove_stale_temporaries, sync_rename
from flags import OneLineParser
from tokenizer import END_OF_TEXT, Tokenizer, TokenizerError, load_tokenizer

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


class DataError(ValueError):
    """Bad or missing data: the message names the path and what was expected."""


# ============================================================================= reading text

# Files read from a directory: text-like suffixes (any file named explicitly is read whatever its
# suffix). Suffixes are compared in lower case: chats.JSONL is a JSONL file.
TEXT_SUFFIXES = (
    ".txt",
    ".text",
    ".md",
    ".markdown",
    ".rst",
    ".tex",
    ".html",
    ".htm",
    ".xml",
    ".csv",
    ".tsv",
    ".json",
    ".jsonl",
    ".ndjson",
    ".jsonlines",
    ".py",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".java",
    ".js",
    ".ts",
    ".go",
    ".rs",
    ".rb",
    ".sh",
    ".toml",
    ".yaml",
    ".yml",
    ".ini",
    ".cfg",
    ".sql",
    ".css",
)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")  # one record per line
# How files become documents; in the cache key, so data cached under other rules is prepared again.
READING_RULES = "records-v2: JSONL suffixes in any case, .json lists of records"


def source_files(
    paths: Path | list[Path],
    suffixes: tuple[str, ...] | None = TEXT_SUFFIXES,
    setting: str = "data.path",
) -> tuple[list[Path], int]:
    """Named files, and every non-hidden file with one of `suffixes` (None: any) under named
    directories, in sorted order -> (files, how many other files the directories held). `setting`
    names where the paths were given (data.path, or data.py's INPUT) in errors."""
    files, ignored = [], 0
    for path in [paths] if isinstance(paths, Path) else paths:
        if path.is_symlink() and not path.exists():
            raise DataError(
                f"{setting} {path} is a symbolic link that leads nowhere (a loop, or "
                f"its target {os.readlink(path)} is missing)"
            )
        if not path.exists():
            raise DataError(
                f"{setting} {path} does not exist (relative paths start at {Path.cwd()})"
            )
        if path.is_file():
            files.append(path)
            continue
        if not path.is_dir():
            raise DataError(
                f"{setting} {path} is neither a file nor a directory (a device such as "
                f"/dev/null, a pipe or a socket); name text or JSONL files, a "
                f"directory of them, or prepared shards"
            )
        found = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        chosen = [p for p in found if suffixes is None or p.suffix.lower() in suffixes]
        if not chosen:
            raise DataError(
                f"{setting} {path} holds no text or JSONL files"
                + (
                    f" ({len(found)} file(s) with other extensions; read them with --extensions "
                    "all)"
                    if found
                    else " (an empty directory)"
                )
            )
        files += chosen
        ignored += len(found) - len(chosen)
    named: dict[Path, Path] = {}
    for file in files:
        first = named.setdefault(file.resolve(), file)
        if first is not file:
            raise DataError(
                f"{setting} names {file} twice (also as {first}): its documents would be read twice"
            )
    return files, ignored


def path_names(paths: Path | list[Path]) -> str:
    """Paths as a user wrote them, for messages: "a.txt, corpus/" rather than a list's repr."""
    return ", ".join(map(str, [paths] if isinstance(paths, Path) else paths))


def iter_documents(
    files: list[Path], text_key: str, binary: list[Path]
) -> Iterator[str | Conversation | Pair]:
    """A JSONL file (JSONL_SUFFIXES, any case) holds one record per line; a .json file holding a
    list of records (or one record) is read the same way when they are conversations, pairs or
    objects with field `text_key`. A record is a conversation ("messages"), a prompt/completion pair
    (chat.read_example), or text in field `text_key`; any other file is one document, and one that
    holds JSON lines of conversations is refused rather than trained on as text. Binary files (a
    NUL byte, or not UTF-8) are appended to `binary` and skipped."""
    for path in files:
        if path.suffix.lower() in JSONL_SUFFIXES:
            yield from _jsonl_records(path, text_key)
            continue
        text = _read_text(path)
        if text is None:
            binary.append(path)
            continue
        records = _json_records(text, path, text_key) if path.suffix.lower() == ".json" else None
        if records is not None:
            yield from (_record(value, where, text_key) for value, where in records)
            continue
        _refuse_hidden_conversations(text, path)
        yield text


def _jsonl_records(path: Path, text_key: str) -> Iterator[str | Conversation | Pair]:
    try:
        with open(path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    record = _json_line(line, path, number, text_key)
                    yield _record(record, f"{path}:{number}", text_key)
    except OSError as error:
        raise DataError(f"{path}: cannot read ({error.strerror or error})") from None


def _json_line(line: bytes, path: Path, number: int, text_key: str) -> object:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path}:{number}: not UTF-8 text ({error.reason} at byte {error.start} of the line)"
        ) from None
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{number}: {expected_record(text_key)}: {error!r}") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise DataError(
            f"{path}:{number}: expected a JSON object with a string field {text_key!r} "
            f"(data.text_key): the line nests arrays or objects too deeply to read"
        ) from None


def expected_record(text_key: str) -> str:
    return (
        f"expected a JSON object with a string field {text_key!r} (data.text_key), 'messages' "
        f"(a conversation), or 'prompt' and 'completion'"
    )


def _record(record: object, where: str, text_key: str) -> str | Conversation | Pair:
    """A JSON record (a JSONL line, an element of a .json list) as a conversation, pair or text."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: {expected_record(text_key)}, got a {type(record).__name__}")
    try:
        example = read_example(record, where)
    except ChatError as error:
        raise DataError(str(error)) from None
    if example is not None:
        return example
    if text_key not in record:
        fields = ", ".join(map(repr, list(record)[:6])) or "no fields"
        raise DataError(f"{where}: {expected_record(text_key)}; it has {fields}")
    if not isinstance(record[text_key], str):
        raise DataError(
            f"{where}: field {text_key!r} must be a string, got {type(record[text_key]).__name__}"
        )
    return record[text_key]


def _is_example(value: object) -> bool:
    """Whether a JSON value is written as a conversation or a prompt/completion pair."""
    pair = isinstance(value, dict) and "prompt" in value and "completion" in value
    return isinstance(value, dict) and ("messages" in value or pair)


def _json_records(text: str, path: Path, text_key: str) -> list[tuple[object, str]] | None:
    """A .json file's records with where each is, when the file holds a list of conversations, pairs
    or text records (or one conversation or pair); None for a text document (package.json)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if _is_example(value):
        return [(value, str(path))]
    if not isinstance(value, list) or not value:
        return None
    texts = all(isinstance(v, dict) and isinstance(v.get(text_key), str) for v in value)
    if not texts and not any(_is_example(v) for v in value):
        return None
    return [(record, f"{path}: record {n + 1} of the list") for n, record in enumerate(value)]


def _refuse_hidden_conversations(text: str, path: Path) -> None:
    """A file read as one text document whose first line is a conversation or a pair in JSON: JSON
    lines under another suffix, which would train as text with every token a target."""
    start = len(text) - len(text.lstrip())
    end = text.find("\n", start)
    first = text[start : end if end >= 0 else len(text)]
    try:
        record = json.loads(first) if first.startswith("{") else None
    except (json.JSONDecodeError, RecursionError):
        return
    if _is_example(record):
        kind = "a conversation ('messages')" if "messages" in record else "a prompt/completion pair"
        read_as = (
            "must hold one JSON value (a list of records)"
            if path.suffix.lower() == ".json"
            else "is read as one text document"
        )
        raise DataError(
            f"{path}: its first line is {kind} in JSON, but a "
            f"{path.suffix or 'suffix-less'} file {read_as}; name it .jsonl to train "
            f"on its lines as records"
        )


def _read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read ({error.strerror or error})") from None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# ========================================================================== prepare: text -> shards


def prepare(
    source: Path | list[Path],
    tokenizer: Tokenizer,
    out_dir: Path,
    text_key: str = "text",
    shard_tokens: int = 1 << 28,
    suffixes: tuple[str, ...] | None = TEXT_SUFFIXES,
    setting: str = "data.path",
) -> Path:
    """Tokenize every document of `source` (paths: see `source_files`) into `out_dir`, atomically
    (temp dir, then rename). Binary files are skipped; meta.json lists them.

    out_dir/tokens_00000.bin   token ids (uint16, or uint32 for vocabularies over 65536), documents
                               back to back, each ending with the eos token
    out_dir/docs_00000.npy int64 [docs + 1]: where each document of that shard starts, then the end
    out_dir/mask_00000.bin with conversations or pairs only: uint8 per token, 1 where it is a target
    out_dir/meta.json written last: format, tokenizer fingerprint, counts, shard names"""
    files, ignored = source_files(source, suffixes, setting)
    missing = tokenizer.missing_bytes()
    if missing:  # tiktoken panics on text with a byte that has no token
        raise DataError(
            f"{setting} {path_names(source)}: the tokenizer has no token for byte "
            f"0x{missing[0]:02x} ({len(missing)} bytes lack one); preparing data "
            f"needs a tokenizer that writes every byte"
        )
    binary: list[Path] = []
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir.parent, f"{out_dir.name}.tmp-")  # left by a killed preparation
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own, from an earlier failed attempt
    tmp.mkdir()
    try:
        writer = ShardWriter(
            tmp, np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32, shard_tokens
        )
        batch: list[str] = []
        chat = ChatEncoder(tokenizer)
        for text in iter_documents(files, text_key, binary):
            # a conversation or a pair, in its place among the documents
            if not isinstance(text, str):
                writer.add(tokenizer.encode_documents(batch))
                batch = []
                writer.add(*encoded(chat, text))
            # tokens of a long document stream to the shard
            elif len(text) > PIECE_CHARS and text.strip():
                writer.add_pieces(encode_in_pieces(text, tokenizer))
            elif text.strip():
                batch.append(text)
            if len(batch) == 256:
                writer.add(tokenizer.encode_documents(batch))
                batch = []
        writer.add(tokenizer.encode_documents(batch))
        if writer.num_docs == 0:
            raise DataError(
                f"{setting} {path_names(source)}: no documents with text in "
                f"{len(files)} file(s)"
                + (
                    f"; {len(binary)} binary file(s) skipped: {', '.join(map(str, binary[:3]))}"
                    if binary
                    else ""
                )
            )
        chat_meta = (
            {
                "chat_template": chat.template.origin,
                "chat_template_digest": chat.template.digest,
                **chat.counts,
            }
            if writer.masked
            else {}
        )
        writer.finish(
            {
                "tokenizer": tokenizer.fingerprint,
                "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id,
                "sources": [str(f) for f in files if f not in binary],
                "skipped_binary": [str(f) for f in binary],
                "skipped_by_extension": ignored,
                **chat_meta,
            }
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        raise
    if out_dir.exists():  # another process prepared the same data meanwhile: keep theirs
        shutil.rmtree(tmp)
    else:
        sync_rename(tmp, out_dir)
    return out_dir


def encoded(
    chat: ChatEncoder, example: Conversation | Pair
) -> tuple[list[list[int]], list[np.ndarray]]:
    try:
        ids, mask = chat.encode(example)
    except ChatError as error:
        raise DataError(str(error)) from None
    return [ids], [mask]


# Documents longer than this many characters are tokenized piece by piece: a 50 MB single-line
# file as one list of Python ints would take about 2 GB.
PIECE_CHARS = 1 << 20


def encode_in_pieces(
    text: str, tokenizer: Tokenizer, size: int | None = None
) -> Iterator[list[int]]:
    """The token ids of one document (ending with eos) in pieces of about `size` characters. Each
    cut falls where a run of whitespace begins, where tiktoken's pre-tokenizer splits too, so the
    ids are those of the whole text; a text without whitespace is cut every `size` characters."""
    start, size = 0, size or PIECE_CHARS
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            end = whitespace_run_start(text, start + size // 2, end) or end
        yield tokenizer.encoding.encode_ordinary(text[start:end]) + (
            [tokenizer.eos_id] if end == len(text) else []
        )
        start = end


def whitespace_run_start(text: str, low: int, high: int) -> int | None:
    """The start of the last run of whitespace that begins in text[low:high], if any."""
    last = max(text.rfind(c, low, high) for c in " \n\t\r")
    if last < low:
        return None
    while last > low and text[last - 1].isspace():
        last -= 1
    return last


class ShardWriter:
    """Appends tokenized documents to shard files; a document never spans two shards. From the first
    document with a loss mask on, every shard gets a mask file (ones for text documents)."""

    def __init__(self, directory: Path, dtype: type, shard_tokens: int):
        self.directory, self.dtype, self.shard_tokens = directory, np.dtype(dtype), shard_tokens
        self.shards: list[str] = []
        self.num_docs = self.num_tokens = 0
        self.masked = False
        self._file = self._mask_file = None
        self._starts: list[int] = []

    def add(self, documents: list[list[int]], masks: list[np.ndarray] | None = None) -> None:
        for ids, mask in zip(documents, masks or [None] * len(documents)):
            shard_full = len(self._starts) > 1 and self._starts[-1] + len(ids) > self.shard_tokens
            if self._file is None or shard_full:
                self._close_shard()
                self._open_shard()
            if mask is not None and self._mask_file is None:
                self._start_masks()
            self._file.write(np.asarray(ids, dtype=self.dtype).tobytes())
            self._write_mask(len(ids), mask)
            self._starts.append(self._starts[-1] + len(ids))
            self.num_docs += 1
            self.num_tokens += len(ids)

    def add_pieces(self, pieces: Iterator[list[int]]) -> None:
        """One document given as consecutive pieces of token ids, written as they come."""
        if self._file is None or (len(self._starts) > 1 and self._starts[-1] >= self.shard_tokens):
            self._close_shard()
            self._open_shard()
        length = 0
        for ids in pieces:
            self._file.write(np.asarray(ids, dtype=self.dtype).tobytes())
            self._write_mask(len(ids), None)
            length += len(ids)
        self._starts.append(self._starts[-1] + length)
        self.num_docs += 1
        self.num_tokens += length

    def finish(self, meta: dict) -> None:
        self._close_shard()
        # shards closed before the first mask: all targets
        for name in self.shards if self.masked else []:
            if not (self.directory / f"mask_{name}.bin").exists():
                tokens = (
                    self.directory / f"tokens_{name}.bin"
                ).stat().st_size // self.dtype.itemsize
                with open(self.directory / f"mask_{name}.bin", "wb") as file:
                    for start in range(0, tokens, 1 << 24):
                        file.write(np.ones(min(1 << 24, tokens - start), np.uint8).tobytes())
        meta = {
            "format": MASKED_FORMAT if self.masked else SHARDS_FORMAT,
            "dtype": self.dtype.name,
            "num_docs": self.num_docs,
            "num_tokens": self.num_tokens,
            "shards": self.shards,
            **meta,
        }
        (self.directory / "meta.json").write_text(json.dumps(meta, indent=1))

    def _start_masks(self) -> None:
        """The first masked document: this shard's earlier (text) documents get masks of ones."""
        self.masked = True
        self._mask_file = open(self.directory / f"mask_{self.shards[-1]}.bin", "wb")
        self._mask_file.write(np.ones(self._starts[-1], np.uint8).tobytes())

    def _write_mask(self, length: int, mask: np.ndarray | None) -> None:
        if self._mask_file is not None:
            self._mask_file.write(
                (
                    np.ones(length, np.uint8) if mask is None else np.asarray(mask, np.uint8)
                ).tobytes()
            )

    def _open_shard(self) -> None:
        name = f"{len(self.shards):05d}"
        self.shards.append(name)
        self._file = open(self.directory / f"tokens_{name}.bin", "wb")
        self._mask_file = open(self.directory / f"mask_{name}.bin", "wb") if self.masked else None
        self._starts = [0]

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            if self._mask_file is not None:
                self._mask_file.close()
            np.save(
                self.directory / f"docs_{self.shards[-1]}.npy",
                np.asarray(self._starts, dtype=np.int64),
            )
            self._file = self._mask_file = None


def prepared_dir(source: Path, tokenizer: Tokenizer, cache_dir: Path, text_key: str) -> Path:
    """Where prepared shards of `source` live: `source` itself when it already is a prepared
    directory, else a cache entry keyed by the files (path, size, mtime) and the tokenizer."""
    if (source / "meta.json").is_file():
        return source
    files = [
        (str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in source_files(source)[0]
    ]
    rules = [
        SHARDS_FORMAT,
        READING_RULES,
        tokenizer.fingerprint,
        text_key,
        template_of(tokenizer).digest,
    ]
    key = hashlib.sha256(json.dumps(rules + files).encode())
    return cache_dir / f"{source.stem}-{key.hexdigest()[:16]}"


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
        self.doc_shard, self.doc_start = np.concatenate(shard_of), np.concatenate(starts)
        self.doc_len = np.concatenate(ends) - self.doc_start
        self.vocab_size = int(self.meta["vocab_size"])
        self.files = [directory / f"tokens_{name}.bin" for name in self.meta["shards"]]
        self.vocab_limit = tokenizer.vocab_size if tokenizer else self.vocab_size
        # Ranges recorded at prepare time are checked now; without them each document read is.
        self.checked_at_open = check_recorded_ranges(
            directory / "meta.json", self.meta, self.vocab_limit
        )

    @property
    def num_docs(self) -> int:
        return len(self.doc_start)

    def document(self, i: int, part: slice = slice(None)) -> np.ndarray:
        """Document i's tokens (a memmap view), or `part` of them: only those are read."""
        start, shard = self.doc_start[i], self.doc_shard[i]
        tokens = self.tokens[shard][start : start + self.doc_len[i]][part]
        if not self.checked_at_open:
            check_token_range(self.files[shard], tokens, self.vocab_limit)
        return tokens

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


def check_recorded_ranges(path: Path, meta: dict, vocab_size: int) -> bool:
    """meta.json's largest token id of each shard ("max_token_ids", written at prepare time) against
    the vocabulary; False when the directory records none (then each document is checked as
    read)."""
    largest = meta.get("max_token_ids")
    if largest is None:
        return False
    if (
        not isinstance(largest, list)
        or len(largest) != len(meta["shards"])
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in largest)
    ):
        raise DataError(
            f"{path}: max_token_ids must list one whole number per shard "
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

# Documents per block of the shuffled order: an epoch permutes the blocks, then the documents within
# each block it reaches, so a rank holds one block's order, not the epoch's (O(rows read)).
BLOCK_DOCS = 1 << 12


class PackedLoader:
    """Fixed-length rows of packed documents for one data-parallel rank; deterministic and
    resumable.

    Rows are numbered globally: micro-batch m is rows [m*W*B, (m+1)*W*B) of the global row sequence
    and rank r takes the B rows starting at m*W*B + r*B, so the data order does not depend on the
    layout and a position saved by one world size is valid for another. Row g is row g % R of
    epoch g // R (R = rows_per_epoch). An epoch's document order is computed block-wise from
    (seed, stream, epoch): the blocks of `block_docs` documents are permuted, then the documents
    within each block, so no rank stores or recomputes a permutation of every document.
    The state is one integer, the next global row, so a restart resumes at the exact token.

    Shards with conversations (masked) are packed whole instead (chat.WholeRows: rows packed once, a
    document longer than seq_len truncated or dropped by `overlong`), and an epoch shuffles the rows
    with (seed, stream, epoch); a target is -100 where the loss mask says the token is not one.
    `stream` tells the sources of a mixture apart (MixedLoader): each shuffles its own way.
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
        stream: int = 0,
        block_docs: int = BLOCK_DOCS,
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
        self.rank, self.world_size, self.stream = rank, world_size, stream
        # The run's STREAM_KEYS (train.py passes them all): a refused resume names the changed.
        self.settings = settings or {
            "data.seq_len": seq_len,
            "data.overlong": overlong,
            "training.seed": seed,
        }
        self.block_docs = block_docs
        block_starts = np.arange(0, len(doc_indices), block_docs)
        self.block_tokens = np.add.reduceat(shards.doc_len[doc_indices], block_starts)  # [blocks]
        self.num_tokens = int(self.block_tokens.sum())
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
        self._epoch_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._block_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

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
        extra token only serves as the last target. Packed whole: row order[g % R] of the
        packing."""
        epoch, start = divmod(g, self.rows_per_epoch)
        if self.whole is not None:  # document i of the row is self.docs[i]
            order = self._row_order(epoch)
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
        _, block_ends = self._blocks(epoch)
        slot = int(np.searchsorted(block_ends, position, side="right"))  # the block of `position`
        order, ends = self._block(epoch, slot)
        # first document ending after `position`
        k = int(np.searchsorted(ends, position, side="right"))
        while position < stop:
            if k == len(order):  # the row goes on in the next block, or the epoch ends (padding)
                slot, k = slot + 1, 0
                if slot == len(block_ends):
                    break
                order, ends = self._block(epoch, slot)
            doc = int(order[k])
            doc_start = ends[k] - self.shards.doc_len[doc]
            take = slice(position - doc_start, min(ends[k], stop) - doc_start)
            n = take.stop - take.start
            offset = position - start * self.seq_len
            tokens[offset : offset + n] = self.shards.document(doc, take)
            docs[offset : offset + n] = doc
            position, k = position + n, k + 1
        return row_arrays(tokens, docs, None)

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.stream, *key])

    def _blocks(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block order [blocks], cumulative end of each in the epoch's stream [blocks]), two epochs
        cached: O(documents / block_docs) each."""
        if epoch not in self._epoch_cache:
            count = len(self.block_tokens)
            order = self._rng(epoch, 0).permutation(count) if self.shuffle else np.arange(count)
            self._epoch_cache = {e: v for e, v in self._epoch_cache.items() if e == epoch - 1}
            self._epoch_cache[epoch] = (order, np.cumsum(self.block_tokens[order]))
        return self._epoch_cache[epoch]

    def _block(self, epoch: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The documents of the epoch's `slot`-th block in their order, and where each ends in the
        epoch's stream; the last few blocks read are cached."""
        if (epoch, slot) not in self._block_cache:
            order, block_ends = self._blocks(epoch)
            block = int(order[slot])
            members = self.docs[block * self.block_docs : (block + 1) * self.block_docs]
            if self.shuffle:
                members = members[self._rng(epoch, 1, block).permutation(len(members))]
            first = block_ends[slot] - self.block_tokens[block]
            if len(self._block_cache) >= 4:
                self._block_cache.pop(next(iter(self._block_cache)))
            ends = first + np.cumsum(self.shards.doc_len[members])
            self._block_cache[epoch, slot] = (members, ends)
        return self._block_cache[epoch, slot]

    def _row_order(self, epoch: int) -> np.ndarray:
        """Packed whole: the epoch's order of the packing's rows [R], two epochs cached."""
        if epoch not in self._epoch_cache:
            rows = np.arange(self.rows_per_epoch)
            order = self._rng(epoch).permutation(rows) if self.shuffle else rows
            self._epoch_cache = {e: v for e, v in self._epoch_cache.items() if e == epoch - 1}
            self._epoch_cache[epoch] = (order, order)
        return self._epoch_cache[epoch][0]

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


# ============================================================================= command line

# --seq-len's bound: 16 times the longest context of the models here (Large 4's 1,048,576).
MAX_SEQ_LEN = 1 << 24


def seq_len_flag(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        message = f"expected a whole number of tokens, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not 1 <= value <= MAX_SEQ_LEN:
        raise argparse.ArgumentTypeError(f"must be 1 <= N <= {MAX_SEQ_LEN:,} tokens, got {value}")
    return value


def text_flag(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def extensions_flag(text: str) -> tuple[str, ...] | None:
    """ "txt,md,jsonl" -> (".txt", ".md", ".jsonl"); "all" -> None (every file)."""
    if text.strip().lower() == "all":
        return None
    names = [name.strip().lstrip(".").lower() for name in text.split(",")]

    def usable(name: str) -> bool:
        spaced = any(c.isspace() for c in name)
        return bool(name) and name != "all" and "/" not in name and not spaced

    if not all(usable(name) for name in names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated file extensions such as "
            f"txt,md,jsonl, or 'all' alone, got {text!r}"
        )
    return tuple("." + name for name in names)


def check_inputs(inputs: list[Path], out: Path) -> None:
    """INPUT... are not prepared already; --out names a new directory where one can be made."""
    for path in inputs:
        if (path / "meta.json").is_file():
            raise DataError(
                f"input {path} is a prepared directory already (it holds meta.json); "
                f'train on it with data.path = "{path}"'
            )
    if out.exists() or out.is_symlink():
        found = "is a file" if out.is_file() else "already exists"
        raise DataError(f"--out {out} {found}; name a new directory (prepare never overwrites)")
    existing = next(parent for parent in out.absolute().parents if parent.exists())
    if not existing.is_dir():
        raise DataError(f"--out {out} lies under {existing}, which is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(f"--out {out}: {existing} is not writable")


def main(argv: list[str] | None = None) -> None:
    """`data.py prepare`; any bad flag or input stops with one line (SystemExit)."""
    parser = OneLineParser(description="Turn text files, directories or JSONL into token shards.")
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="tokenize INPUT... into shards under --out")
    prep.add_argument(
        "input", type=Path, nargs="+", help="text files, .jsonl files or directories of them"
    )
    prep.add_argument("--out", type=Path, required=True, help="output directory (must not exist)")
    prep.add_argument(
        "--tokenizer",
        type=text_flag,
        default="byte",
        help="byte | a .tiktoken file | a tokenizer.json dir | a name",
    )
    prep.add_argument("--eos-token", type=text_flag, default=END_OF_TEXT)
    prep.add_argument(
        "--text-key", type=text_flag, default="text", help="the JSONL field that holds the text"
    )
    prep.add_argument(
        "--extensions",
        type=extensions_flag,
        default=",".join(s[1:] for s in TEXT_SUFFIXES),
        help="file extensions read from directories, comma-separated, or 'all' "
        "(named files are always read)",
    )
    prep.add_argument(
        "--seq-len",
        type=seq_len_flag,
        help="with conversations: report how rows of this length hold them",
    )
    prep.add_argument(
        "--overlong", choices=OVERLONG, help="with --seq-len: as data.overlong (default truncate)"
    )
    args = parser.parse_args(argv)
    if args.overlong and not args.seq_len:
        parser.error(
            "argument --overlong: only says how rows of --seq-len tokens fit "
            "conversations; give --seq-len too"
        )
    try:
        prepare_command(args)
    except (DataError, TokenizerError) as error:
        raise SystemExit(f"error: {error}") from None


def prepare_command(args: argparse.Namespace) -> None:
    check_inputs(args.input, args.out)
    tokenizer = load_tokenizer(
        args.tokenizer, args.eos_token, setting="--tokenizer", eos_setting="--eos-token"
    )
    directory = prepare(
        args.input, tokenizer, args.out, args.text_key, suffixes=args.extensions, setting="input"
    )
    shards = TokenShards(directory)
    meta, binary = shards.meta, shards.meta["skipped_binary"]
    named = f" ({', '.join(binary[:3])}{', ...' if len(binary) > 3 else ''})" if binary else ""
    print(
        f"{args.out}: {shards.num_docs} documents, {int(shards.doc_len.sum()):,} tokens from "
        f"{len(meta['sources'])} file(s) ({args.tokenizer} tokenizer, vocabulary "
        f"{tokenizer.vocab_size}); skipped "
        f"{len(binary)} binary file(s){named} and {meta['skipped_by_extension']} file(s) by "
        "extension"
    )
    if shards.masked:
        print(chat_summary(meta))
    if shards.masked and args.seq_len:
        report = rows_report(shards, args.seq_len, args.overlong or "truncate")
        print(f"with --seq-len {args.seq_len}: {report}")
    elif args.seq_len:
        print(
            f"with --seq-len {args.seq_len}: nothing to report; the data holds no conversations "
            f"or pairs, and plain text is cut into rows wherever they end"
        )


def rows_report(shards: TokenShards, seq_len: int, overlong: str) -> str:
    """How rows of seq_len tokens would hold the prepared documents (what a run would print)."""
    whole = WholeRows(
        shards.doc_len, seq_len, overlong, lambda i: bool(shards.loss_mask(i)[1:seq_len].any())
    )
    if whole.num_tokens == 0:
        return (
            f"no document fits: all {shards.num_docs} are longer than {seq_len} tokens and "
            f"--overlong {overlong} leaves none (or none keeps a target)"
        )
    rows = PackedLoader(
        shards, np.arange(shards.num_docs), seq_len, 1, 0, name="all", overlong=overlong
    )
    return rows.describe()


if __name__ == "__main__":
    main()
