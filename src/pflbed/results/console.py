"""The console every command prints through. In a terminal, rich lays out to its width; piped into a file or
another program there is no width to fit, and rich's default of 80 columns would wrap tables and cut paths
(`bench --list`, `data list`): lines are then as long as their content. Nothing pflbed prints is rich markup or an
emoji code, but much of it is the user's or the code's own text in brackets (`list[str]`, `--set
model.archs=[lenet5]`, a path): read as markup, `[str]` would vanish as an unknown style tag."""

from __future__ import annotations

import sys

from rich.console import Console

PIPED_WIDTH = 100_000  # no table or line reaches it: nothing wraps


def console() -> Console:
    width = None if sys.stdout.isatty() else PIPED_WIDTH
    return Console(soft_wrap=True, width=width, markup=False, emoji=False)
