"""The command line as documented: the README's synopses agree with the parser, every option's
help says its default, ``prove`` says the sizes it accepts, and the help names installed docs."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvspec import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def synopses() -> dict[str, str]:
    """README's ``kvspec COMMAND ...`` lines with their continuation lines."""
    block = README.read_text().split("## Command line", 1)[1].split("```")[1]
    found: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if line.startswith("kvspec "):
            current = line.split()[1]
            found[current] = line
        elif current and line.startswith(" " * 12) and line.strip().startswith(("[", "--")):
            found[current] += " " + line.strip()
        else:
            current = None
    return found


def options(text: str) -> dict[str, set[str] | None]:
    """Each ``--option`` of a synopsis, with the ``a|b`` choices written after it, if any."""
    out: dict[str, set[str] | None] = {}
    for name, value in re.findall(r"(--[a-z][a-z-]*)(?:[ =]([^\]\s]+))?", text):
        out[name] = set(value.split("|")) if value and "|" in value else None
    return out


@pytest.mark.parametrize("name", sorted(subparsers()))
def test_the_readme_synopsis_lists_exactly_the_options_of_help(name: str) -> None:
    synopsis = synopses().get(name)
    assert synopsis is not None, f"README has no synopsis of kvspec {name}"
    written = options(synopsis)
    parser = subparsers()[name]
    actual = {
        opt: action
        for action in parser._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    }
    assert set(written) == set(actual), (name, set(written) ^ set(actual))
    for opt, choices in written.items():
        if choices is not None and actual[opt].choices:  # not a metavar such as PATH|smollm2
            assert choices == set(actual[opt].choices), (name, opt)


@pytest.mark.parametrize("name", sorted(subparsers()))
def test_every_option_has_help_that_says_its_default(name: str) -> None:
    parser = subparsers()[name]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, (name, action.dest)
        if action.default is not None and not isinstance(action.default, bool):  # a flag's
            # default is its absence: "--no-shrink (default: True)" would say the opposite
            assert f"default: {action.default}" in text or "default" in action.help, (
                name,
                action.dest,
            )


def test_prove_says_the_sizes_it_accepts() -> None:
    text = " ".join(subparsers()["prove"].format_help().split())
    for name, (low, high) in cli.PROVE_LIMITS.items():
        assert re.search(rf"--{name} {name.upper()} .*?{low}\.\.{high}", text), name


def test_the_help_names_a_docs_folder_that_is_there() -> None:
    assert f"documentation: {cli.DOCS}" in cli.build_parser().format_help().replace("\n", " ")
    assert (cli.DOCS / "trace-format.md").is_file()
