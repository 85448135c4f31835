"""prepare.py: inputs read as documents (text, directories, JSONL), tokenized into shards; its errors."""

import json
from pathlib import Path

import numpy as np
import pytest
import tiktoken

import prepare as preparation
from data import DataError, TokenShards
from prepare import prepare
from tokenizer import Tokenizer, load_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")


def test_prepare_text_directory_and_jsonl(tmp_path):
    source = tmp_path / "corpus"
    (source / "sub").mkdir(parents=True)
    (source / "a.txt").write_text("first document")
    (source / "sub" / "b.md").write_text("second")
    (source / ".hidden").write_text("never read")
    (source / "c.jsonl").write_text(json.dumps({"text": "third"}) + "\n\n" + json.dumps({"text": "fourth"}) + "\n")
    tokenizer = load_tokenizer("byte")
    out = prepare(source, tokenizer, tmp_path / "prepared")
    shards = TokenShards(out, tokenizer)
    texts = [tokenizer.decode(shards.document(i)[:-1].tolist()) for i in range(shards.num_docs)]
    assert texts == ["first document", "third", "fourth", "second"]  # sorted paths: a.txt, c.jsonl, sub/b.md
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
    preparation.main(["prepare", str(corpus), "--out", str(tmp_path / "only_md"), "--extensions", "md"])
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
    with pytest.raises(DataError, match="no documents with text in 1 file.*1 binary file.* skipped: .*binary.txt"):
        prepare(tmp_path / "binary.txt", tokenizer, tmp_path / "out")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:3: not UTF-8 text \(invalid continuation byte at byte 13"):
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
    with pytest.raises(DataError, match=r"images holds no text or JSONL files \(1 file\(s\) with other extensions"):
        prepare(tmp_path / "images", tokenizer, tmp_path / "out")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]  # no output, no temp dir


def test_a_long_document_is_tokenized_in_pieces_with_the_same_ids(tmp_path, monkeypatch):
    """A long single-line document (here 300 KB, with pieces of 20,000 characters instead of 1 MiB)
    is encoded piece by piece (memory: one piece of ids, not the document's), cut where whitespace
    runs begin: the ids equal those of the whole text, for bytes and for BPE merges across spaces."""
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
