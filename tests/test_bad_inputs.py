"""Inputs that once ended in a raw traceback or a misleading message (issue 19): each now stops with
one line of the repository's own error kinds that names the file, key or flag and says what was
expected.

Every table row is (how to build the bad input, what the message must name, a pattern it must
match); `{dir}` in the name stands for the row's directory. One small trained run (module-scoped)
provides the checkpoints that the sample.py and convert.py rows copy and damage."""

import base64
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import convert
import prepare as preparation
import sample
from checkpoint_files import CheckpointError
from config import ConfigError, load_config
from data import DataError, TokenShards
from helpers import DEFAULT_FAMILY, debug_args, only, run_debug, stops_with_one_line, tiny_preset
from prepare import prepare
from registry import family
from tokenizer import TokenizerError, bytes_to_unicode, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Two steps of the debug config: run_0001/step_00000001 and step_00000002 under ckpt/, and the
    Hugging Face export hf/."""
    directory = tmp_path_factory.mktemp("trained")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_debug(
            directory,
            "--training.steps=2",
            "--checkpoint.every=1",
            "--training.sample_tokens=0",
            f"--checkpoint.export_hf={directory / 'hf'}",
        )
    finally:
        torch.set_num_threads(threads)
    return directory


def edit_json(file: Path, change) -> None:
    data = json.loads(file.read_text())
    file.write_text(json.dumps(change(data)))


def ranks_file(path: Path, tokens: list[bytes]) -> str:
    """A .tiktoken file ranking `tokens` in order."""
    path.write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    )
    return str(path)


# ========================================================================= train.py's configuration


def debug(tmp_path: Path, *overrides: str) -> tuple[str, list[str]]:
    """The debug config with its paths under tmp_path, as (file, overrides) for load_config."""
    args = debug_args(tmp_path, *overrides)
    return args[1], args[2:]


def not_utf8(tmp_path, monkeypatch):
    (tmp_path / "run.toml").write_bytes(b'[model]\npreset = "tiny\xff"\n')
    return tmp_path / "run.toml", []


def hf_config(text):
    """A run whose [model].hf_config is a config.json holding text (a dict, or a function making
    one)."""

    def build(tmp_path, monkeypatch):
        (tmp_path / "config.json").write_text(json.dumps(text() if callable(text) else text))
        return debug(tmp_path, "--model.preset=", f"--model.hf_config={tmp_path / 'config.json'}")

    return build


def overrides(*given: str):
    return lambda tmp_path, monkeypatch: debug(tmp_path, *given)


def export_under_a_file(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    return debug(tmp_path, f"--checkpoint.export_hf={tmp_path / 'afile' / 'hf'}")


def export_read_only(tmp_path, monkeypatch):
    """A read-only directory; os.access says so even to root, who may write anywhere."""
    (tmp_path / "ro").mkdir(mode=0o555)
    real = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode: real(p, mode) and not (Path(p) == tmp_path / "ro" and mode & os.W_OK),
    )
    return debug(tmp_path, f"--checkpoint.export_hf={tmp_path / 'ro' / 'hf'}")


def tiny_hf_config() -> dict:
    """config.json of the smallest preset of the family the run trains."""
    return family(DEFAULT_FAMILY).config.from_name(tiny_preset(DEFAULT_FAMILY)).to_hf_config()


CONFIG_CASES = {
    "toml not utf-8": (not_utf8, "{dir}/run.toml", r"not UTF-8 text .* must be UTF-8"),
    "seed -1": (
        overrides("--training.seed=-1"),
        "[training].seed",
        r"must be 0 <= seed < 2\*\*64, "
        r"got -1$",
    ),
    "seed 2**64": (
        overrides(f"--training.seed={2**64}"),
        "[training].seed",
        r"must be 0 <= seed < "
        r"2\*\*64",
    ),
    "model_type a list": (
        hf_config(lambda: {**tiny_hf_config(), "model_type": ["flint"]}),
        "{dir}/config.json",
        r"model_type \['flint'\] is not one of",
    ),
    "text_config a string": pytest.param(
        hf_config({"model_type": "mistral_large4", "text_config": "tiny"}),
        "text_config",
        r"config.json: text_config must be an "
        r"object .* got str",
        marks=only("large4"),
    ),
    "text_config a number": pytest.param(
        hf_config({"model_type": "mistral_large4", "text_config": 3}),
        "text_config",
        r"config.json: text_config must be an object .* got int 3",
        marks=only("large4"),
    ),
    "pp_microbatches 3 of 4 rows": (
        overrides("--parallel.pp=2", "--parallel.pp_microbatches=3"),
        "--parallel.pp_microbatches",
        r"= 3 must divide the "
        r"\[training\].batch_size = 4",
    ),
    "pp stages 2 of 3 rows": (
        overrides("--parallel.pp=2", "--training.batch_size=3"),
        "--training.batch_size",
        r"pp_microbatches = 2 \(one per pipeline stage\) must divide "
        r".*batch_size = 3",
    ),
    "pp_microbatches -1": (
        overrides("--parallel.pp=2", "--parallel.pp_microbatches=-1"),
        "[parallel].pp_microbatches",
        r"must be >= 0 .*got -1",
    ),
    "export under a file": (
        export_under_a_file,
        "checkpoint.export_hf",
        r"lies under .*afile, "
        r"which is a file",
    ),
    "export read-only": (export_read_only, "checkpoint.export_hf", r"ro/hf is not writable"),
}


@pytest.mark.parametrize("build, named, pattern", CONFIG_CASES.values(), ids=CONFIG_CASES)
def test_bad_training_configs_stop_with_one_line(tmp_path, monkeypatch, build, named, pattern):
    path, given = build(tmp_path, monkeypatch)
    stops_with_one_line(
        lambda: load_config(path, given), ConfigError, named.format(dir=tmp_path), pattern
    )


# ============================================================================= data and tokenizers


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A prepared data directory of 20 small documents (one shard): 10 of 31 tokens, 10 of 36, 670
    in all."""
    directory = tmp_path_factory.mktemp("prepared")
    (directory / "docs.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i} " * 5}) + "\n" for i in range(20))
    )
    return prepare(directory / "docs.jsonl", load_tokenizer("byte"), directory / "shards")


def meta(change):
    return lambda directory: edit_json(directory / "meta.json", change)


PREPARED_CASES = {
    "meta.json a list": (
        meta(lambda m: []),
        "{dir}/meta.json",
        r"expected a JSON object, got a "
        r"list",
    ),
    "meta.json lacks shards": (
        meta(lambda m: {k: v for k, v in m.items() if k != "shards"}),
        "{dir}/meta.json",
        r"lacks key 'shards', expected a list",
    ),
    "meta.json lacks dtype": (
        meta(lambda m: {k: v for k, v in m.items() if k != "dtype"}),
        "{dir}/meta.json",
        r"lacks key 'dtype', expected a str",
    ),
    "missing shard": (
        lambda d: (d / "tokens_00000.bin").unlink(),
        "{dir}/tokens_00000.bin",
        r"missing; .*prepare",
    ),
    "empty shard": (
        lambda d: (d / "tokens_00000.bin").write_bytes(b""),
        "{dir}/tokens_00000.bin",
        r"empty; .*prepare",
    ),
    "meta.json of another version": (
        meta(lambda m: {**m, "format": "flint-token-shards-v9"}),
        "{dir}/meta.json",
        r"format 'flint-token-shards-v9', .* another version .*prepare the data again$",
    ),
    "meta.json not UTF-8": (
        lambda d: (d / "meta.json").write_bytes(b"\xff{}"),
        "{dir}/meta.json",
        r"cannot read JSON: .*not a prepared data directory",
    ),
    "shard named outside": (
        meta(lambda m: {**m, "shards": ["../../outside"]}),
        "{dir}/meta.json",
        r"list of shard names, got .* shards \['\.\./\.\./outside'\]",
    ),
    "masked without its template": (
        meta(lambda m: {**m, "format": "flint-token-shards-v2"}),
        "{dir}/meta.json",
        r"lacks key 'chat_template', expected a str: the file is damaged",
    ),
    "shard cut by a byte": (
        lambda d: cut(d / "tokens_00000.bin", 1),
        "{dir}/tokens_00000.bin",
        r"not a shard of uint16 tokens \(Size of available data is not a ",
    ),
    "shard cut by a token": (
        lambda d: cut(d / "tokens_00000.bin", 2),
        "{dir}/tokens_00000.bin",
        r"holds 669 tokens but docs_00000.npy ends at 670",
    ),
    "document index out of order": (
        lambda d: index(d, [0, 50, 10, 670]),
        "{dir}/docs_00000.npy",
        r"document starts must rise from 0, got \[0, 50, 10, 670\]",
    ),
    "document index not from 0": (
        lambda d: index(d, [5, 670]),
        "{dir}/docs_00000.npy",
        r"rise from 0, got \[5, 670\]",
    ),
    "coarse starts missing": (
        lambda d: (d / "coarse_starts.npy").unlink(),
        "{dir}/coarse_starts.npy",
        r"not the coarse document starts \(.*No such file.*\); prepare the data again",
    ),
    "coarse starts of another corpus": (
        lambda d: np.save(d / "coarse_starts.npy", np.array([0, 5, 9])),
        "{dir}/coarse_starts.npy",
        r"expected \d+ integer starts ending at the shards' 670 tokens, got int64 \[3\]",
    ),
    "document index of floats": (
        lambda d: index(d, [0.0, 670.0]),
        "{dir}/docs_00000.npy",
        r"expected the integer start of each document then the end, got "
        r"an array of float64",
    ),
}


def cut(file: Path, size: int) -> None:
    file.write_bytes(file.read_bytes()[:-size])


def index(directory: Path, bounds: list) -> None:
    np.save(directory / "docs_00000.npy", np.array(bounds))


@pytest.mark.parametrize("damage, named, pattern", PREPARED_CASES.values(), ids=PREPARED_CASES)
def test_damaged_prepared_directories_stop_with_one_line(
    tmp_path, prepared, damage, named, pattern
):
    directory = shutil.copytree(prepared, tmp_path / "shards")
    damage(directory)
    stops_with_one_line(
        lambda: read_every_document(TokenShards(directory, load_tokenizer("byte"))),
        DataError,
        named.format(dir=directory),
        pattern,
    )


def read_every_document(shards: TokenShards) -> None:
    """Opening checks what it can in O(shards); a document's own bounds are checked when read."""
    for i in range(shards.num_docs):
        shards.document(i)


def test_a_deeply_nested_jsonl_line_stops_with_one_line(tmp_path):
    (tmp_path / "deep.jsonl").write_text(
        '{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    )
    stops_with_one_line(
        lambda: prepare(tmp_path / "deep.jsonl", load_tokenizer("byte"), tmp_path / "out"),
        DataError,
        f"{tmp_path / 'deep.jsonl'}:1",
        r"'text' \(data.text_key\): the line nests "
        r".* too deeply",
    )


def prepare_args(*given: str, inputs=("a.txt",), make=None):
    """prepare.py prepare's argv in a directory holding a.txt ("some text") and b.txt (empty);
    `make(dir)` adds to it first. --out is out/ unless given."""

    def build(directory: Path) -> list[str]:
        (directory / "a.txt").write_text("some text")
        (directory / "b.txt").write_text("")
        if make:
            make(directory)
        out = [] if "--out" in given else ["--out", str(directory / "out")]
        return ["prepare", *(str(directory / name) for name in inputs), *out, *given]

    return build


def join_args(parts: list[str], given: list[str] | None = None):
    """prepare.py join's argv over parts i/N of a.txt and b.txt (other2: part 2/2 of a.txt alone),
    and shards/, a prepared directory; `given` names the directories joined (default part1...)."""

    def build(directory: Path) -> list[str]:
        for name, text in (("a.txt", "some text"), ("b.txt", "more text")):
            (directory / name).write_text(text)
        prepared_input(directory)
        for part in parts:
            preparation.main(
                [
                    "prepare",
                    str(directory / "a.txt"),
                    str(directory / "b.txt"),
                    "--out",
                    str(directory / f"part{part[0]}"),
                    "--part",
                    part,
                ]
            )
        preparation.main(
            [
                "prepare",
                str(directory / "a.txt"),
                "--out",
                str(directory / "other2"),
                "--part",
                "2/2",
            ]
        )
        names = given or [f"part{part[0]}" for part in parts]
        return ["join", *(str(directory / name) for name in names), "--out", str(directory / "out")]

    return build


def prepared_input(directory: Path) -> None:
    prepare(directory / "a.txt", load_tokenizer("byte"), directory / "shards")


DATA_CLI_CASES = {
    "seq-len -5": (
        prepare_args("--seq-len", "-5"),
        "--seq-len",
        r"must be 1 <= N <= 16,777,216 tokens, got -5$",
    ),
    "seq-len 0": (
        prepare_args("--seq-len", "0"),
        "--seq-len",
        r"must be 1 <= N <= 16,777,216 tokens, got 0$",
    ),
    "seq-len huge": (prepare_args("--seq-len", str(2**24 + 1)), "--seq-len", r"got 16777217$"),
    "seq-len 1.5": (
        prepare_args("--seq-len", "1.5"),
        "--seq-len",
        r"expected a whole number of tokens, got '1.5'",
    ),
    "seq-len word": (
        prepare_args("--seq-len", "many"),
        "--seq-len",
        r"whole number of tokens, got 'many'",
    ),
    "overlong without seq-len": (
        prepare_args("--overlong", "drop"),
        "--overlong",
        r"give --seq-len too",
    ),
    "overlong bogus": (
        prepare_args("--seq-len", "8", "--overlong", "cut"),
        "--overlong",
        r"invalid choice: 'cut'",
    ),
    "text-key empty": (prepare_args("--text-key", ""), "--text-key", r"must not be empty"),
    "eos-token empty": (prepare_args("--eos-token", ""), "--eos-token", r"must not be empty"),
    "tokenizer empty": (prepare_args("--tokenizer", ""), "--tokenizer", r"must not be empty"),
    "extensions empty": (
        prepare_args("--extensions", ",,"),
        "--extensions",
        r"comma-separated file extensions",
    ),
    "extensions all and more": (
        prepare_args("--extensions", "txt,all"),
        "--extensions",
        r"'all' alone",
    ),
    "tokenizer bogus": (
        prepare_args("--tokenizer", "bogus"),
        "--tokenizer 'bogus'",
        r"is not \"byte\"",
    ),
    "eos-token bogus": (
        prepare_args("--eos-token", "<eos>"),
        "--eos-token '<eos>'",
        r"not a special token",
    ),
    "out exists": (
        prepare_args(make=lambda d: (d / "out").mkdir()),
        "--out {dir}/out",
        r"already exists; name a new directory \(prepare never overwrites\)$",
    ),
    "out a file": (
        prepare_args(make=lambda d: (d / "out").write_text("")),
        "--out {dir}/out",
        r"is a file; name a new",
    ),
    "out under a file": (
        prepare_args("--out", "{dir}/a.txt/out"),
        "--out {dir}/a.txt/out",
        r"lies under {dir}/a.txt, which is a file$",
    ),
    "input missing": (
        prepare_args(inputs=("a.txt", "missing.txt")),
        "input {dir}/missing.txt",
        r"does not exist",
    ),
    "input empty": (
        prepare_args(inputs=("b.txt",)),
        "input {dir}/b.txt:",
        r"no documents with text in 1 file",
    ),
    "input named twice": (
        prepare_args(inputs=("b.txt", "b.txt")),
        "input names {dir}/b.txt twice",
        r"read twice$",
    ),
    "tokenizer lacking bytes": (
        prepare_args(
            "--tokenizer",
            "{dir}/ascii.tiktoken",
            make=lambda d: ranks_file(d / "ascii.tiktoken", [bytes([b]) for b in range(128)]),
        ),
        "input {dir}/a.txt",
        r"the tokenizer has no token for byte 0x80 \(128 bytes lack one\)",
    ),
    "workers 0": (prepare_args("--workers", "0"), "--workers", r"must be >= 1, got 0$"),
    "part 0 of 2": (prepare_args("--part", "0/2"), "--part", r"1 <= i <= N .*got '0/2'$"),
    "part 3 of 2": (prepare_args("--part", "3/2"), "--part", r"1 <= i <= N .*got '3/2'$"),
    "part a word": (prepare_args("--part", "half"), "--part", r"expected i/N .*got 'half'$"),
    "input zst": (
        prepare_args(inputs=("a.txt.zst",), make=lambda d: (d / "a.txt.zst").write_bytes(b"(")),
        "{dir}/a.txt.zst",
        r"\.zst files are not read .*decompress it first \(zstd -d\)",
    ),
    "join a part missing": (
        join_args(["1/3", "3/3"]),
        "join: part(s) 2 of 3 missing",
        r"\(given: 1/3, 3/3\); prepare each with --part i/3$",
    ),
    "join a part twice": (
        join_args(["1/2", "2/2"], given=["part1", "part2", "part1"]),
        "join: part 1/2 given twice ({dir}/part1 and {dir}/part1)",
        r"twice",
    ),
    "join not a part": (
        join_args(["1/2", "2/2"], given=["part1", "shards"]),
        "join: {dir}/shards is not a part directory",
        r"make parts with prepare --part i/N$",
    ),
    "join parts of other inputs": (
        join_args(["1/2", "2/2"], given=["part1", "other2"]),
        "join: {dir}/other2 is part 2/2 of another preparation than {dir}/part1",
        r"other inputs, tokenizer or settings",
    ),
    "input prepared": (
        prepare_args(inputs=("shards",), make=prepared_input),
        "input {dir}/shards",
        r"is a prepared directory already \(it holds meta.json\); train on it with data.path",
    ),
}


@pytest.mark.parametrize("build, named, pattern", DATA_CLI_CASES.values(), ids=DATA_CLI_CASES)
def test_bad_prepare_flags_and_inputs_stop_with_one_line(tmp_path, build, named, pattern):
    """Every flag of prepare.py prepare, and its inputs and output: one line naming it (paths
    written as paths), and nothing written."""
    argv = [arg.format(dir=tmp_path) for arg in build(tmp_path)]
    before = sorted(tmp_path.iterdir())
    stops_with_one_line(
        lambda: preparation.main(argv),
        SystemExit,
        named.format(dir=tmp_path),
        pattern.format(dir=re.escape(str(tmp_path))),
    )
    assert sorted(tmp_path.iterdir()) == before


def test_prepare_accepts_the_boundary_values_of_its_flags(tmp_path, capsys):
    """The refusals' boundaries: --seq-len 1 and 16,777,216 report rows; --extensions all; two
    inputs, one of them empty; an upper-case extension in --extensions."""
    (tmp_path / "a.TXT").write_text("some text")
    (tmp_path / "b.txt").write_text("")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    for seq_len in ("1", str(2**24)):
        preparation.main(
            [
                "prepare",
                str(tmp_path / "chat.jsonl"),
                "--out",
                str(tmp_path / f"out{seq_len}"),
                "--seq-len",
                seq_len,
                "--overlong",
                "drop",
            ]
        )
    printed = capsys.readouterr().out
    assert (
        "with --seq-len 1: no document fits: all 1 are longer than 1 tokens and --overlong drop"
        in printed
    )
    assert f"with --seq-len {2**24}: all 3 tokens (1 rows of {2**24})" in printed
    preparation.main(
        ["prepare", str(tmp_path), "--out", str(tmp_path / "all"), "--extensions", "TXT"]
    )
    assert "1 documents, 10 tokens from 2 file(s)" in capsys.readouterr().out


def tokenizer_json(spec):
    def build(directory: Path) -> str:
        (directory / "tokenizer.json").write_text(json.dumps(spec))
        return str(directory)

    return build


def tiktoken_bytes(content: bytes):
    def build(directory: Path) -> str:
        (directory / "ranks.tiktoken").write_bytes(content)
        return str(directory / "ranks.tiktoken")

    return build


def byte_level(merges=None, pre_tokenizer=None, vocab_id=None, eos_id=256):
    """tokenizer.json of a byte-level BPE without merges (and <|endoftext|>), changed as named: the
    merges, the pre_tokenizer, the id of the byte 0's token, the id of <|endoftext|>."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)} | (
        {table[0]: vocab_id} if vocab_id is not None else {}
    )
    spec = {
        "model": {"type": "BPE", "vocab": vocab, "merges": [] if merges is None else merges},
        "normalizer": None,
        "added_tokens": [{"content": "<|endoftext|>", "id": eos_id}],
        "pre_tokenizer": pre_tokenizer or {"type": "ByteLevel", "add_prefix_space": False},
    }
    return tokenizer_json(spec)


BPE = {"type": "BPE", "vocab": {"a": 0}, "merges": []}
TOKENIZER_CASES = {
    "empty .tiktoken": (tiktoken_bytes(b""), "{dir}/ranks.tiktoken", r"no ranks \(an empty file\)"),
    "binary .tiktoken": (
        tiktoken_bytes(b"\x00\xff\xfe\x80"),
        "{dir}/ranks.tiktoken",
        r"not a text file",
    ),
    "tokenizer.json a list": (
        tokenizer_json([]),
        "{dir}/tokenizer.json",
        r"expected a JSON object "
        r".* got a list",
    ),
    "model a string": (
        tokenizer_json({"model": "BPE"}),
        "{dir}/tokenizer.json",
        r"got model = "
        r"'BPE'",
    ),
    "vocab a list": (
        tokenizer_json({"model": {**BPE, "vocab": ["a"]}, "normalizer": None}),
        "model.vocab",
        r"tokenizer.json: model.vocab must be an object of token -> id",
    ),
    "added token without content": (
        tokenizer_json({"model": BPE, "normalizer": None, "added_tokens": [{"id": 3}]}),
        "added_tokens",
        r"tokenizer.json: added_tokens must be .* "
        r"string 'content'",
    ),
    "merges a number": (
        byte_level(merges=5),
        "{dir}/tokenizer.json",
        r"model.merges must be a list .* got 5$",
    ),
    "merge a number": (
        byte_level(merges=[7]),
        "{dir}/tokenizer.json",
        r"merge 0 7 must be 'left right'",
    ),
    "pre_tokenizer a string": (
        byte_level(pre_tokenizer="ByteLevel"),
        "{dir}/tokenizer.json",
        r"pre_tokenizer step 'ByteLevel' is not supported",
    ),
    "pretokenizers a number": (
        byte_level(pre_tokenizer={"type": "Sequence", "pretokenizers": 3}),
        "{dir}/tokenizer.json",
        r"pre_tokenizer.pretokenizers must be a list, got 3$",
    ),
    "Split pattern a string": (
        byte_level(pre_tokenizer={"type": "Split", "pattern": "x", "behavior": "Isolated"}),
        "{dir}/tokenizer.json",
        r"pre_tokenizer step .* is not supported",
    ),
    "Split regex broken": (
        byte_level(
            pre_tokenizer={"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated"}
        ),
        "{dir}/tokenizer.json",
        r"the pre_tokenizer's regex '\(\(' is not valid: Parsing error",
    ),
    "two tokens share an id": (
        byte_level(vocab_id=1),
        "{dir}/tokenizer.json",
        r"tokens b'\\x00' and b'\\x01' share the id 1",
    ),
    "negative id": (
        byte_level(vocab_id=-1),
        "{dir}/tokenizer.json",
        r"token b'\\x00' has id -1; expected 0 <= id",
    ),
    "id past 2**32": (
        byte_level(vocab_id=2**40),
        "{dir}/tokenizer.json",
        r"has id 1099511627776; expected 0 <= id < 16,777,216$",
    ),
    "special token on a byte's id": (
        byte_level(eos_id=5),
        "{dir}/tokenizer.json",
        r"tokens b'\\x05' and '<\|endoftext\|>' share the id 5",
    ),
    ".tiktoken rank shared": (
        tiktoken_bytes(b"YQ== 0\nYg== 0\n"),
        "{dir}/ranks.tiktoken",
        r"b'a' and b'b' share the id 0",
    ),
    ".tiktoken token twice": (
        tiktoken_bytes(b"YQ== 0\nYQ== 1\n"),
        "{dir}/ranks.tiktoken:2",
        r"b'a' is ranked twice",
    ),
    ".tiktoken rank negative": (tiktoken_bytes(b"YQ== -1\n"), "{dir}/ranks.tiktoken", r"has id -1"),
}


@pytest.mark.parametrize("build, named, pattern", TOKENIZER_CASES.values(), ids=TOKENIZER_CASES)
def test_bad_tokenizer_files_stop_with_one_line(tmp_path, build, named, pattern):
    spec = build(tmp_path)
    stops_with_one_line(
        lambda: load_tokenizer(spec), TokenizerError, named.format(dir=tmp_path), pattern
    )


# ============================================================================= sample.py


def step_copy(change=None):
    """sample.py's arguments for a copy of the run's last step, changed by change(directory)."""

    def build(trained: Path, directory: Path) -> list[str]:
        shutil.copytree(trained / "ckpt" / "run_0001" / "step_00000002", directory)
        if change:
            change(directory)
        return ["--checkpoint", str(directory)]

    return build


def flags(*given: str, tokenizer=None):
    """The last step with these flags (tokenizer: a list of byte strings for a .tiktoken file)."""

    def build(trained: Path, directory: Path) -> list[str]:
        extra = (
            ["--tokenizer", ranks_file(directory.parent / "ranks.tiktoken", tokenizer)]
            if tokenizer
            else []
        )
        return [*step_copy()(trained, directory), *given, *extra]

    return build


def nan_weights(trained: Path, directory: Path) -> list[str]:
    shutil.copytree(trained / "hf", directory)
    shard = next(directory.glob("model-*.safetensors"))
    state = load_file(shard)
    state["model.embed_tokens.weight"][0, 0] = float("nan")
    save_file(state, shard, metadata={"format": "pt"})
    return ["--checkpoint", str(directory)]


BYTES = [bytes([b]) for b in range(256)]
SAMPLE_CASES = {
    "train_config.json not JSON": (
        step_copy(lambda d: (d / "train_config.json").write_text("{nope")),
        "{dir}/train_config.json",
        r"cannot read JSON",
    ),
    "train_config.json a list": (
        step_copy(lambda d: (d / "train_config.json").write_text("[]")),
        "{dir}/train_config.json",
        r"expected a JSON object, got a list",
    ),
    "data a string": (
        step_copy(lambda d: (d / "train_config.json").write_text('{"data": "x"}')),
        "{dir}/train_config.json",
        r"expected data to be an object .* got data = 'x'",
    ),
    "model_type a list": (
        step_copy(lambda d: edit_json(d / "config.json", lambda c: {**c, "model_type": ["flint"]})),
        "{dir}/config.json",
        r"model_type \['flint'\] is not one of",
    ),
    "temperature inf": (
        flags("--temperature", "inf"),
        "--temperature",
        r"0 \(greedy\) or a finite "
        r"number",
    ),
    "temperature nan": (
        flags("--temperature", "nan"),
        "--temperature",
        r"finite number >= 0.001, "
        r"got nan",
    ),
    "temperature 1e-45": (
        flags("--temperature", "1e-45"),
        "--temperature",
        r"finite number >= "
        r"0.001, got 1e-45",
    ),
    "NaN weights": pytest.param(
        nan_weights,
        "{dir}",
        r"the checkpoint's weights are not finite "
        r"\(embed_tokens.weight",
        marks=only("flint"),
    ),  # Flint's published names
    "max-new-tokens past the context": (
        flags("--max-new-tokens", "5000"),
        "--max-new-tokens",
        r"prompt's 4 tokens exceed .* max_position_embeddings = "
        r"4096.* at most 4092",
    ),
    "prompt character the tokenizer lacks": (
        flags("--prompt", "é", tokenizer=BYTES[:128]),
        "--prompt",
        r"character 'é' \(byte 0xc3\) has no token",
    ),
    "tokenizer larger than the vocabulary": (
        flags(tokenizer=BYTES + [bytes([65, b]) for b in range(20)]),
        "--tokenizer",
        r"277 tokens, more than the model's "
        r"vocab_size = 264",
    ),
    "device foo": (
        flags("--device", "foo"),
        "--device",
        r"expected cpu or cuda \(cuda:N\), got "
        r"'foo'",
    ),
    "seed 2**64": (flags("--seed", str(2**64)), "--seed", r"must be 0 <= seed < 2\*\*64"),
}


@pytest.mark.slow
@pytest.mark.parametrize("build, named, pattern", SAMPLE_CASES.values(), ids=SAMPLE_CASES)
def test_bad_sampling_inputs_stop_with_one_line(trained, tmp_path, build, named, pattern):
    argv = build(trained, tmp_path / "checkpoint")
    stops_with_one_line(
        lambda: sample.main([*argv[:2], "--max-new-tokens", "2", "--temperature", "0", *argv[2:]]),
        SystemExit,
        named.format(dir=tmp_path / "checkpoint"),
        pattern,
    )


def test_a_run_directory_samples_its_newest_intact_checkpoint(trained, tmp_path, capsys):
    runs = shutil.copytree(trained / "ckpt", tmp_path / "ckpt")
    newest = runs / "run_0001" / "step_00000002"
    data_file = next(newest.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:-8])
    assert sample.resolve_checkpoint(runs, "--checkpoint") == runs / "run_0001" / "step_00000001"
    warning = capsys.readouterr().err
    assert f"WARNING: skipping the damaged checkpoint {newest}: {data_file}" in warning
    older = runs / "run_0001" / "step_00000001" / next(newest.glob("*.distcp")).name
    older.write_bytes(older.read_bytes()[:-8])
    stops_with_one_line(
        lambda: sample.resolve_checkpoint(runs, "--checkpoint"),
        CheckpointError,
        f"--checkpoint {runs}",
        r"none of its 2 step_\* checkpoints is intact",
    )


# ============================================================================= convert.py


def hf_copy(change):
    """convert.py to-native of a copy of the run's export, changed by change(directory)."""

    def build(trained: Path, directory: Path) -> list[str]:
        shutil.copytree(trained / "hf", directory)
        change(directory)
        return ["to-native", str(directory), str(directory.parent / "out")]

    return build


def weight_map_shard(shard: str):
    def change(directory: Path) -> None:
        def edit(index: dict) -> dict:
            first = next(iter(index["weight_map"]))
            return {**index, "weight_map": {**index["weight_map"], first: shard}}

        edit_json(directory / "model.safetensors.index.json", edit)

    return change


def config_fields(**fields):
    return lambda directory: edit_json(directory / "config.json", lambda c: {**c, **fields})


def large4_config(**fields):
    def change(directory: Path) -> None:
        text = {
            **family("large4").config.from_name("large4-tiny").to_hf_config()["text_config"],
            **fields,
        }
        (directory / "config.json").write_text(
            json.dumps({"model_type": "mistral_large4", "text_config": text})
        )

    return change


def to_hf(change):
    def build(trained: Path, directory: Path) -> list[str]:
        directory.mkdir()
        change(trained, directory)
        return ["to-hf", str(directory), str(directory.parent / "out")]

    return build


INDEX = "{dir}/model.safetensors.index.json"
CONVERT_CASES = {
    "weight_map names ''": (hf_copy(weight_map_shard("")), INDEX, r"in '', which is not a file of"),
    "weight_map names '.'": (
        hf_copy(weight_map_shard(".")),
        INDEX,
        r"in '\.', which is not a file "
        r"of",
    ),
    "num_hidden_layers a string": pytest.param(
        hf_copy(config_fields(num_hidden_layers="4")),
        "{dir}/config.json",
        r"num_hidden_layers must be a positive integer, got "
        r"'4'",
        marks=only("flint"),
    ),  # Flint's config.json is flat
    "Large 4 num_hidden_layers a string": pytest.param(
        hf_copy(large4_config(num_hidden_layers="8")),
        "{dir}/config.json",
        r"num_hidden_layers must be a positive "
        r"integer, got '8'",
        marks=only("large4"),
    ),
    "model_type a list": (
        hf_copy(config_fields(model_type=["flint"])),
        "{dir}/config.json",
        r"model_type \['flint'\] is not one of",
    ),
    "text_config a list": pytest.param(
        hf_copy(config_fields(model_type="mistral_large4", text_config=[1])),
        "{dir}/config.json",
        r"text_config must be an object .* got "
        r"list \[1\]",
        marks=only("large4"),
    ),
    "to-hf of a published checkpoint": (
        to_hf(lambda t, d: shutil.copytree(t / "hf", d, dirs_exist_ok=True)),
        "{dir}",
        r"not a native checkpoint \(no .metadata",
    ),
    "to-hf of a config.json alone": (
        to_hf(lambda t, d: shutil.copy(t / "hf" / "config.json", d)),
        "{dir}",
        r"not a native checkpoint \(no .metadata",
    ),
}


@pytest.mark.parametrize("build, named, pattern", CONVERT_CASES.values(), ids=CONVERT_CASES)
def test_bad_conversion_inputs_stop_with_one_line(trained, tmp_path, build, named, pattern):
    argv = build(trained, tmp_path / "checkpoint")
    stops_with_one_line(
        lambda: convert.main(argv), SystemExit, named.format(dir=tmp_path / "checkpoint"), pattern
    )
    assert not (tmp_path / "out").exists()


# ============================================================================= resuming, other data


def chat_data(path: Path) -> Path:
    """30 conversations of 22 byte tokens ("User: q\\nAssistant: ab" and the end-of-text), two to a
    row of the debug config's 64 tokens, and 10 of 120: 25 rows when the long ones are truncated, 15
    when they are dropped."""
    short = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]}
    long = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "word " * 20},
        ]
    }
    path.write_text("".join(json.dumps(short if i % 4 else long) + "\n" for i in range(40)))
    return path


@pytest.mark.slow
def test_a_resume_names_every_data_setting_that_changed(tmp_path, capsys):
    """A resume whose rows differ from the checkpoint's is refused naming each data setting that
    changed (data.overlong, data.text_key and training.seed here; it named data.seq_len alone,
    unchanged). Its boundary, a resume whose rows hold (the same data under another spelling of its
    path), goes on with a warning naming the change; and of [logging] profile_steps = "1-2", step 1
    trained before the resume is said to be lost to the profile while step 2, the first the resume
    trains, is profiled."""
    data_file = chat_data(tmp_path / "chat.jsonl")
    chat = [f"--data.path={data_file}", "--training.sample_tokens=0", "--data.val_fraction=0"]
    run_debug(tmp_path, *chat, "--training.steps=1")
    resume = [*chat, "--training.steps=2", "--checkpoint.resume=auto"]
    checkpoint = tmp_path / "ckpt" / "run_0001" / "step_00000001"
    changed = ["--data.overlong=drop", "--data.text_key=body", "--training.seed=3"]
    stops_with_one_line(
        lambda: run_debug(tmp_path, *resume, *changed),
        DataError,
        "changed since the checkpoint: data.text_key 'text' -> 'body', data.overlong "
        "'truncate' -> 'drop', training.seed 0 -> 3;",
        r"^the checkpoint's train data position was saved for 25 rows of 64 tokens per epoch, but "
        r"this run has 15 rows of 64: [^;]*; resume with the checkpoint's data settings",
    )
    capsys.readouterr()
    respelled = str(tmp_path / "ckpt" / ".." / data_file.name)
    run_debug(tmp_path, *resume, f"--data.path={respelled}", "--logging.profile_steps=1-2")
    printed = capsys.readouterr().out
    assert (
        f"WARNING: resumed with data settings changed since {checkpoint}: data.path "
        f"{str(data_file)!r} -> {respelled!r}; from step 2 the run reads other rows"
    ) in printed
    assert (
        "WARNING: command line --logging.profile_steps: profile_steps = '1-2' names steps 1-2, of "
        "which 1-1 were trained before this run resumed at step 1: profiling steps 2-2 only"
    ) in printed
    assert [p.name for p in checkpoint.parent.glob("trace_*")] == ["trace_steps2-2_rank0.json"]
