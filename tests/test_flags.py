"""flags.py: a bad flag stops with one line naming the flag; the bounds and names it checks."""

import argparse

import pytest

from flags import OneLineParser, at_least, names_from


def parser() -> OneLineParser:
    parser = OneLineParser()
    parser.add_argument("--rows", type=at_least(2))
    parser.add_argument("--modes", type=names_from(["none", "full"]))
    return parser


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rows", "1"], "error: argument --rows: must be >= 2, got 1"),
        (["--rows", "2.5"], "error: argument --rows: expected an integer >= 2, got '2.5'"),
        (
            ["--modes", "full,some"],
            "error: argument --modes: unknown name 'some'; choose from none,full",
        ),
        (["--modes", "full,full"], "error: argument --modes: a name given twice in 'full,full'"),
        (["--modes", ""], "error: argument --modes: unknown name ''; choose from none,full"),
        (["--colour", "red"], "error: unrecognized arguments: --colour red"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(argv, message):
    with pytest.raises(SystemExit) as stop:
        parser().parse_args(argv)
    assert str(stop.value) == message


def test_the_boundary_values_are_accepted_as_given():
    args = parser().parse_args(["--rows", "2", "--modes", "full,none"])
    assert args.rows == 2 and args.modes == ["full", "none"]


def test_the_types_refuse_through_argparse():
    """Each type raises argparse's own error, so any parser names the flag before the reason."""
    with pytest.raises(argparse.ArgumentTypeError):
        at_least(0)("-1")
    with pytest.raises(argparse.ArgumentTypeError):
        names_from(["a"])("b")
