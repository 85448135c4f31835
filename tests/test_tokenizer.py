"""tokenizer.py: every way to load a tokenizer, none of them downloading, and the tokenizer.json
conversion checked against byte-level BPE written out by hand."""

import base64
import json
import os
import random
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import tiktoken.load

from tokenizer import (
    TokenizerError,
    bytes_to_unicode,
    hf_tokenizer_encoding,
    hf_tokenizer_files,
    load_tokenizer,
    write_hf_tokenizer,
)

# ============================================================================= load_tokenizer


def test_byte_tokenizer_round_trips_any_text_and_ends_documents():
    tokenizer = load_tokenizer("byte")
    text = "héllo   wörld\n\t€ 12345 — ok"
    (ids,) = tokenizer.encode_documents([text])
    assert ids[:-1] == list(text.encode("utf-8")) and ids[-1] == tokenizer.eos_id == 256
    assert tokenizer.vocab_size == 257
    assert tokenizer.decode(ids[:-1]) == text


def test_tiktoken_file_applies_its_merges(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 256
    ranks[b"abc"] = 257
    path = tmp_path / "small.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    tokenizer = load_tokenizer(str(path))
    (ids,) = tokenizer.encode_documents(["abcab x"])
    assert ids == [257, 256, ord(" "), ord("x"), 258]  # 258: <|endoftext|> after the last rank
    assert tokenizer.vocab_size == 259


def test_named_encoding_is_never_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # an empty cache: a miss
    with pytest.raises(TokenizerError, match="never downloads"):
        load_tokenizer("gpt2")
    with pytest.raises(TokenizerError, match="data.tokenizer 'no-such' is not"):
        load_tokenizer("no-such")
    with pytest.raises(TokenizerError, match="data.tokenizer 'missing.tiktoken' is not"):
        load_tokenizer("missing.tiktoken")


def test_checkpoint_tokenizer_loads_its_tokenizer_json(tmp_path):
    vocab = {bytes_to_unicode()[b]: b for b in range(256)} | {"ab": 256, "<|endoftext|>": 257}
    spec = {
        "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]},
        "normalizer": None,
        "added_tokens": [{"id": 257, "content": "<|endoftext|>"}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = load_tokenizer("checkpoint", checkpoint_dir=str(tmp_path))
    assert (
        tokenizer.encode_documents(["abc"]) == [[256, ord("c"), 257]]
        and tokenizer.vocab_size == 258
    )
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece"}}))
    with pytest.raises(TokenizerError, match="model.type must be 'BPE'"):
        load_tokenizer(str(tmp_path))


def test_eos_token_must_exist():
    with pytest.raises(TokenizerError, match="data.eos_token '<|im_end|>'"):
        load_tokenizer("byte", eos_token="<|im_end|>")


# ==================================================================== a checkpoint's tokenizer.json

# Pre-tokenizer split that Python's re and tiktoken's regex engine read the same way on the test
# text: contractions, letters (with "_"), up to 3 digits, other symbols, and whitespace runs.
SPLIT = r"""'s|'t| ?[^\W\d]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+"""
SPECIALS = ["<|endoftext|>", "<|im_start|>"]
CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 2024 and the dog's 3 friends said "
    "'hello'!\n"
    "Numbers like 123456 and 7 go in groups; tabs\tand  double  spaces too. Café, naïve, déjà "
    "vu.\n"
    "東京 and 東京タワー are in Tokyo. snake_case_names and CamelCase. "
) * 3
TEXT = (
    "Hello the lazy fox!!  It's 98765 o'clock\t\tat Café déjà-vu — 東京タワー 🚀🚀 "
    "snake_case<|endoftext|>  new\n\n  lines <|im_start|>x   "
)


def gpt2_byte_table() -> dict[int, str]:
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def test_byte_table_is_gpt2s():
    table = gpt2_byte_table()
    assert (table[ord(" ")], table[ord("\n")], table[0], table[ord("a")], table[173]) == (
        "Ġ",
        "Ċ",
        "Ā",
        "a",
        "Ń",
    )
    assert bytes_to_unicode() == table


def merge_word(word: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if tuple(word[i : i + 2]) == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(corpus: str, pattern: str, num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training: repeatedly merge the most frequent adjacent pair (new tokens only)."""
    table = gpt2_byte_table()
    words = Counter(
        tuple(table[b] for b in piece.encode()) for piece in re.findall(pattern, corpus)
    )
    merges, tokens = [], set(table.values())
    for _ in range(num_merges):
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        candidates = [p for p in pairs if p[0] + p[1] not in tokens]
        if not candidates:
            break
        best = max(candidates, key=lambda p: (pairs[p], p))
        merges.append(best)
        tokens.add(best[0] + best[1])
        words = Counter({tuple(merge_word(list(w), best)): c for w, c in words.items()})
    return merges


def bpe_by_hand(text: str, merges, vocab: dict, pattern: str) -> list[int]:
    """Hugging Face BPE semantics: specials first, split, bytes -> chars, lowest-ranked listed merge
    first."""
    table, ranks, ids = gpt2_byte_table(), {pair: i for i, pair in enumerate(merges)}, []
    for chunk in re.split("(" + "|".join(map(re.escape, SPECIALS)) + ")", text):
        if chunk in SPECIALS:
            ids.append(vocab[chunk])
            continue
        for piece in re.findall(pattern, chunk):
            word = [table[b] for b in piece.encode()]
            while len(word) > 1:
                pair = min(zip(word, word[1:]), key=lambda p: ranks.get(p, len(ranks)))
                if pair not in ranks:
                    break
                word = merge_word(word, pair)
            ids += [vocab[token] for token in word]
    return ids


def write_tokenizer(directory: Path, pre_tokenizer: dict, pattern: str, pair_lists: bool = False):
    merges = train_bpe(CORPUS, pattern, 300)
    byte_tokens = list(gpt2_byte_table().values())
    random.Random(0).shuffle(byte_tokens)  # byte ids need not follow byte order
    vocab = {token: i for i, token in enumerate(byte_tokens + [a + b for a, b in merges])}
    added = [{"id": len(vocab) + i, "content": t, "special": True} for i, t in enumerate(SPECIALS)]
    spec = {
        "version": "1.0",
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": [list(m) if pair_lists else " ".join(m) for m in merges],
        },
    }
    directory.mkdir(exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return merges, {**vocab, **{t["content"]: t["id"] for t in added}}


@pytest.mark.parametrize("pair_lists", [False, True])
def test_tokenizer_matches_bpe_by_hand(tmp_path, monkeypatch, pair_lists):
    def no_downloads(*args, **kwargs):
        raise AssertionError("tiktoken tried to download")

    monkeypatch.setattr(tiktoken.load, "read_file", no_downloads)
    pre = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT}, "behavior": "Isolated", "invert": False},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
        ],
    }
    merges, vocab = write_tokenizer(tmp_path, pre, SPLIT, pair_lists)
    encoding = hf_tokenizer_encoding(tmp_path)
    ids = encoding.encode(TEXT, allowed_special="all")
    assert ids == bpe_by_hand(TEXT, merges, vocab, SPLIT)
    assert len(ids) < len(TEXT.encode())  # merges did apply
    assert encoding.decode(ids) == TEXT
    assert encoding.encode(CORPUS) == bpe_by_hand(CORPUS, merges, vocab, SPLIT)


def test_byte_level_pre_tokenizer_uses_the_gpt2_split(tmp_path):
    ascii_gpt2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"""
    merges, vocab = write_tokenizer(
        tmp_path, {"type": "ByteLevel", "add_prefix_space": False}, ascii_gpt2
    )
    text = "It's the lazy dog's 12345 friends,  they'll jump!!\n\n over  it "
    encoding = hf_tokenizer_encoding(tmp_path / "tokenizer.json")
    assert encoding.encode(text) == bpe_by_hand(text, merges, vocab, ascii_gpt2)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.__setitem__("normalizer", {"type": "NFC"}), "normalizer must be null"),
        (lambda s: s["model"]["merges"].reverse(), "merge 1 "),
        (lambda s: s["model"]["vocab"].__setitem__("∑x", 10_000), "'∑x' is not byte-level"),
        (lambda s: s.__setitem__("pre_tokenizer", {"type": "Whitespace"}), "pre_tokenizer step"),
    ],
)
def test_unsupported_tokenizers_are_refused(tmp_path, edit, message):
    write_tokenizer(tmp_path, {"type": "ByteLevel", "add_prefix_space": False}, SPLIT)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    edit(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match=re.escape(message)):
        hf_tokenizer_encoding(tmp_path)


# ================================================================ export in transformers' format

REFERENCE_VENV = Path(os.environ.get("FLINT_HF_VENV", Path.home() / ".cache" / "flint" / "hfvenv"))
REFERENCE_PYTHON = REFERENCE_VENV / "bin" / "python"  # tests/hf_venv.py's, with transformers
TEXTS = ["héllo   wörld\n\t€ 12345 — ok", "abcab x", "User: What is a list?\nAssistant: "]


def small_bpe(tmp_path: Path):
    """A .tiktoken tokenizer with two merges: a + b -> ab (256), ab + c -> abc (257)."""
    ranks = {**{bytes([b]): b for b in range(256)}, b"ab": 256, b"abc": 257}
    path = tmp_path / "small.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return load_tokenizer(str(path))


def test_the_byte_tokenizer_exports_each_byte_at_its_id_and_end_of_text():
    """GPT-2's byte chars, by hand: printable bytes stand for themselves, bytes 0-32 are
    U+0100-U+0120, 127-160 are U+0121-U+0142, 173 (soft hyphen) is U+0143."""
    files = hf_tokenizer_files(load_tokenizer("byte"))
    spec, config = files["tokenizer.json"], files["tokenizer_config.json"]
    vocab = spec["model"]["vocab"]
    assert len(vocab) == 256 and spec["model"]["merges"] == []
    expected = {
        "A": 65,
        "~": 126,
        "\u0100": 0,
        "\u010a": 10,
        "\u0120": 32,
        "\u0121": 127,
        "\u0142": 160,
        "\u0143": 173,
        "\u00ae": 174,
        "\u00ff": 255,
    }
    assert {token: vocab[token] for token in expected} == expected
    (added,) = spec["added_tokens"]
    assert added["content"] == "<|endoftext|>" and added["id"] == 256 and added["special"] is True
    assert config["eos_token"] == config["bos_token"] == "<|endoftext|>"
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["add_bos_token"] is False


def test_a_bpe_exports_the_merges_that_rebuild_its_tokens(tmp_path):
    """Each multi-byte token's merge, in rank order (hand-built), and flint reads the export back to
    the same ids."""
    tokenizer = small_bpe(tmp_path)
    write_hf_tokenizer(tokenizer, tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["model"]["merges"] == [["a", "b"], ["ab", "c"]]
    assert spec["model"]["vocab"]["abc"] == 257 and spec["added_tokens"][0]["id"] == 258
    back = hf_tokenizer_encoding(tmp_path)
    for text in TEXTS:
        assert back.encode_ordinary(text) == tokenizer.encoding.encode_ordinary(text)


@pytest.mark.slow
@pytest.mark.skipif(not REFERENCE_PYTHON.exists(), reason=f"no reference venv {REFERENCE_PYTHON}")
@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_transformers_autotokenizer_reads_the_export_to_the_same_ids(tmp_path, kind):
    tokenizer = load_tokenizer("byte") if kind == "byte" else small_bpe(tmp_path)
    write_hf_tokenizer(tokenizer, tmp_path)
    script = (
        "import json, sys; from transformers import AutoTokenizer\n"
        "t = AutoTokenizer.from_pretrained(sys.argv[1]); texts = json.loads(sys.argv[2])\n"
        "ids = [t(text)['input_ids'] for text in texts]\n"
        "print(json.dumps({'ids': ids, 'eos': t.eos_token_id, 'bos': t.bos_token_id,"
        " 'decoded': [t.decode(i) for i in ids]}))"
    )
    result = subprocess.run(
        [str(REFERENCE_PYTHON), "-c", script, str(tmp_path), json.dumps(TEXTS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    read = json.loads(result.stdout.strip().splitlines()[-1])
    assert read["ids"] == [tokenizer.encoding.encode_ordinary(text) for text in TEXTS]
    assert read["eos"] == read["bos"] == tokenizer.eos_id and read["decoded"] == TEXTS
