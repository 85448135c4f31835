"""chat.py: conversations rendered with a chat template, the assistant's tokens as the only targets,
and the same text, ids and assistant masks as transformers' apply_chat_template on two published
templates (tests/fixtures/chat, written once by tests/make_chat_fixture.py under the reference
venv)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from chat import (
    CLOSE_MARK,
    OPEN_MARK,
    PLAIN_TEMPLATE,
    ChatEncoder,
    ChatError,
    Conversation,
    Pair,
    WholeRows,
    pack_rows,
    read_example,
    split_marks,
)
from data import DataError
from helpers import stops_with_one_line
from prepare import prepare
from tokenizer import TokenizerError, load_tokenizer, read_chat_template

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat"
CHAT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]
EXPECTED = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))
CONFIG = json.loads((FIXTURES / "qwen2_tokenizer_config.json").read_text())
TEMPLATE_FILES = {
    "qwen3": "qwen3_chat_template.jinja",
    "qwen3_marked": "qwen3_marked.jinja",
    "qwen2_marked": "qwen2_marked.jinja",
}


def fixture_tokenizer(tmp_path: Path, name: str, template: str | None = None):
    """The fixture's BPE with `name`'s chat template: Qwen2's in tokenizer_config.json as published,
    the others as chat_template.jinja (or `template`, in tokenizer_config.json)."""
    directory = tmp_path / name
    directory.mkdir()
    shutil.copy(FIXTURES / "tokenizer.json", directory)
    config = (
        dict(CONFIG)
        if name == "qwen2"
        else {k: v for k, v in CONFIG.items() if k != "chat_template"}
    )
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if name in TEMPLATE_FILES:
        shutil.copy(FIXTURES / TEMPLATE_FILES[name], directory / "chat_template.jinja")
    return load_tokenizer(str(directory))


# ----------------------------------------------------------------------------- against transformers

CASES = [
    (template, case)
    for template in ("qwen2", "qwen3", "qwen3_marked")
    for case in EXPECTED[template]
]


@pytest.mark.parametrize("template, case", CASES, ids=[f"{t}: {c}" for t, c in CASES])
def test_text_ids_and_mask_equal_transformers(tmp_path, template, case):
    """The text and ids of apply_chat_template, and the assistant mask transformers computes from
    the template with generation markers: by prefix renders for the published templates, by the
    markers for the marked one. The published Qwen3 template writes an earlier answer without its
    <think> block once a later turn follows: prefix renders cannot place it, and the conversation is
    refused."""
    expected = EXPECTED[template][case]
    encoder = ChatEncoder(fixture_tokenizer(tmp_path, template))
    assert encoder.render(expected["messages"], False, "case")[0] == expected["text"]
    if "mask" not in expected:
        with pytest.raises(
            ChatError,
            match=r"case: message \d: .* cannot be found by prefix "
            r"renders .*renders this "
            r"turn differently once later turns follow.*\{% "
            r"generation %\}",
        ):
            encoder.encode(Conversation(expected["messages"], "case"))
        return
    ids, mask = encoder.encode(Conversation(expected["messages"], "case"))
    assert ids == expected["ids"]
    assert mask.tolist() == expected["mask"]


def test_generation_prompts_equal_transformers(tmp_path):
    for template in ("qwen2", "qwen3"):
        encoder = ChatEncoder(fixture_tokenizer(tmp_path, template))
        one_turn = EXPECTED[template]["one turn"]["messages"][:1]
        assert encoder.render(one_turn, True, "case")[0] == EXPECTED["generation_prompt"][template]


def test_a_merge_across_an_answers_edge_is_counted(tmp_path):
    """Qwen3's generation prompt ends with "<think>\\n" and the answer starts with "\\n</think>":
    the BPE merges the two newlines into one token, which the mask includes (it overlaps the answer,
    as in transformers' mask) and the summary counts. Qwen2's answers start after a newline of their
    own."""
    qwen3 = ChatEncoder(fixture_tokenizer(tmp_path, "qwen3"))
    qwen3.encode(Conversation(EXPECTED["qwen3"]["one turn"]["messages"], "case"))
    assert qwen3.counts["tokens_across_answer_edges"] == 1
    qwen2 = ChatEncoder(fixture_tokenizer(tmp_path, "qwen2"))
    qwen2.encode(Conversation(EXPECTED["qwen2"]["system, multi"]["messages"], "case"))
    assert qwen2.counts["tokens_across_answer_edges"] == 0


def test_markers_and_prefix_renders_find_the_same_tokens(tmp_path):
    """Qwen2's template with generation markers gives the mask that prefix renders of the published
    one give."""
    plain, marked = (
        ChatEncoder(fixture_tokenizer(tmp_path, "qwen2")),
        ChatEncoder(fixture_tokenizer(tmp_path, "qwen2_marked")),
    )
    assert marked.marked and not plain.marked
    for case in EXPECTED["qwen2"].values():
        conversation = Conversation(case["messages"], "case")
        (ids, mask), (marked_ids, marked_mask) = (
            plain.encode(conversation),
            marked.encode(conversation),
        )
        assert ids == marked_ids and mask.tolist() == marked_mask.tolist()


# ----------------------------------------------------------------------------- the plain template


def test_the_plain_template_renders_the_documented_text_and_trains_on_the_answers():
    encoder = ChatEncoder(load_tokenizer("byte"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is pass?"},
        {"role": "assistant", "content": "A null operation."},
        {"role": "user", "content": "And del?"},
        {"role": "assistant", "content": "Deletion: ünï."},
    ]
    ids, mask = encoder.encode(Conversation(messages, "case"))
    text = (
        "System: Be brief.\nUser: What is pass?\nAssistant: A null operation.<|endoftext|>User: "
        "And "
        "del?\n"
        "Assistant: Deletion: ünï.<|endoftext|>"
    )
    assert encoder.render(messages, False, "case")[0] == text
    # one byte per token, 256 for the end-of-text
    expected = list(text.replace("<|endoftext|>", "\0").encode())
    assert ids == [256 if b == 0 else b for b in expected]
    targets = bytes(i for i, keep in zip(ids, mask) if keep and i != 256)
    assert (
        targets.decode() == "A null operation.Deletion: ünï."
        and int(mask.sum()) == len(targets) + 2
    )
    # each answer's end-of-text is a target
    assert [i for i, keep in zip(ids, mask) if keep].count(256) == 2
    assert (
        encoder.render(messages[:2], True, "case")[0]
        == "System: Be brief.\nUser: What is pass?\nAssistant: "
    )
    assert encoder.template.source == PLAIN_TEMPLATE


def test_a_pair_trains_on_the_completion_and_the_end_of_text():
    encoder = ChatEncoder(load_tokenizer("byte"))
    ids, mask = encoder.encode(Pair("Q: 2+2?\nA:", " 4", "case"))
    assert ids == list(b"Q: 2+2?\nA: 4") + [256]
    assert mask.tolist() == [0] * 10 + [1, 1, 1]
    assert encoder.counts["pairs"] == 1 and encoder.counts["target_tokens"] == 3


# -------------------------------------------------------------------- reading templates and records


def test_the_template_is_read_as_transformers_reads_it(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; a list of named templates gives
    "default"; special tokens written as {"content": ...} are their content."""
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "lstrip": False},
                "eos_token": "</s>",
                "pad_token": None,
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D"},
                ],
            }
        )
    )
    template = read_chat_template(directory)
    assert template.source == "D" and dict(template.variables) == {
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    (directory / "chat_template.jinja").write_text("J")
    assert read_chat_template(directory).source == "J"
    (directory / "chat_template.jinja").unlink()
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "x", "template": "T"}]})
    )
    stops_with_one_line(
        lambda: read_chat_template(directory),
        TokenizerError,
        "tokenizer_config.json",
        r"none named 'default'",
    )
    (directory / "tokenizer_config.json").write_text("{not json")
    stops_with_one_line(
        lambda: read_chat_template(directory),
        TokenizerError,
        "tokenizer_config.json",
        "cannot read JSON",
    )
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert read_chat_template(directory) is None


def test_records_are_told_apart_by_their_fields():
    assert read_example({"text": "x"}, "f:1") is None
    assert read_example({"messages": [{"role": "assistant", "content": "a"}]}, "f:1").where == "f:1"
    assert read_example({"prompt": "p", "completion": "c"}, "f:2") == Pair("p", "c", "f:2")


BAD_LINES = {
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, r"no assistant turn"),
    "unknown role": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]},
        r"message 1 has role 'tool'; expected one of system, user, assistant",
    ),
    "content not a string": (
        {"messages": [{"role": "assistant", "content": ["a"]}]},
        r"message 0 must be an object with a string 'content'",
    ),
    "no messages": ({"messages": []}, r"'messages' must be a non-empty list"),
    "pair without completion": (
        {"prompt": "p"},
        r"needs the string fields 'prompt' and "
        r"'completion'; 'completion' "
        r"is missing",
    ),
    "pair with a number": ({"prompt": "p", "completion": 4}, r"'completion' is a int"),
    "malformed JSON": (
        '{"messages": [',
        r"expected a JSON object .*'messages' \(a conversation\), "
        r"or 'prompt' and "
        r"'completion'",
    ),
    "generation mark in content": (
        {"messages": [{"role": "assistant", "content": f"a{CLOSE_MARK}"}]},
        r"U\+E001",
    ),
}


@pytest.mark.parametrize("line, pattern", BAD_LINES.values(), ids=BAD_LINES)
def test_a_bad_line_stops_prepare_with_one_line_naming_it(tmp_path, line, pattern):
    good = json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    )
    (tmp_path / "chat.jsonl").write_text(
        good + "\n\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n"
    )
    tokenizer = (
        fixture_tokenizer(tmp_path, "qwen2_marked")
        if "mark" in pattern or "E001" in pattern
        else load_tokenizer("byte")
    )
    stops_with_one_line(
        lambda: prepare(tmp_path / "chat.jsonl", tokenizer, tmp_path / "out"),
        DataError,
        f"{tmp_path / 'chat.jsonl'}:3",
        pattern,
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_a_template_that_fails_stops_with_one_line(tmp_path):
    """A template that raises (raise_exception, as templates refuse roles out of order), one that is
    not Jinja, and one that renders no answer: each names the line or the template's file and
    line."""
    line = json.dumps(
        {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}
    )
    (tmp_path / "chat.jsonl").write_text(json.dumps({"text": "plain"}) + "\n" + line + "\n")
    cases = {
        "raises": (
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must "
            "start with a "
            "user message') }}{% endif %}",
            f"{tmp_path / 'chat.jsonl'}:2",
            r"chat template \(.*tokenizer_config.json chat_template\) failed to render "
            r"this conversation: "
            r"TemplateError: Conversations must start with a user message",
        ),
        "not jinja": (
            "{% for message in messages %}\n{{ message.content }",
            "tokenizer_config.json chat_template: line 2",
            r"not a Jinja template",
        ),
        "renders nothing": (
            "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% "
            "endif %}{% endfor %}",
            f"{tmp_path / 'chat.jsonl'}:2",
            r"no token of the assistant's is left to train on",
        ),
    }
    for name, (template, named, pattern) in cases.items():
        tokenizer = fixture_tokenizer(tmp_path, name.replace(" ", "_"), template)
        stops_with_one_line(
            lambda: prepare(tmp_path / "chat.jsonl", tokenizer, tmp_path / "out"),
            DataError,
            named,
            pattern,
        )


def template_dir(tmp_path: Path, source: bytes) -> Path:
    """The fixture's BPE with `source` as its chat_template.jinja."""
    directory = tmp_path / "tok"
    directory.mkdir()
    shutil.copy(FIXTURES / "tokenizer.json", directory)
    config = {k: v for k, v in CONFIG.items() if k != "chat_template"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_bytes(source)
    return directory


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            b"\xff\xfe{{ messages }}\x00",
            r"chat_template.jinja: not UTF-8 text \(invalid start byte at byte 0\); a chat "
            r"template is a Jinja text file$",
        ),
        (
            b" \n\t",
            r"chat_template.jinja: empty; write a Jinja chat template there or remove the file$",
        ),
    ],
    ids=["binary", "blank"],
)
def test_an_unreadable_template_file_stops_with_one_line_naming_it(tmp_path, source, pattern):
    directory = template_dir(tmp_path, source)
    stops_with_one_line(
        lambda: load_tokenizer(str(directory)),
        TokenizerError,
        str(directory / "chat_template.jinja"),
        pattern,
    )


ROLE_LINES = "{% for m in messages %}{{ m.role }}:\n{{ m.content }}\n{% endfor %}"
TEMPLATE_CASES = {
    "generation never closed": (
        "{% for m in messages %}{% generation %}{{ m.content }}{% endfor %}",
        "template",
        r"^[^ ]*chat_template.jinja: line 1 of the chat template: Encountered unknown tag 'endfor'"
        r".*'endgeneration'.*; it is not a Jinja template$",
    ),
    "generation around nothing": (
        "{% for m in messages %}{{ m.content }}{% generation %}{% endgeneration %}{% endfor %}",
        "line",
        r"no token of the assistant's is left to train on: the "
        r"\{% generation %\} blocks of the chat template .* enclose "
        r"none of the text",
    ),
    "renders nothing": (
        "{% if false %}{{ messages }}{% endif %}",
        "line",
        r"left to train on: the chat template .*chat_template.jinja renders this conversation as "
        r"empty text$",
    ),
    "error over two lines": (
        "{{ raise_exception('first line\nsecond line') }}",
        "line",
        r"failed to render this conversation: TemplateError: first line second line$",
    ),
}


@pytest.mark.parametrize("source, named, pattern", TEMPLATE_CASES.values(), ids=TEMPLATE_CASES)
def test_a_broken_template_stops_prepare_with_one_line(tmp_path, source, named, pattern):
    """Not Jinja (named by the template's file and line, not wrapped as a render failure of the
    first conversation), generation markers that enclose nothing, a template that renders nothing,
    an error message of two lines."""
    directory = template_dir(tmp_path, source.encode())
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    where = (
        str(directory / "chat_template.jinja")
        if named == "template"
        else f"{tmp_path / 'chat.jsonl'}:1"
    )
    stops_with_one_line(
        lambda: prepare(tmp_path / "chat.jsonl", load_tokenizer(str(directory)), tmp_path / "out"),
        DataError,
        where,
        pattern,
    )


def test_a_generation_tag_in_a_comment_is_no_generation_block(tmp_path):
    """The boundary of the case above: a template whose only {% generation %} is inside a comment
    has no block, so its answers are found by prefix renders (a search of the text took it for a
    marked template whose blocks enclosed nothing)."""
    source = (
        "{# answers could be marked with {% generation %} #}"
        + ROLE_LINES
        + "{% if add_generation_prompt %}assistant:\n{% endif %}"
    )
    encoder = ChatEncoder(load_tokenizer(str(template_dir(tmp_path, source.encode()))))
    ids, mask = encoder.encode(Conversation(CHAT, "case"))
    assert not encoder.marked
    assert encoder.tokenizer.decode(ids) == "user:\nq\nassistant:\nab\n"
    assert encoder.tokenizer.decode([i for i, keep in zip(ids, mask) if keep]) == "ab\n"


def test_split_marks_returns_the_text_and_the_marked_spans():
    assert split_marks(
        f"ab{OPEN_MARK}cd{CLOSE_MARK}e{OPEN_MARK}{CLOSE_MARK}f{OPEN_MARK}g{CLOSE_MARK}", "w"
    ) == ("abcdefg", [(2, 4), (6, 7)])
    with pytest.raises(ChatError, match=r"w: .*U\+E000"):
        split_marks(f"a{OPEN_MARK}b{OPEN_MARK}", "w")


# ---------------------------------------------------------------------- rows of whole conversations


def test_best_fit_decreasing_packs_every_document_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, 300)
    docs, starts = pack_rows(lengths, 40)
    # each kept document once, 0-length ones out
    assert sorted(docs.tolist()) == np.flatnonzero(lengths).tolist()
    sizes = [int(lengths[docs[a:b]].sum()) for a, b in zip(starts[:-1], starts[1:])]
    # FFD's bound
    assert max(sizes) <= 40 and len(sizes) <= int(np.ceil(lengths.sum() / 40 * 11 / 9)) + 1
    # [7, 3] and [5, 5]: ties by index
    assert pack_rows(np.array([5, 7, 3, 5]), 10)[0].tolist() == [1, 2, 0, 3]
    # 3 joins the fuller row (free 4, not 5)
    assert pack_rows(np.array([6, 5, 3]), 10)[0].tolist() == [0, 2, 1]
    assert np.array_equal(pack_rows(lengths, 40)[0], docs)  # the same every time


def test_overlong_documents_are_truncated_or_dropped_and_counted():
    lengths = np.array([5, 12, 30, 8])
    has_target = {1: True, 2: False}  # document 2's first 10 tokens hold no target
    truncate = WholeRows(lengths, 10, "truncate", lambda i: has_target[i])
    assert truncate.lengths.tolist() == [5, 10, 0, 8] and (
        truncate.truncated,
        truncate.dropped,
    ) == (1, 1)
    drop = WholeRows(lengths, 10, "drop", lambda i: True)
    assert drop.lengths.tolist() == [5, 0, 0, 8] and (drop.truncated, drop.dropped) == (0, 2)
    assert drop.num_tokens == 13 and drop.num_rows == 2
