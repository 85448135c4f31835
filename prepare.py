"""Preparation for data.py's loader: text files, directories, JSONL, .gz, parquet -> token shards.

    inputs  --units (by name and size)-->  one process a unit  --join-->  shards + meta.json

The shards' format (and reading them back) is data.py's; this file reads the inputs, tokenizes them
and writes the shards. The inputs are cut into units by their names and sizes alone, each unit
written to its own shards by one of several worker processes, then the units' shards are numbered
in input order: the output is the same bytes for any number of workers, or of hosts writing parts.

Command line: `python prepare.py prepare INPUT... --out DIR [--tokenizer byte] [--extensions
txt,md,jsonl] [--workers N] [--part i/N] [--seq-len N --overlong truncate|drop]` (the last two only
report what a run would fit), and `python prepare.py join PART_DIRS... --out DIR` after --part runs;
a bad flag or input stops with one line naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

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
from data import (
    COARSE_FILE,
    FORMAT_VERSION,
    MASKED_FORMAT,
    OVERLONG,
    SHARDS_FORMAT,
    DataError,
    PackedLoader,
    Split,
    TokenShards,
    coarse_starts,
)
from files import remove_stale_temporaries, sync_rename
from flags import OneLineParser, positive
from tokenizer import END_OF_TEXT, Tokenizer, TokenizerError, load_tokenizer

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
    ".parquet",
)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")  # one record per line
# How files become documents; in the cache key, so data cached under other rules is prepared again.
READING_RULES = "records-v3: JSONL suffixes in any case, .json lists of records, .gz, parquet"


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
        chosen = [p for p in found if suffixes is None or reading_suffix(p) in suffixes]
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


def reading_suffix(path: Path) -> str:
    """The suffix that says how a file is read, in lower case: a.jsonl.gz reads as .jsonl."""
    inner = Path(path.stem) if path.suffix.lower() == ".gz" else path
    return inner.suffix.lower()


# A piece of input: (file, first byte, end byte). A large JSONL file is read in several pieces,
# each holding the lines that begin in its byte range; any other file is one piece, read whole.
Piece = tuple[Path, int, int]


def iter_documents(
    pieces: list[Piece], text_key: str, binary: list[Path]
) -> Iterator[str | Conversation | Pair]:
    """A JSONL file (JSONL_SUFFIXES, any case) holds one record per line; a .json file holding a
    list of records (or one record) is read the same way when they are conversations, pairs or
    objects with field `text_key`. A record is a conversation ("messages"), a prompt/completion pair
    (chat.read_example), or text in field `text_key`; a parquet file's rows are texts in column
    `text_key`; any other file is one document, and one that holds JSON lines of conversations is
    refused rather than trained on as text. A .gz file reads as its content. Binary files (a NUL
    byte, or not UTF-8) are appended to `binary` and skipped."""
    for path, start, end in pieces:
        suffix = reading_suffix(path)
        if path.suffix.lower() == ".zst":
            raise DataError(
                f"{path}: .zst files are not read (no zstandard library is installed); "
                f"decompress it first (zstd -d) or use .gz"
            )
        if suffix in JSONL_SUFFIXES:
            yield from _jsonl_records(path, text_key, start, end)
            continue
        if suffix == ".parquet":
            yield from _parquet_texts(path, text_key)
            continue
        text = _read_text(path)
        if text is None:
            binary.append(path)
            continue
        records = _json_records(text, path, text_key) if suffix == ".json" else None
        if records is not None:
            yield from (_record(value, where, text_key) for value, where in records)
            continue
        _refuse_hidden_conversations(text, path)
        yield text


def _jsonl_records(
    path: Path, text_key: str, start: int = 0, end: int = -1
) -> Iterator[str | Conversation | Pair]:
    """The records of the lines that begin in bytes [start, end) (end -1: the whole file), named
    path:line from the start of the file, or by their byte offset in a later piece."""
    try:
        with _open_binary(path) as lines:
            if start > 0:  # the line that holds byte start - 1 belongs to the piece before
                lines.seek(start - 1)
                lines.readline()
            position = lines.tell()
            for number, line in enumerate(iter(lines.readline, b""), 1):
                if end >= 0 and position >= end:
                    break
                where = f"{path}:{number}" if start == 0 else f"{path}: the line at byte {position}"
                position += len(line)
                if line.strip():
                    yield _record(_json_line(line, where, text_key), where, text_key)
    except OSError as error:  # gzip.BadGzipFile is one
        raise DataError(f"{path}: cannot read ({error.strerror or error})") from None
    except EOFError:
        raise DataError(f"{path}: the gzip stream ends early (a truncated file)") from None


def _open_binary(path: Path):
    """A file's bytes, decompressed when it is a .gz file."""
    return gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb")


def _json_line(line: bytes, where: str, text_key: str) -> object:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise DataError(
            f"{where}: not UTF-8 text ({error.reason} at byte {error.start} of the line)"
        ) from None
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: {expected_record(text_key)}: {error!r}") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise DataError(
            f"{where}: expected a JSON object with a string field {text_key!r} "
            f"(data.text_key): the line nests arrays or objects too deeply to read"
        ) from None


def _parquet_texts(path: Path, text_key: str) -> Iterator[str]:
    """The texts of a parquet file's column `text_key`, a batch of rows at a time. pyarrow is
    optional (README, Data): only parquet needs it."""
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise DataError(
            f"{path}: reading parquet needs pyarrow, which is not installed (pip install pyarrow)"
        ) from None
    try:
        table = parquet.ParquetFile(path)
    except Exception as error:  # pyarrow's errors share no base class of their own
        raise DataError(f"{path}: not a parquet file ({one_line(error)})") from None
    columns = table.schema_arrow.names
    if text_key not in columns:
        raise DataError(
            f"{path}: no column {text_key!r} (data.text_key, --text-key); it has "
            f"{', '.join(map(repr, columns[:6])) or 'no columns'}"
        )
    for batch in table.iter_batches(batch_size=1024, columns=[text_key]):
        for value in batch.column(0).to_pylist():
            if not isinstance(value, str):
                raise DataError(
                    f"{path}: column {text_key!r} must hold strings, got {type(value).__name__}"
                )
            yield value


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
        with _open_binary(path) as file:
            data = file.read()
    except OSError as error:  # gzip.BadGzipFile is one
        raise DataError(f"{path}: cannot read ({error.strerror or error})") from None
    except EOFError:
        raise DataError(f"{path}: the gzip stream ends early (a truncated file)") from None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# ========================================================================== prepare: text -> shards

# Inputs are cut into units of about UNIT_BYTES: consecutive small files together, a large JSONL
# file at line boundaries. A unit is one worker's job and writes its own shards, so the output
# depends on the inputs alone, never on how many workers or hosts (--part) prepared it.
UNIT_BYTES = 32 << 20


def prepare(
    source: Path | list[Path],
    tokenizer: Tokenizer,
    out_dir: Path,
    text_key: str = "text",
    shard_tokens: int = 1 << 28,
    suffixes: tuple[str, ...] | None = TEXT_SUFFIXES,
    setting: str = "data.path",
    workers: int = 1,
    part: tuple[int, int] = (1, 1),
    progress_every: float | None = None,
) -> Path:
    """Tokenize every document of `source` (paths: see `source_files`) into `out_dir`, atomically
    (temp dir, then rename), with `workers` processes. Binary files are skipped; meta.json lists
    them.

    out_dir/tokens_00000.bin   token ids (uint16, or uint32 for vocabularies over 65536), documents
                               back to back, each ending with the eos token
    out_dir/docs_00000.npy     int64 [docs + 1]: where each document of that shard starts, then
                               the end
    out_dir/mask_00000.bin     with conversations or pairs only: uint8 per token, 1 where it is a
                               target
    out_dir/coarse_starts.npy  int64: where every 4,096th document starts (data.COARSE_DOCS), then
                               the end, so that opening need not read the document index
    out_dir/meta.json          written last: format, tokenizer fingerprint, counts, shard names,
                               each shard's largest token id and checksum

    part (i, N) other than (1, 1) writes part i of N instead: the units of its share, joined with
    the other parts' by `join` into what one run would have written. progress_every: seconds
    between progress lines (None: none).
    """
    files, ignored = source_files(source, suffixes, setting)
    missing = tokenizer.missing_bytes()
    if missing:  # tiktoken panics on text with a byte that has no token
        raise DataError(
            f"{setting} {path_names(source)}: the tokenizer has no token for byte "
            f"0x{missing[0]:02x} ({len(missing)} bytes lack one); preparing data "
            f"needs a tokenizer that writes every byte"
        )
    units = plan_units(files, UNIT_BYTES)
    plan = {
        "tokenizer": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "files": [str(f) for f in files],
        "skipped_by_extension": ignored,
        "chat_template": template_of(tokenizer).origin,
        "chat_template_digest": template_of(tokenizer).digest,
        "text_key": text_key,
        "shard_tokens": shard_tokens,
        "units": [[list(map(str, p)) for p in u] for u in units],
    }
    first, last = part_range(len(units), part)
    total = sum(input_bytes(unit) for unit in units[first:last])
    progress = None if progress_every is None else Progress(total, progress_every)
    with atomic_directory(out_dir) as tmp:
        job = (tokenizer, text_key, shard_tokens)
        run_units(
            job, [(i, units[i], tmp / unit_name(i)) for i in range(first, last)], workers, progress
        )
        if part == (1, 1):
            assemble(
                plan,
                [tmp / unit_name(i) for i in range(len(units))],
                tmp,
                f"{setting} {path_names(source)}",
            )
        else:
            write_json(
                tmp / "part.json",
                {
                    "part": list(part),
                    "plan": plan_digest(plan),
                    "part_units": [first, last],
                    **plan,
                },
            )
    return out_dir


@contextlib.contextmanager
def atomic_directory(out_dir: Path) -> Iterator[Path]:
    """A temporary directory beside `out_dir`, renamed to it when the block ends without an
    error, removed when it raises: nothing half-written stays behind."""
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir.parent, f"{out_dir.name}.tmp-")  # left by a killed preparation
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own, from an earlier failed attempt
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():  # another process prepared the same data meanwhile: keep theirs
        shutil.rmtree(tmp)
    else:
        sync_rename(tmp, out_dir)


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1))


def unit_name(index: int) -> str:
    return f"unit_{index:06d}"


def plan_units(files: list[Path], unit_bytes: int) -> list[list[Piece]]:
    """The units of work, in input order, decided by the files' names and sizes alone."""
    units: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for file in files:
        length = file.stat().st_size
        splits = file.suffix.lower() in JSONL_SUFFIXES and length > unit_bytes  # not compressed
        if splits:
            units += [current] if current else []
            current, size = [], 0
            units += [
                [(file, start, min(start + unit_bytes, length))]
                for start in range(0, length, unit_bytes)
            ]
            continue
        current.append((file, 0, -1))
        size += length
        if size >= unit_bytes:
            units.append(current)
            current, size = [], 0
    return units + [current] if current else units


def part_range(num_units: int, part: tuple[int, int]) -> tuple[int, int]:
    """Part i of N takes the i-th of N runs of consecutive units, as even as whole units allow."""
    index, count = part
    return (index - 1) * num_units // count, index * num_units // count


def plan_digest(plan: dict) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


# The job every worker runs (tokenizer, text_key, shard_tokens): set before the workers fork, so a
# tokenizer that does not pickle reaches them too.
_JOB: tuple[Tokenizer, str, int] | None = None


def run_units(
    job: tuple[Tokenizer, str, int],
    todo: list[tuple[int, list[Piece], Path]],
    workers: int,
    progress: Progress | None,
) -> None:
    """Each unit of `todo` into its own directory, by `workers` processes (in this one for 1)."""
    global _JOB
    _JOB = job
    with contextlib.ExitStack() as stack:
        if workers == 1 or len(todo) <= 1:
            done = map(_write_unit, todo)
        else:
            pool = multiprocessing.get_context("fork").Pool(min(workers, len(todo)))
            stack.enter_context(pool)
            done = pool.imap_unordered(_write_unit, todo)
        for counts in done:
            if progress is not None:
                progress.add(*counts)
    _JOB = None


def _write_unit(todo: tuple[int, list[Piece], Path]) -> tuple[int, int, int]:
    """One unit's shards and meta.json -> (input bytes, documents, tokens), for the progress."""
    _, pieces, directory = todo
    tokenizer, text_key, shard_tokens = _JOB
    directory.mkdir()
    binary: list[Path] = []
    writer = ShardWriter(directory, token_dtype(tokenizer), shard_tokens)
    chat = ChatEncoder(tokenizer)
    batch: list[str] = []
    for text in iter_documents(pieces, text_key, binary):
        if not isinstance(text, str):  # a conversation or a pair, in its place among the documents
            writer.add(tokenizer.encode_documents(batch))
            batch = []
            writer.add(*encoded(chat, text))
        elif len(text) > PIECE_CHARS and text.strip():  # a long document streams to the shard
            writer.add_pieces(encode_in_pieces(text, tokenizer))
        elif text.strip():
            batch.append(text)
        if len(batch) == 256:
            writer.add(tokenizer.encode_documents(batch))
            batch = []
    writer.add(tokenizer.encode_documents(batch))
    writer.finish({"skipped_binary": [str(f) for f in binary], "chat_counts": chat.counts})
    return input_bytes(pieces), writer.num_docs, writer.num_tokens


def input_bytes(pieces: list[Piece]) -> int:
    return sum(path.stat().st_size if end < 0 else end - start for path, start, end in pieces)


def token_dtype(tokenizer: Tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32


def assemble(plan: dict, units: list[Path], out: Path, what: str) -> None:
    """Every unit's shards moved into `out` under one numbering, in unit order, and meta.json
    written: the same bytes whichever workers or parts wrote the units."""
    metas = [json.loads((unit / "meta.json").read_text()) for unit in units]
    masked = any(meta["format"] == MASKED_FORMAT for meta in metas)
    shards, largest, checksums = [], [], []
    for unit, meta in zip(units, metas):
        for index, name in enumerate(meta["shards"]):
            new = f"{len(shards):05d}"
            for kind, suffix in (("tokens", "bin"), ("docs", "npy"), ("mask", "bin")):
                if (unit / f"{kind}_{name}.{suffix}").exists():
                    os.replace(unit / f"{kind}_{name}.{suffix}", out / f"{kind}_{new}.{suffix}")
            if masked and meta["format"] != MASKED_FORMAT:  # text only: every token a target
                size = (out / f"tokens_{new}.bin").stat().st_size
                write_ones(out / f"mask_{new}.bin", size // np.dtype(meta["dtype"]).itemsize)
            shards.append(new)
            largest.append(meta["shard_max_token"][index])
            checksums.append(meta["shard_sha256"][index])
        shutil.rmtree(unit)
    binary = [name for meta in metas for name in meta["skipped_binary"]]
    num_docs = sum(meta["num_docs"] for meta in metas)
    if num_docs == 0:
        raise DataError(
            f"{what}: no documents with text in {len(plan['files'])} file(s)"
            + (f"; {len(binary)} binary file(s) skipped: {', '.join(binary[:3])}" if binary else "")
        )
    chat_meta = (
        {
            "chat_template": plan["chat_template"],
            "chat_template_digest": plan["chat_template_digest"],
            **summed_counts([meta["chat_counts"] for meta in metas]),
        }
        if masked
        else {}
    )
    np.save(out / COARSE_FILE, coarse_starts(out, shards))
    write_json(
        out / "meta.json",
        {
            "format": MASKED_FORMAT if masked else SHARDS_FORMAT,
            "dtype": metas[0]["dtype"],
            "num_docs": num_docs,
            "num_tokens": sum(meta["num_tokens"] for meta in metas),
            "shards": shards,
            "tokenizer": plan["tokenizer"],
            "vocab_size": plan["vocab_size"],
            "eos_id": plan["eos_id"],
            "sources": [f for f in plan["files"] if f not in set(binary)],
            "skipped_binary": binary,
            "skipped_by_extension": plan["skipped_by_extension"],
            **chat_meta,
            "format_version": FORMAT_VERSION,
            "shard_max_token": largest,
            "shard_sha256": checksums,
        },
    )


def write_ones(path: Path, tokens: int) -> None:
    with open(path, "wb") as file:
        for start in range(0, tokens, 1 << 24):
            file.write(np.ones(min(1 << 24, tokens - start), np.uint8).tobytes())


def summed_counts(counts: list[dict[str, int]]) -> dict[str, int]:
    """The chat counts of several units as one: totals, and the longest of the longest."""
    return {key: (max if key == "longest" else sum)(c[key] for c in counts) for key in counts[0]}


# ============================================================================= join: parts -> one


def join(part_dirs: list[Path], out_dir: Path) -> Path:
    """The parts of one preparation (`prepare --part i/N`, each i once) as the directory a single
    run would have written, byte for byte."""
    parts = [read_part(directory) for directory in part_dirs]
    first_dir, first = part_dirs[0], parts[0]
    by_index: dict[int, Path] = {}
    for directory, part in zip(part_dirs, parts):
        if part["plan"] != first["plan"] or part["part"][1] != first["part"][1]:
            raise DataError(
                f"join: {directory} is part {part['part'][0]}/{part['part'][1]} of "
                f"another preparation than {first_dir} (other inputs, tokenizer or "
                f"settings)"
            )
        index = part["part"][0]
        if index in by_index:
            raise DataError(
                f"join: part {index}/{part['part'][1]} given twice ({by_index[index]} "
                f"and {directory})"
            )
        by_index[index] = directory
    count = first["part"][1]
    missing = [str(i) for i in range(1, count + 1) if i not in by_index]
    if missing:
        raise DataError(
            f"join: part(s) {', '.join(missing)} of {count} missing (given: "
            f"{', '.join(f'{i}/{count}' for i in sorted(by_index))}); prepare each "
            f"with --part i/{count}"
        )
    units = []
    for index in range(1, count + 1):
        start, end = parts[part_dirs.index(by_index[index])]["part_units"]
        units += [by_index[index] / unit_name(u) for u in range(start, end)]
    with atomic_directory(out_dir) as tmp:
        for unit in units:  # copied, so the parts stay whole if the join fails
            shutil.copytree(unit, tmp / unit.name)
        assemble(first, [tmp / unit.name for unit in units], tmp, f"join {path_names(part_dirs)}")
    return out_dir


def read_part(directory: Path) -> dict:
    """A part directory's part.json, or one line saying the directory is not one."""
    try:
        part = json.loads((directory / "part.json").read_text())
    except (OSError, ValueError):
        part = None
    if not isinstance(part, dict) or not {"part", "part_units", "plan", "units"} <= set(part):
        raise DataError(
            f"join: {directory} is not a part directory (no readable part.json); make "
            f"parts with prepare --part i/N"
        )
    (first, last), (index, count) = part["part_units"], part["part"]
    for unit in range(first, last):
        if not (directory / unit_name(unit) / "meta.json").is_file():
            raise DataError(
                f"join: {directory / unit_name(unit)} is missing or incomplete; "
                f"prepare part {index}/{count} again"
            )
    return part


# ============================================================================= progress


class Progress:
    """A line every `every` seconds on a long preparation: documents, MB, tokens, rates, and the
    time left at the rate so far (by bytes of input read against the total)."""

    def __init__(
        self,
        total_bytes: int,
        every: float = 5.0,
        clock=time.monotonic,
        write=lambda line: print(line, file=sys.stderr, flush=True),
    ):
        self.total, self.every, self.clock, self.write = total_bytes, every, clock, write
        self.start = self.last = clock()
        self.bytes = self.docs = self.tokens = 0

    def add(self, size: int, docs: int, tokens: int) -> None:
        self.bytes, self.docs = self.bytes + size, self.docs + docs
        self.tokens += tokens
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.write(self.line(now - self.start))

    def line(self, elapsed: float) -> str:
        elapsed = max(elapsed, 1e-9)
        rate = self.bytes / elapsed
        left = (self.total - self.bytes) / rate if rate > 0 else float("inf")
        return (
            f"prepare: {self.docs:,} documents, {self.bytes / 1e6:,.1f} of "
            f"{self.total / 1e6:,.1f} MB, {self.tokens:,} tokens; {rate / 1e6:,.2f} MB/s, "
            f"{self.tokens / elapsed:,.0f} tokens/s; ETA {clock_time(left)}"
        )


def clock_time(seconds: float) -> str:
    """Seconds as h:mm:ss ("?" when unknown)."""
    if not math.isfinite(seconds):
        return "?"
    whole = round(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


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
        # Each shard's largest token id and the sha256 of its tokens file, for meta.json: the
        # range is checked once here rather than by a pass over every token at each load.
        self.largest: list[int] = []
        self.checksums: list[str] = []
        self._largest, self._hash = 0, hashlib.sha256()

    def add(self, documents: list[list[int]], masks: list[np.ndarray] | None = None) -> None:
        for ids, mask in zip(documents, masks or [None] * len(documents)):
            shard_full = len(self._starts) > 1 and self._starts[-1] + len(ids) > self.shard_tokens
            if self._file is None or shard_full:
                self._close_shard()
                self._open_shard()
            if mask is not None and self._mask_file is None:
                self._start_masks()
            self._write_tokens(ids)
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
            self._write_tokens(ids)
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
            "format_version": FORMAT_VERSION,
            "shard_max_token": self.largest,
            "shard_sha256": self.checksums,
        }
        np.save(self.directory / COARSE_FILE, coarse_starts(self.directory, self.shards))
        (self.directory / "meta.json").write_text(json.dumps(meta, indent=1))

    def _write_tokens(self, ids: list[int]) -> None:
        tokens = np.asarray(ids, dtype=self.dtype)
        self._file.write(tokens.tobytes())
        self._hash.update(tokens.tobytes())
        self._largest = max(self._largest, int(tokens.max()) if len(tokens) else 0)

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
            self.largest.append(self._largest)
            self.checksums.append(self._hash.hexdigest())
            self._largest, self._hash = 0, hashlib.sha256()


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
    """`prepare.py prepare`; any bad flag or input stops with one line (SystemExit)."""
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
    prep.add_argument(
        "--workers",
        type=positive,
        default=os.cpu_count() or 1,
        help="processes that tokenize (default: one per core)",
    )
    prep.add_argument(
        "--part",
        type=part_flag,
        default=(1, 1),
        help="i/N: write part i of N (one per host), then join them",
    )
    together = commands.add_parser("join", help="join the parts of --part i/N into one directory")
    together.add_argument("parts", type=Path, nargs="+", help="the part directories, each once")
    together.add_argument(
        "--out", type=Path, required=True, help="output directory (must not exist)"
    )
    args = parser.parse_args(argv)
    if args.command == "prepare" and args.overlong and not args.seq_len:
        parser.error(
            "argument --overlong: only says how rows of --seq-len tokens fit "
            "conversations; give --seq-len too"
        )
    try:
        if args.command == "join":
            check_inputs([], args.out)
            summarize(join(args.parts, args.out), args.out, "the parts'", None)
        else:
            prepare_command(args)
    except (DataError, TokenizerError) as error:
        raise SystemExit(f"error: {error}") from None


def part_flag(text: str) -> tuple[int, int]:
    """ "2/8" -> (2, 8): part 2 of 8, 1 <= i <= N."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise argparse.ArgumentTypeError(
            f"expected i/N with 1 <= i <= N (part 2 of 8: 2/8), got {text!r}"
        )
    return int(index), int(count)


def prepare_command(args: argparse.Namespace) -> None:
    check_inputs(args.input, args.out)
    tokenizer = load_tokenizer(
        args.tokenizer, args.eos_token, setting="--tokenizer", eos_setting="--eos-token"
    )
    directory = prepare(
        args.input,
        tokenizer,
        args.out,
        args.text_key,
        suffixes=args.extensions,
        setting="input",
        workers=args.workers,
        part=args.part,
        progress_every=5.0,
    )
    if args.part != (1, 1):
        first, last = json.loads((directory / "part.json").read_text())["part_units"]
        print(
            f"{args.out}: part {args.part[0]}/{args.part[1]}, {last - first} unit(s) of input; "
            f"when every part is written: python3 prepare.py join PART_DIRS... --out DIR"
        )
        return
    summarize(directory, args.out, args.tokenizer, args)


def summarize(
    directory: Path, out: Path, tokenizer_name: str, args: argparse.Namespace | None
) -> None:
    """What a prepared directory holds, printed; with --seq-len, how rows would hold it."""
    shards = TokenShards(directory)
    meta, binary = shards.meta, shards.meta["skipped_binary"]
    named = f" ({', '.join(binary[:3])}{', ...' if len(binary) > 3 else ''})" if binary else ""
    print(
        f"{out}: {shards.num_docs} documents, {shards.num_tokens:,} tokens from "
        f"{len(meta['sources'])} file(s) ({tokenizer_name} tokenizer, vocabulary "
        f"{shards.vocab_size}); skipped "
        f"{len(binary)} binary file(s){named} and {meta['skipped_by_extension']} file(s) by "
        "extension"
    )
    if shards.masked:
        print(chat_summary(meta))
    if args is None:
        return
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
        shards.lengths(np.arange(shards.num_docs)),
        seq_len,
        overlong,
        lambda i: bool(shards.loss_mask(i)[1:seq_len].any()),
    )
    if whole.num_tokens == 0:
        return (
            f"no document fits: all {shards.num_docs} are longer than {seq_len} tokens and "
            f"--overlong {overlong} leaves none (or none keeps a target)"
        )
    rows = PackedLoader(
        shards, Split.whole(shards.num_docs), seq_len, 1, 0, name="all", overlong=overlong
    )
    return rows.describe()


if __name__ == "__main__":
    main()
