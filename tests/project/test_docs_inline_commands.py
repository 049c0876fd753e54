"""The commands the pages name inline (`pflbed bench -c … --jobs 2` in a table or a sentence), not only the fenced
ones `test_docs_commands` runs: each takes only commands and options the parser has, and every repository file it
names exists. A renamed option or a moved suite left such a command as written, and a user copying it got an
error; the reproduction page is made of them."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from pflbed.cli import _parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "results" / "README.md", *(ROOT / "docs").rglob("*.md")])
SYNOPSIS = re.compile(r"[\[{…]|\.\.\.")  # a synopsis, `pflbed run [-c FILE.yaml] [--set key=value ...]`: not a command
ANGLED = re.compile(r"<[^<>]*>")  # `<same name>`: one value to fill in, spaces and all
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|/[A-Z][A-Z_]*(\.\w+)?$")  # a value to fill in: `--method M`, `seeds/FILE`


def inline_commands() -> list[tuple[str, str]]:
    """(page, command) for every inline code span starting `pflbed COMMAND` or `python benchmarks/`."""
    found = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # fenced blocks: test_docs_commands runs them
        for span in re.findall(r"`([^`\n]+)`", text):
            if re.match(r"pflbed [a-z]", span) or span.startswith("python benchmarks/"):
                found.append((str(page.relative_to(ROOT)), span))
    return found


COMMANDS = inline_commands()


def test_the_pages_name_commands_inline():
    assert len(COMMANDS) > 100 and any("--jobs 2" in c for _, c in COMMANDS)


class _Refused(Exception):
    pass


def _parse(words: list[str]) -> str | None:
    """The parser's complaint about `words`, or None. A mention of an option alone (`pflbed run --resume`) or of a
    command without its required options (`pflbed bench`) is prose, not a command to copy: only an unknown command,
    option or choice is a complaint, and a missing required option where a value is given without it (`pflbed
    bench SUITE.yaml`, written for `-c SUITE.yaml`)."""
    parser = _parser()

    def refuse(message: str) -> None:
        raise _Refused(message)

    for p in [parser, *(a for act in parser._actions if isinstance(act, argparse._SubParsersAction)
                        for a in act.choices.values())]:  # fmt: skip
        p.error = refuse  # type: ignore[method-assign]
        for act in p._actions:
            if isinstance(act, argparse._SubParsersAction):
                for sub in act.choices.values():
                    sub.error = refuse  # type: ignore[method-assign]
    try:
        parser.parse_args(words)
    except _Refused as e:
        message = str(e)
        choice = re.search(r"invalid choice: '([^']*)'", message)
        if "unrecognized arguments" in message or (choice and not PLACEHOLDER.search(choice[1])):
            return message
        if "arguments are required" in message and any(not w.startswith("-") for w in _after_command(words)):
            return message
    except SystemExit:  # --help, --version
        pass
    return None


def _after_command(words: list[str]) -> list[str]:
    """`words` after the command's names (`bench`, `flower local`): its options and their values."""
    parser, i = _parser(), 0
    while i < len(words):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[i] not in subs[0].choices:
            break
        parser, i = subs[0].choices[words[i]], i + 1
    return words[i:]


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_an_inline_command_takes_options_the_parser_has_and_names_files_that_exist(page, command):
    words = shlex.split(ANGLED.sub("PLACEHOLDER", command))
    if words[0] == "pflbed" and not SYNOPSIS.search(command):
        assert _parse(words[1:]) is None, f"{page}: `{command}`: {_parse(words[1:])}"
    for word in words[1:]:
        if word.startswith("benchmarks/") and not word.startswith("benchmarks/results/") and \
                not PLACEHOLDER.search(word):  # fmt: skip
            assert (ROOT / word).exists(), f"{page}: `{command}` names {word}, which is not in the repository"
