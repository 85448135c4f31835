"""tools/synthetic_corpus.py: N documents, the same bytes for a seed, other bytes for another."""

import json

import pytest

from helpers import stops_with_one_line
from tools import synthetic_corpus


def test_the_corpus_has_n_documents_and_is_fixed_by_its_seed(tmp_path):
    synthetic_corpus.main(
        [
            "--out",
            str(tmp_path / "a"),
            "--documents",
            "7",
            "--files",
            "3",
            "--words",
            "10",
            "--seed",
            "5",
        ]
    )
    synthetic_corpus.main(
        [
            "--out",
            str(tmp_path / "b"),
            "--documents",
            "7",
            "--files",
            "3",
            "--words",
            "10",
            "--seed",
            "5",
        ]
    )
    synthetic_corpus.main(
        [
            "--out",
            str(tmp_path / "c"),
            "--documents",
            "7",
            "--files",
            "3",
            "--words",
            "10",
            "--seed",
            "6",
        ]
    )
    files = sorted((tmp_path / "a").iterdir())
    assert [f.name for f in files] == [
        "corpus_00000.jsonl",
        "corpus_00001.jsonl",
        "corpus_00002.jsonl",
    ]
    lines = [line for f in files for line in f.read_text().splitlines()]
    assert [len(f.read_text().splitlines()) for f in files] == [2, 2, 3]  # 7 * i // 3 apart
    words = [json.loads(line)["text"].split() for line in lines]
    assert all(5 <= len(w) <= 15 for w in words)  # half to one and a half times --words
    assert all(word.isalpha() and word.islower() for w in words for word in w)
    same = [f.read_bytes() for f in sorted((tmp_path / "b").iterdir())]
    other = [f.read_bytes() for f in sorted((tmp_path / "c").iterdir())]
    assert [f.read_bytes() for f in files] == same != other


@pytest.mark.parametrize(
    "argv, named, pattern",
    [
        (["--documents", "0"], "--documents", r"must be >= 1, got 0"),
        (["--documents", "2", "--files", "0"], "--files", r"must be >= 1, got 0"),
        (["--documents", "2", "--seed", "-1"], "--seed", r"must be >= 0, got -1"),
    ],
)
def test_bad_flags_stop_with_one_line(tmp_path, argv, named, pattern):
    stops_with_one_line(
        lambda: synthetic_corpus.main(["--out", str(tmp_path / "o"), *argv]),
        SystemExit,
        named,
        pattern,
    )
    assert not (tmp_path / "o").exists()


def test_an_existing_out_is_refused_and_the_boundary_values_accepted(tmp_path):
    (tmp_path / "o").mkdir()
    stops_with_one_line(
        lambda: synthetic_corpus.main(["--out", str(tmp_path / "o"), "--documents", "1"]),
        SystemExit,
        "--out",
        "exists; name a new directory",
    )
    synthetic_corpus.main(
        ["--out", str(tmp_path / "n"), "--documents", "1", "--words", "1", "--seed", "0"]
    )
    assert len(json.loads((tmp_path / "n" / "corpus_00000.jsonl").read_text())["text"].split()) == 1
