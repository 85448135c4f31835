"""tools/loader_bench.py: the synthetic prepared directory it writes, and what it measures."""

import json

import numpy as np

import data
from tools import loader_bench


def test_the_synthetic_directory_is_a_prepared_one_with_the_documents_asked(tmp_path, monkeypatch):
    """1,000 documents of 8..23 tokens over shards of at most 4,000 tokens (about 15.5 * 1,000 /
    4,000 -> 4 or 5 shards): the loader opens it, every document has its length, none spans two
    shards, and the token files hold as many uint16 ids as the index says."""
    monkeypatch.setattr(loader_bench, "SHARD_TOKENS", 4000)
    tokens = loader_bench.write_corpus(tmp_path, 1000)
    shards = data.TokenShards(tmp_path)
    lengths = shards.lengths(np.arange(1000))
    assert shards.num_docs == 1000 and int(lengths.sum()) == shards.num_tokens == tokens
    assert lengths.min() >= 8 and lengths.max() <= 23
    assert 4 <= len(shards.meta["shards"]) <= 5
    for name in shards.meta["shards"]:
        bounds = np.load(tmp_path / f"docs_{name}.npy")
        assert bounds[-1] <= 4000
        assert (tmp_path / f"tokens_{name}.bin").stat().st_size == 2 * bounds[-1]
    assert json.loads((tmp_path / "meta.json").read_text())["num_tokens"] == tokens


def test_a_measurement_reads_a_batch_and_counts_per_document(tmp_path, monkeypatch):
    monkeypatch.setattr(loader_bench, "SEQ_LEN", 16)
    loader_bench.write_corpus(tmp_path, 2000)
    result = loader_bench.measure(tmp_path)
    assert result["docs"] == 2000
    assert 0 <= result["open_s"] <= result["first_batch_s"]
    assert 0 < result["python_peak_mib"] < 64
    assert loader_bench.row(result).startswith("| 2,000 | ")


def test_drawing_the_documents_in_chunks_writes_the_same_directory(tmp_path, monkeypatch):
    """1B documents are drawn 16M at a time; chunks of 64 and of 1 (shards of 4,000 tokens: a shard
    takes documents of several chunks, and a chunk can start a shard) write the same files as one
    draw of all 1,000."""
    monkeypatch.setattr(loader_bench, "SHARD_TOKENS", 4000)
    tokens = loader_bench.write_corpus(tmp_path / "whole", 1000)
    whole = sorted(path.name for path in (tmp_path / "whole").iterdir())
    for chunk in (64, 1):
        monkeypatch.setattr(loader_bench, "CHUNK_DOCS", chunk)
        assert loader_bench.write_corpus(tmp_path / f"{chunk}", 1000) == tokens
        assert whole == sorted(path.name for path in (tmp_path / f"{chunk}").iterdir())
        for name in whole:
            want = (tmp_path / "whole" / name).read_bytes()
            assert (tmp_path / f"{chunk}" / name).read_bytes() == want, (chunk, name)


def test_cold_evicts_each_directorys_files_before_measuring(tmp_path, monkeypatch, capsys):
    """--cold: every file of the size's directory is advised out of the page cache, before the
    measuring process starts; without it, none is."""
    advised, order = [], []
    monkeypatch.setattr(loader_bench.os, "posix_fadvise", lambda fd, *a: advised.append(a))
    measured = {"docs": 100, "open_s": 0, "open_cpu_s": 0, "first_batch_s": 0}
    measured |= {"first_batch_cpu_s": 0, "python_peak_mib": 0, "anon_mib": 0, "file_mib": 0}

    class Child:
        stdout = json.dumps(measured)

    def run(*args, **kwargs):
        order.append(len(advised))
        return Child

    monkeypatch.setattr(loader_bench.subprocess, "run", run)
    loader_bench.main(["--docs", "100", "--dir", str(tmp_path)])
    loader_bench.main(["--cold", "--docs", "100", "--dir", str(tmp_path)])
    files = len(list((tmp_path / "docs_100").iterdir()))
    assert order == [0, files] and len(advised) == files == 4  # tokens, index, coarse, meta
    assert all(a[2] == loader_bench.os.POSIX_FADV_DONTNEED for a in advised)
    assert "| 100 | " in capsys.readouterr().out
