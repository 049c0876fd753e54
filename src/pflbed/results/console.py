"""The console every command prints through. In a terminal, rich lays out to its width; piped into a file or
another program there is no width to fit, and rich's default of 80 columns would wrap tables and cut paths
(`bench --list`, `data list`): lines are then as long as their content."""

from __future__ import annotations

import sys

from rich.console import Console

PIPED_WIDTH = 100_000  # no table or line reaches it: nothing wraps


def console() -> Console:
    return Console(soft_wrap=True) if sys.stdout.isatty() else Console(soft_wrap=True, width=PIPED_WIDTH)
