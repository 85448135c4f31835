"""Write data/python_chat.jsonl: conversations about Python answered from the embedded corpus.

    python3 data/make_python_chat.py  # the same bytes every time, from data/python_reference.jsonl

Each topic of the Python Language Reference (data/python_reference.jsonl) gives three or four
conversations in the {"messages": [...]} form of chat.py: a question about the topic's heading,
answered with the first sentences of its first paragraph of prose, asked in different words, once
with a system message, once followed by "Tell me more." and the next paragraph, and for a topic
named after a keyword, a question about that keyword. The questions are the project's; the answers
are the reference's text, whitespace-reflowed (see data/README.md for provenance and license)."""

from __future__ import annotations

import json
import keyword
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEM = "You answer questions about the Python language from its reference manual."
# characters per answer: its first sentences (at least one), so a small model learns where it ends
MAX_ANSWER = 240


def paragraphs(text: str) -> list[str]:
    """The topic's paragraphs after its heading, without section underlines and version notes."""
    kept = []
    for paragraph in text.split("\n\n")[1:]:
        lines = [
            line
            for line in paragraph.strip("\n").splitlines()
            if not re.fullmatch(r"[=*\-]{3,}", line)
        ]
        if lines and not re.match(r"(New|Changed|Deprecated) in version|\*\*Source code", lines[0]):
            kept.append("\n".join(lines))
    return kept


def is_block(paragraph: str) -> bool:
    """Grammar rules and code are indented by three spaces in the reference."""
    return all(line.startswith("   ") for line in paragraph.splitlines())


def answers(text: str) -> list[str]:
    """Answers in reading order: each prose paragraph (not grammar, code or a list item), reflowed,
    a final colon (it introduced a block) made a full stop, cut after its last sentence that ends
    within MAX_ANSWER characters (or after its first sentence)."""
    found = []
    for paragraph in paragraphs(text):
        prose = re.sub(r":$", ".", " ".join(paragraph.split()))
        if (
            is_block(paragraph)
            or not prose.endswith(".")
            or prose.startswith(("* ", "- ", "Note:"))
        ):
            continue
        ends = [m.end() for m in re.finditer(r"\.(?= [A-Z\"(])", prose)] + [len(prose)]
        found.append(prose[: max([e for e in ends if e <= MAX_ANSWER], default=ends[0])])
    return found


def subject(heading: str) -> str:
    """'Assignment statements' -> 'assignment statements'; 'The "if" statement' -> 'the "if"
    statement'."""
    return heading[0].lower() + heading[1:] if heading[1:2].islower() else heading


def conversations(title: str, text: str) -> list[dict]:
    about, replies = subject(text.splitlines()[0].strip()), answers(text)
    if not replies:
        return []
    user = lambda content: {"role": "user", "content": content}  # noqa: E731
    assistant = lambda content: {"role": "assistant", "content": content}  # noqa: E731
    made = [
        [user(f"What does the Python reference say about {about}?"), assistant(replies[0])],
        [{"role": "system", "content": SYSTEM}, user(f"Explain {about}."), assistant(replies[0])],
        [user(f"Tell me about {about}."), assistant(replies[0])]
        + ([user("Tell me more."), assistant(replies[1])] if len(replies) > 1 else []),
    ]
    if keyword.iskeyword(title):
        made.append([user(f'What does the "{title}" keyword do?'), assistant(replies[0])])
    return [{"messages": messages} for messages in made]


def main() -> None:
    topics = [
        json.loads(line)
        for line in (HERE / "python_reference.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    lines = [
        json.dumps(c, ensure_ascii=False)
        for t in topics
        for c in conversations(t["title"], t["text"])
    ]
    (HERE / "python_chat.jsonl").write_text(
        "".join(line + "\n" for line in lines), encoding="utf-8"
    )
    print(f"data/python_chat.jsonl: {len(lines)} conversations from {len(topics)} topics")


if __name__ == "__main__":
    main()
