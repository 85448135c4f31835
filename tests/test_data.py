"""data.py: the prepared shards read back, and the packed loader's coverage, masks, order and
position."""

import json
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import prepare as preparation
from data import DataError, PackedLoader, Split, TokenShards, split_documents
from helpers import DEFAULT_FAMILY, FAMILY_NAMES, build, stops_with_one_line, tiny_config
from prepare import prepare
from tokenizer import Tokenizer, byte_encoding, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- helpers


def unique_token_shards(directory, doc_lengths, shard_tokens=1 << 20):
    """Shards whose every token id is unique (its stream index), so a test can tell tokens apart."""
    writer = preparation.ShardWriter(directory, np.uint32, shard_tokens)
    start = 0
    for n in doc_lengths:
        writer.add([list(range(start, start + n))])
        start += n
    writer.finish({"tokenizer": "test", "vocab_size": start, "eos_id": 0, "sources": []})
    return TokenShards(directory)


def epoch_rows(loader, rows):
    return [loader.row(g) for g in range(rows)]


# ----------------------------------------------------------------------------- prepare


def test_documents_never_span_shards(tmp_path):
    shards = unique_token_shards(tmp_path, [5, 7, 3, 9, 2], shard_tokens=10)
    assert len(shards.meta["shards"]) == 4  # [5], [7, 3], [9], [2]: a document never straddles two
    assert np.concatenate([shards.document(i) for i in range(5)]).tolist() == list(range(26))


def test_shards_from_another_tokenizer_are_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    out = prepare(tmp_path / "a.txt", load_tokenizer("byte"), tmp_path / "prepared")
    with pytest.raises(DataError, match="prepared with tokenizer"):
        TokenShards(out, Tokenizer(byte_encoding(), 256, "another vocabulary"))


def test_ids_outside_the_vocabulary_are_refused_when_read_or_at_open_when_recorded(tmp_path):
    """Without a recorded range, opening reads no token and the row that holds the bad id is
    refused, naming the shard; a range recorded in meta.json is refused at open; the boundary (the
    largest id 256 of the 257-token vocabulary) opens."""
    (tmp_path / "a.txt").write_text("text")
    tokenizer = load_tokenizer("byte")
    out = prepare(tmp_path / "a.txt", tokenizer, tmp_path / "prepared")
    meta = json.loads((out / "meta.json").read_text())
    del meta["shard_max_token"]  # as a directory of format version 1 records no range
    (out / "meta.json").write_text(json.dumps(meta))
    tokens = np.memmap(out / "tokens_00000.bin", dtype=np.uint16, mode="r+")
    tokens[1] = 300  # the byte vocabulary has 257 ids
    tokens.flush()
    loader = PackedLoader(
        TokenShards(out, tokenizer), Split.whole(1), seq_len=2, batch_size=1, seed=0
    )
    refusal = r"tokens_00000.bin holds token id 300, outside the vocabulary of 257"
    with pytest.raises(DataError, match=refusal):
        loader.row(0)
    (out / "meta.json").write_text(json.dumps({**meta, "shard_max_token": [300]}))
    with pytest.raises(DataError, match=refusal):
        TokenShards(out, tokenizer)
    (out / "meta.json").write_text(json.dumps({**meta, "shard_max_token": [256]}))
    assert TokenShards(out, tokenizer).checked_at_open


def test_embedded_corpus_is_present_and_splits():
    lines = data.EMBEDDED_CORPUS.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 79 and all(json.loads(line)["text"] for line in lines)
    train, val = (split.indices() for split in split_documents(79, 0.05, "corpus"))
    assert len(val) == 4 and not set(train) & set(val) and len(train) + len(val) == 79
    # fixed, whatever the seed
    assert split_documents(79, 0.05, "corpus")[1].indices().tolist() == val.tolist()
    with pytest.raises(DataError, match="too few"):
        split_documents(1, 0.05, "one.txt")


# ----------------------------------------------------------------------------- packing


def test_packing_covers_every_token_once_per_epoch(tmp_path):
    lengths = [17, 3, 40, 1, 25, 9, 64, 2]
    shards = unique_token_shards(tmp_path, lengths)
    loader = PackedLoader(shards, Split.whole(len(lengths)), seq_len=16, batch_size=1, seed=3)
    rows = epoch_rows(loader, loader.rows_per_epoch)
    inputs = np.concatenate([r["input_ids"][r["doc_ids"] >= 0] for r in rows])
    assert sorted(inputs.tolist()) == list(range(sum(lengths)))  # every token exactly once
    assert loader.rows_per_epoch == -(-sum(lengths) // 16)
    for r in rows:  # the target is the next token of the same document, else -100
        doc_of = np.searchsorted(np.cumsum(lengths), r["input_ids"], side="right")
        for i in range(16):
            if r["doc_ids"][i] < 0:
                assert r["targets"][i] == -100
            elif r["targets"][i] != -100:
                assert r["targets"][i] == r["input_ids"][i] + 1
                assert (
                    np.searchsorted(np.cumsum(lengths), r["targets"][i], side="right") == doc_of[i]
                )
            else:  # the document's last token: its successor belongs to another document
                assert r["input_ids"][i] + 1 in np.cumsum(lengths)
        assert (r["doc_ids"][r["doc_ids"] >= 0] == np.array(doc_of)[r["doc_ids"] >= 0]).all()


# Each family's model of the test below: Flint's 3 layers with full attention only; Large 4's layout
# model (its sparse selection picks among a document's keys: 4 of up to 20).
PACKING_MODELS = {"flint": {"num_hidden_layers": 3, "sliding_window": None}, "large4": {}}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_rows_never_attend_across_documents(tmp_path, family):
    """Changing one document's tokens leaves every other document's logits in the row unchanged."""
    shards = unique_token_shards(tmp_path, [7, 12, 5, 20])
    loader = PackedLoader(shards, Split.whole(4), seq_len=32, batch_size=1, seed=0, shuffle=False)
    batch = loader.next_batch()
    config = tiny_config(family, **PACKING_MODELS[family])
    vocab = min(200, config.vocab_size)
    input_ids = batch["input_ids"] % vocab
    model = build(config)
    logits = model(input_ids, doc_ids=batch["doc_ids"])
    doc_ids = batch["doc_ids"][0]
    for doc in doc_ids.unique().tolist():
        changed = input_ids.clone()
        changed[0, doc_ids == doc] = (changed[0, doc_ids == doc] + 7) % vocab
        others = doc_ids != doc
        # A leak would move logits by O(1e-2); the grouped GEMM's blocking may move them by ~1e-7.
        torch.testing.assert_close(
            model(changed, doc_ids=batch["doc_ids"])[0, others],
            logits[0, others],
            rtol=0,
            atol=1e-5,
        )


def test_rows_are_sharded_by_rank_and_independent_of_world_size(tmp_path):
    shards = unique_token_shards(tmp_path, [30, 11, 50, 7, 19])
    single = PackedLoader(shards, Split.whole(5), seq_len=8, batch_size=4, seed=1)
    ranks = [
        PackedLoader(shards, Split.whole(5), seq_len=8, batch_size=2, seed=1, rank=r, world_size=2)
        for r in range(2)
    ]
    for _ in range(3):
        together = single.next_batch()["input_ids"]
        split = torch.cat([loader.next_batch()["input_ids"] for loader in ranks])
        assert torch.equal(together, split)
    assert ranks[0].next_row == ranks[1].next_row == single.next_row == 12


def test_order_depends_on_seed_and_epoch(tmp_path):
    shards = unique_token_shards(tmp_path, [10] * 12)

    def first_tokens(seed, epoch):
        loader = PackedLoader(shards, Split.whole(12), seq_len=10, batch_size=1, seed=seed)
        return [
            int(loader.row(epoch * loader.rows_per_epoch + k)["input_ids"][0]) for k in range(12)
        ]

    assert first_tokens(0, 0) == first_tokens(0, 0)
    assert first_tokens(0, 0) != first_tokens(1, 0)
    assert first_tokens(0, 0) != first_tokens(0, 1)
    assert sorted(first_tokens(0, 1)) == sorted(first_tokens(0, 0))


def test_loader_position_survives_a_restart(tmp_path):
    shards = unique_token_shards(tmp_path, [13, 29, 8, 41, 6])

    def make() -> PackedLoader:
        return PackedLoader(shards, Split.whole(5), seq_len=8, batch_size=2, seed=5, epochs=3)

    loader = make()
    for _ in range(4):
        loader.next_batch()
    # plain integers, as a checkpoint stores them
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [loader.next_batch() for _ in range(5)]  # crosses into the next epoch
    restarted = make()
    restarted.load_state_dict(state)
    for want in expected:
        got = restarted.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)
    other = PackedLoader(shards, Split.whole(5), seq_len=4, batch_size=2, seed=5)
    with pytest.raises(DataError, match=r"since the checkpoint: data.seq_len 8 -> 4; resume"):
        other.load_state_dict(state)


def saved_run(directory: Path, **data_settings) -> Path:
    """A checkpoint directory whose train_config.json holds these [data] settings (and training.seed
    5)."""
    directory.mkdir()
    (directory / "train_config.json").write_text(
        json.dumps({"data": data_settings, "training": {"seed": 5}})
    )
    return directory


def test_a_refused_position_names_each_data_setting_that_changed(tmp_path):
    """The saved position of rows of 8 tokens: data.overlong and data.path changed (the rows
    differ), each named with both values, the unchanged data.seq_len not; the same settings with
    other rows: the files changed; a checkpoint without train_config.json: only data.seq_len is
    known. The boundary: the same rows load whatever the settings say (train.py warns of their
    change)."""
    shards = unique_token_shards(tmp_path, [13, 29, 8, 41, 6])
    settings = {
        "data.path": "new.jsonl",
        "data.seq_len": 8,
        "data.overlong": "drop",
        "training.seed": 5,
    }
    state = {
        "next_row": 2,
        "rows_per_epoch": 12,
        "seq_len": 8,
    }  # 12 rows: another data set than these 13
    loader = PackedLoader(
        shards, Split.whole(5), seq_len=8, batch_size=2, seed=5, settings=settings
    )
    changed = saved_run(tmp_path / "changed", path="old.jsonl", seq_len=8, overlong="truncate")
    with pytest.raises(
        DataError,
        match=r"saved for 12 rows of 8 tokens per epoch, but this run has 13 rows of 8: "
        r"changed since the checkpoint: data.path 'old.jsonl' -> 'new.jsonl', "
        r"data.overlong 'truncate' -> 'drop'; resume with",
    ):
        loader.load_state_dict(state, changed)
    same = saved_run(tmp_path / "same", path="new.jsonl", seq_len=8, overlong="drop")
    with pytest.raises(
        DataError,
        match=r"of 8: the data's files changed since the checkpoint; its settings did not",
    ):
        loader.load_state_dict(state, same)
    with pytest.raises(
        DataError, match=r"of 8: the data or a data setting changed .*records only data.seq_len"
    ):
        loader.load_state_dict(state, tmp_path / "no_checkpoint")
    loader.load_state_dict({**state, "rows_per_epoch": 13}, changed)
    assert loader.next_row == 2


def test_running_out_of_data_says_how_much_there_was(tmp_path):
    shards = unique_token_shards(tmp_path, [16, 16])
    loader = PackedLoader(shards, Split.whole(2), seq_len=8, batch_size=2, seed=0, epochs=1)
    loader.next_batch()
    loader.next_batch()
    with pytest.raises(
        DataError, match="ran out of data: the train split has 4 rows of 8 tokens per epoch"
    ):
        loader.next_batch()


# -------------------------------------------------------------------------- conversations (chat.py)

WORDS = ["alpha", "beta", "gamma", "delta", "ünï", "x" * 12, "the", "yield"]


def conversations(count: int, seed: int) -> list[list[dict]]:
    """Conversations of one to three turns, with and without a system message, of varied lengths."""
    rng = np.random.default_rng(seed)
    say = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    made = []
    for _ in range(count):
        turns = [{"role": "system", "content": say(3)}] if rng.random() < 0.3 else []
        for _ in range(rng.integers(1, 4)):
            turns += [
                {"role": "user", "content": say(rng.integers(1, 6))},
                {"role": "assistant", "content": say(rng.integers(1, 12))},
            ]
        made.append(turns)
    return made


def plain_rendering(messages: list[dict]) -> tuple[list[int], list[int]]:
    """chat.py's plain template written out for the byte tokenizer -> (ids, 1 where the token is the
    assistant's): "Role: content", then a newline, or the end-of-text (256) after an answer."""
    ids, mask = [], []
    for message in messages:
        head, body = f"{message['role'].capitalize()}: ".encode(), list(message["content"].encode())
        answer = message["role"] == "assistant"
        ids += list(head) + body + [256 if answer else ord("\n")]
        mask += [0] * len(head) + [int(answer)] * (len(body) + 1)
    return ids, mask


def prepared_conversations(
    tmp_path, chats: list[list[dict]], texts: list[str] = (), shard_tokens: int = 1 << 28
):
    lines = [json.dumps({"text": t}) for t in texts] + [json.dumps({"messages": m}) for m in chats]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    tokenizer = load_tokenizer("byte")
    return TokenShards(
        prepare(
            tmp_path / "chat.jsonl", tokenizer, tmp_path / "prepared", shard_tokens=shard_tokens
        ),
        tokenizer,
    )


def test_conversations_are_stored_with_the_mask_of_their_answers_beside_text(tmp_path):
    """Text documents first, then conversations, in shards of 200 tokens: every shard gets a mask
    file, all ones for text, the answers' tokens for conversations."""
    chats = conversations(12, seed=0)
    shards = prepared_conversations(
        tmp_path, chats, texts=["first text " * 30, "second"], shard_tokens=200
    )
    assert (
        shards.masked
        and shards.meta["format"] == data.MASKED_FORMAT
        and len(shards.meta["shards"]) > 3
    )
    assert (shards.meta["conversations"], shards.meta["pairs"]) == (12, 0)
    for i, text in enumerate(["first text " * 30, "second"]):
        assert (
            shards.document(i).tolist() == list(text.encode()) + [256] and shards.loss_mask(i).all()
        )
    for i, messages in enumerate(chats, start=2):
        ids, mask = plain_rendering(messages)
        assert shards.document(i).tolist() == ids and shards.loss_mask(i).tolist() == mask
    assert shards.meta["target_tokens"] == sum(sum(plain_rendering(m)[1][1:]) for m in chats)


CHAT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]
PAIR = {"prompt": "p", "completion": "c"}


@pytest.mark.parametrize(
    "name, content",
    [
        ("chats.JSONL", json.dumps({"messages": CHAT}) + "\n" + json.dumps(PAIR) + "\n"),
        ("chats.Jsonl", json.dumps({"messages": CHAT}) + "\n" + json.dumps(PAIR) + "\n"),
        ("chats.ndjson", json.dumps({"messages": CHAT}) + "\n" + json.dumps(PAIR) + "\n"),
        ("chats.json", json.dumps([{"messages": CHAT}, PAIR])),
        ("chats.JSON", json.dumps([{"messages": CHAT}, PAIR])),
    ],
    ids=lambda value: value if value.startswith("chats") else "",
)
def test_chat_data_is_read_as_records_whatever_the_suffix_case(tmp_path, name, content):
    """A conversation and a pair, under a careless suffix or in a .json list, are trained as chat
    data: the answer "ab" and its end-of-text, the completion "c" and its end-of-text; not as one
    text document with every token a target."""
    (tmp_path / name).write_text(content)
    shards = TokenShards(prepare(tmp_path / name, load_tokenizer("byte"), tmp_path / "out"))
    assert shards.masked and (shards.meta["conversations"], shards.meta["pairs"]) == (1, 1)
    user, answer = list(b"User: q\nAssistant: "), list(b"ab") + [256]
    assert shards.document(0).tolist() == user + answer
    assert shards.loss_mask(0).tolist() == [0] * len(user) + [1] * 3
    assert shards.document(1).tolist() == [ord("p"), ord("c"), 256]
    assert shards.loss_mask(1).tolist() == [0, 1, 1]


def test_json_files_that_hold_no_records_stay_text_documents(tmp_path):
    """A package.json (an object) and a list of numbers are text, as every .json of a code corpus
    was; a .json list of objects with the text field is one document per object."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.json").write_text('{"name": "pkg", "version": "1.0"}')
    (tmp_path / "corpus" / "b.json").write_text("[1, 2]")
    (tmp_path / "corpus" / "c.json").write_text(json.dumps([{"text": "one"}, {"text": "two"}]))
    tokenizer = load_tokenizer("byte")
    shards = TokenShards(prepare(tmp_path / "corpus", tokenizer, tmp_path / "out"))
    texts = [tokenizer.decode(shards.document(i)[:-1].tolist()) for i in range(shards.num_docs)]
    assert (
        texts == ['{"name": "pkg", "version": "1.0"}', "[1, 2]", "one", "two"] and not shards.masked
    )


@pytest.mark.parametrize(
    "name, content, named, pattern",
    [
        (
            "chats.txt",
            json.dumps({"messages": CHAT}) + "\n",
            "chats.txt",
            r"first line is a conversation \('messages'\) in JSON, but a \.txt file is read as one "
            r"text document; name it \.jsonl",
        ),
        (
            "pairs",
            "\n" + json.dumps(PAIR) + "\n",
            "pairs",
            r"a prompt/completion pair in JSON, but a suffix-less file",
        ),
        (
            "chats.json",
            json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT}) + "\n",
            "chats.json",
            r"but a \.json file must hold one JSON value \(a list of records\); name it \.jsonl",
        ),
        (
            "chats.json",
            json.dumps([{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}]}]),
            "chats.json: record 2 of the list",
            r"message 0 has role 'bot'",
        ),
        (
            "chats.json",
            json.dumps([{"messages": CHAT}, "a string"]),
            "chats.json: record 2 of the list",
            r"expected a JSON object .* got a str",
        ),
        (
            "chats.JSONL",
            json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": []}) + "\n",
            "chats.JSONL:2",
            r"'messages' must be a non-empty list",
        ),
    ],
    ids=[
        "jsonl named .txt",
        "pairs without suffix",
        "jsonl named .json",
        "json list with a bad role",
        "json list with a string",
        "upper-case jsonl with an empty conversation",
    ],
)
def test_conversations_never_train_as_plain_text(tmp_path, name, content, named, pattern):
    """A file that holds conversations but would be read as one text document is refused, and a bad
    record in a .json list is named by its place in the list, as a JSONL record is by its line."""
    (tmp_path / name).write_text(content)
    stops_with_one_line(
        lambda: prepare(tmp_path / name, load_tokenizer("byte"), tmp_path / "out"),
        DataError,
        str(tmp_path / named),
        pattern,
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_conversations_are_packed_whole_and_only_answers_are_targets(tmp_path, overlong):
    """Each epoch, every conversation sits in exactly one row, whole from its first token (cut to
    seq_len or left out when longer, as data.overlong says); a target is the next token of the same
    conversation where that token is the assistant's, -100 everywhere else."""
    chats, seq_len = conversations(40, seed=1), 64
    shards = prepared_conversations(tmp_path, chats)
    loader = PackedLoader(
        shards, Split.whole(40), seq_len=seq_len, batch_size=1, seed=3, overlong=overlong
    )
    rendered = [plain_rendering(m) for m in chats]
    longer = [i for i, (ids, _) in enumerate(rendered) if len(ids) > seq_len]
    lost = (
        longer if overlong == "drop" else [i for i in longer if not any(rendered[i][1][1:seq_len])]
    )
    assert longer and (loader.whole.truncated, loader.whole.dropped) == (
        len(longer) - len(lost),
        len(lost),
    )
    for epoch in range(2):
        seen = []
        for g in range(epoch * loader.rows_per_epoch, (epoch + 1) * loader.rows_per_epoch):
            row = loader.row(g)
            for doc in np.unique(row["doc_ids"][row["doc_ids"] >= 0]):
                at = np.flatnonzero(row["doc_ids"] == doc)
                ids, mask = rendered[doc]
                kept = min(len(ids), seq_len)
                assert (
                    at.tolist() == list(range(at[0], at[0] + kept))
                    and row["input_ids"][at].tolist() == ids[:kept]
                )
                expected = [
                    ids[k + 1] if k + 1 < kept and mask[k + 1] else -100 for k in range(kept)
                ]
                assert row["targets"][at].tolist() == expected
                seen.append(int(doc))
            assert (row["targets"][row["doc_ids"] < 0] == -100).all()
        assert sorted(seen) == [i for i in range(40) if i not in lost]


def test_packed_conversations_resume_at_the_exact_row(tmp_path):
    shards = prepared_conversations(tmp_path, conversations(30, seed=2))

    def make() -> PackedLoader:
        return PackedLoader(shards, Split.whole(30), seq_len=96, batch_size=2, seed=5, epochs=4)

    loader = make()
    for _ in range(3):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    # crosses into the next epoch
    expected = [loader.next_batch() for _ in range(loader.rows_per_epoch // 2 + 1)]
    restarted = make()
    restarted.load_state_dict(state)
    for want in expected:
        got = restarted.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_shards_rendered_with_another_template_are_refused(tmp_path):
    prepared_conversations(tmp_path, conversations(3, seed=0))
    meta = json.loads((tmp_path / "prepared" / "meta.json").read_text())
    (tmp_path / "prepared" / "meta.json").write_text(
        json.dumps({**meta, "chat_template_digest": "another"})
    )
    with pytest.raises(
        DataError,
        match="rendered with the chat template of the plain template .* prepare the data again",
    ):
        TokenShards(tmp_path / "prepared", load_tokenizer("byte"))


def answer_loss_written_out(
    logits: torch.Tensor, input_ids: torch.Tensor, doc_ids: torch.Tensor, chats: list[list[dict]]
) -> tuple[torch.Tensor, int]:
    """Sum over every position whose next token is an answer token of the same conversation (masks
    from plain_rendering, not from the loader) of -log softmax(logits)[next token] -> (sum,
    count)."""
    total, count = logits.new_zeros((), dtype=torch.float64), 0
    for b in range(input_ids.shape[0]):
        for doc in doc_ids[b].unique().tolist():
            if doc < 0:
                continue
            at = torch.nonzero(doc_ids[b] == doc).flatten()
            ids, mask = plain_rendering(chats[doc])
            assert input_ids[b, at].tolist() == ids[: len(at)]
            for k in range(len(at) - 1):
                if mask[k + 1]:
                    total = total - torch.log_softmax(logits[b, at[k]].double(), dim=-1)[ids[k + 1]]
                    count += 1
    return total, count


def test_the_sft_loss_is_the_cross_entropy_of_the_answers_alone(tmp_path):
    chats = conversations(10, seed=4)
    shards = prepared_conversations(tmp_path, chats)
    batch = PackedLoader(
        shards, Split.whole(10), seq_len=160, batch_size=3, seed=0, shuffle=False
    ).next_batch()
    model = build(tiny_config(DEFAULT_FAMILY, vocab_size=264), plain=True)
    loss = model(batch["input_ids"], batch["targets"], batch["doc_ids"])
    logits = model(batch["input_ids"], doc_ids=batch["doc_ids"])
    total, count = answer_loss_written_out(logits, batch["input_ids"], batch["doc_ids"], chats)
    assert (
        count == int((batch["targets"] != -100).sum())
        and count < int((batch["doc_ids"] >= 0).sum()) // 2
    )
    torch.testing.assert_close(loss.double(), total / count, rtol=1e-5, atol=0)


def check_answer_tokens_weigh_the_same(directory: Path, chats: list[list[dict]]) -> None:
    """Two ranks (FSDP), two micro-batches each, rows with different numbers of answer tokens: the
    accumulated gradient equals that of the mean over all answer tokens of the step, written out."""
    from torch.distributed.tensor import DTensor

    from helpers import assert_close_to_scale
    from parallel import ParallelConfig, build_mesh, parallelize

    torch.manual_seed(0)
    shards, config = TokenShards(directory), tiny_config(DEFAULT_FAMILY, vocab_size=264)
    loader = dict(seq_len=96, batch_size=1, seed=0)
    everything = PackedLoader(shards, Split.whole(len(chats)), **loader)
    rows = [everything.row(g) for g in range(4)]  # micro-batch m, rank r: global row 2 m + r
    assert len({int((r["targets"] != -100).sum()) for r in rows}) == 4  # the rows weigh differently
    reference = build(config, plain=True)
    ids, doc_ids = (
        torch.from_numpy(np.stack([r[k] for r in rows])) for k in ("input_ids", "doc_ids")
    )
    total, count = answer_loss_written_out(reference(ids, doc_ids=doc_ids), ids, doc_ids, chats)
    (total / count).backward()
    cfg = ParallelConfig(dp_shard=2, param_dtype="float32")
    pm = parallelize(build(config, plain=True), cfg, build_mesh(cfg, "cpu", config.num_experts))
    mine = PackedLoader(
        shards, Split.whole(len(chats)), rank=torch.distributed.get_rank(), world_size=2, **loader
    )
    batches = [mine.next_batch() for _ in range(2)]
    num_tokens = pm.global_tokens(torch.stack([b["targets"] for b in batches]))
    loss = sum(
        pm.forward_backward(b["input_ids"], b["targets"], b["doc_ids"], num_tokens) for b in batches
    )
    assert_close_to_scale(loss.double(), (total / count).detach(), what="loss")
    expected = dict(reference.named_parameters())
    for name, param in pm.module.named_parameters():
        if param.requires_grad:  # not Large 4's frozen indexer
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            assert_close_to_scale(grad, expected[name].grad, what=name)


def test_every_answer_token_weighs_the_same_across_micro_batches_and_ranks(tmp_path):
    from helpers import spawn

    chats = conversations(16, seed=6)
    prepared_conversations(tmp_path, chats)
    spawn(2, check_answer_tokens_weigh_the_same, tmp_path / "prepared", chats)


def test_a_missing_or_short_mask_file_is_refused(tmp_path):
    prepared_conversations(tmp_path, conversations(3, seed=0))
    mask = tmp_path / "prepared" / "mask_00000.bin"
    mask.write_bytes(mask.read_bytes()[:-1])
    with pytest.raises(
        DataError,
        match=r"mask_00000.bin: \d+ bytes for the shard's \d+ tokens; "
        r".*prepare the data again",
    ):
        TokenShards(tmp_path / "prepared")
    mask.unlink()
    with pytest.raises(DataError, match=r"mask_00000.bin: missing"):
        TokenShards(tmp_path / "prepared")


# ------------------------------------------------------------------ block-wise order, mixtures


def test_unshuffled_rows_are_the_documents_in_order(tmp_path):
    """Without shuffling (validation), row g is tokens [g*T, g*T + T] of the documents back to back,
    across blocks of documents, as before the block-wise order: a hand-built stream."""
    lengths = [5, 9, 3, 12, 7, 4, 11]
    shards = unique_token_shards(tmp_path, lengths)  # token id = stream index
    loader = PackedLoader(
        shards, Split.whole(7), seq_len=8, batch_size=1, seed=0, shuffle=False, block_docs=2
    )
    total = sum(lengths)
    for g in range(loader.rows_per_epoch):
        want = np.arange(g * 8, min(g * 8 + 8, total))
        row = loader.row(g)
        assert row["input_ids"][: len(want)].tolist() == want.tolist()
        assert (row["doc_ids"][len(want) :] == -1).all()


def test_block_wise_order_covers_every_token_and_holds_one_block(tmp_path):
    """Blocks of 3 documents: each epoch still reads every token once, in an order that depends on
    the epoch; what the loader keeps is the blocks' order (ceil(10 / 3) = 4 entries) and at most 4
    blocks of 3 documents, not an order of every document."""
    lengths = [6, 1, 14, 3, 9, 2, 8, 5, 11, 4]
    shards = unique_token_shards(tmp_path, lengths)
    loader = PackedLoader(shards, Split.whole(10), seq_len=5, batch_size=1, seed=2, block_docs=3)
    orders = []
    for epoch in range(2):
        rows = [loader.row(epoch * loader.rows_per_epoch + k) for k in range(loader.rows_per_epoch)]
        inputs = np.concatenate([r["input_ids"][r["doc_ids"] >= 0] for r in rows])
        assert sorted(inputs.tolist()) == list(range(63))
        orders.append(inputs.tolist())
    assert orders[0] != orders[1]
    assert all(len(order) == 4 for order, _ in loader._epoch_cache.values())
    assert len(loader._block_cache) <= 4
    assert all(len(docs) <= 3 for docs, _ in loader._block_cache.values())


def test_opening_a_directory_reads_no_token(tmp_path, monkeypatch):
    """check_token_range runs on nothing at open, and on the rows' own tokens as they are read."""
    checked = []
    original = data.check_token_range

    def counted(file, tokens, vocab):
        checked.append(len(tokens))
        original(file, tokens, vocab)

    monkeypatch.setattr(data, "check_token_range", counted)
    unique_token_shards(tmp_path, [40, 50, 60])
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["shard_max_token"]  # no recorded range (format version 1): checked as rows are read
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    shards = TokenShards(tmp_path)
    assert checked == []
    loader = PackedLoader(shards, Split.whole(3), seq_len=8, batch_size=1, seed=0)
    assert checked == []
    loader.row(4)
    assert 0 < sum(checked) <= 9  # the row's 8 tokens and the next one, its last target


# ------------------------------------------------------------ memory per rank O(rows read)


def written_out_split(num_docs: int, fraction: float, groups: int) -> tuple[list, list]:
    """The split's rule written out: documents in groups of ceil(N / groups) consecutive ones, and
    round(fraction * group count) groups (at least one) held out, the first of a permutation of the
    groups seeded 1234: for N <= groups, the permutation of the documents the split always used."""
    size = -(-num_docs // groups)
    count = -(-num_docs // size)
    held = set(np.random.default_rng(1234).permutation(count)[: max(1, round(fraction * count))])
    val = [d for d in range(num_docs) if d // size in held]
    return [d for d in range(num_docs) if d // size not in held], val


@pytest.mark.parametrize("groups", [1 << 16, 8], ids=["a document a group", "groups of 7"])
def test_the_split_holds_out_whole_groups_seeded_as_before(monkeypatch, groups):
    """Up to SPLIT_GROUPS documents the held-out documents are those of the old stored permutation
    (the same rows as before); above, whole groups of consecutive documents."""
    monkeypatch.setattr(data, "SPLIT_GROUPS", groups)
    train, val = split_documents(50, 0.25, "corpus")
    want_train, want_val = written_out_split(50, 0.25, groups)
    assert val.indices().tolist() == want_val and train.indices().tolist() == want_train
    assert len(train) == len(want_train) and train.select(3, 9).tolist() == want_train[3:9]
    assert groups == 8 or len(want_val) == round(0.25 * 50)


@pytest.mark.parametrize("fraction", [0.25, 0.75])
def test_a_splits_token_counts_are_the_sums_of_its_documents(tmp_path, monkeypatch, fraction):
    """tokens_before(j) = the tokens of the split's first j documents, over shards of several
    documents, from whichever side of the split has fewer groups (0.25 and 0.75 take each)."""
    monkeypatch.setattr(data, "SPLIT_GROUPS", 8)
    lengths = np.random.default_rng(0).integers(1, 30, size=50)
    shards = unique_token_shards(tmp_path, lengths.tolist(), shard_tokens=100)
    assert len(shards.meta["shards"]) > 5
    for split, want in zip(split_documents(50, fraction, "c"), written_out_split(50, fraction, 8)):
        expected = np.concatenate([[0], np.cumsum(lengths[want])])
        assert split.tokens_before(shards, np.arange(len(want) + 1)).tolist() == expected.tolist()


def block_wise_rows(lengths, members, seed, seq_len, block_docs, epoch) -> list[list[int]]:
    """An epoch's rows written out from the loader's contract, for shards whose token ids are the
    stream index: blocks of block_docs consecutive members permuted by (seed, 0, epoch, 0), each
    block's members by (seed, 0, epoch, 1, block), the documents back to back cut into rows."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    blocks = [members[b : b + block_docs] for b in range(0, len(members), block_docs)]
    stream = []
    for block in np.random.default_rng([seed, 0, epoch, 0]).permutation(len(blocks)):
        docs = blocks[block]
        for k in np.random.default_rng([seed, 0, epoch, 1, block]).permutation(len(docs)):
            stream += range(starts[docs[k]], starts[docs[k] + 1])
    return [stream[i : i + seq_len] for i in range(0, len(stream), seq_len)]


@pytest.mark.parametrize("groups", [1 << 16, 8], ids=["a document a group", "groups of 7"])
def test_rows_are_the_block_wise_order_of_the_split_written_out(tmp_path, monkeypatch, groups):
    """Two epochs of the training split's rows, on one rank and on two (B = 2 each), equal the
    order written out: the same rows as before the split stopped being a stored list (one
    document a group), and, with groups, the same rule over the groups' documents."""
    monkeypatch.setattr(data, "SPLIT_GROUPS", groups)
    lengths = np.random.default_rng(1).integers(1, 12, size=50)
    shards = unique_token_shards(tmp_path, lengths.tolist(), shard_tokens=64)
    train, _ = split_documents(50, 0.25, "c")
    members = written_out_split(50, 0.25, groups)[0]
    setting = dict(seq_len=8, seed=3, block_docs=6)
    one = PackedLoader(shards, train, batch_size=4, **setting)
    two = [
        PackedLoader(shards, train, batch_size=2, rank=r, world_size=2, **setting) for r in (0, 1)
    ]
    want = [r for e in (0, 1) for r in block_wise_rows(lengths, members, 3, 8, 6, e)]
    assert one.rows_per_epoch * 2 == len(want)
    for m in range(len(want) // 4):
        batch = one.next_batch()["input_ids"]
        halves = torch.cat([loader.next_batch()["input_ids"] for loader in two])
        assert torch.equal(batch, halves)
        for i, row in enumerate(want[4 * m : 4 * m + 4]):
            assert batch[i, : len(row)].tolist() == row


def test_whole_rows_are_shuffled_block_wise(tmp_path):
    """Conversations: each epoch reads every row of the packing once, in the block-wise order
    written out (blocks of 3 rows permuted by (seed, 0, epoch, 0), each block's rows by (seed, 0,
    epoch, 1, block)), and what the loader keeps is the blocks' order (ceil(R / 3) entries) and at
    most 4 blocks of 3 rows, not an order of every row."""
    shards = prepared_conversations(tmp_path, conversations(30, seed=2))
    setting = dict(seq_len=96, batch_size=1, seed=5, block_docs=3)
    plain = PackedLoader(shards, Split.whole(30), shuffle=False, **setting)
    loader = PackedLoader(shards, Split.whole(30), **setting)
    rows = loader.rows_per_epoch
    packing = [plain.row(r)["input_ids"].tolist() for r in range(rows)]
    orders = []
    for epoch in range(2):
        read = [loader.row(epoch * rows + r)["input_ids"].tolist() for r in range(rows)]
        assert sorted(read) == sorted(packing)
        orders.append([packing.index(r) for r in read])
    assert orders[0] != orders[1] and orders[0] != list(range(rows))
    for epoch, order in enumerate(orders):  # blocks of 3 rows, permuted, then within each
        blocks = [list(range(b, min(b + 3, rows))) for b in range(0, rows, 3)]
        want = []
        for b in np.random.default_rng([5, 0, epoch, 0]).permutation(len(blocks)):
            rng = np.random.default_rng([5, 0, epoch, 1, b])
            want += [blocks[b][k] for k in rng.permutation(len(blocks[b]))]
        assert order == want
    assert all(len(order) == -(-rows // 3) for order, _ in loader._epoch_cache.values())
    assert len(loader._block_cache) <= 4
    assert all(len(members) <= 3 for members, _ in loader._block_cache.values())


class Untouchable:
    """A shard's document index that may not be read."""

    def __getitem__(self, key):
        raise AssertionError(f"the document index was read at {key}")


def test_opening_reads_the_coarse_starts_and_no_entry_of_the_index(tmp_path, monkeypatch):
    """A grid of 4 documents (COARSE_DOCS), 58 documents in 8 shards split into groups of 16, not
    ceil(58 / 4) = 15 (whole multiples of the grid): the training and validation loaders open
    without reading the document index, and read the same rows, in both epochs, as from the index
    (a version 2 directory)."""
    monkeypatch.setattr(data, "COARSE_DOCS", 4)
    monkeypatch.setattr(data, "SPLIT_GROUPS", 4)
    lengths = np.random.default_rng(2).integers(1, 12, size=58)
    shards = unique_token_shards(tmp_path, lengths.tolist(), shard_tokens=50)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    assert shards.coarse.tolist() == starts[:-1:4].tolist() + [starts[-1]]
    assert len(shards.meta["shards"]) >= 8
    train, val = split_documents(58, 0.25, "c")
    assert train.group_docs == 16 and len(train) + len(val) == 58
    index, shards.bounds = shards.bounds, [Untouchable()] * len(shards.bounds)
    setting = dict(seq_len=8, batch_size=1, seed=3, block_docs=4)
    loaders = [PackedLoader(shards, split, **setting) for split in (train, val)]
    shards.bounds = index
    from_index = TokenShards(tmp_path)
    from_index.coarse = None
    for loader, split in zip(loaders, (train, val)):
        reference = PackedLoader(from_index, split, **setting)
        assert loader.block_sizes.tolist() == reference.block_sizes.tolist()
        for g in range(2 * loader.rows_per_epoch):
            assert loader.row(g)["input_ids"].tolist() == reference.row(g)["input_ids"].tolist()


def opening_peak(directory: Path) -> int:
    """Bytes of Python-side allocations (numpy's arrays included) at their peak while opening a
    directory as train.py does, splitting it and reading a first batch."""
    tracemalloc.start()
    shards = TokenShards(directory)
    train, _ = split_documents(shards.num_docs, 0.05, "corpus")
    PackedLoader(shards, train, seq_len=64, batch_size=2, seed=0).next_batch()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_opening_a_corpus_holds_no_memory_per_document(tmp_path):
    """10k, 100k and 1M documents: the peak grows by the split's groups (at most 65,536) and the
    blocks' counts (one a 4,096 documents), under 1 MiB from 100k to 1M documents, where a stored
    index and split (28 bytes a document) would add 24 MiB."""
    from tools.loader_bench import write_corpus

    peaks = []
    for num_docs in (10_000, 100_000, 1_000_000):
        write_corpus(tmp_path / str(num_docs), num_docs)
        peaks.append(opening_peak(tmp_path / str(num_docs)))
    assert peaks[2] - peaks[1] < 1 << 20 and peaks[2] < 4 << 20, peaks


def source_shards(directory: Path, doc_lengths: list[int], first_id: int) -> TokenShards:
    """Shards whose token ids are first_id, first_id + 1, ...: each source's ids its own range."""
    directory.mkdir()
    writer = preparation.ShardWriter(directory, np.uint32, 1 << 20)
    start = first_id
    for n in doc_lengths:
        writer.add([list(range(start, start + n))])
        start += n
    writer.finish({"tokenizer": "test", "vocab_size": start, "eos_id": 0, "sources": []})
    return TokenShards(directory)


def mixture(
    tmp_path, weights, exhausted="repeat", batch_size=4, rank=0, world_size=1, seed=7, epochs=1
):
    """Three sources whose token ids lie in [0, 1000), [1000, 2000), [2000, 3000)."""
    loaders = []
    for s in range(3):
        directory = tmp_path / f"source{s}"
        shards = (
            TokenShards(directory)
            if directory.exists()
            else source_shards(directory, [7, 13, 4, 9, 11][s:] + [6] * 5, 1000 * s)
        )
        loaders.append(
            PackedLoader(
                shards,
                Split.whole(shards.num_docs),
                seq_len=8,
                batch_size=batch_size,
                seed=seed,
                epochs=epochs,
                rank=rank,
                world_size=world_size,
                stream=s,
            )
        )
    return data.MixedLoader(loaders, ["web", "code", "math"], weights, seed, exhausted)


def test_mixture_proportions_are_the_weights_within_sampling_error(tmp_path):
    """4,000 rows drawn 70/20/10: each source's count within 4 binomial standard deviations
    (sqrt(n p (1 - p)): 29.0, 25.3, 19.0 rows), told apart by their token ids; tokens_drawn
    agrees."""
    loader = mixture(tmp_path, [0.7, 0.2, 0.1], batch_size=40)
    counts = np.zeros(3, dtype=int)
    for _ in range(100):
        first_ids = loader.next_batch()["input_ids"][:, 0]
        counts += np.bincount(first_ids.numpy() // 1000, minlength=3)
    assert counts.sum() == 4000
    for count, expected, deviation in zip(counts, [2800, 800, 400], [29.0, 25.3, 19.0]):
        assert abs(count - expected) < 4 * deviation, counts
    assert loader.tokens_drawn() == dict(zip(["web", "code", "math"], (counts * 8).tolist()))


def test_a_mixture_resumes_at_the_exact_row_on_another_world_size(tmp_path):
    """Three global batches of 4 rows on one rank, saved; the next five on two ranks of 2 rows each
    are the one-rank run's, row for row; a source's repeat epoch is crossed on the way."""
    single = mixture(tmp_path, [0.5, 0.3, 0.2])
    for _ in range(3):
        single.next_batch()
    state = json.loads(json.dumps(single.state_dict()))  # plain integers, as a checkpoint has
    expected = [single.next_batch() for _ in range(5)]
    assert any(p >= s.rows_per_epoch for p, s in zip(single.positions, single.sources))
    ranks = [
        mixture(tmp_path, [0.5, 0.3, 0.2], batch_size=2, rank=r, world_size=2) for r in range(2)
    ]
    for loader in ranks:
        loader.load_state_dict(state)
    for want in expected:
        got = [loader.next_batch() for loader in ranks]
        for key in want:
            assert torch.equal(torch.cat([g[key] for g in got]), want[key])
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()


def test_a_one_source_mixture_reads_the_rows_of_data_path(tmp_path):
    """Weight 1 on one source: the rows of the plain loader of that source, in the same order."""
    shards = unique_token_shards(tmp_path, [13, 29, 8, 41, 6])
    plain = PackedLoader(shards, Split.whole(5), seq_len=8, batch_size=2, seed=5, epochs=2)
    mixed = data.MixedLoader(
        [PackedLoader(shards, Split.whole(5), seq_len=8, batch_size=2, seed=5, epochs=2)],
        ["only"],
        [1.0],
        seed=5,
    )
    for _ in range(6):
        want, got = plain.next_batch(), mixed.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_exhausted_source_stops_the_run_or_repeats(tmp_path):
    """ "stop": the micro-batch that would draw a source's row past data.epochs is refused in one
    line naming the source, the batches before it pass; "repeat": it goes on into a new epoch of
    that source, every token of which comes again."""
    stopping = mixture(tmp_path, [0.2, 0.2, 0.6], exhausted="stop", batch_size=1)
    math_rows = stopping.sources[2].rows_per_epoch
    drawn = 0
    while True:
        try:
            stopping.next_batch()
        except DataError as error:
            message = str(error)
            break
        drawn += 1
    assert stopping.positions[2] == math_rows  # every row of one epoch of math, none more
    assert "\n" not in message
    assert f"source math ran out of data at micro-batch {drawn}: its {math_rows} rows" in message
    repeating = mixture(tmp_path, [0.2, 0.2, 0.6], exhausted="repeat", batch_size=1)
    math_ids = []
    for _ in range(drawn + 60):
        row = repeating.next_batch()
        if int(row["input_ids"][0, 0]) >= 2000:
            math_ids += row["input_ids"][0][row["doc_ids"][0] >= 0].tolist()
    epoch = list(range(2000, 2000 + 4 + 9 + 11 + 5 * 6))  # math's documents: [4, 9, 11] + [6] * 5
    assert sorted(math_ids[: len(epoch)]) == epoch
    assert sorted(math_ids[len(epoch) : 2 * len(epoch)]) == epoch


def test_a_mixture_position_from_other_sources_is_refused(tmp_path):
    loader = mixture(tmp_path, [0.5, 0.3, 0.2])
    state = {**loader.state_dict(), "source_1_rows": 2}
    rows = [source.rows_per_epoch for source in loader.sources]
    with pytest.raises(DataError, match=rf"saved for sources of \[{rows[0]}, 2, {rows[2]}\] rows"):
        loader.load_state_dict(state)
    loader.load_state_dict({**state, "source_1_rows": rows[1], "source_1_position": 3})
    assert loader.positions == [0, 3, 0]


def test_a_checkpoint_of_another_number_of_sources_is_refused_in_one_line(tmp_path):
    """The saved position's keys (as torch.distributed.checkpoint names them) of two sources, of
    data.path alone, or of the same three: refused naming [data] sources and the change, or let
    through, before the position is loaded (saying what changed when the weights did)."""
    three = mixture(tmp_path, [0.5, 0.3, 0.2])
    saved = {f"train.data.{key}" for key in three.state_dict()} | {"train.step", "model.w"}
    assert data.check_saved_sources(saved, three, tmp_path) is None
    two = saved - {"train.data.source_2_position", "train.data.source_2_rows"}
    checkpoint = saved_run(tmp_path / "ckpt", sources=[{"path": "web", "weight": 1}])
    three.sources[0].settings["data.sources"] = [{"path": "web", "weight": 1}, "code", "math"]
    stops_with_one_line(
        lambda: data.check_saved_sources(two, three, checkpoint),
        DataError,
        str(checkpoint),
        r"saved the data position of a mixture of 2 \[data\] sources, but this run reads a "
        r"mixture of 3 \[data\] sources \(data.sources \[\{'path': 'web', 'weight': 1\}\] -> "
        r".*'code', 'math'\]\): a resume continues the checkpoint's \[data\] sources",
    )
    reweighted = saved_run(tmp_path / "reweighted", sources=["web", "code", "math"])
    assert data.check_saved_sources(saved, three, reweighted) == (
        "data.sources ['web', 'code', 'math'] -> [{'path': 'web', 'weight': 1}, 'code', 'math']: "
        "each source goes on from its position, the rows from here on drawn with these weights"
    )
    plain = {"train.data.next_row", "train.data.rows_per_epoch", "train.data.seq_len"}
    with pytest.raises(DataError, match=r"position of one source \(data.path\), but this run"):
        data.check_saved_sources(plain, three, tmp_path)


@pytest.mark.slow
def test_resuming_with_a_third_source_stops_with_one_line(tmp_path, capsys):
    """train.py: two steps on a mixture of two sources, checkpointed; the resume with three stops
    before loading anything, in one line naming [data] sources, where
    torch.distributed.checkpoint would fail on a key the checkpoint lacks; the resume with the two
    reweighted goes on and says so."""
    import train
    from helpers import debug_configs

    for name in "abc":
        (tmp_path / name).mkdir()
        for k in range(40):
            (tmp_path / name / f"{k}.txt").write_text(f"{name} {k} " * 40)
    debug = debug_configs()[DEFAULT_FAMILY].read_text()
    settings = [
        f"--data.cache_dir={tmp_path / 'cache'}",
        f"--checkpoint.dir={tmp_path / 'ckpt'}",
        f"--logging.jsonl={tmp_path / 'metrics.jsonl'}",
        "--logging.peak_tflops=0.1",
        "--training.steps=2",
        "--training.sample_tokens=0",
    ]
    for count in (2, 3):
        listed = ", ".join(f'{{path = "{tmp_path / n}", weight = 1}}' for n in "abc"[:count])
        toml = debug.replace('path = "data/python_reference.jsonl"', f"sources = [{listed}]")
        (tmp_path / f"{count}.toml").write_text(toml)
    train.main(["--config", str(tmp_path / "2.toml"), *settings])
    checkpoint = tmp_path / "ckpt" / "run_0001" / "step_00000002"
    stops_with_one_line(
        lambda: train.main(
            ["--config", str(tmp_path / "3.toml"), *settings, f"--checkpoint.resume={checkpoint}"]
        ),
        DataError,
        str(checkpoint),
        r"saved the data position of a mixture of 2 \[data\] sources, but this run reads a "
        r"mixture of 3 \[data\] sources \(data.sources .*\): a resume continues",
    )
    reweighted = (tmp_path / "2.toml").read_text().replace("weight = 1}]", "weight = 3}]")
    (tmp_path / "reweighted.toml").write_text(reweighted)
    capsys.readouterr()
    resumed = ["--config", str(tmp_path / "reweighted.toml"), *settings[:-2], "--training.steps=3"]
    train.main([*resumed, "--training.sample_tokens=0", f"--checkpoint.resume={checkpoint}"])
    assert re.search(
        rf"resumed from {checkpoint} at step 2 of 3; checkpoints go to \S+; the data changed: "
        r"data.sources .*'weight': 1\}\] -> .*'weight': 3\}\]: each source goes on from its "
        r"position, the rows from here on drawn with these weights",
        capsys.readouterr().out,
    )


@pytest.mark.slow
def test_train_prepares_raw_text_with_a_worker_process_per_core(tmp_path, monkeypatch):
    """Raw text as data.path: rank 0 prepares it with as many worker processes as the host gives
    it cores (3 here, units of 2 KiB so that there are several), the same bytes as one process."""
    import train
    from helpers import tiny_model_toml

    (tmp_path / "corpus").mkdir()
    for k in range(12):
        (tmp_path / "corpus" / f"{k}.txt").write_text(f"word {k} " * 120)
    monkeypatch.setattr(preparation, "UNIT_BYTES", 2048)
    monkeypatch.setattr(train.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    used = []
    original = preparation.run_units
    monkeypatch.setattr(preparation, "run_units", lambda *a: used.append(a[2]) or original(*a))
    (tmp_path / "run.toml").write_text(
        tiny_model_toml()
        + f'[data]\npath = "{tmp_path}/corpus"\nseq_len = 32\ncache_dir = "{tmp_path}/cache"\n'
    )
    cfg = train.load_config(tmp_path / "run.toml", ["--model.vocab_size=512", "--training.steps=2"])
    train.setup_data(cfg, train.Process(0, 1, 0, 1, torch.device("cpu")))
    assert used == [3]
    (prepared,) = (tmp_path / "cache").iterdir()
    one = prepare(tmp_path / "corpus", load_tokenizer("byte"), tmp_path / "one")
    assert len(json.loads((one / "meta.json").read_text())["shards"]) > 3
    for file in one.iterdir():
        assert (prepared / file.name).read_bytes() == file.read_bytes(), file.name


def test_train_reads_the_sources_of_the_config_as_a_mixture(tmp_path):
    """[data].sources of two text corpora reach train.setup_data: a MixedLoader of both, with the
    config's weights and exhausted rule, each source prepared; data.path alone stays one loader."""
    import train
    from helpers import tiny_model_toml

    for name, word in (("a", "alpha"), ("b", "omega")):
        (tmp_path / name).mkdir()
        for k in range(12):
            (tmp_path / name / f"{k}.txt").write_text(f"{word} {k} " * 20)
    common = f'seq_len = 32\ncache_dir = "{tmp_path}/cache"\n'
    (tmp_path / "run.toml").write_text(
        tiny_model_toml()
        + (
            f'[data]\nsources = [{{path = "{tmp_path}/a", weight = 3}}, '
            f'{{path = "{tmp_path}/b", weight = 1}}]\nexhausted = "repeat"\n{common}'
        )
    )
    plain_data = f'[data]\npath = "{tmp_path}/a"\n{common}'
    (tmp_path / "plain.toml").write_text(tiny_model_toml() + plain_data)
    ckpt = (
        f"--checkpoint.dir={tmp_path}/ckpt",
        "--model.vocab_size=512",
        "--training.steps=2",
        "--training.batch_size=2",
    )
    run = train.Process(0, 1, 0, 1, torch.device("cpu"))
    _, loader, val = train.setup_data(train.load_config(tmp_path / "run.toml", list(ckpt)), run)
    assert isinstance(loader, data.MixedLoader) and isinstance(val, data.MixedLoader)
    assert loader.names == [f"{tmp_path}/a", f"{tmp_path}/b"] and loader.weights.tolist() == [3, 1]
    assert loader.exhausted == "repeat" and val.exhausted == "repeat"
    assert [s.stream for s in loader.sources] == [0, 1]
    assert len(list((tmp_path / "cache").iterdir())) == 2
    plain = train.setup_data(train.load_config(tmp_path / "plain.toml", list(ckpt)), run)[1]
    assert isinstance(plain, PackedLoader)
