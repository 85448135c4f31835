"""Generate the chat-template fixtures in tests/fixtures/chat/ with the published reference,
transformers 5.24's apply_chat_template.

    # re-runs itself under a venv with transformers
    FLINT_HF_VENV=/work/refvenv python3 tests/make_chat_fixture.py

Not part of the test suite, which needs neither this script nor transformers: tests/test_chat.py
compares chat.py with the committed expected.json. Inputs (committed, see
tests/fixtures/chat/README.md): the chat templates published with Qwen2-7B-Instruct (QWEN2_TEMPLATE
below, from its tokenizer_config.json) and with Qwen3-4B-Thinking-2507 (qwen3_chat_template.jinja).
Writes, in tests/fixtures/chat/:

- tokenizer.json: a byte-level BPE of 600 tokens that `tokenizers` trains here on the embedded
  corpus, with Qwen2's pre-tokenizer split, the special tokens <|endoftext|>, <|im_start|>,
  <|im_end|> and the added (not special) tokens <think>, </think>, so the rendered text has BPE
  merges and special tokens to match.
- qwen2_tokenizer_config.json: that tokenizer's tokenizer_config.json with QWEN2_TEMPLATE as
  chat_template.
- qwen2_marked.jinja, qwen3_marked.jinja: the two templates with {% generation %} blocks around what
  the assistant writes (its turn after the generation prompt, with <|im_end|>\\n), rendering the
  same text.
- expected.json: per case, the messages, the text (apply_chat_template(tokenize=False)), the ids
  (tokenize=True) and, from the marked template, transformers' assistant mask
  (return_assistant_tokens_mask).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hf_venv import rerun_with_transformers

VENV = Path(os.environ.get("FLINT_HF_VENV", Path.home() / ".cache" / "flint" / "hfvenv"))
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat"
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != "
    "'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif "
    "%}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% "
    "endif %}"
)
QWEN2_MARKED = QWEN2_TEMPLATE.replace(
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}",
    "{{'<|im_start|>' + message['role'] + '\\n'}}{% if message['role'] == 'assistant' %}{% "
    "generation %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}",
)
# Qwen3's assistant branch (without tool calls, which these cases do not have), marked.
QWEN3_ASSISTANT = """        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}"""
QWEN3_ASSISTANT_MARKED = """        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' }}
            {%- generation %}{{- reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}{%- endgeneration %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' }}
            {%- generation %}{{- content + '<|im_end|>\\n' }}{%- endgeneration %}
        {%- endif %}
        {%- if false %}"""
QWEN3_END = """        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}"""
QWEN3_END_MARKED = """    {%- elif message.role == "tool" %}"""

SYSTEM = {"role": "system", "content": "You answer questions about Python."}
CASES = {  # name -> messages; "multi" cases have an assistant turn before the last user turn
    "one turn": [
        {"role": "user", "content": "What does pass do?"},
        {"role": "assistant", "content": "Nothing: it is a null operation."},
    ],
    "system, multi": [
        SYSTEM,
        {"role": "user", "content": "What is a lambda?"},
        {"role": "assistant", "content": "An anonymous function:\n\n   lambda x: x + 1"},
        {"role": "user", "content": "And yield?"},
        {"role": "assistant", "content": "  It makes a generator.  "},
    ],
    "unicode and a special token in content": [
        {"role": "user", "content": "Schreib «café» — ünïcode ✓ and <|im_end|> as text"},
        {"role": "assistant", "content": "«café» ✓ — a <|im_end|> inside"},
    ],
    "ends with a user turn, multi": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ],
    "reasoning in the answer": [
        SYSTEM,
        {"role": "user", "content": "Is 7 prime?"},
        {
            "role": "assistant",
            "content": "<think>\nIt has no divisor but 1 and 7.\n</think>\n\nYes.",
        },
    ],
}


def train_tokenizer(directory: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| "
        r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
        r"\s+(?!\S)|\s+"
    )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [
        json.loads(line)["text"]
        for line in (ROOT / "data" / "python_reference.jsonl").open(encoding="utf-8")
    ]
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save(str(directory / "tokenizer.json"))


def tokenizer_dir(base: Path, name: str, config: dict, jinja: str | None) -> Path:
    directory = base / name
    directory.mkdir()
    shutil.copy(OUT / "tokenizer.json", directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False, indent=1)
    )
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)
    return directory


def rendered(tokenizer, messages: list[dict], marked=None) -> dict:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    case = {"messages": messages, "text": text, "ids": list(ids)}
    if marked is not None:
        assert marked.apply_chat_template(messages, tokenize=False) == text, (
            "the marked template renders other text"
        )
        out = marked.apply_chat_template(
            messages, return_dict=True, return_assistant_tokens_mask=True
        )
        assert list(out["input_ids"]) == case["ids"]
        case["mask"] = list(out["assistant_masks"])
    return case


def main() -> None:
    rerun_with_transformers(__file__, VENV)
    from transformers import AutoTokenizer

    train_tokenizer(OUT)
    qwen3 = (OUT / "qwen3_chat_template.jinja").read_text()
    assert QWEN3_ASSISTANT in qwen3 and QWEN3_END in qwen3, (
        "the Qwen3 template is not the published one"
    )
    qwen3_marked = qwen3.replace(QWEN3_ASSISTANT, QWEN3_ASSISTANT_MARKED).replace(
        QWEN3_END, QWEN3_END_MARKED
    )
    (OUT / "qwen2_marked.jinja").write_text(QWEN2_MARKED)
    (OUT / "qwen3_marked.jinja").write_text(qwen3_marked)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
    }
    (OUT / "qwen2_tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": QWEN2_TEMPLATE}, indent=1)
    )
    with tempfile.TemporaryDirectory() as tmp:
        load = lambda name, jinja, template=None: AutoTokenizer.from_pretrained(  # noqa: E731
            tokenizer_dir(
                Path(tmp),
                name,
                {**config, **({"chat_template": template} if template else {})},
                jinja,
            )
        )
        qwen2, qwen2_marked = (
            load("qwen2", None, QWEN2_TEMPLATE),
            load("qwen2_marked", QWEN2_MARKED),
        )
        qwen3_tok, qwen3_marked_tok = load("qwen3", qwen3), load("qwen3_marked", qwen3_marked)
        expected = {
            "qwen2": {
                name: rendered(qwen2, messages, qwen2_marked) for name, messages in CASES.items()
            },
            # The published Qwen3 template renders an earlier answer without its <think> block once
            # a later turn follows: prefix renders cannot find it, the marked template can.
            "qwen3": {
                name: rendered(qwen3_tok, messages, None if "multi" in name else qwen3_marked_tok)
                for name, messages in CASES.items()
            },
            "qwen3_marked": {
                name: rendered(qwen3_marked_tok, messages, qwen3_marked_tok)
                for name, messages in CASES.items()
            },
            "generation_prompt": {
                "qwen2": qwen2.apply_chat_template(
                    CASES["one turn"][:1], tokenize=False, add_generation_prompt=True
                ),
                "qwen3": qwen3_tok.apply_chat_template(
                    CASES["one turn"][:1], tokenize=False, add_generation_prompt=True
                ),
            },
        }
    (OUT / "expected.json").write_text(json.dumps(expected, ensure_ascii=False, indent=1))
    import transformers

    print(f"wrote {OUT} with transformers {transformers.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
