"""Conversations for supervised fine-tuning: rendered with a chat template, tokenized, and masked so
that only what the assistant says is trained on (data.py stores the mask next to the tokens).

A JSONL line of either form (prepare.py reads the files; a line with neither is a text document):

    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
        rendered with the tokenizer's own chat template (chat_template.jinja, else
        tokenizer_config.json's "chat_template", next to tokenizer.json) or, for a tokenizer without
        one, PLAIN_TEMPLATE. Targets: each assistant turn as the model writes it after the
        generation prompt, with the template's end-of-turn marker. Other keys of a message reach the
        template as written.
    {"prompt": "...", "completion": "..."}
        trained as written, without a template: the prompt's tokens, the completion's, then the
        end-of-text token. Targets: the completion and the end-of-text. (Write a pair as messages to
        have it rendered in the chat template.)

Rendering: Jinja2 (torch's own dependency, pinned with it) in its immutable sandbox, with the
settings, globals and `tojson` filter of transformers' apply_chat_template and the named special
tokens of tokenizer_config.json as variables, so the text is the one transformers renders.

Which characters are the assistant's. A template with {% generation %} ... {% endgeneration %}
blocks (transformers' markers): the text they enclose. Otherwise prefix renders: for assistant
message k, prompt = render(messages[:k], add_generation_prompt=True) and turn =
render(messages[:k+1]); the turn must start with the prompt and the whole conversation with the
turn, and the assistant's text is turn[len(prompt):]. A template that writes a turn differently once
later turns follow (one that drops past reasoning, say) is refused, naming the line and message: add
generation markers to it, or give each assistant turn a conversation of its own.

Which tokens. The rendered text is tokenized whole, with special tokens matched in the text, as
apply_chat_template(tokenize=True) does, so the ids are the ones transformers gives; a token is a
target when it overlaps the assistant's text (transformers' rule for its assistant masks). With a
BPE tokenizer a merge may cross the start of an answer; the prepare summary counts such tokens.

Rows: `WholeRows` puts whole conversations into rows (data.PackedLoader).
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenizer import ChatTemplate, Tokenizer

ROLES = ("system", "user", "assistant")
# The template of tokenizers that carry none (the embedded byte tokenizer): "Role: content" lines,
# each answer ended by the end-of-text token, so that a sample stops there. A conversation renders
# as
#   System: You answer questions.\nUser: What is pass?\nAssistant: A null
#   operation.<|endoftext|>User: ...
# and a prompt for a sample is "User: What is pass?\nAssistant: ".
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message.role | capitalize }}: {{ message.content "
    "}}"
    "{{ eos_token if message.role == 'assistant' else '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
PLAIN_ORIGIN = "the plain template (chat.py PLAIN_TEMPLATE)"
# While rendering, the text of a generation block is wrapped in these two private-use characters.
OPEN_MARK, CLOSE_MARK = "\ue000", "\ue001"


class ChatError(ValueError):
    """A conversation, pair or template that cannot be trained on; the message names the file and
    line."""


def one_line(text: str) -> str:
    """A message from Jinja or a template (raise_exception) on one line, as every error here is."""
    return " ".join(str(text).split())


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    where: str  # "file:line", for messages


@dataclass(frozen=True)
class Pair:
    prompt: str
    completion: str
    where: str


# ============================================================================= reading records


def read_example(record: dict, where: str) -> Conversation | Pair | None:
    """A JSONL record as a conversation ("messages") or a prompt/completion pair; None for any other
    record (a text document). `where` is "file:line" for the messages."""
    if "messages" in record:
        return Conversation(checked_messages(record["messages"], where), where)
    if "prompt" not in record and "completion" not in record:
        return None
    for field in ("prompt", "completion"):
        if not isinstance(record.get(field), str):
            found = "missing" if field not in record else f"a {type(record[field]).__name__}"
            raise ChatError(
                f"{where}: a prompt/completion pair needs the string fields 'prompt' "
                "and 'completion'; "
                f"{field!r} is {found}"
            )
    return Pair(record["prompt"], record["completion"], where)


def checked_messages(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ChatError(
            f'{where}: \'messages\' must be a non-empty list of {{"role", "content"}} '
            "objects, "
            f"got {messages!r:.60}"
        )
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ChatError(
                f"{where}: message {index} must be an object with a string 'content', "
                f"got {message!r:.60}"
            )
        if message.get("role") not in ROLES:
            raise ChatError(
                f"{where}: message {index} has role {message.get('role')!r}; expected "
                "one of "
                f"{', '.join(ROLES)}"
            )
    if not any(message["role"] == "assistant" for message in messages):
        raise ChatError(
            f"{where}: the conversation has no assistant turn, so none of it would be "
            "trained on; add "
            f"one or remove the line"
        )
    return messages


# ============================================================================= the sandbox


class GenerationMarks(jinja2.ext.Extension):
    """{% generation %} ... {% endgeneration %}, transformers' marker of what the assistant writes:
    renders its body between OPEN_MARK and CLOSE_MARK, which `split_marks` takes out again."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Callable[[], str]) -> str:
        return OPEN_MARK + caller() + CLOSE_MARK


def sandbox() -> ImmutableSandboxedEnvironment:
    """Jinja's immutable sandbox, set up as transformers sets it up for chat templates."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationMarks, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = to_json
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda pattern: datetime.now().strftime(pattern)
    return environment


def to_json(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as chat templates expect it: not HTML-escaped (Jinja's own tojson escapes <, >, & and
    ')."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def split_marks(marked: str, where: str) -> tuple[str, list[tuple[int, int]]]:
    """Text rendered with generation marks -> (the text without them, [start, end) of each marked
    span)."""
    pieces, spans, length, start = [], [], 0, None
    for piece in re.split(f"([{OPEN_MARK}{CLOSE_MARK}])", marked):
        if piece == OPEN_MARK and start is None:
            start = length
        elif piece == CLOSE_MARK and start is not None:
            if length > start:
                spans.append((start, length))
            start = None
        elif piece in (OPEN_MARK, CLOSE_MARK):
            raise ChatError(
                f"{where}: the conversation holds the character U+{ord(piece):04X}, "
                "which marks "
                f"generation blocks while rendering; remove it"
            )
        else:
            pieces.append(piece)
            length += len(piece)
    if start is not None:
        raise ChatError(
            f"{where}: the conversation holds the character U+{ord(OPEN_MARK):04X}, "
            "which marks "
            f"generation blocks while rendering; remove it"
        )
    return "".join(pieces), spans


# ============================================================================= encoding


def template_of(tokenizer: Tokenizer) -> ChatTemplate:
    """The tokenizer files' chat template, else PLAIN_TEMPLATE ending answers with the tokenizer's
    end-of-text."""
    if tokenizer.chat_template is not None:
        return tokenizer.chat_template
    eos = tokenizer.encoding.decode_single_token_bytes(tokenizer.eos_id).decode(
        "utf-8", errors="replace"
    )
    return ChatTemplate(PLAIN_TEMPLATE, PLAIN_ORIGIN, (("eos_token", eos),))


class ChatEncoder:
    """Conversations and pairs -> (token ids, target mask), with one tokenizer and its chat
    template. `counts` adds up what it encoded, for the prepare summary."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.template = tokenizer, template_of(tokenizer)
        self.counts = {
            "conversations": 0,
            "pairs": 0,
            "target_tokens": 0,
            "tokens_across_answer_edges": 0,
            "longest": 0,
        }
        self._compiled: jinja2.Template | None = None
        self._byte_lengths: np.ndarray | None = None

    def encode(self, example: Conversation | Pair) -> tuple[list[int], np.ndarray]:
        """-> ids, mask (uint8 [len(ids)]: 1 where the token is the assistant's)."""
        if isinstance(example, Pair):
            ids, mask = self.pair_tokens(example)
            self.counts["pairs"] += 1
        else:
            ids, mask = self.conversation_tokens(example.messages, example.where)
            self.counts["conversations"] += 1
        if not mask[1:].any():  # the first token is never predicted
            raise ChatError(
                f"{example.where}: no token of the assistant's is left to train on: "
                f"{self.why_no_target(example)}"
            )
        self.counts["target_tokens"] += int(mask[1:].sum())
        self.counts["longest"] = max(self.counts["longest"], len(ids))
        return ids, mask

    def why_no_target(self, example: Conversation | Pair) -> str:
        if isinstance(example, Pair):
            return "the completion is empty"
        origin = self.template.origin
        if not self.render(example.messages, False, example.where)[0].strip():
            return f"the chat template {origin} renders this conversation as empty text"
        if self.marked:
            return (
                f"the {{% generation %}} blocks of the chat template {origin} enclose none of "
                f"the text it renders for this conversation; put each assistant message's "
                f"content inside one"
            )
        return f"the chat template {origin} renders the assistant's turns empty"

    def pair_tokens(self, pair: Pair) -> tuple[list[int], np.ndarray]:
        prompt = self.tokenizer.encoding.encode_ordinary(pair.prompt)
        completion = self.tokenizer.encoding.encode_ordinary(pair.completion) + [
            self.tokenizer.eos_id
        ]
        return prompt + completion, np.repeat(
            np.array([0, 1], np.uint8), [len(prompt), len(completion)]
        )

    def conversation_tokens(self, messages: list[dict], where: str) -> tuple[list[int], np.ndarray]:
        text, spans = self.assistant_text(messages, where)
        ids = self.tokenizer.encoding.encode(text, allowed_special="all")
        ends = np.cumsum(self.byte_lengths[ids])  # [N]: where each token's bytes end in the text
        starts = ends - self.byte_lengths[ids]
        mask = np.zeros(len(ids), dtype=bool)
        for first, last in spans:
            # characters -> bytes
            first, last = len(text[:first].encode()), len(text[:last].encode())
            mask |= (starts < last) & (ends > first)
            self.counts["tokens_across_answer_edges"] += int(
                ((starts < first) & (ends > first)).sum() + ((starts < last) & (ends > last)).sum()
            )
        return ids, mask.astype(np.uint8)

    def assistant_text(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the [start, end) characters of each assistant turn."""
        text, marked = self.render(messages, False, where)
        if self.marked:
            return text, marked
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, _ = self.render(messages[:k], True, where)
            turn, _ = self.render(messages[: k + 1], False, where)
            if not turn.startswith(prompt) or not text.startswith(turn):
                problem = (
                    f"render(messages[:{k}], add_generation_prompt=True) does not begin "
                    f"render(messages[:{k + 1}])"
                    if not turn.startswith(prompt)
                    else "it renders this turn differently once later turns follow (as templates "
                    "that drop "
                    "past reasoning do)"
                )
                raise ChatError(
                    f"{where}: message {k}: the assistant's tokens cannot be found by "
                    "prefix renders of "
                    f"the chat template ({self.template.origin}): {problem}. Mark them "
                    "with "
                    f"{{% generation %}} ... {{% endgeneration %}} in the template, or "
                    "give each "
                    f"assistant turn a conversation of its own"
                )
            spans.append((len(prompt), len(turn)))
        return text, spans

    def render(
        self, messages: list[dict], add_generation_prompt: bool, where: str
    ) -> tuple[str, list]:
        """-> (text, generation spans) of the template on `messages`."""
        compiled = self.compiled
        try:
            marked = compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **dict(self.template.variables),
            )
        # a template is a program: whatever it raises, it failed on this input
        except Exception as error:
            raise ChatError(
                f"{where}: the chat template ({self.template.origin}) failed to render "
                "this "
                f"conversation: {type(error).__name__}: {one_line(error)}"
            ) from error
        return split_marks(marked, where) if self.marked else (marked, [])

    @property
    def compiled(self) -> jinja2.Template:
        """The template compiled once, in the sandbox; a syntax error names its file and line."""
        if self._compiled is None:
            environment = sandbox()
            try:
                syntax = environment.parse(self.template.source)
                self._compiled = environment.from_string(syntax)
            except jinja2.TemplateSyntaxError as error:
                origin = self.template.origin
                raise ChatError(
                    f"{origin}: line {error.lineno} of the chat template: "
                    f"{one_line(error.message)}; it is not a Jinja template"
                ) from None
            calls = syntax.find_all(jinja2.nodes.ExtensionAttribute)
            self._marked = any(node.name == "_mark" for node in calls)
        return self._compiled

    @property
    def marked(self) -> bool:
        """Whether the template has {% generation %} blocks (parsed, so not in a comment)."""
        self.compiled  # parses the template, finding its blocks
        return self._marked

    @property
    def byte_lengths(self) -> np.ndarray:
        """int64 [vocab]: how many bytes of text each token id stands for (0 for ids that are no
        token)."""
        if self._byte_lengths is None:
            encoding, lengths = (
                self.tokenizer.encoding,
                np.zeros(self.tokenizer.encoding.n_vocab, np.int64),
            )
            for token in range(encoding.n_vocab):
                try:
                    lengths[token] = len(encoding.decode_single_token_bytes(token))
                except KeyError:
                    continue
            self._byte_lengths = lengths
        return self._byte_lengths


def chat_summary(meta: dict) -> str:
    """What prepare made of the conversations and pairs (their counts in a prepared meta.json)."""
    edges = meta["tokens_across_answer_edges"]
    return (
        f"{meta['conversations']} conversations and {meta['pairs']} prompt/completion pairs "
        f"({meta['chat_template']}): {meta['target_tokens']:,} target tokens, the longest "
        f"{meta['longest']:,} "
        f"tokens"
        + (f"; {edges} tokens straddle an answer's edge (a BPE merge across it)" if edges else "")
    )


# ====================================================================== rows of whole conversations


class WholeRows:
    """Rows of seq_len tokens that hold whole documents (data.PackedLoader's rows for
    conversations).

    A document longer than seq_len is fitted by `overlong`: "truncate" keeps its first seq_len
    tokens (and drops it when no target is left among them: keeps_a_target(i) says), "drop" leaves
    it out. The rows are packed once (pack_rows), so they depend on the documents and seq_len only.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        seq_len: int,
        overlong: str,
        keeps_a_target: Callable[[int], bool],
    ):
        long = np.flatnonzero(lengths > seq_len)
        dropped = long if overlong == "drop" else [i for i in long if not keeps_a_target(int(i))]
        # [D]: tokens each keeps (0: left out)
        self.lengths = np.minimum(lengths, seq_len).astype(np.int64)
        self.lengths[dropped] = 0
        self.seq_len, self.truncated, self.dropped = seq_len, len(long) - len(dropped), len(dropped)
        self.row_docs, self.row_starts = pack_rows(self.lengths, seq_len)
        self.num_rows, self.num_tokens = len(self.row_starts) - 1, int(self.lengths.sum())

    def report(self) -> str:
        return (
            f"{len(self.lengths)} documents packed whole, rows "
            f"{self.num_tokens / (self.num_rows * self.seq_len):.0%} "
            f"full; longer than seq_len: {self.truncated} truncated, {self.dropped} dropped "
            "(data.overlong)"
        )

    def fill(
        self,
        r: int,
        document: Callable[[int], np.ndarray],
        loss_mask: Callable[[int], np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row r: its documents back to back from position 0, each cut to its fitted length, then
        padding -> tokens, document indices (-1: padding), loss mask; each [seq_len + 1]."""
        tokens = np.zeros(self.seq_len + 1, dtype=np.int64)
        docs = np.full(self.seq_len + 1, -1, dtype=np.int64)
        mask = np.zeros(self.seq_len + 1, dtype=bool)
        position = 0
        for i in self.row_docs[self.row_starts[r] : self.row_starts[r + 1]]:
            n = int(self.lengths[i])
            tokens[position : position + n] = document(int(i))[:n]
            mask[position : position + n] = loss_mask(int(i))[:n]
            docs[position : position + n] = i
            position += n
        return tokens, docs, mask


def pack_rows(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: each document, longest first (ties by index), joins the row with the
    least free space that holds it, else starts a row; documents of length 0 are left out. The free
    sizes are kept as a sorted list of distinct sizes with a stack of rows each, so a placement is a
    bisection. -> (documents of all rows back to back [D'], where each row starts there, then the
    end [R + 1])."""
    rows: list[list[int]] = []
    free_sizes: list[int] = []
    rows_with_free: dict[int, list[int]] = {}
    for doc in np.argsort(-lengths, kind="stable"):
        length = int(lengths[doc])
        if length == 0:
            break
        k = bisect.bisect_left(free_sizes, length)
        if k == len(free_sizes):
            rows.append([])
            row, free = len(rows) - 1, capacity
        else:
            free = free_sizes[k]
            row = rows_with_free[free].pop()
            if not rows_with_free[free]:
                del rows_with_free[free], free_sizes[k]
        rows[row].append(int(doc))
        if free - length > 0:
            if free - length not in rows_with_free:
                bisect.insort(free_sizes, free - length)
            rows_with_free.setdefault(free - length, []).append(row)
    starts = np.cumsum([0] + [len(row) for row in rows])
    return np.array([doc for row in rows for doc in row], dtype=np.int64), starts
