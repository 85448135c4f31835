"""Every tokenizer Flint uses, each as a tiktoken encoding; nothing is ever downloaded.

    "byte"                        256 byte tokens + <|endoftext|>
    a .tiktoken file              ranks only, split with the cl100k pattern
    a tiktoken encoding name      only if it is already in tiktoken's cache
    "checkpoint" or a directory   the checkpoint's byte-level BPE tokenizer.json, as ranks, with
                                  the chat template its tokenizer files carry, if any

`load_tokenizer(spec, eos_token, checkpoint_dir)` picks one and returns a `Tokenizer`: the encoding,
the id appended to every document, a fingerprint that prepared shards record, and the chat template
(chat.py renders conversations with it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import tiktoken.load

END_OF_TEXT = "<|endoftext|>"
# The split pattern of the cl100k family, for .tiktoken rank files (which store ranks only).
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
    r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
# GPT-2's pre-tokenizer split, what a ByteLevel pre-tokenizer with use_regex applies.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded: the message names the setting or file and what was
    expected."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template as Hugging Face tokenizer files carry it (chat.py renders it)."""

    source: str  # the Jinja text
    origin: str  # the file it was read from, or what else made it
    # bos_token, eos_token, ...: what the template sees by name
    variables: tuple[tuple[str, str], ...] = ()

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.source, self.variables]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Tokenizer:
    encoding: tiktoken.Encoding
    eos_id: int  # appended to every document
    fingerprint: str  # identifies the vocabulary; prepared shards record it
    # the tokenizer files' own; None: chat.py's plain template
    chat_template: ChatTemplate | None = None

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        return [
            ids + [self.eos_id] for ids in self.encoding.encode_ordinary_batch(texts, num_threads=4)
        ]

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids, errors="replace")

    def missing_bytes(self) -> list[int]:
        """The byte values that have no single-byte token (text holding one cannot be encoded)."""
        missing = []
        for byte in range(256):
            try:
                self.encoding.encode_single_token(bytes([byte]))
            except KeyError:
                missing.append(byte)
        return missing


def load_tokenizer(
    spec: str,
    eos_token: str = END_OF_TEXT,
    checkpoint_dir: str = "",
    setting: str = "data.tokenizer",
    eos_setting: str = "data.eos_token",
) -> Tokenizer:
    """spec: "byte" | "checkpoint" (the tokenizer.json of [model].init_from) | a directory with
    tokenizer.json | a .tiktoken file | a tiktoken encoding name that is already cached. `setting`
    and `eos_setting` name where spec and eos_token were given (a config key, a flag) in errors."""
    names, template = tiktoken.list_encoding_names(), None
    if spec == "byte":
        encoding, fingerprint = byte_encoding(), "byte-v1"
    elif spec == "checkpoint" or Path(spec).is_dir():
        if spec == "checkpoint" and not checkpoint_dir:
            raise TokenizerError(
                f'{setting} = "checkpoint" needs [model].init_from to name a checkpoint directory'
            )
        directory = Path(checkpoint_dir if spec == "checkpoint" else spec)
        encoding, fingerprint = checkpoint_encoding(directory, setting)
        template = read_chat_template(directory)
    elif spec.endswith(".tiktoken") and Path(spec).is_file():
        encoding, fingerprint = (
            tiktoken_file_encoding(Path(spec)),
            "tiktoken:" + _file_digest(Path(spec)),
        )
    elif spec in names:
        encoding = cached_encoding(spec)
        fingerprint = f"named:{spec}:{encoding.n_vocab}"
    else:
        raise TokenizerError(
            f'{setting} {spec!r} is not "byte", "checkpoint", a directory '
            f"with "
            "tokenizer.json, an existing .tiktoken file, or a tiktoken encoding "
            f"({', '.join(names)})"
        )
    if eos_token not in encoding.special_tokens_set:
        raise TokenizerError(
            f"{eos_setting} {eos_token!r} is not a special token of tokenizer "
            f"{spec!r}; it has "
            f"{sorted(encoding.special_tokens_set)[:8]}"
        )
    eos_id = encoding.encode_single_token(eos_token)
    return Tokenizer(encoding, eos_id, f"{fingerprint}|eos={eos_id}", template)


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ====================================================================== byte, .tiktoken file, named


def byte_encoding() -> tiktoken.Encoding:
    """256 single-byte tokens plus <|endoftext|> (id 256): any UTF-8 text, nothing to download.

    With no merges, the split pattern does not change the result; \\S+|\\s+ keeps pieces short.
    """
    ranks = {bytes([b]): b for b in range(256)}
    return tiktoken.Encoding(
        name="byte", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={END_OF_TEXT: 256}
    )


def tiktoken_file_encoding(path: Path) -> tiktoken.Encoding:
    """A .tiktoken ranks file ("<base64 token> <rank>" per line) with the cl100k split pattern;
    <|endoftext|> is added after the last rank."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise TokenizerError(
            f"{path}: not a text file ({error.reason} at byte {error.start}); "
            "expected "
            f"'<base64 token> <rank>' lines"
        ) from error
    ranks = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            token = base64.b64decode(token, validate=True)
            rank = int(rank)
        except ValueError as error:
            raise TokenizerError(
                f"{path}:{number}: expected '<base64 token> <rank>', got {line[:60]!r}"
            ) from error
        if token in ranks:
            raise TokenizerError(f"{path}:{number}: token {token!r} is ranked twice")
        ranks[token] = rank
    if not ranks:
        raise TokenizerError(
            f"{path}: no ranks (an empty file); expected '<base64 token> <rank>' lines"
        )
    special = {END_OF_TEXT: max(ranks.values()) + 1}
    check_ids(ranks, special, path)
    return tiktoken.Encoding(
        name=path.stem, pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens=special
    )


# Token ids up to 16M: 64 times the largest published vocabularies (262,144); tiktoken stores u32.
MAX_TOKEN_ID = 1 << 24


def check_ids(ranks: dict[bytes, int], special: dict[str, int], where: Path) -> None:
    """Every token's id is its own and in range: tiktoken panics on a shared id (a Rust panic, no
    Python error) and overflows on a negative one."""
    owner: dict[int, object] = {}
    for token, token_id in [*ranks.items(), *special.items()]:
        if not 0 <= token_id < MAX_TOKEN_ID:
            raise TokenizerError(
                f"{where}: token {token!r} has id {token_id}; expected 0 <= id < {MAX_TOKEN_ID:,}"
            )
        first = owner.setdefault(token_id, token)
        if first != token:
            raise TokenizerError(f"{where}: tokens {first!r} and {token!r} share the id {token_id}")


def cached_encoding(name: str) -> tiktoken.Encoding:
    """A tiktoken encoding from tiktoken's cache. On a miss tiktoken would fetch the encoding's
    file; refuse instead of downloading."""
    original = tiktoken.load.read_file

    def read_local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            cache = (
                os.environ.get("TIKTOKEN_CACHE_DIR")
                or os.environ.get("DATA_GYM_CACHE_DIR")
                or "<tmp>/data-gym-cache"
            )
            raise TokenizerError(
                f"tiktoken encoding {name!r} is not in the tiktoken cache "
                f"({cache}) and this "
                'program never downloads; use data.tokenizer = "byte", a '
                ".tiktoken file, or "
                f"a checkpoint directory with tokenizer.json"
            )
        return original(blobpath)

    tiktoken.load.read_file = read_local_only
    try:
        return tiktoken.get_encoding(name)
    finally:
        tiktoken.load.read_file = original


# ==================================================================== a checkpoint's tokenizer.json


def checkpoint_encoding(
    directory: Path,
    setting: str = "data.tokenizer",
) -> tuple[tiktoken.Encoding, str]:
    """The checkpoint's own tokenizer.json -> (encoding, fingerprint)."""
    if not (directory / "tokenizer.json").is_file():
        raise TokenizerError(
            f"{directory}: no tokenizer.json to load the checkpoint's tokenizer from"
        )
    try:
        encoding = hf_tokenizer_encoding(directory)
    except TokenizerError as error:
        raise TokenizerError(f"{setting}: {error}") from error
    return encoding, "tokenizer.json:" + _file_digest(directory / "tokenizer.json")


# The named special tokens that transformers passes to a chat template (its special_tokens_map).
TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def read_chat_template(directory: Path) -> ChatTemplate | None:
    """The chat template next to tokenizer.json, as transformers finds it: chat_template.jinja, else
    tokenizer_config.json's "chat_template" (a string, or a list of named templates: "default"),
    with that file's named special tokens as variables; None when there is none."""
    config_file, jinja_file = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TokenizerError(f"{config_file}: cannot read JSON: {error}") from error
        if not isinstance(config, dict):
            raise TokenizerError(
                f"{config_file}: expected a JSON object, got a {type(config).__name__}"
            )
    variables = tuple(
        (name, token_text(config[name], config_file, name))
        for name in TEMPLATE_TOKEN_NAMES
        if config.get(name) is not None
    )
    if jinja_file.is_file():
        return ChatTemplate(template_text(jinja_file), str(jinja_file), variables)
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
        if source is None:
            raise TokenizerError(
                f"{config_file}: chat_template lists templates "
                f"{sorted(map(str, named))} but none "
                f"named 'default'"
            )
    if source is None:
        return None
    if not isinstance(source, str):
        raise TokenizerError(
            f"{config_file}: chat_template must be a string (a Jinja template) or "
            "a list of "
            f"{{'name', 'template'}} objects, got {source!r:.60}"
        )
    if not source.strip():
        raise TokenizerError(
            f"{config_file}: chat_template is empty; write a Jinja chat template "
            f"there or remove the key"
        )
    return ChatTemplate(source, f"{config_file} chat_template", variables)


def template_text(file: Path) -> str:
    """chat_template.jinja's text: UTF-8 and not empty (an empty one renders no conversation)."""
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise TokenizerError(
            f"{file}: not UTF-8 text ({error.reason} at byte {error.start}); a "
            f"chat template is a Jinja text file"
        ) from None
    except OSError as error:
        raise TokenizerError(f"{file}: cannot read ({error.strerror or error})") from None
    if not text.strip():
        raise TokenizerError(f"{file}: empty; write a Jinja chat template there or remove the file")
    return text


def token_text(value: object, where: Path, name: str) -> str:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if not isinstance(value, str):
        raise TokenizerError(
            f"{where}: {name} must be a string or an object with a string "
            f"'content', got {value!r:.60}"
        )
    return value


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte table: printable bytes stand for themselves, the others for chars from U+0100
    on, so every byte of a byte-level BPE token is one visible character in tokenizer.json."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def _split_pattern(pre_tokenizer: dict | None, where: Path) -> str:
    """The one regex a byte-level pre-tokenizer splits with (tiktoken's pat_str)."""
    sequence = isinstance(pre_tokenizer, dict) and pre_tokenizer.get("type") == "Sequence"
    steps = pre_tokenizer.get("pretokenizers") if sequence else [pre_tokenizer]
    if not isinstance(steps, list):
        raise TokenizerError(
            f"{where}: pre_tokenizer.pretokenizers must be a list, got {steps!r:.60}"
        )
    patterns = []
    for step in steps:
        kind = step.get("type") if isinstance(step, dict) else None
        pattern = step.get("pattern") if kind == "Split" else None
        if (
            isinstance(pattern, dict)
            and isinstance(pattern.get("Regex"), str)
            and step.get("behavior") == "Isolated"
            and not step.get("invert")
        ):
            patterns.append(step["pattern"]["Regex"])
        elif kind == "ByteLevel" and not step.get("add_prefix_space"):
            patterns += [GPT2_PATTERN] if step.get("use_regex", True) else []
        else:
            raise TokenizerError(
                f"{where}: pre_tokenizer step {step!r} is not supported; expected "
                "Split with a "
                "Regex pattern and behavior 'Isolated', or ByteLevel without "
                "add_prefix_space"
            )
    if len(patterns) != 1:
        raise TokenizerError(
            f"{where}: pre_tokenizer must split with exactly one regex, found {len(patterns)}"
        )
    return patterns[0]


def added_tokens(entries: object, where: Path) -> dict[str, int]:
    """tokenizer.json's added_tokens ([{"content": ..., "id": ...}, ...]) -> content -> id."""

    def valid(token: object) -> bool:
        return (
            isinstance(token, dict)
            and isinstance(token.get("content"), str)
            and isinstance(token.get("id"), int)
            and not isinstance(token.get("id"), bool)
        )

    bad = [entries] if not isinstance(entries, list) else [t for t in entries if not valid(t)]
    if bad:
        raise TokenizerError(
            f"{where}: added_tokens must be a list of objects with a string "
            "'content' and an "
            f"integer 'id', got {bad[0]!r:.60}"
        )
    return {t["content"]: t["id"] for t in entries}


def hf_tokenizer_encoding(path: str | Path) -> tiktoken.Encoding:
    """A byte-level BPE tokenizer.json (or the directory holding it) as a tiktoken.Encoding with the
    same ids.

    tiktoken merges by token id, so ids must grow in merge order; added tokens become special tokens
    (encode with allowed_special to match them in text); tiktoken cannot normalize, so the
    normalizer must be null; the pre-tokenizer must split with one regex (Split Isolated, or
    ByteLevel)."""
    path = Path(path)
    path = path / "tokenizer.json" if path.is_dir() else path
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"{path}: cannot read JSON: {error}") from error
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        found = (
            f"model = {spec.get('model')!r:.40}"
            if isinstance(spec, dict)
            else f"a {type(spec).__name__}"
        )
        raise TokenizerError(
            f"{path}: expected a JSON object whose 'model' is an object (the BPE "
            "vocab and "
            f"merges), got {found}"
        )
    bpe = spec["model"]
    if bpe.get("type") != "BPE":
        raise TokenizerError(f"{path}: model.type must be 'BPE', got {bpe.get('type')!r}")
    for field in ("dropout", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"):
        if bpe.get(field):
            raise TokenizerError(
                f"{path}: model.{field} is {bpe[field]!r}; "
                f"a byte-level BPE for tiktoken needs it unset"
            )
    if spec.get("normalizer") is not None:
        raise TokenizerError(
            f"{path}: normalizer must be null (tiktoken cannot normalize), got "
            f"{spec['normalizer']!r}"
        )
    special = added_tokens(spec.get("added_tokens", []), path)
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab, ranks = bpe.get("vocab") or {}, {}
    if not isinstance(vocab, dict) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()
    ):
        raise TokenizerError(
            f"{path}: model.vocab must be an object of token -> id, got {vocab!r:.40}"
        )
    for token, token_id in vocab.items():
        if token in special:
            if special[token] != token_id:
                raise TokenizerError(
                    f"{path}: added token {token!r} has id {special[token]} but vocab id {token_id}"
                )
            continue
        bad = [c for c in token if c not in to_byte]
        if bad:
            raise TokenizerError(
                f"{path}: vocab token {token!r} is not byte-level "
                f"({bad[0]!r} is not a GPT-2 byte char)"
            )
        ranks[bytes(to_byte[c] for c in token)] = token_id
    missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
    if missing_bytes:
        raise TokenizerError(
            f"{path}: vocab lacks the byte token "
            f"{bytes_to_unicode()[missing_bytes[0]]!r}; "
            f"a byte-level BPE needs all 256"
        )
    merges = bpe.get("merges") or []
    if not isinstance(merges, list):
        raise TokenizerError(
            f"{path}: model.merges must be a list of 'left right' strings or "
            f"[left, right] pairs, got {merges!r:.40}"
        )
    merged, previous = set(), -1
    for number, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        pair = pair if isinstance(pair, list) else []
        if len(pair) != 2 or not all(isinstance(side, str) for side in pair):
            raise TokenizerError(
                f"{path}: merge {number} {merge!r} must be 'left right' or [left, right]"
            )
        left, right = pair
        token_id = vocab.get(left + right)
        if left not in vocab or right not in vocab or token_id is None or token_id <= previous:
            raise TokenizerError(
                f"{path}: merge {number} {left!r} + {right!r} must join two vocab "
                "tokens into one "
                f"whose id is above the previous merge's ({previous}); got id "
                f"{token_id}"
            )
        merged.add(left + right)
        previous = token_id
    unmerged = [t for t in vocab if len(t) > 1 and t not in merged and t not in special]
    if unmerged:
        raise TokenizerError(f"{path}: vocab token {unmerged[0]!r} is made by no merge")
    check_ids(ranks, special, path)
    pattern = _split_pattern(spec.get("pre_tokenizer"), path)
    try:
        return tiktoken.Encoding(
            name=f"flint:{path}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
        )
    except ValueError as error:  # the split regex does not compile
        raise TokenizerError(
            f"{path}: the pre_tokenizer's regex {pattern!r:.60} is not valid: {error}"
        ) from None


# ==================================================================== export (transformers' files)


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges that rebuild each multi-byte token, in rank order: BPE run on the token's bytes
    with the tokens ranked below it leaves two pieces, the pair its own merge joins (the byte
    tokenizer has none)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            joined = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, at = min(joined)
            if best >= rank:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def _bpe_model(ranks: dict[bytes, int]) -> dict:
    """tokenizer.json's "model": each token's bytes in GPT-2's byte chars at its id, the merges."""
    chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    in_order = sorted(ranks.items(), key=lambda item: item[1])
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": {text(token): rank for token, rank in in_order},
        "merges": [[text(left), text(right)] for left, right in bpe_merges(ranks)],
    }


def hf_tokenizer_files(tokenizer: Tokenizer) -> dict[str, dict]:
    """The tokenizer as transformers' PreTrainedTokenizerFast reads it, with the same ids:
    tokenizer.json, a byte-level BPE (the special tokens added, the encoding's split regex), and
    tokenizer_config.json, whose eos and bos are the end-of-text token (flint prepends no BOS; a
    bos_token set keeps generate() from asking for one)."""
    encoding = tokenizer.encoding
    special = encoding._special_tokens  # tiktoken keeps no public copy of it or of the ranks
    eos = next(name for name, token_id in special.items() if token_id == tokenizer.eos_id)
    added = [
        {
            "id": token_id,
            "content": name,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for name, token_id in sorted(special.items())
    ]
    split = {
        "type": "Split",
        "pattern": {"Regex": encoding._pat_str},
        "behavior": "Isolated",
        "invert": False,
    }
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": False,
    }
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
        "post_processor": None,
        "decoder": byte_level,
        "model": _bpe_model(encoding._mergeable_ranks),
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template.source
    return {"tokenizer.json": spec, "tokenizer_config.json": config}


def write_hf_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """hf_tokenizer_files into `directory` (an export's temporary directory: written whole or not
    at all)."""
    for name, content in hf_tokenizer_files(tokenizer).items():
        text = json.dumps(content, indent=1, ensure_ascii=False) + "\n"
        (directory / name).write_text(text, encoding="utf-8")
