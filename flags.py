"""Command-line flags of the scripts and tools: a bad value stops with one line that names the flag
and what it expects (argparse's usage text and exit status 2 would bury it), and numbers are refused
where they cannot mean anything (0 or fewer rows, steps, GPUs) rather than silently replaced by a
default."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, "error: argument --flag: what was expected"."""

    def error(self, message: str):
        raise SystemExit(f"error: {message}")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (the message names the bound and the value given)."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return integer


positive = at_least(1)
non_negative = at_least(0)


def names_from(known: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names, each one of `known`, none twice."""
    known = tuple(known)

    def names(text: str) -> list[str]:
        chosen = text.split(",")
        for name in chosen:
            if name not in known:
                raise argparse.ArgumentTypeError(
                    f"unknown name {name!r}; choose from {','.join(known)}"
                )
        if len(set(chosen)) < len(chosen):
            raise argparse.ArgumentTypeError(f"a name given twice in {text!r}")
        return chosen

    return names
