"""prepare.py: inputs read as documents (text, directories, JSONL), tokenized into shards; its
errors."""

import gzip
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken

import prepare as preparation
from data import DataError, TokenShards
from helpers import stops_with_one_line
from prepare import prepare
from tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prepare_text_directory_and_jsonl(tmp_path):
    source = tmp_path / "corpus"
    (source / "sub").mkdir(parents=True)
    (source / "a.txt").write_text("first document")
    (source / "sub" / "b.md").write_text("second")
    (source / ".hidden").write_text("never read")
    (source / "c.jsonl").write_text(
        json.dumps({"text": "third"}) + "\n\n" + json.dumps({"text": "fourth"}) + "\n"
    )
    tokenizer = load_tokenizer("byte")
    out = prepare(source, tokenizer, tmp_path / "prepared")
    shards = TokenShards(out, tokenizer)
    texts = [tokenizer.decode(shards.document(i)[:-1].tolist()) for i in range(shards.num_docs)]
    # sorted paths: a.txt, c.jsonl, sub/b.md
    assert texts == ["first document", "third", "fourth", "second"]
    assert all(shards.document(i)[-1] == tokenizer.eos_id for i in range(shards.num_docs))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "prepared"]  # no temp dir left
    assert shards.meta["dtype"] == "uint16"


def test_prepare_several_inputs_filters_extensions_and_skips_binary_files(tmp_path, capsys):
    corpus, notes = tmp_path / "corpus", tmp_path / "notes.txt"
    corpus.mkdir()
    (corpus / "a.md").write_text("alpha")
    (corpus / "b.png").write_bytes(b"\x89PNG\r\n")  # not a text extension: never read
    (corpus / "c.txt").write_bytes(b"text\x00with a NUL")  # binary despite its name
    (corpus / "d.py").write_text("print(1)")
    notes.write_text("notes")
    preparation.main(["prepare", str(corpus), str(notes), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "3 documents, " in out and "from 3 file(s)" in out
    assert f"skipped 1 binary file(s) ({corpus / 'c.txt'}) and 1 file(s) by extension" in out
    shards = TokenShards(tmp_path / "out")
    assert shards.meta["sources"] == [str(corpus / "a.md"), str(corpus / "d.py"), str(notes)]
    preparation.main(
        ["prepare", str(corpus), "--out", str(tmp_path / "only_md"), "--extensions", "md"]
    )
    assert TokenShards(tmp_path / "only_md").num_docs == 1


def test_prepare_errors_name_the_path(tmp_path):
    tokenizer = load_tokenizer("byte")
    with pytest.raises(DataError, match="does not exist"):
        prepare(tmp_path / "missing", tokenizer, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty directory"):
        prepare(tmp_path / "empty", tokenizer, tmp_path / "out")
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(DataError, match="no documents with text"):
        prepare(tmp_path / "blank.txt", tokenizer, tmp_path / "out")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: .*'text'"):
        prepare(tmp_path / "bad.jsonl", tokenizer, tmp_path / "out")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(
        DataError, match="no documents with text in 1 file.*1 binary file.* skipped: .*binary.txt"
    ):
        prepare(tmp_path / "binary.txt", tokenizer, tmp_path / "out")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')
    with pytest.raises(
        DataError,
        match=r"latin1.jsonl:3: not UTF-8 text \(invalid continuation "
        r"byte at byte 13",
    ):
        prepare(tmp_path / "latin1.jsonl", tokenizer, tmp_path / "out")
    with pytest.raises(DataError, match="/dev/null is neither a file nor a directory"):
        prepare(Path("/dev/null"), tokenizer, tmp_path / "out")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    with pytest.raises(DataError, match="loop_a is a symbolic link that leads nowhere"):
        prepare(tmp_path / "loop_a", tokenizer, tmp_path / "out")
    (tmp_path / "latin1b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1b.jsonl:2: not UTF-8 text"):
        prepare(tmp_path / "latin1b.jsonl", tokenizer, tmp_path / "out")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"\x89PNG")
    with pytest.raises(
        DataError,
        match=r"images holds no text or JSONL files \(1 file\(s\) with "
        r"other extensions",
    ):
        prepare(tmp_path / "images", tokenizer, tmp_path / "out")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]  # no output, no temp dir


def test_a_long_document_is_tokenized_in_pieces_with_the_same_ids(tmp_path, monkeypatch):
    """A long single-line document (here 300 KB, with pieces of 20,000 characters instead of 1 MiB)
    is encoded piece by piece (memory: one piece of ids, not the document's), cut where whitespace
    runs begin: the ids equal those of the whole text, for bytes and for BPE merges across
    spaces."""
    monkeypatch.setattr(preparation, "PIECE_CHARS", 20_000)
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "  beta", "gamma\t", "the", "ünï", "x" * 40])
    text = " ".join(words[rng.integers(0, len(words), 40_000)])
    (tmp_path / "long.txt").write_text(text)
    byte, calls = load_tokenizer("byte"), []
    encode = byte.encoding.encode_ordinary

    class Recording:  # the byte encoding, recording the length of each text it encodes
        def __getattr__(self, name):
            return getattr(byte.encoding, name)

        def encode_ordinary(self, piece):
            calls.append(len(piece))
            return encode(piece)

    tokenizer = Tokenizer(Recording(), byte.eos_id, byte.fingerprint)
    out = TokenShards(prepare(tmp_path / "long.txt", tokenizer, tmp_path / "prepared"))
    assert len(calls) >= 3 and max(calls) <= preparation.PIECE_CHARS
    assert out.document(0).tolist() == encode(text) + [tokenizer.eos_id]
    ranks = {bytes([i]): i for i in range(256)} | {b" t": 256, b"he": 257, b" the": 258, b"  ": 259}
    bpe = tiktoken.Encoding("bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    bpe_tokenizer = Tokenizer(bpe, 0, "bpe")
    pieces = [i for ids in preparation.encode_in_pieces(text, bpe_tokenizer, size=999) for i in ids]
    assert pieces == bpe.encode_ordinary(text) + [0]


# GPT-2's pre-tokenizer: words with their leading space, and runs of whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# ----------------------------------------------------------------------------- workers and parts


def mixed_corpus(directory: Path) -> Path:
    """Small text files, a JSONL file large enough to be cut into several units at 400 bytes a
    unit, a gzipped JSONL file, and conversations (so every shard needs a loss mask)."""
    directory.mkdir()
    for i in range(5):
        (directory / f"a{i}.txt").write_text(f"text {i} " * 25)
    lines = [json.dumps({"text": f"line {i} " * (i % 7 + 1)}) for i in range(60)]
    (directory / "big.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(directory / "c.jsonl.gz", "wt") as file:
        file.write(json.dumps({"text": "from a gzip file"}) + "\n")
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (directory / "d_chat.jsonl").write_text(json.dumps(chat) + "\n")
    return directory


def expected_texts() -> list[str]:
    """The corpus's text documents in input order (sorted paths), written out by hand."""
    return (
        [f"text {i} " * 25 for i in range(5)]
        + [f"line {i} " * (i % 7 + 1) for i in range(60)]
        + ["from a gzip file"]
    )


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


PIDS = []  # where unit_writer_recording_pid's file lies, set by the test that uses it


def unit_writer_recording_pid(todo):
    """prepare._write_unit, noting which process wrote each unit (a module-level function, so the
    workers reach it by name)."""
    with open(PIDS[0], "a") as file:
        file.write(f"{os.getpid()}\n")
    return WRITE_UNIT(todo)


WRITE_UNIT = preparation._write_unit


def test_one_and_several_workers_write_the_same_bytes(tmp_path, monkeypatch):
    """Units of 400 bytes: 3 worker processes write the same shards and meta.json, byte for byte,
    as one process; the units really ran in several processes; documents keep the input order."""
    monkeypatch.setattr(preparation, "UNIT_BYTES", 400)
    monkeypatch.setattr(preparation, "_write_unit", unit_writer_recording_pid)
    PIDS[:] = [tmp_path / "pids"]
    source, tokenizer = mixed_corpus(tmp_path / "corpus"), load_tokenizer("byte")
    one = prepare(source, tokenizer, tmp_path / "one", workers=1)
    assert len(set((tmp_path / "pids").read_text().split())) == 1
    (tmp_path / "pids").unlink()
    several = prepare(source, tokenizer, tmp_path / "several", workers=3)
    assert len(set((tmp_path / "pids").read_text().split()) - {str(os.getpid())}) >= 2
    assert files_of(one) == files_of(several)
    shards = TokenShards(one, tokenizer)
    units = len(preparation.plan_units(sorted(source.iterdir()), 400))
    assert len(shards.meta["shards"]) == units > 5  # one shard per unit: the corpus is cut
    texts = [tokenizer.decode(shards.document(i)[:-1].tolist()) for i in range(shards.num_docs)]
    assert texts[:-1] == expected_texts() and shards.masked
    assert shards.loss_mask(0).all() and not shards.loss_mask(shards.num_docs - 1).all()


def test_parts_joined_write_what_one_run_writes(tmp_path, monkeypatch, capsys):
    """Three parts (given to join in any order) joined: the bytes of one run; each part holds a
    disjoint run of the units, and together all of them."""
    monkeypatch.setattr(preparation, "UNIT_BYTES", 400)
    source, tokenizer = mixed_corpus(tmp_path / "corpus"), load_tokenizer("byte")
    one = prepare(source, tokenizer, tmp_path / "one", workers=1)
    parts = [prepare(source, tokenizer, tmp_path / f"part{i}", part=(i, 3)) for i in (1, 2, 3)]
    held = [sorted(p.name for p in part.glob("unit_*")) for part in parts]
    every = sorted(name for names in held for name in names)
    units = preparation.plan_units(sorted(source.iterdir()), 400)
    assert len(every) == len(set(every)) == len(units)
    assert all(held)
    preparation.main(
        ["join", str(parts[2]), str(parts[0]), str(parts[1]), "--out", str(tmp_path / "joined")]
    )
    printed = capsys.readouterr().out
    assert f"{tmp_path / 'joined'}: {TokenShards(one).num_docs} documents" in printed
    assert files_of(one) == files_of(tmp_path / "joined")
    assert [sorted(p.name for p in part.glob("unit_*")) for part in parts] == held  # still whole


# ----------------------------------------------------------------------------- formats


def test_large_jsonl_pieces_name_their_lines_by_byte(tmp_path, monkeypatch):
    """A bad line in a later piece of a cut JSONL file is named by its byte offset."""
    monkeypatch.setattr(preparation, "UNIT_BYTES", 100)
    lines = [json.dumps({"text": "x" * 20})] * 8 + ['{"body": 1}']
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    offset = sum(len(line) + 1 for line in lines[:-1])
    stops_with_one_line(
        lambda: prepare(tmp_path / "big.jsonl", load_tokenizer("byte"), tmp_path / "out"),
        DataError,
        f"big.jsonl: the line at byte {offset}:",
        "'text'",
    )


def test_gzip_text_and_jsonl_are_read_and_a_truncated_one_is_one_line(tmp_path):
    tokenizer = load_tokenizer("byte")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt.gz").write_bytes(gzip.compress(b"a gzipped text"))
    records = json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n"
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(gzip.compress(records.encode()))
    (tmp_path / "in" / "c.png.gz").write_bytes(gzip.compress(b"not read"))  # by its inner suffix
    shards = TokenShards(prepare(tmp_path / "in", tokenizer, tmp_path / "out"))
    texts = [tokenizer.decode(shards.document(i)[:-1].tolist()) for i in range(shards.num_docs)]
    assert texts == ["a gzipped text", "one", "two"]
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(records.encode())[:-12])
    stops_with_one_line(
        lambda: prepare(tmp_path / "cut.jsonl.gz", tokenizer, tmp_path / "o2"),
        DataError,
        "cut.jsonl.gz",
        "ends early",
    )
    (tmp_path / "plain.txt.gz").write_text("not gzip")
    stops_with_one_line(
        lambda: prepare(tmp_path / "plain.txt.gz", tokenizer, tmp_path / "o3"),
        DataError,
        "plain.txt.gz: cannot read",
        "gzip",
    )


def test_parquet_without_pyarrow_is_one_line_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    stops_with_one_line(
        lambda: prepare(tmp_path / "a.parquet", load_tokenizer("byte"), tmp_path / "out"),
        DataError,
        "a.parquet: reading parquet needs pyarrow",
        r"pip install pyarrow",
    )


def test_parquet_texts_and_a_missing_text_column(tmp_path):
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    parquet.write_table(
        pyarrow.table({"text": ["first", "second"], "id": [1, 2]}), tmp_path / "a.parquet"
    )
    tokenizer = load_tokenizer("byte")
    shards = TokenShards(prepare(tmp_path / "a.parquet", tokenizer, tmp_path / "out"))
    assert [tokenizer.decode(shards.document(i)[:-1].tolist()) for i in range(2)] == [
        "first",
        "second",
    ]
    parquet.write_table(pyarrow.table({"body": ["x"]}), tmp_path / "b.parquet")
    stops_with_one_line(
        lambda: prepare(tmp_path / "b.parquet", tokenizer, tmp_path / "o2"),
        DataError,
        "b.parquet: no column 'text'",
        "it has 'body'",
    )


# ----------------------------------------------------------------------------- meta.json, progress


def test_meta_records_each_shards_largest_id_and_checksum(tmp_path):
    """Hand-computed: "ab" and "zz" are bytes 97, 98 and 122, 122, each document ending with 256."""
    (tmp_path / "a.txt").write_text("ab")
    (tmp_path / "b.txt").write_text("zz")
    out = prepare(
        [tmp_path / "a.txt", tmp_path / "b.txt"],
        load_tokenizer("byte"),
        tmp_path / "out",
        shard_tokens=3,
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format_version"] == 3 and meta["shard_max_token"] == [256, 256]
    assert meta["shard_sha256"] == [
        hashlib.sha256(np.array(ids, np.uint16).tobytes()).hexdigest()
        for ids in ([97, 98, 256], [122, 122, 256])
    ]


def test_the_loader_reads_format_versions_1_to_3_and_refuses_a_later_one(tmp_path):
    (tmp_path / "a.txt").write_text("ab")
    out = prepare(tmp_path / "a.txt", load_tokenizer("byte"), tmp_path / "out")
    meta = json.loads((out / "meta.json").read_text())
    assert TokenShards(out).coarse.tolist() == [0, 3]  # version 3, the boundary: "ab" and its end
    (out / "coarse_starts.npy").unlink()
    (out / "meta.json").write_text(json.dumps({**meta, "format_version": 2}))
    assert TokenShards(out).num_docs == 1 and TokenShards(out).coarse is None  # version 2
    for key in ("format_version", "shard_max_token", "shard_sha256"):
        del meta[key]
    (out / "meta.json").write_text(json.dumps(meta))
    assert TokenShards(out).num_docs == 1  # version 1: written before the ranges were recorded
    (out / "meta.json").write_text(json.dumps({**meta, "format_version": 4}))
    stops_with_one_line(
        lambda: TokenShards(out),
        DataError,
        "meta.json: format_version 4",
        "expected 1 to 3: prepared by a newer version",
    )


def test_progress_lines_give_rates_and_time_left_every_few_seconds():
    """A fake clock: no line 4 s in; 8 MB of 10 MB and 2,000,000 tokens in 8 s is 1 MB/s and
    250,000 tokens/s, 2 MB left: 2 s; then none until 5 s have passed since the last line."""
    now, lines = [100.0], []
    progress = preparation.Progress(10_000_000, every=5.0, clock=lambda: now[0], write=lines.append)
    now[0] = 104.0
    progress.add(4_000_000, 120, 1_000_000)
    assert lines == []
    now[0] = 108.0
    progress.add(4_000_000, 80, 1_000_000)
    assert lines == [
        "prepare: 200 documents, 8.0 of 10.0 MB, 2,000,000 tokens; 1.00 MB/s, "
        "250,000 tokens/s; ETA 0:00:02"
    ]
    now[0] = 112.0
    progress.add(0, 0, 0)
    assert len(lines) == 1  # 4 s since the last line


def test_the_command_line_uses_one_worker_per_core_unless_told(tmp_path, monkeypatch):
    """--workers defaults to os.cpu_count() (here pretended 7) and reaches run_units; --workers 1,
    the accepted boundary, too."""
    seen, run_units = [], preparation.run_units
    monkeypatch.setattr(preparation.os, "cpu_count", lambda: 7)
    monkeypatch.setattr(
        preparation,
        "run_units",
        lambda job, todo, workers, progress: seen.append(workers)
        or run_units(job, todo, workers, progress),
    )
    (tmp_path / "a.txt").write_text("text")
    preparation.main(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o1")])
    preparation.main(
        ["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o2"), "--workers", "1"]
    )
    assert seen == [7, 1]


def test_a_damaged_part_is_one_line(tmp_path):
    """A part.json without its keys, and a part whose unit directory went missing."""
    (tmp_path / "a.txt").write_text("text")
    part = prepare(tmp_path / "a.txt", load_tokenizer("byte"), tmp_path / "part2", part=(2, 2))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "part.json").write_text("{}")
    stops_with_one_line(
        lambda: preparation.join([tmp_path / "broken"], tmp_path / "out"),
        DataError,
        f"join: {tmp_path / 'broken'} is not a part directory",
        "--part",
    )
    shutil.rmtree(part / "unit_000000")
    stops_with_one_line(
        lambda: preparation.join([part], tmp_path / "out"),
        DataError,
        f"join: {part / 'unit_000000'} is missing",
        "prepare part 2/2 again",
    )
