"""The console every command prints through: text prints as written, whatever brackets or colons it holds, and a
pipe gets lines as long as their content."""

from __future__ import annotations

import re
import sys

import pytest

from pflbed.results.console import console

AS_WRITTEN = ("type list[str]; --set model.architectures=[lenet5,resnet18]; runs/[/x]; :smile: [bold]b[/bold] "
              "[0.001, 0.3]")


def test_brackets_and_colons_print_as_written_not_as_markup_or_emoji(capsys):
    console().print(AS_WRITTEN)  # as markup: "[str]" and "[lenet5,resnet18]" vanish and "[/x]" is an error
    assert capsys.readouterr().out == AS_WRITTEN + "\n"


@pytest.mark.parametrize("tty", [False, True])
def test_a_pipe_gets_lines_as_long_as_their_content_and_a_terminal_its_width(tty, monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    monkeypatch.setenv("COLUMNS", "90")  # the terminal's width, where rich cannot ask the terminal itself
    printed = console()
    assert printed.width == (90 if tty else 100_000)
    printed.print(AS_WRITTEN * 4)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # a terminal's colours, whatever the text
    assert shown == AS_WRITTEN * 4 + "\n"  # soft wrap: a long line is never cut, in either
